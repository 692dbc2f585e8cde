"""funcspec: speculative decoding for LLMs in a JAX/XLA style on PyTorch.

Public API::

    funcspec.load_model(path)                       # HF checkpoint -> Model
    funcspec.Engine(model, speculative_config=...)  # host loop + one graph per (B, K) bucket
    funcspec.generate(model, prompts, sampling_params, **engine_kwargs)
    funcspec.LLM(model=PATH, **vllm_engine_args)    # vLLM facade
    funcspec.SamplingParams, funcspec.SpecConfig
"""

import os as _os
import sys as _sys

# NOTE: torch's OpenMP (libgomp) spins a long while at a barrier before it sleeps: on cores that other work
# shares, a thread spins out its time slice waiting for one that is not running. A short spin (30000 iterations)
# keeps quiet speed and gives way under contention (figures: graphs/results/HISTORY.md, "Sharing the cores"). libgomp reads it once, when torch loads it,
# so it is set before anything imports torch, and never over the user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT.
if "torch" not in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    _os.environ["GOMP_SPINCOUNT"] = "30000"

from funcspec.checkpoints import Model, load_model  # noqa: E402 (after the OpenMP default)
from funcspec.config import SamplingParams, SpecConfig
from funcspec.engine import Engine
from funcspec.llm import LLM
from funcspec.outputs import CompletionOutput, RequestOutput


def generate(model, prompts, sampling_params=None, **engine_kwargs):
    """One-shot generation: build an :class:`Engine`, run ``prompts``, return its outputs."""
    return Engine(model, **engine_kwargs).generate(prompts, sampling_params)


__all__ = [
    "CompletionOutput",
    "Engine",
    "LLM",
    "Model",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "generate",
    "load_model",
]
