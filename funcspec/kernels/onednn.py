"""bf16 linear layers on oneDNN's pre-packed weights, on CPUs with bf16 instructions (AVX512-BF16, AMX) where
funcspec's kernels are turned off or could not be built (:mod:`funcspec.kernels.build`).

``F.linear`` on bf16 CPU weights re-lays W out into oneDNN's blocked format on
every call, so a decode step streams each weight about twice. Packing once (at
load: ``funcspec.quant.prepare_params``) makes the product stream W once, and
its cost barely grows with the row count: verifying K+1 tokens costs about
what decoding one does (graphs/results/notes/kernels.md).

oneDNN's result for a row does not depend on how many rows come with it once
there are at least two (a single row takes another kernel, so fewer than
``MIN_ROWS`` rows are padded), so AR (1 row) and verification (K+1 rows) stay
bitwise consistent: greedy speculation equals greedy AR exactly.
"""

from __future__ import annotations

import torch

PACK_ROWS = 4
"""The row-count hint oneDNN packs for (other hints timed the same)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a bf16 weight [out, in]."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


MIN_ROWS = 4
"""Fewer rows are padded with zeros to this many (see :func:`_packed_linear`)."""


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    # NOTE: oneDNN runs a single row through another kernel (a GEMV) whose
    # result can differ in the last bit from the same row among others: at
    # real sizes (a [8192, 2048] weight) AR's 1-row product would then differ
    # from verification's K+1 rows. Padded to MIN_ROWS, every row count takes
    # the GEMM kernel, which also streams the weights faster than the GEMV.
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    x2 = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, MIN_ROWS - rows))  # [MIN_ROWS, in]
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], n)


def _packed_linear_meta(x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


# NOTE: a raw Library op, not torch.library.custom_op: the decorator's Python
# wrapper costs more per call than the op itself (graphs/results/notes/kernels.md).
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
_LIB.impl("packed_linear", _packed_linear, "MkldnnCPU")  # the packed weight is an opaque oneDNN tensor
_LIB.impl("packed_linear", _packed_linear_meta, "Meta")


def packed_op(x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    """``x @ W.T (+ b)`` [..., n] for bf16 x [..., in] and W packed by :func:`pack`, on the CPU."""
    return torch.ops.funcspec.packed_linear(x, packed, bias, n)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for bf16 x [..., in] and W [out, in], packing W on this call (tests; a model's
    weights are packed once, at load)."""
    return packed_op(x, pack(weight), bias, weight.shape[0])
