"""``EngineArgs``: every engine argument, under vLLM's names, with one set of defaults and one validation.

``LLM(...)``, ``Engine(...)``, ``funcspec.generate(...)``, ``funcspec serve`` and
``funcspec precompile`` all build one :class:`EngineArgs` (``EngineArgs.from_kwargs``
takes their keywords) and hand it to the engine's build steps (:mod:`funcspec.build`).
Every argument that can be judged without the checkpoint's weights is judged
here, once, so a refused engine has read nothing and started nothing.

The defaults are vLLM's: graphs are compiled (``backend="auto"``) unless
``enforce_eager=True``. funcspec's own arguments (``backend``, ``device``,
``cpu_kernels``, ``context_buckets``, ``ops``) are fields too. A tensor-parallel
rank 0 sends its followers :meth:`EngineArgs.to_dict` (plain data) with its plan.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from funcspec.capture.backends import BACKENDS, auto_backend
from funcspec.checkpoints import Model
from funcspec.checkpoints.files import FLOAT_DTYPES, TOKENIZER_FILES, has_tokenizer
from funcspec.config import CompilationConfig, SpecConfig
from funcspec.config.checks import check_bool, check_int, is_int
from funcspec.kernels import Ops
from funcspec.quant.formats import on_load

__all__ = ["EngineArgs", "NO_EFFECT_ARGS", "DEPRECATED_ARGS", "DTYPES", "torch_dtype", "check_device"]

NO_EFFECT_ARGS = frozenset({
    "gpu_memory_utilization", "async_scheduling", "distributed_executor_backend", "enable_prefix_caching",
    "trust_remote_code", "max_num_batched_tokens", "swap_space",
    "block_size", "enable_chunked_prefill", "disable_log_stats", "tokenizer_mode", "data_parallel_size",
    "served_model_name", "kv_cache_dtype", "disable_custom_all_reduce",
})
"""vLLM engine arguments that have no effect on a funcspec engine: accepted, and named in one warning."""

DEPRECATED_ARGS: Mapping[str, str] = {
    "max_batch_size": "max_num_seqs",
    "batch_buckets": "compilation_config['batch_sizes'] (or vLLM's cudagraph_capture_sizes)",
    "capture": "compilation_config['capture']",
    "compile_cache": "compilation_config['compile_cache']",
    "capture_logprobs": "compilation_config['capture_logprobs']",
}
"""``Engine``'s old keyword spellings and what replaces each: they still work, with a ``DeprecationWarning``."""

DTYPES = {"auto": "float32", "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}
"""``dtype`` names -> torch dtypes: vLLM's, and float64. NOTE: ``"auto"`` is float32 here (vLLM: the
checkpoint's ``torch_dtype``), the precision every CPU path is tested in."""


def torch_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` as a torch dtype: a name of :data:`DTYPES` or a floating torch dtype."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, DTYPES[dtype])
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a floating torch dtype, got {dtype!r}")


def check_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` this process can use; ``ValueError`` naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device name such as 'cpu' or 'cuda:0', got {device!r} ({e})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available to this torch")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


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


def _flag(kind: str, text: str) -> dict:
    """A field's metadata: how ``funcspec serve`` reads its flag (``kind``) and the flag's help."""
    return {"cli": kind, "help": text}


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every argument of an engine, vLLM's names first, then funcspec's own.

    Constructing one validates it: a bad value is a ``ValueError`` naming the field (``FileNotFoundError`` for a
    ``tokenizer`` directory without a tokenizer), before any checkpoint weight is read. The parsed forms replace
    the given ones: ``speculative_config`` becomes a :class:`~funcspec.config.SpecConfig` (or ``None``; an empty
    dict or string is ``None``), ``compilation_config`` a :class:`~funcspec.config.CompilationConfig`, ``ops`` an
    :class:`~funcspec.kernels.Ops`, a torch ``dtype`` its name. ``backend``, when given, wins over
    ``enforce_eager``.
    """

    model: Any = dataclasses.field(metadata=_flag("positional", "the target checkpoint: a directory or a .gguf file"))
    tokenizer: Optional[str] = dataclasses.field(default=None, metadata=_flag("str", "a directory to take the "
                                                                                       "tokenizer from"))
    speculative_config: Any = dataclasses.field(default=None, metadata=_flag("json", "vLLM speculative_config"))
    tensor_parallel_size: int = dataclasses.field(default=1, metadata=_flag("int", "ranks the target is sharded "
                                                                                    "across"))
    enable_expert_parallel: bool = dataclasses.field(default=False, metadata=_flag(
        "bool", "split a mixture-of-experts target's experts whole across the ranks"))
    max_model_len: Optional[int] = dataclasses.field(default=None, metadata=_flag(
        "int", "prompt + output limit (default: min(max_position_embeddings, 2048))"))
    max_num_seqs: int = dataclasses.field(default=8, metadata=_flag("int", "KV slots (continuous batching)"))
    enforce_eager: bool = dataclasses.field(default=False, metadata=_flag("bool", "the eager backend: no graph is "
                                                                                  "compiled"))
    compilation_config: Any = dataclasses.field(default=None, metadata=_flag(
        "json", "vLLM compilation_config; funcspec's keys: batch_sizes, capture, compile_cache, capture_logprobs, "
                "compile_helpers"))
    additional_config: Optional[dict] = dataclasses.field(default=None, metadata=_flag(
        "json", "vLLM-Ascend additional_config (rejection sampler, draft window, dynamic spec)"))
    kv_transfer_config: Optional[dict] = dataclasses.field(default=None, metadata=_flag(
        "json", "vLLM's hidden-states connector, for method extract_hidden_states"))
    seed: int = dataclasses.field(default=0, metadata=_flag("int", "seed of requests without one"))
    dtype: Any = dataclasses.field(default="auto", metadata=_flag("str", "auto | float32 | bfloat16 | float16 "
                                                                          "(auto: float32)"))
    quantization: Optional[str] = dataclasses.field(default=None, metadata=_flag(
        "str", "quantize the target on load (int8, int4, ...), or the stored format it must be in"))
    backend: Optional[str] = dataclasses.field(default=None, metadata=_flag(
        "str", f"funcspec's capture backend, one of {BACKENDS} (default: auto, eager under enforce_eager)"))
    device: Any = dataclasses.field(default="cpu", metadata=_flag("str", "funcspec's device"))
    cpu_kernels: bool = dataclasses.field(default=True, metadata=_flag("bool", "funcspec's own CPU kernels in the "
                                                                               "default ops"))
    context_buckets: Optional[tuple[int, ...]] = dataclasses.field(default=None, metadata=_flag(
        "ints", "KV lengths a step's attention reads (default: by the decode kernel)"))
    ops: Optional[Ops] = dataclasses.field(default=None, metadata=_flag(
        "json", "the kernels, as funcspec.kernels.Ops fields (default: what the device takes)"))

    def __post_init__(self) -> None:
        _check_scalars(self)
        torch_dtype(self.dtype)  # a ValueError naming dtype for anything but a float's name or torch dtype
        if isinstance(self.dtype, torch.dtype):
            self._set("dtype", str(self.dtype).removeprefix("torch."))  # one spelling: its name
        check_device(self.device)
        self._set("ops", _ops(self.ops, self.cpu_kernels))
        if self.context_buckets is not None:
            if isinstance(self.context_buckets, (str, bytes)) or not isinstance(self.context_buckets, Sequence):
                raise ValueError(f"context_buckets must be a list of KV lengths, got {self.context_buckets!r}")
            self._set("context_buckets", tuple(self.context_buckets))
        on_load(self.quantization)
        if not isinstance(self.compilation_config, CompilationConfig):
            cc = CompilationConfig.from_vllm(self.compilation_config)
            _warn_ignored("EngineArgs", list(cc.ignored))
            self._set("compilation_config", cc)
        self._set("speculative_config", _spec(self))
        if self.kv_transfer_config is not None and self.method != "extract_hidden_states":
            raise ValueError("kv_transfer_config is only supported with method 'extract_hidden_states'")
        if self.speculative_config is not None:  # NOTE: before aclgraph's import of torch_npu: K + 1 <= 16 first
            self.speculative_config.validate_for_backend(self.resolved_backend)
        self.batch_buckets  # noqa: B018 (capture sizes that name no batch size are refused now)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    # ----------------------------------------------------------------- what the fields resolve to
    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype (``"auto"``: float32)."""
        return torch_dtype(self.dtype)

    @property
    def backend_name(self) -> str:
        """The backend asked for: ``backend``, else ``"eager"`` under ``enforce_eager``, else ``"auto"``."""
        return self.backend or ("eager" if self.enforce_eager else "auto")

    @property
    def resolved_backend(self) -> str:
        """The backend this engine captures with: :attr:`backend_name`, ``auto`` resolved for ``device``
        (without importing any device module)."""
        name = self.backend_name
        return auto_backend(self.device) if name == "auto" else name

    @property
    def method(self) -> Optional[str]:
        """The speculative method, or ``None``."""
        return self.speculative_config.method if self.speculative_config is not None else None

    @property
    def max_k(self) -> int:
        """The largest K a step drafts (``SpecConfig.max_k``, where it is derived); 0 without speculation."""
        spec = self.speculative_config
        return spec.max_k if spec is not None else 0

    def k_for_batch_size(self, n: int) -> int:
        """The K a batch of ``n`` rows runs with (``SpecConfig.k_for_batch_size``: the batch-size table's, else
        :attr:`max_k`); 0 without speculation."""
        spec = self.speculative_config
        return spec.k_for_batch_size(n) if spec is not None else 0

    @property
    def batch_buckets(self) -> Optional[list[int]]:
        """The batch buckets: ``compilation_config.batch_sizes``, or those its ``cudagraph_capture_sizes``
        name (``None``: the default)."""
        if self.compilation_config.batch_sizes is not None:
            return sorted(self.compilation_config.batch_sizes)
        return batch_buckets_from_compilation(self.compilation_config.cudagraph_capture_sizes,
                                              self.k_for_batch_size, self.max_num_seqs)

    # ----------------------------------------------------------------- building one
    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], caller: str = "EngineArgs") -> "EngineArgs":
        """The :class:`EngineArgs` of ``LLM``'s, ``Engine``'s or ``generate``'s keywords (``model`` among them).

        vLLM arguments with no effect here (:data:`NO_EFFECT_ARGS`) and ``compilation_config`` keys with none
        are named in one warning; an old spelling (:data:`DEPRECATED_ARGS`) warns a ``DeprecationWarning``
        naming its replacement; any other unknown keyword is a ``ValueError`` with a suggestion. ``caller``
        starts those messages.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        _refuse_unknown(set(kwargs) - fields - set(DEPRECATED_ARGS) - NO_EFFECT_ARGS, fields, caller)
        given = {k: v for k, v in kwargs.items() if k in fields}
        old = {k: kwargs[k] for k in DEPRECATED_ARGS if k in kwargs}
        for name in old:
            warnings.warn(f"{caller}: {name}= is deprecated; use {DEPRECATED_ARGS[name]}", DeprecationWarning,
                          stacklevel=3)
        if "max_batch_size" in old:
            if "max_num_seqs" in given:
                raise ValueError("max_batch_size is the old name of max_num_seqs: give max_num_seqs alone")
            given["max_num_seqs"] = old.pop("max_batch_size")
        buckets = old.pop("batch_buckets", None)
        cc = _compilation(given.get("compilation_config"), old)
        _warn_ignored(caller, sorted(k for k in kwargs if k in NO_EFFECT_ARGS) + list(cc.ignored))
        args = cls(**{**given, "compilation_config": cc})
        return args if buckets is None else args.with_batch_buckets(buckets)

    def with_batch_buckets(self, buckets: Sequence[int]) -> "EngineArgs":
        """These arguments with exactly the batch buckets ``buckets`` (``compilation_config.batch_sizes``)."""
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) \
                or not all(is_int(n) and n >= 1 for n in buckets):
            raise ValueError(f"batch_buckets must be a list of batch sizes >= 1, got {buckets!r}")
        cc = dataclasses.replace(self.compilation_config, batch_sizes=tuple(buckets))
        return dataclasses.replace(self, compilation_config=cc)

    # ----------------------------------------------------------------- as plain data (tensor-parallel followers)
    def to_dict(self) -> dict[str, Any]:
        """These arguments as plain data (JSON-able): what a spawned tensor-parallel rank 0 sends its followers.

        ``speculative_config``, ``compilation_config`` and ``ops`` become dicts of their fields, ``device`` its
        string. A loaded :class:`~funcspec.checkpoints.Model` does not travel: followers
        load their own from a path (``ValueError`` naming ``model``)."""
        if isinstance(self.model, Model):
            raise ValueError("model: a spawned tensor-parallel engine needs a checkpoint path (each rank loads "
                             "its own), got a loaded Model")
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["model"] = os.fspath(self.model)
        out["device"] = str(self.device)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineArgs":
        """The arguments :meth:`to_dict` wrote (``EngineArgs.from_dict(a.to_dict()) == a`` for a path model);
        every check runs again, and an unknown field is a ``ValueError`` naming it."""
        from funcspec.plan import _fields, _spec

        d = _fields(cls, d, "EngineArgs", nested=[f.name for f in dataclasses.fields(cls)])
        spec = d["speculative_config"]
        cc = _fields(CompilationConfig, d["compilation_config"], "EngineArgs.compilation_config")
        return cls(**{**d, "speculative_config": None if spec is None else _spec(spec),
                      "compilation_config": CompilationConfig(**cc)})


def _check_scalars(args: EngineArgs) -> None:
    """The arguments that are one value each: a ``ValueError`` naming the first bad one."""
    if not isinstance(args.model, (str, os.PathLike, Model)):
        raise ValueError(f"model must be a checkpoint directory or a .gguf file path, got {args.model!r}")
    check_int("tensor_parallel_size", args.tensor_parallel_size, lo=1)  # whether the target divides by it: load
    check_int("max_num_seqs", args.max_num_seqs, lo=1)
    if args.max_model_len is not None:
        check_int("max_model_len", args.max_model_len, lo=2)
    check_bool("enforce_eager", args.enforce_eager)
    check_bool("enable_expert_parallel", args.enable_expert_parallel)
    if not isinstance(args.cpu_kernels, bool):
        raise ValueError(f"cpu_kernels must be True or False, got {args.cpu_kernels!r}")
    if not is_int(args.seed):
        raise ValueError(f"seed must be an integer, got {args.seed!r}")
    if args.backend is not None and args.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {args.backend!r}")
    tok = args.tokenizer
    if tok is not None and not isinstance(tok, (str, os.PathLike)):
        raise ValueError(f"tokenizer must be a directory path, got {tok!r}")
    if tok is not None and not has_tokenizer(tok):  # NOTE: load_model would quietly run without one
        raise FileNotFoundError(f"tokenizer {os.fspath(tok)!r}: not a directory with a tokenizer "
                                f"(looked for {', '.join(TOKENIZER_FILES)})")


def _ops(ops: Any, cpu_kernels: bool) -> Optional[Ops]:
    """``ops`` as :class:`Ops` (a dict of its fields, as ``to_dict`` writes it, is read back)."""
    if ops is not None and not cpu_kernels:
        raise ValueError("cpu_kernels=False shapes the default ops: pass ops or cpu_kernels, not both")
    if ops is None or isinstance(ops, Ops):
        return ops
    if not isinstance(ops, Mapping):
        raise ValueError(f"ops must be a funcspec.kernels.Ops or a dict of its fields, got {type(ops).__name__}")
    from funcspec.plan import _fields

    return Ops(**_fields(Ops, {**dataclasses.asdict(Ops()), **ops}, "ops"))


def _spec(args: EngineArgs) -> Optional[SpecConfig]:
    """``speculative_config`` (with ``additional_config``) parsed; a parsed one is kept as it is. Keys with no
    effect are named in a warning."""
    spec = args.speculative_config
    if isinstance(spec, SpecConfig):
        return spec
    off = spec is None or (isinstance(spec, (Mapping, str)) and not spec)  # an empty dict or string: none
    target = None if isinstance(args.model, Model) else args.model
    parsed = SpecConfig.from_vllm(None if off else spec, args.additional_config, target=target)
    if parsed is not None and parsed.ignored_keys:
        warnings.warn(f"speculative_config: keys with no effect in funcspec: {list(parsed.ignored_keys)}",
                      stacklevel=4)
    return parsed


def _compilation(value: Any, old: Mapping[str, Any]) -> CompilationConfig:
    """``compilation_config`` parsed, with the old keywords ``capture``, ``compile_cache`` and
    ``capture_logprobs`` (``old``) as its keys; a key given both ways is a ``ValueError``."""
    cc = CompilationConfig.from_vllm(value)
    twice = sorted(k for k in old if isinstance(value, Mapping) and k in value)
    if twice:
        raise ValueError(f"{twice[0]} is given twice: as {twice[0]}= and as compilation_config[{twice[0]!r}]")
    return dataclasses.replace(cc, **old) if old else cc


def _refuse_unknown(unknown: set[str], fields: set[str], caller: str) -> None:
    """A ``ValueError`` naming the ``unknown`` keywords, with the closest known name of each."""
    if not unknown:
        return
    known = sorted(NO_EFFECT_ARGS | fields)
    close = {k: difflib.get_close_matches(k, known, n=1) for k in sorted(unknown)}
    hints = "; ".join(f"{k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
    raise ValueError(f"{caller}: unknown engine argument(s) {sorted(unknown)}" + (f" ({hints})" if hints else ""))


def _warn_ignored(caller: str, ignored: list[str]) -> None:
    if ignored:
        warnings.warn(f"{caller}: arguments with no effect in funcspec were ignored: {ignored}", stacklevel=4)


def _plain(value: Any) -> Any:
    """A field's value as plain data: a dataclass as a dict of its fields, a tuple as a list (recursively)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
