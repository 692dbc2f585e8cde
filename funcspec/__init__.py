"""funcspec: speculative decoding for LLMs in a JAX/XLA style on PyTorch.

Public API::

    funcspec.load_model(path)                       # HF checkpoint -> Model
    funcspec.Engine(model, speculative_config=...)  # host loop + one graph per (B, K) bucket
    funcspec.generate(model, prompts, sampling_params, **engine_kwargs)
    funcspec.LLM(model=PATH, **vllm_engine_args)    # vLLM facade
    funcspec.SamplingParams, funcspec.SpecConfig
"""

from funcspec.checkpoints import Model, load_model
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
