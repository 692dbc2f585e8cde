"""Attention of a few query tokens over the KV cache as it lies: the CPU decode kernel behind
:func:`~funcspec.nn.llama.attend` (where the step's ``Ops`` has ``decode_attention``).

A decode or verify step has 1-65 query tokens and reads the live cache once per
layer, so it should cost about what streaming K and V costs; SDPA's CPU flash
kernel spends several times that at these shapes (graphs/results/notes/kernels.md).

:file:`attention.cpp` reads K and V in place (the cache views' strides),
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

SERIAL_MACS = 1 << 17
"""Attentions of fewer multiply-adds (over the whole cache read, T_read) run on one thread: waking the pool costs
more. Above it a second thread gains from about 100 visible positions on (graphs/results/notes/kernels.md)."""


def supports(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these operands (static: device, dtypes, head size, autograd)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, vals))
    return (q.device.type == "cpu" and not grad and q.dtype in DTYPES and keys.dtype == q.dtype
            and vals.dtype == q.dtype and 1 <= q.shape[-1] <= MAX_HEAD_DIM and build.available())


def _check(q, keys, vals, visible) -> None:
    """The kernel reads raw memory: a wrong dtype or shape must fail here, not read out of bounds."""
    if q.dtype not in DTYPES or keys.dtype != q.dtype or vals.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, keys and vals must all be bfloat16 or float32, "
                         f"got {q.dtype}, {keys.dtype} and {vals.dtype}")
    if q.dim() != 4 or not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"decode_attention: q must be [B, T, H, D] with the head size D in 1..{MAX_HEAD_DIM}, "
                         f"got {list(q.shape)}")
    b, t, h, d = q.shape
    # NOTE: H_kv >= 1 before h % H_kv: a Python ZeroDivisionError (or the kernel's integer division by zero)
    # would not say which operand is wrong.
    if keys.dim() != 4 or keys.shape != vals.shape or keys.shape[0] != b or keys.shape[3] != d \
            or keys.shape[1] < 1 or h % keys.shape[1]:
        raise ValueError(f"decode_attention: keys and vals must be [{b}, H_kv, T_read, {d}] with H_kv "
                         f"dividing {h}, got {list(keys.shape)} and {list(vals.shape)}")
    if visible.dtype != torch.bool or tuple(visible.shape) != (b, t, keys.shape[2]):
        raise ValueError(f"decode_attention: visible must be bool [{b}, {t}, {keys.shape[2]}], "
                         f"got {visible.dtype} {list(visible.shape)}")


def _decode_attention(q, keys, vals, visible) -> torch.Tensor:
    _check(q, keys, vals, visible)
    b, t, h, d = q.shape
    hkv, tr = keys.shape[1], keys.shape[2]
    q = q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    vals = vals if vals.stride(-1) == 1 else vals.contiguous()
    visible = visible.contiguous()
    out = q.new_empty((b, t, h * d))  # [B, T, H·D]
    lib = build.loaded()
    fn = lib.funcspec_attend_bf16 if q.dtype == torch.bfloat16 else lib.funcspec_attend_f32
    threads = 1 if b * t * h * tr * d < SERIAL_MACS else torch.get_num_threads()
    fn(q.data_ptr(), keys.data_ptr(), vals.data_ptr(), visible.data_ptr(), out.data_ptr(), b, t, h, hkv, d, tr,
       *keys.stride()[:3], *vals.stride()[:3], d ** -0.5, threads)
    return out


def _decode_attention_meta(q, keys, vals, visible) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))


# NOTE: a raw Library op, as funcspec::stream_linear: opaque to torch.compile, cheap to call.
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor keys, Tensor vals, Tensor visible) -> Tensor")
_LIB.impl("decode_attention", _decode_attention, "CPU")
_LIB.impl("decode_attention", _decode_attention_meta, "Meta")


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of q [B, T, H, D] over keys/vals [B, H_kv, T_read, D] where visible [B, T, T_read].

    Returns [B, T, H·D]. Query head h reads KV head h // (H / H_kv) (GQA). A row
    that sees no position gets zeros. Needs :func:`supports`.
    """
    return torch.ops.funcspec.decode_attention(q, keys, vals, visible)
