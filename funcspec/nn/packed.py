"""bf16 linear layers on oneDNN's pre-packed weights (AMX CPUs, and AVX512-BF16 ones where
the streaming kernel of :mod:`funcspec.nn.stream` could not be built).

``F.linear`` on bf16 CPU weights re-lays W out into oneDNN's blocked format on
every call, so a decode step streams each weight about twice. Packing once and
reusing the packed copy makes the product stream W once, and its cost barely
grows with the row count: verifying K+1 tokens costs about what decoding one
does. Measured on a 2-core AMD EPYC (Zen 4, AVX512-BF16, no AMX), the 169
linears of a Qwen2.5-0.5B shape (1 GB of bf16 weights): 40-60 ms for any row
count from 1 to 9, against 62-111 ms for ``F.linear`` and 34-168 ms for
inductor's fused row reductions (which grow with the rows).

The packed copy lives in a side table keyed by the weight's address, shape,
strides and version counter, so the forward stays a pure function of plain
tensors: :func:`packed_linear` is a custom op that ``torch.compile`` keeps
opaque, and it finds (or makes) the packed copy at run time. An in-place update
of W (``load_state_dict``, an optimizer step) bumps the version and repacks;
the entry is dropped when the weight's base tensor is freed. Tensors made under
``torch.inference_mode`` keep no version counter: update those out of place.

NOTE: the table holds a second copy of every bf16 weight it has seen (the
packed one), so a bf16 model takes twice its size in memory on these CPUs.
oneDNN's result for a row does not depend on how many rows come with it once
there are at least two (a single row takes another kernel, so fewer than
``MIN_ROWS`` rows are padded), so AR (1 row) and verification (K+1 rows) stay
bitwise consistent: greedy speculation equals greedy AR exactly.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import weakref

import torch

PACK_ROWS = 4
"""The row-count hint oneDNN packs for; 1, 4, 5, 16 and 64 timed the same within noise."""

_PACKED: dict[tuple, tuple[tuple, torch.Tensor]] = {}
"""((address, shape, strides) per weight..., pack function) -> (versions, packed weight)."""


HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page: 2 MiB."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice that asks for transparent huge pages."""


@functools.cache
def _madvise():
    """libc's ``madvise``, or ``None`` off Linux."""
    if sys.platform != "linux":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the CPU, backed by transparent huge pages where Linux grants them.

    NOTE: decode streams the packed weights (and reads the KV cache) once per
    step; with 4 KiB pages that is a TLB miss every 4 KiB. Many kernels only
    grant huge pages to memory that asks (``madvise``), as this VM's does, so
    the tensor is a 2 MiB-aligned view into a buffer one page larger, advised
    before anything touches it. The unaligned ends are never touched, so they
    take no memory. Interleaved over the same bf16 weights, huge pages streamed
    5.5% faster (30.9 against 29.0 GB/s, 2-core Zen 4 EPYC).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # [bytes + one page]
    off = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + off, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # best effort: no check
    return raw[off:off + nbytes].view(dtype).view(shape)


def pack_key(weight, pack) -> tuple:
    """The side table's key of a weight (or tuple of weights) packed by ``pack``."""
    if not isinstance(weight, tuple):
        return (weight.data_ptr(), weight.shape, weight.stride(), pack)
    return (*((w.data_ptr(), w.shape, w.stride()) for w in weight), pack)


def cached_pack(weight, pack) -> torch.Tensor:
    """``pack(weight)``, made on first use and after any in-place update of the weight, then kept.

    ``weight`` is a tensor, or a tuple of tensors packed together (the streaming
    kernel's fused q/k/v and gate/up); the entry is rebuilt when any of them
    changes. The side table serves every packed layout (oneDNN's here, the
    streaming kernel's in :mod:`funcspec.nn.stream`): ``pack`` is part of the key.
    """
    group = weight if isinstance(weight, tuple) else (weight,)
    key = pack_key(weight, pack)
    version = tuple(map(_version, group))
    hit = _PACKED.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    packed = pack(weight)
    if hit is None:
        # NOTE: a view (a tied head, a reinterpreted graph input) dies each call;
        # its base owns the memory, so the entry lives and dies with the base
        # (with the first base to go, for a group).
        for w in group:
            weakref.finalize(w if w._base is None else w._base, _PACKED.pop, key, None)
    _PACKED[key] = (version, packed)
    return packed


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a bf16 weight [out, in], made on first use and after any in-place update."""
    return cached_pack(weight, _onednn_pack)


def _version(weight: torch.Tensor) -> int:
    """The in-place update counter; inference-mode tensors keep none (and are read-only outside it)."""
    return 0 if weight.is_inference() else weight._version


MIN_ROWS = 4
"""Fewer rows are padded with zeros to this many (see :func:`_packed_linear`)."""


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    # NOTE: oneDNN runs a single row through another kernel (a GEMV) whose
    # result can differ in the last bit from the same row among others: at
    # real sizes (a [8192, 2048] weight) AR's 1-row product would then differ
    # from verification's K+1 rows. Padded to MIN_ROWS, every row count takes
    # the GEMM kernel, and 4-6 rows also streamed the weights 15-20% faster
    # than 1-3 rows (the 113 linears of a Llama-3.2-1B shape, 2.4 GB bf16, on
    # a 2-core Zen 4 EPYC: about 90-100 ms against 110-128 ms for one row).
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")
    x2 = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, MIN_ROWS - rows))  # [MIN_ROWS, in]
    out = torch.ops.mkldnn._linear_pointwise(x2, packed_weight(weight), bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear_meta(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The shape of ``x @ W.T``: the Meta kernel of :func:`packed_linear`."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# NOTE: a raw Library op, not torch.library.custom_op: the decorator's Python
# wrapper cost 44 us a call against 19 us, 3.7 ms on a 169-linear decode step.
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
_LIB.impl("packed_linear", linear_meta, "Meta")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for bf16 x [..., in] and W [out, in] on the CPU, through the packed copy of W."""
    return torch.ops.funcspec.packed_linear(x, weight, bias)
