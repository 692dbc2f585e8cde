"""funcspec: speculative decoding for LLMs in a JAX/XLA style on PyTorch.

Public API::

    funcspec.load_model(path)                       # HF checkpoint -> Model
    funcspec.EngineArgs(model=PATH, ...)            # every engine argument, vLLM's names and defaults
    funcspec.Engine(model, speculative_config=...)  # host loop + one graph per (B, K) bucket
    funcspec.generate(model, prompts, sampling_params, **engine_args)
    funcspec.LLM(model=PATH, **engine_args)         # vLLM facade
    funcspec.SamplingParams, funcspec.SpecConfig
"""

import os as _os
import sys as _sys

# NOTE: torch's OpenMP (libgomp) spins a long while at a barrier before it sleeps: on cores that other work
# shares, a thread spins out its time slice waiting for one that is not running. A short spin (30000 iterations)
# keeps quiet speed and gives way under contention (figures: graphs/results/HISTORY.md, "Sharing the cores").
# libgomp reads it once, when torch loads it, so it is set before anything imports torch, and never over the
# user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT.
if "torch" not in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    _os.environ["GOMP_SPINCOUNT"] = "30000"

from funcspec.args import EngineArgs  # after the OpenMP default
from funcspec.checkpoints import Model, load_model
from funcspec.config import SamplingParams, SpecConfig
from funcspec.engine import Engine
from funcspec.llm import LLM
from funcspec.outputs import CompletionOutput, RequestOutput


def generate(model, prompts, sampling_params=None, **engine_args):
    """One-shot generation: build an :class:`Engine` of ``model`` (a path, a loaded model or an
    :class:`EngineArgs`) and ``engine_args`` (:class:`EngineArgs`' fields), run ``prompts``, return its outputs."""
    args = model if isinstance(model, EngineArgs) and not engine_args else \
        EngineArgs.from_kwargs({"model": model, **engine_args}, "funcspec.generate")
    return Engine(args).generate(prompts, sampling_params)


__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineArgs",
    "LLM",
    "Model",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "generate",
    "load_model",
]
