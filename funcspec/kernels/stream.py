"""Weight-streaming linear layers for CPU decode, on every kernel build (:mod:`funcspec.kernels.build`).

Decode multiplies a few rows (B·(K+1)) by weights far beyond the caches, so a
step costs what reading the weights once costs; oneDNN's bf16 GEMM and MKL's
fp32 products do not reach that on the CPUs measured (graphs/results/notes/kernels.md).

:file:`stream.cpp` multiplies W packed once (:func:`pack_weight`, at load:
``funcspec.quant.prepare_params``) into column blocks of 64 outputs, each one
contiguous stream, by broadcast rows of x (``vdpbf16ps`` for bf16 and FMA for
fp32 on the avx512bf16 build; the other builds' vectors, simd.h): fp32
accumulators that are outputs, no horizontal sums, a few rows per pass. From 6
rows on the compute holds the loads back, so those passes prefetch the next
chunk. The threads take runs of blocks as they free up (guided), not equal
shares: a VM's cores differ in speed from moment to moment.

Linears that read the same input (q/k/v, gate/up) are packed side by side into
one stream (:func:`pack_weights`): a Llama decode step then makes 65 calls
instead of 113, each with its Python cost.

Every output element sums over k in one fixed order whatever the row count, so
a row's result does not depend on the rows beside it: AR (1 row) and
verification (K+1 rows, B·(K+1) in a batch) agree bit for bit, and greedy
speculation equals greedy AR. :func:`stream_op` is a custom op, opaque to
``torch.compile``; the library is :mod:`funcspec.kernels.build`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from funcspec.kernels import build
from funcspec.kernels.cpu import huge_empty

DTYPES = (torch.bfloat16, torch.float32)
BLOCK = 64
"""Outputs per column block of the packed layout (stream.cpp's ``BLOCK``)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the kernel's layout: column blocks of 64 outputs, each one contiguous stream.

    bf16 [ceil(N/64), K/2, 64, 2] (k pairs, what ``vdpbf16ps`` multiplies), fp32
    [ceil(N/64), K, 64]. N is zero-padded to a whole block and bf16's K to even.
    """
    n, k = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    w = F.pad(weight.detach(), (0, -k % pair, 0, -n % BLOCK))  # [N', K']
    w = w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1] // pair, pair).permute(0, 2, 1, 3)  # [N'/64, K'/P, 64, P]
    return huge_empty(w.shape, w.dtype).copy_(w)


def pack_weights(weights) -> torch.Tensor:
    """Weights [N_i, K] of one input packed one after another (:func:`pack_weight` each): one stream
    whose outputs are the weights' outputs side by side, each but the last padded to whole blocks."""
    parts = [pack_weight(w) for w in weights]  # [ceil(N_i/64), K'/P, 64, P] each
    return torch.cat(parts, out=huge_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype))


def widths(sizes) -> list[int]:
    """The columns each of the weights of ``sizes`` (out features, in order) takes in their packed group's
    product: padded to whole blocks, the last one not."""
    sizes = list(sizes)
    return [-(-n // BLOCK) * BLOCK for n in sizes[:-1]] + [sizes[-1]]


def group_bias(sizes, biases, dtype) -> torch.Tensor | None:
    """The biases of a packed group side by side as its outputs lie (zeros for a weight without one), or
    ``None`` when none has one: what :func:`stream_op` adds for the group."""
    if all(b is None for b in biases):
        return None
    parts = [torch.zeros(n, dtype=dtype) if b is None else b.to(dtype) for n, b in zip(sizes, biases)]
    return torch.cat([F.pad(b, (0, w - b.shape[0])) for b, w in zip(parts, widths(sizes))])  # [sum of widths]


def _stream_linear_meta(x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


# NOTE: a raw Library op: its CPU kernel is C++ (torch_ops.cpp, registered by build.torch_ops), so a call
# costs no Python; here its schema and the shape function tracing uses.
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("stream_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")
_LIB.impl("stream_linear", _stream_linear_meta, "Meta")


def stream_op(x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    """``x @ W.T (+ b)`` [..., n] for x [..., in] and W packed by :func:`pack_weight` (or a group by
    :func:`pack_weights`, whose ``n`` is the sum of :func:`widths`), of x's dtype (bf16 or fp32), on the CPU.

    Needs :func:`funcspec.kernels.build.available`; a row's result is bitwise the same whatever rows come with it.
    A wrong dtype or shape is a ``ValueError`` naming it.
    """
    build.ready()
    return torch.ops.funcspec.stream_linear(x, packed, bias, n)


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for x [..., in] and W [out, in], packing W on this call (tests and one-off products;
    a model's weights are packed once, at load)."""
    return stream_op(x, pack_weight(weight), bias, weight.shape[0])


def stream_linears(x: torch.Tensor, weights, biases=None) -> list[torch.Tensor]:
    """``[x @ W_i.T (+ b_i)]`` for weights W_i [out_i, in] of one input x [..., in], in one pass over them all,
    packed on this call. Each output's bits are those of :func:`stream_linear` on its own weight (same k order)."""
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"stream_linear: one bias (or None) per weight, got {len(weights)} weights and "
                         f"{len(biases)} biases")
    sizes = [w.shape[0] for w in weights]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
            raise ValueError(f"stream_linear: weights must be [out, {x.shape[-1]}] of x's dtype {x.dtype}, got "
                             f"{list(w.shape)} {w.dtype}")
    out = stream_op(x, pack_weights(weights), group_bias(sizes, biases, x.dtype), sum(widths(sizes)))
    return split(out, sizes)


def split(out: torch.Tensor, sizes) -> list[torch.Tensor]:
    """A packed group's product [..., sum of widths] as each weight's output [..., out_i] (views)."""
    parts = out.split(widths(sizes), -1)  # one call for all the views; then drop any block padding
    return [p if p.shape[-1] == n else p[..., :n] for p, n in zip(parts, sizes)]
