"""Quantized linear layers: 8-, 6- and 4-bit weights in groups, the CPU kernel (every build; VNNI on avx512bf16) and
its reference.

A quantized weight W [N, K] is stored as unsigned values q (8, 6 or 4 bits) with
one fp16 scale s per output and group of G consecutive k (G a multiple of 32,
G = K for per-channel), and for asymmetric formats one fp16 offset o::

    W[n, k] = s[n, g] * (q[n, k] - zero)   symmetric (zero = 128 for 8 bits, 32 for 6, 8 for 4)
    W[n, k] = s[n, g] * q[n, k] - o[n, g]  asymmetric (8 and 4 bits)

That one family holds GGUF's Q8_0 (8-bit, G = 32), Q4_0 (4-bit, G = 32), Q4_K
(4-bit, G = 32, asymmetric: its 6-bit sub-block scales and mins times the
super-block's d and dmin) and Q6_K (6-bit, G = 16: its int8 sub-block scales
times d), and funcspec's own round-to-nearest int8 (per
channel) and int4 (G = 32 or 128); GPTQ / AWQ zero points are its offsets.

The product quantizes each row's activations per block of 32 k to int8 (as
llama.cpp's Q8 activations: d = max|x| / 127, round half to even), sums each
block as integers (``vpdpbusd`` on the avx512bf16 build), and scales in fp32, block after block
(:file:`quant.cpp`): a row's result does not depend on the rows beside it, so
AR and verification agree bit for bit. :func:`reference` is the same math in
torch, for CPUs without the kernel (slowly) and for tests.

:func:`pack` lays q, s and o out in column blocks of 32 outputs, one stream
each, as the kernel reads them; :class:`QuantFormat` is the static part a
quantized linear's params carry (``prepare_params`` and the checkpoint readers
make them).
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.kernels import build
from funcspec.kernels.cpu import huge_empty

QB = 32
"""Outputs per column block of the packed layout (quant.cpp's ``QB``)."""
ZEROS = {8: 128, 6: 32, 4: 8}
"""Bits -> the symmetric zero point: ``W = s (q - zero)``."""
AB = 32
"""k per activation block: the granularity of the activations' int8 scales, and of G."""
DTYPES = (torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """The static part of a quantized linear (its params: ``qweight``, ``scales``, ``offsets``?, ``bias``?).

    Attributes:
        bits: 8 or 4.
        group: G, the k per scale (a multiple of 32 dividing K; K for per-channel).
        out_features: N.
        in_features: K.
        asym: whether the params hold ``offsets`` (else the zero is 128 or 8).
        name: the format's name, for reports (``int8``, ``int4-g32``, ``gguf-q4_k``, ...).
    """

    bits: int
    group: int
    out_features: int
    in_features: int
    asym: bool = False
    name: str = ""

    @property
    def zero(self) -> int:
        """The symmetric formats' zero point."""
        return ZEROS[self.bits]

    @property
    def bytes(self) -> int:
        """Bytes the kernel streams per product: values, scales and offsets."""
        n = -(-self.out_features // QB) * QB
        return n * self.in_features * self.bits // 8 + n * (self.in_features // self.group) * 2 * (1 + self.asym)


def check_shape(n: int, k: int, bits: int, group: int, asym: bool = False) -> None:
    """``ValueError`` for a weight the kernel cannot hold: K a multiple of 32; G a multiple of 32 dividing K, or
    16 at 8 and 6 bits (GGUF's Q6_K sub-blocks); 6-bit weights symmetric."""
    if bits not in ZEROS:
        raise ValueError(f"quantized weights are 8, 6 or 4 bits, got {bits}")
    if k % AB or k % group or (group % AB and not (bits != 4 and group == 16)):
        raise ValueError(f"quantized weight [{n}, {k}]: in_features must be a multiple of {AB} and the group size "
                         f"a multiple of {AB} dividing it (or 16 at 8 and 6 bits); got group {group}")
    if bits == 6 and asym:
        raise ValueError(f"quantized weight [{n}, {k}]: 6-bit weights are symmetric (no offsets)")


def pack(q: torch.Tensor, scales: torch.Tensor, offsets, bits: int) -> tuple:
    """q [N, K] (uint8 values), scales and offsets [N, K/G] in the kernel's layout: ``(qweight, scales, offsets)``.

    qweight: 8-bit [N'/32, K/4, 32, 4]; 4-bit [N'/32, K/8, 32, 4] (a byte holds k = 8s + j low and 8s + 4 + j
    high); 6-bit [N'/32, 3K/16, 32, 4], units of 16 k: their low 4 bits as two 4-bit steps, then a step whose
    byte j holds the high 2 bits of k = 4i + j at bits 2i. Scales / offsets fp16 [N'/32, K/G, 32]; N' = N
    rounded up to 32 (zero padding).
    """
    n, k = q.shape
    pad = -n % QB
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))  # [N', K]
    if bits == 8:
        v = q.view(-1, QB, k // 4, 4).permute(0, 2, 1, 3)  # [N'/32, K/4, 32, 4]
    elif bits == 4:
        v = _nibbles(q).flatten(1, 2)  # [N'/32, K/8, 32, 4]
    else:
        units = q.view(-1, QB, k // 16, 4, 4)  # [N'/32, 32, K/16, quad i, j]
        high = (units >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=q.device).view(4, 1)  # at 2i
        high = high[..., 0, :] | high[..., 1, :] | high[..., 2, :] | high[..., 3, :]  # [N'/32, 32, K/16, 4]
        steps = torch.cat([_nibbles(q & 0x0F), high.permute(0, 2, 1, 3).unsqueeze(2)], 2)  # [N'/32, K/16, 3, 32, 4]
        v = steps.flatten(1, 2)  # [N'/32, 3K/16, 32, 4]
    packed = huge_empty(v.shape, torch.uint8, v.device).copy_(v)

    def groups(t):
        t = torch.nn.functional.pad(t.to(torch.float16), (0, 0, 0, pad))  # [N', K/G]
        return t.view(-1, QB, t.shape[1]).transpose(1, 2).contiguous()  # [N'/32, K/G, 32]

    return packed, groups(scales), None if offsets is None else groups(offsets)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [N', K] as steps of 8 k: [N'/32, K/16, 2, 32, 4] (K/8 steps in pairs), byte j of an output
    holding k = 8s + j in its low nibble and 8s + 4 + j in its high one."""
    octets = q.view(-1, QB, q.shape[1] // 16, 2, 2, 4)  # [N'/32, 32, K/16, step, (low, high), j]
    return (octets[..., 0, :] | (octets[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)


def _unnibble(steps: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_nibbles`: [N'/32, S, 32, 4] steps of 8 k -> values [N', 8S]."""
    lo, hi = steps & 0x0F, steps >> 4  # [N'/32, S, 32, 4] each
    return torch.stack([lo, hi], 3).permute(0, 2, 1, 3, 4).reshape(-1, steps.shape[1] * 8)  # [N', 8S]


def unpack(qweight: torch.Tensor, scales: torch.Tensor, offsets, fmt: QuantFormat) -> tuple:
    """The inverse of :func:`pack`: q [N, K] uint8, scales and offsets [N, K/G] fp16."""
    n, k = fmt.out_features, fmt.in_features
    if fmt.bits == 8:
        q = qweight.permute(0, 2, 1, 3).reshape(-1, k)  # [N', K]
    elif fmt.bits == 4:
        q = _unnibble(qweight)  # [N', K]
    else:
        units = qweight.view(qweight.shape[0], k // 16, 3, QB, 4)  # [N'/32, K/16, (step, step, high), 32, 4]
        low = _unnibble(units[:, :, :2].flatten(1, 2))  # [N', K]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qweight.device).view(4, 1)
        high = (units[:, :, 2].unsqueeze(-2) >> shifts) & 3  # [N'/32, K/16, 32, quad i, j]
        q = low | (high.permute(0, 2, 1, 3, 4).reshape(-1, k) << 4)  # [N', K]

    def groups(t):
        return None if t is None else t.transpose(1, 2).reshape(-1, t.shape[1])[:n]

    return q[:n], groups(scales), groups(offsets)


def dequantize(qweight, scales, offsets, fmt: QuantFormat, dtype=torch.float32) -> torch.Tensor:
    """W [N, K] in ``dtype`` from its packed quantized params."""
    q, s, o = unpack(qweight, scales, offsets, fmt)
    s = s.float().repeat_interleave(fmt.group, 1)  # [N, K]
    w = s * q.float() - o.float().repeat_interleave(fmt.group, 1) if fmt.asym else s * (q.float() - fmt.zero)
    return w.to(dtype)


def _qlinear_meta(x, qweight, scales, offsets, bias, n: int, k: int, bits: int, group: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


# NOTE: a raw Library op, as funcspec::stream_linear: opaque to torch.compile, its CPU kernel C++ (torch_ops.cpp).
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? offsets, Tensor? bias, int n, int k, int bits, "
            "int group) -> Tensor")
_LIB.impl("qlinear", _qlinear_meta, "Meta")


def qlinear(x: torch.Tensor, p: dict) -> torch.Tensor:
    """``x @ W.T (+ b)`` for x [..., K] (bf16 or fp32) and a quantized linear's params ``p`` (``qweight``,
    ``scales``, ``offsets``?, ``bias``?, ``format``), through the kernel. Needs :func:`build.available`."""
    f = p["format"]
    if f.asym != (p.get("offsets") is not None):
        raise ValueError(f"qlinear: offsets is {'missing' if f.asym else 'unexpected'} for {f}")
    build.ready()
    return torch.ops.funcspec.qlinear(x, p["qweight"], p["scales"], p.get("offsets"), p.get("bias"),
                                      f.out_features, f.in_features, f.bits, f.group)


def widths(sizes) -> list[int]:
    """The columns each member of a fused quantized group (out features ``sizes``, in order) takes in its product:
    whole column blocks of 32, the last one not."""
    sizes = list(sizes)
    return [-(-n // QB) * QB for n in sizes[:-1]] + [sizes[-1]]


def split(out: torch.Tensor, sizes) -> list[torch.Tensor]:
    """A fused quantized group's product [..., sum of widths] as each member's output [..., n_i] (views)."""
    parts = out.split(widths(sizes), -1)
    return [p if p.shape[-1] == n else p[..., :n] for p, n in zip(parts, sizes)]


def quantize_activations(x: torch.Tensor) -> tuple:
    """x [R, K] as int8 per row and block of 32 k: ``(xq [R, K/32, 32] int32, d [R, K/32], sums [R, K/32])``."""
    xb = x.float().view(x.shape[0], -1, AB)  # [R, K/32, 32]
    amax = xb.abs().amax(-1)  # [R, K/32]
    # NOTE: a tensor divided, as the kernel divides: ``127.0 / amax`` is torch's reciprocal() * 127, another
    # rounding, which at a tie (bf16 inputs make many) rounds x to the other integer.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int32)
    return xq, amax / 127.0, xq.sum(-1)


def reference(x: torch.Tensor, p: dict) -> torch.Tensor:
    """The kernel's math in torch (the same int8 activations and integer block sums; the fp32 sum over blocks in
    torch's order): for CPUs without the kernel, and a check of it. A row's result does not depend on its batch."""
    f = p["format"]
    q, s, o = unpack(p["qweight"], p["scales"], p.get("offsets"), f)  # [N, K], [N, K/G] each
    rows = x.reshape(-1, f.in_features)
    xq, d, sums = quantize_activations(rows)  # [R, B, 32], [R, B], [R, B]
    unit = min(f.group, AB)  # the k of one integer sum: 32, or 16 for groups of 16
    per = f.group // unit
    xq = xq.view(xq.shape[0], -1, unit)  # [R, U, unit]
    sums = xq.sum(-1)  # [R, U]
    d = d.repeat_interleave(AB // unit, 1)  # [R, U]
    # NOTE: the integer sums in fp32: every partial sum is an integer below 32 * 255 * 127 < 2^24, so any order
    # of adding them is exact, and float matmuls run on every device (CUDA has no int32 bmm).
    dots = torch.einsum("ruk,nuk->rnu", xq.float(), q.view(f.out_features, -1, unit).float())  # [R, N, U] exact
    s = s.float().repeat_interleave(per, 1)  # [N, U]
    if f.asym:
        units = dots * s - o.float().repeat_interleave(per, 1) * sums.float().unsqueeze(1)
    else:
        units = (dots - f.zero * sums.unsqueeze(1)) * s
    y = (units * d.unsqueeze(1)).sum(-1)  # [R, N]
    if p.get("bias") is not None:
        y = y + p["bias"].float()
    return y.to(x.dtype).view(*x.shape[:-1], f.out_features)
