"""vLLM's ``compilation_config``: :class:`CompilationConfig`, with vLLM's field names, and the keys funcspec reads.

funcspec compiles each (batch, K) bucket's whole step as one static graph with
its backend (``LLM(backend=...)``, ``enforce_eager``), so of vLLM's keys only
``cudagraph_capture_sizes`` has an effect (the batch buckets); funcspec adds
``capture``, ``capture_logprobs``, ``compile_cache`` and ``compile_helpers``. Every other key, vLLM's
or one neither knows, is kept unread and named in ``LLM``'s one warning about
arguments with no effect, with the reason (:attr:`CompilationConfig.ignored`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from funcspec.capture import CAPTURE_MODES
from funcspec.config.checks import check_bool, is_int

CC = "compilation_config."

_WHOLE_STEP = "funcspec captures each bucket's whole step as one static graph"
_BACKEND = "funcspec compiles with its backend (LLM(backend=...), enforce_eager)"
_CACHE = "funcspec files compiled steps in inductor's cache directory (compile_cache: one file)"
NO_EFFECT: Mapping[str, str] = {
    **dict.fromkeys(("cudagraph_mode", "splitting_ops", "use_inductor_graph_partition", "full_cuda_graph",
                     "use_cudagraph", "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "cudagraph_specialize_lora",
                     "max_cudagraph_capture_size", "compile_sizes", "compile_ranges_split_points",
                     "dynamic_shapes_config"), _WHOLE_STEP),
    **dict.fromkeys(("level", "mode", "backend", "custom_ops", "inductor_compile_config", "inductor_passes",
                     "pass_config", "use_inductor", "compile_mm_encoder"), _BACKEND),
    **dict.fromkeys(("cache_dir", "debug_dump_path", "compile_cache_save_format"), _CACHE),
}
"""vLLM's ``CompilationConfig`` keys that change nothing in funcspec, and why."""

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """vLLM's ``CompilationConfig`` (``from vllm.config import CompilationConfig`` becomes
    ``from funcspec.config import CompilationConfig``); ``LLM(compilation_config=...)`` takes it or a dict.

    Attributes:
        cudagraph_capture_sizes: vLLM's capture sizes, n·(K_n + 1) tokens: the batch buckets n.
        batch_sizes: funcspec's: the batch buckets themselves (where capture sizes would name more than one
            batch size under a K table); not with ``cudagraph_capture_sizes``.
        capture: funcspec's: ``"startup"`` captures every graph while ``LLM(...)`` starts, ``"lazy"`` each on first use.
        capture_logprobs: funcspec's: also capture the logprobs graphs at start-up.
        compile_cache: funcspec's: a ``funcspec precompile`` file to load first.
        compile_helpers: funcspec's: processes that compile a share of the start-up graphs beside the engine
            (:mod:`funcspec.capture.helpers`); ``None``: one per idle core, ``0``: none.
        mode, level, backend, cudagraph_mode, custom_ops, splitting_ops, compile_sizes, inductor_compile_config,
        pass_config, max_cudagraph_capture_size, cudagraph_num_of_warmups, use_inductor_graph_partition,
        cache_dir: vLLM's, with no effect here (:data:`NO_EFFECT` says why); ``cudagraph_mode`` and
            ``mode`` must still be values vLLM knows.
        unknown_keys: keys of a dict that neither vLLM's fields above nor funcspec's are (also no effect).
    """

    cudagraph_capture_sizes: Optional[tuple[int, ...]] = None
    batch_sizes: Optional[tuple[int, ...]] = None
    capture: str = "startup"
    capture_logprobs: bool = False
    compile_cache: Optional[str] = None
    compile_helpers: Optional[int] = None
    mode: Any = None
    level: Any = None
    backend: Any = None
    cudagraph_mode: Any = None
    custom_ops: Any = None
    splitting_ops: Any = None
    compile_sizes: Any = None
    inductor_compile_config: Any = None
    pass_config: Any = None
    max_cudagraph_capture_size: Any = None
    cudagraph_num_of_warmups: Any = None
    use_inductor_graph_partition: Any = None
    cache_dir: Any = None
    unknown_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"{CC}capture must be one of {CAPTURE_MODES}, got {self.capture!r}")
        check_bool(CC + "capture_logprobs", self.capture_logprobs)
        if self.compile_cache is not None and not isinstance(self.compile_cache, (str, os.PathLike)):
            raise ValueError(f"{CC}compile_cache must be a file path, got {self.compile_cache!r}")
        if self.compile_helpers is not None and not (is_int(self.compile_helpers) and self.compile_helpers >= 0):
            raise ValueError(f"{CC}compile_helpers must be a number of processes >= 0, got {self.compile_helpers!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) \
                    or not all(is_int(s) and s >= 1 for s in sizes):
                raise ValueError(f"{CC}cudagraph_capture_sizes must be a list of integers >= 1, got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sizes))
        batch = self.batch_sizes
        if batch is not None:
            if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence) \
                    or not all(is_int(n) and n >= 1 for n in batch):
                raise ValueError(f"{CC}batch_sizes must be a list of batch sizes >= 1, got {batch!r}")
            if sizes is not None:
                raise ValueError(f"{CC}batch_sizes and {CC}cudagraph_capture_sizes both name the batch buckets: "
                                 "give one")
            object.__setattr__(self, "batch_sizes", tuple(batch))
        _check_name("cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES)
        _check_name("mode", self.mode, COMPILATION_MODES, levels=True)

    @classmethod
    def from_vllm(cls, value: Any) -> "CompilationConfig":
        """``LLM``'s ``compilation_config``: ``None``, a dict (unknown keys kept in :attr:`unknown_keys`), a
        ``CompilationConfig``, or vLLM's integer level."""
        if value is None or isinstance(value, CompilationConfig):
            return value or cls()
        if is_int(value):
            return cls(level=value)
        if not isinstance(value, Mapping):
            raise ValueError(f"compilation_config must be a dict (or funcspec.config.CompilationConfig, or vLLM's "
                             f"integer level), got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"unknown_keys"}
        known = {k: v for k, v in value.items() if k in fields}
        return cls(**known, unknown_keys=tuple(str(k) for k in value if k not in fields))

    @property
    def ignored(self) -> tuple[str, ...]:
        """The given keys with no effect, each as ``compilation_config.<key> (<why>)``, for ``LLM``'s warning."""
        given = [f.name for f in dataclasses.fields(self) if f.name in NO_EFFECT and getattr(self, f.name) is not None]
        return tuple([f"{CC}{k} ({NO_EFFECT[k]})" for k in given] + [_unknown(k) for k in self.unknown_keys])


def _check_name(field: str, value: Any, names: tuple[str, ...], levels: bool = False) -> None:
    """A vLLM enum value given by name (any case), or by number for ``levels``: refused otherwise, as vLLM does."""
    if value is None or (levels and is_int(value) and 0 <= value < len(names)):
        return
    if not (isinstance(value, str) and value.upper() in names):
        raise ValueError(f"{CC}{field} must be one of {list(names)}" + (" or 0-3" if levels else "") +
                         f", got {value!r}")


def _unknown(key: str) -> str:
    """An unknown key's entry in the warning, with the closest known key when there is one."""
    known = [f.name for f in dataclasses.fields(CompilationConfig) if f.name != "unknown_keys"] + list(NO_EFFECT)
    close = difflib.get_close_matches(key, known, n=1)
    return f"{CC}{key} (not a key of vLLM's or funcspec's" + (f"; did you mean {close[0]!r}?)" if close else ")")
