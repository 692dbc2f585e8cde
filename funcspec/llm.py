"""``funcspec.LLM``: a vLLM facade, so the guide's ``LLM(...)`` examples run unchanged."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from funcspec.engine import Engine

# vLLM engine arguments that have no effect on a single-device funcspec engine.
NO_EFFECT_ARGS = frozenset({
    "gpu_memory_utilization", "async_scheduling", "distributed_executor_backend", "enable_prefix_caching",
    "trust_remote_code", "enable_expert_parallel", "max_num_batched_tokens", "swap_space",
    "block_size", "enable_chunked_prefill", "disable_log_stats", "tokenizer_mode", "data_parallel_size",
    "served_model_name", "kv_cache_dtype", "disable_custom_all_reduce",
})


def batch_buckets_from_compilation(compilation_config: Any, k_for_batch_size: Callable[[int], int],
                                   max_batch: int) -> Optional[list[int]]:
    """Batch buckets from vLLM ``cudagraph_capture_sizes`` (token counts n·(K_n+1)).

    ``k_for_batch_size(n)`` is the K a batch of n runs with (the
    ``num_speculative_tokens_per_batch_size`` table, or the fixed K), so the
    sizes ``funcspec tune-k`` exports decode back to their buckets. A size
    matching several n names all of them (e.g. 4 = 1·(3+1) = 4·(0+1)): an
    extra bucket costs a capture, a missing one would pad batches further.
    """
    sizes = compilation_option(compilation_config, "cudagraph_capture_sizes")
    if not sizes:
        return None
    buckets = set()
    for s in sizes:
        ns = {n for n in range(1, max_batch + 1) if n * (k_for_batch_size(n) + 1) == s}
        if not ns:
            raise ValueError(f"compilation_config.cudagraph_capture_sizes: {s} is not n·(K+1) for any batch size "
                             f"n <= max_num_seqs={max_batch} with its num_speculative_tokens K")
        buckets |= ns
    return sorted(buckets)


def compilation_option(compilation_config: Any, key: str, default=None):
    """One key of a ``compilation_config`` dict or object (``default`` when absent)."""
    if compilation_config is None:
        return default
    if isinstance(compilation_config, dict):
        return compilation_config.get(key, default)
    return getattr(compilation_config, key, default)


class LLM:
    """vLLM-compatible entry point: ``LLM(model=PATH, **engine_args).generate(prompts, params)``.

    Mapped: ``max_model_len``, ``max_num_seqs`` (slots), ``enforce_eager`` (eager
    backend), ``speculative_config``, ``compilation_config`` (capture sizes ->
    batch buckets; funcspec's ``"capture": "lazy"`` captures each graph on first
    use instead of while ``LLM(...)`` starts, ``"compile_cache": FILE`` loads
    ``funcspec precompile``'s file first, ``"capture_logprobs": True`` also compiles the logprobs graphs at
    start-up), ``additional_config``, ``seed``, ``dtype``, ``quantization``
    (funcspec quantizes on load: ``"int8"``, ``"int4"``, ...; ``"gguf"`` for a
    ``.gguf`` model, whose weights come quantized), ``tokenizer`` (a directory). funcspec's own
    ``backend`` and ``device`` may also be given. Arguments with no effect here
    are accepted with one warning. ``tensor_parallel_size=N`` shards the target
    across N ranks: from a plain process this ``LLM`` is rank 0 and spawns the
    others (:mod:`funcspec.distributed`); under ``torchrun`` every rank builds
    its own. :meth:`close` stops them (so does interpreter exit).
    """

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 8, enforce_eager: bool = False, speculative_config: Optional[dict] = None,
                 compilation_config: Any = None, additional_config: Optional[dict] = None,
                 kv_transfer_config: Optional[dict] = None, seed: int = 0, dtype: Any = "float32",
                 backend: Optional[str] = None, device: str = "cpu", quantization: Optional[str] = None,
                 tokenizer: Optional[str] = None, **kwargs):
        unknown = sorted(set(kwargs) - NO_EFFECT_ARGS)
        if unknown:
            raise ValueError(f"LLM: unknown engine argument(s) {unknown}")
        if kwargs:
            warnings.warn(f"LLM: arguments with no effect in funcspec were ignored: {sorted(kwargs)}", stacklevel=2)
        import torch

        from funcspec import methods
        from funcspec.config import SpecConfig

        spec = SpecConfig.from_vllm(speculative_config, additional_config) if speculative_config else None
        if spec is not None and spec.ignored_keys:
            warnings.warn(f"speculative_config: keys with no effect in funcspec: {list(spec.ignored_keys)}",
                          stacklevel=2)
        # A method that does not speculate (extract_hidden_states) decodes autoregressively: K = 0.
        max_k = spec.num_speculative_tokens if spec and methods.lookup(spec.method).speculates else 0
        k_of = spec.k_for_batch_size if spec and spec.num_speculative_tokens_per_batch_size else lambda n: max_k
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else torch.float32
        self.engine = Engine(
            model, speculative_config=spec, backend=backend or ("eager" if enforce_eager else "auto"),
            max_batch_size=max_num_seqs, max_model_len=max_model_len, additional_config=additional_config,
            batch_buckets=batch_buckets_from_compilation(compilation_config, k_of, max_num_seqs), seed=seed,
            device=device, dtype=torch_dtype, kv_transfer_config=kv_transfer_config,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, tokenizer=tokenizer,
            capture=compilation_option(compilation_config, "capture", "startup"),  # funcspec's key: or "lazy"
            compile_cache=compilation_option(compilation_config, "compile_cache", None),
            capture_logprobs=compilation_option(compilation_config, "capture_logprobs", False),
        )

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False):
        """Same as :meth:`funcspec.Engine.generate`."""
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Stop the spawned tensor-parallel ranks, if any (:meth:`funcspec.Engine.close`)."""
        self.engine.close()

    def get_tokenizer(self):
        """The target checkpoint's tokenizer (``None`` if it ships none), as vLLM's ``LLM.get_tokenizer``."""
        return self.engine.model.tokenizer
