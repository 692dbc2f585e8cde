"""Attention of a few query tokens over the KV cache as it lies: the CPU decode kernel behind
:func:`~funcspec.nn.llama.attend` (where the step's ``Ops`` has ``decode_attention``).

A decode or verify step has 1-65 query tokens and reads the live cache once per
layer, so it should cost about what streaming K and V costs; SDPA's CPU flash
kernel spends several times that at these shapes (graphs/results/notes/kernels.md).

:file:`attention.cpp` reads q, K and V in place (q a view of the fused q/k/v product, K and V the cache),
skips the positions a query cannot see, and runs the G query heads of a KV head
together, so each K and V row is loaded once for all of them. Scores, softmax
and sums are fp32; on the avx512bf16 build bf16 multiplies raw bf16 pairs
(``vdpbf16ps``), with the probabilities rounded to bf16 for the weighted sum of
V as SDPA's bf16 kernels do (the other builds convert K and V to fp32).
Every query row is computed by the same instructions whatever rows come with it,
so AR (1 token) and verification (K+1) agree bit for bit. It is built into the
library of :mod:`funcspec.kernels.build` and needs what that needs (:func:`supports`).
"""

from __future__ import annotations

import torch

from funcspec.kernels import build
from funcspec.kernels.stream import DTYPES

MAX_HEAD_DIM = 256
"""The avx512bf16 kernel keeps a query row in registers: 16 zmm of fp32."""


def supports(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these operands (static: device, dtypes, head size, autograd)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, vals))
    return (q.device.type == "cpu" and not grad and q.dtype in DTYPES and keys.dtype == q.dtype
            and vals.dtype == q.dtype and 1 <= q.shape[-1] <= MAX_HEAD_DIM and build.available())


def _decode_attention_meta(q, keys, vals, visible) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))


# NOTE: a raw Library op, as funcspec::stream_linear: opaque to torch.compile, its CPU kernel C++ (torch_ops.cpp).
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor keys, Tensor vals, Tensor visible) -> Tensor")
_LIB.impl("decode_attention", _decode_attention_meta, "Meta")


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of q [B, T, H, D] over keys/vals [B, H_kv, T_read, D] where visible [B, T, T_read].

    Returns [B, T, H·D]. Query head h reads KV head h // (H / H_kv) (GQA). A row
    that sees no position gets zeros. Needs :func:`supports`; a wrong dtype or shape is a ``ValueError`` naming it
    (a head size outside 1..:data:`MAX_HEAD_DIM`, H_kv not dividing H, a mask not [B, T, T_read]).
    """
    build.ready()
    return torch.ops.funcspec.decode_attention(q, keys, vals, visible)
