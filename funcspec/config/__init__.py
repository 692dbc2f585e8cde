"""Static configuration: per-request sampling parameters and the parsed ``speculative_config``.

Configs are frozen, hashable dataclasses: they are part of a bucket's
key and are never traced. Every constructor validates and normalises its fields,
so an instance is always complete and consistent. A bad value raises
``ValueError`` whose message names the field, for example
``speculative_config.num_speculative_tokens must be >= 1 for method 'ngram', got 0``.

Modules, lowest first:

- ``checks``: the small validators and the field paths messages name.
- ``sampling_params``: ``SamplingParams``.
- ``additional``: vLLM-Ascend's ``rejection_sampler_config`` and ``dynamic_spec_config``.
- ``rules``: the checks a ``SpecConfig`` obeys (what each method allows comes
  from the method registry, ``funcspec.methods``), as ``resolve``: the given
  field values in, the final ones out.
- ``vllm``: vLLM's dicts translated into ``SpecConfig`` fields (keys, aliases,
  fallbacks, ignored keys).
- ``spec``: ``SpecConfig`` itself.
- ``prompts``: ``generate``'s and ``add_request``'s prompts and sampling
  parameters, checked before any request exists.
- ``compilation``: vLLM's ``compilation_config`` as ``CompilationConfig``.

This package re-exports the public names, so ``from funcspec.config import X`` is the import to use.
"""

from funcspec.config.additional import DYNAMIC_SPEC_METHODS, DynamicSpecConfig, RejectionSamplerConfig
from funcspec.config.compilation import CompilationConfig
from funcspec.config.rules import REJECTION_SAMPLE_METHODS, VLLM_METHODS
from funcspec.config.sampling_params import SamplingParams
from funcspec.config.spec import BACKENDS, NPU_MAX_QUERY_TOKENS, SpecConfig
from funcspec.config.vllm import METHOD_ALIASES

__all__ = [
    "BACKENDS",
    "CompilationConfig",
    "DYNAMIC_SPEC_METHODS",
    "DynamicSpecConfig",
    "METHOD_ALIASES",
    "NPU_MAX_QUERY_TOKENS",
    "REJECTION_SAMPLE_METHODS",
    "RejectionSamplerConfig",
    "SamplingParams",
    "SpecConfig",
    "VLLM_METHODS",
]
