"""``funcspec.LLM``: a vLLM facade, so the guide's ``LLM(...)`` examples run unchanged."""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from funcspec.capture.backends import BACKENDS
from funcspec.checkpoints import Model
from funcspec.checkpoints.files import FLOAT_DTYPES, TOKENIZER_FILES, has_tokenizer
from funcspec.config import CompilationConfig
from funcspec.config.checks import check_bool, check_int, is_int
from funcspec.engine import Engine

# vLLM engine arguments that have no effect on a single-device funcspec engine.
NO_EFFECT_ARGS = frozenset({
    "gpu_memory_utilization", "async_scheduling", "distributed_executor_backend", "enable_prefix_caching",
    "trust_remote_code", "max_num_batched_tokens", "swap_space",
    "block_size", "enable_chunked_prefill", "disable_log_stats", "tokenizer_mode", "data_parallel_size",
    "served_model_name", "kv_cache_dtype", "disable_custom_all_reduce",
})

DTYPES = {"auto": "float32", "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}
"""``dtype`` names -> torch dtypes: vLLM's, and float64. NOTE: ``"auto"`` is float32 here (vLLM: the
checkpoint's ``torch_dtype``), the precision every CPU path is tested in."""


def torch_dtype(dtype: Any):
    """``LLM(dtype=...)`` as a torch dtype: a name of :data:`DTYPES` or a floating torch dtype."""
    import torch

    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, DTYPES[dtype])
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a floating torch dtype, got {dtype!r}")


def check_device(device: Any):
    """``device`` as a ``torch.device`` this process can use; ``ValueError`` naming it otherwise."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device name such as 'cpu' or 'cuda:0', got {device!r} ({e})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available to this torch")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_engine_args(model: Any, tensor_parallel_size: Any, max_num_seqs: Any, max_model_len: Any,
                      enforce_eager: Any, seed: Any, tokenizer: Any, backend: Any, kwargs: Mapping) -> None:
    """``LLM``'s scalar arguments, checked before the checkpoint is read: ``ValueError`` naming the argument
    (``FileNotFoundError`` for a tokenizer directory without a tokenizer); ``kwargs``: the rest, each a vLLM
    argument with no effect here (else a ``ValueError`` with a suggestion)."""
    unknown = sorted(set(kwargs) - NO_EFFECT_ARGS)
    if unknown:
        known = sorted(NO_EFFECT_ARGS | set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"})
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = "; ".join(f"{k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
        raise ValueError(f"LLM: unknown engine argument(s) {unknown}" + (f" ({hints})" if hints else ""))
    if not isinstance(model, (str, os.PathLike, Model)):
        raise ValueError(f"model must be a checkpoint directory or a .gguf file path, got {model!r}")
    check_int("tensor_parallel_size", tensor_parallel_size, lo=1)  # whether the target divides by it: the engine
    check_int("max_num_seqs", max_num_seqs, lo=1)
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, lo=2)
    check_bool("enforce_eager", enforce_eager)
    if not is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError(f"tokenizer must be a directory path, got {tokenizer!r}")
    if tokenizer is not None and not has_tokenizer(tokenizer):  # NOTE: load_model would quietly run without one
        raise FileNotFoundError(f"tokenizer {os.fspath(tokenizer)!r}: not a directory with a tokenizer "
                                f"(looked for {', '.join(TOKENIZER_FILES)})")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def batch_buckets_from_compilation(sizes: Optional[Sequence[int]], k_for_batch_size: Callable[[int], int],
                                   max_batch: int) -> Optional[list[int]]:
    """Batch buckets from vLLM ``cudagraph_capture_sizes`` (token counts n·(K_n+1)).

    ``k_for_batch_size(n)`` is the K a batch of n runs with (the
    ``num_speculative_tokens_per_batch_size`` table, or the fixed K), so the
    sizes ``funcspec tune-k`` exports decode back to their buckets. A size
    matching several n names all of them (e.g. 4 = 1·(3+1) = 4·(0+1)): an
    extra bucket costs a capture, a missing one would pad batches further.
    """
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


class LLM:
    """vLLM-compatible entry point: ``LLM(model=PATH, **engine_args).generate(prompts, params)``.

    Mapped: ``max_model_len``, ``max_num_seqs`` (slots), ``enforce_eager`` (eager
    backend), ``speculative_config``, ``compilation_config`` (a dict or
    :class:`funcspec.config.CompilationConfig`: capture sizes -> batch buckets;
    funcspec's ``"capture": "lazy"`` captures each graph on first
    use instead of while ``LLM(...)`` starts, ``"compile_cache": FILE`` loads
    ``funcspec precompile``'s file first, ``"capture_logprobs": True`` also compiles the logprobs graphs at
    start-up; vLLM's other keys are named in the warning below), ``additional_config``, ``seed``, ``dtype``,
    ``quantization``
    (funcspec quantizes on load: ``"int8"``, ``"int4"``, ...; ``"gguf"`` for a
    ``.gguf`` model, whose weights come quantized), ``tokenizer`` (a directory). funcspec's own
    ``backend``, ``device`` and ``cpu_kernels`` (``False``: none of funcspec's CPU kernels, as
    ``FUNCSPEC_CPU_KERNELS=0``) may also be given. Arguments with no effect here
    are accepted with one warning. ``tensor_parallel_size=N`` shards the target
    across N ranks: from a plain process this ``LLM`` is rank 0 and spawns the
    others (:mod:`funcspec.distributed`); under ``torchrun`` every rank builds
    its own. :meth:`close` stops them (so does interpreter exit). ``enable_expert_parallel``
    splits a mixture-of-experts target's experts whole across those ranks instead of slicing each.
    """

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 8, enforce_eager: bool = False, speculative_config: Optional[dict] = None,
                 compilation_config: Any = None, additional_config: Optional[dict] = None,
                 kv_transfer_config: Optional[dict] = None, seed: int = 0, dtype: Any = "float32",
                 backend: Optional[str] = None, device: str = "cpu", quantization: Optional[str] = None,
                 tokenizer: Optional[str] = None, cpu_kernels: bool = True, enable_expert_parallel: bool = False,
                 **kwargs):
        # NOTE: every argument is checked before the checkpoint is read or anything is built, so a refused
        # LLM(...) costs nothing and leaves nothing behind (no ranks, no caches).
        check_engine_args(model, tensor_parallel_size, max_num_seqs, max_model_len, enforce_eager, seed, tokenizer,
                          backend, kwargs)
        dt = torch_dtype(dtype)
        check_device(device)
        cc = CompilationConfig.from_vllm(compilation_config)
        ignored = sorted(kwargs) + list(cc.ignored)
        if ignored:
            warnings.warn(f"LLM: arguments with no effect in funcspec were ignored: {ignored}", stacklevel=2)
        from funcspec import methods
        from funcspec.config import SpecConfig

        # An empty dict or string is no speculation, as None; additional_config is validated either way.
        off = speculative_config is None or (isinstance(speculative_config, (Mapping, str)) and not speculative_config)
        spec = SpecConfig.from_vllm(None if off else speculative_config, additional_config,
                                    target=None if isinstance(model, Model) else model)
        if spec is not None and spec.ignored_keys:
            warnings.warn(f"speculative_config: keys with no effect in funcspec: {list(spec.ignored_keys)}",
                          stacklevel=2)
        # A method that does not speculate (extract_hidden_states) decodes autoregressively: K = 0.
        max_k = spec.num_speculative_tokens if spec and methods.lookup(spec.method).speculates else 0
        k_of = spec.k_for_batch_size if spec and spec.num_speculative_tokens_per_batch_size else lambda n: max_k
        self.engine = Engine(
            model, speculative_config=spec, backend=backend or ("eager" if enforce_eager else "auto"),
            max_batch_size=max_num_seqs, max_model_len=max_model_len, additional_config=additional_config,
            batch_buckets=batch_buckets_from_compilation(cc.cudagraph_capture_sizes, k_of, max_num_seqs), seed=seed,
            device=device, dtype=dt, kv_transfer_config=kv_transfer_config,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, tokenizer=tokenizer,
            capture=cc.capture, compile_cache=cc.compile_cache, capture_logprobs=cc.capture_logprobs,
            cpu_kernels=cpu_kernels, enable_expert_parallel=enable_expert_parallel,
        )

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False):
        """Same as :meth:`funcspec.Engine.generate`."""
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Stop the spawned tensor-parallel ranks, if any (:meth:`funcspec.Engine.close`)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        """``with LLM(...) as llm:`` closes the engine (its tensor-parallel ranks) on leaving the block."""
        self.close()

    def get_tokenizer(self):
        """The target checkpoint's tokenizer (``None`` if it ships none), as vLLM's ``LLM.get_tokenizer``."""
        return self.engine.model.tokenizer
