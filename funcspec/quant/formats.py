"""Weight formats funcspec quantizes to on load: round-to-nearest int8 and int4, per channel or per group.

``LLM(model, quantization=NAME)`` (and ``Engine(..., quantization=NAME)``)
quantizes every linear layer of a bf16/fp32 checkpoint (embeddings stay as
they are: they are read by row) into the one family the kernel runs
(:mod:`funcspec.kernels.quant`). The scale of each group is rounded to fp16
first, then the values against it, so the stored weight is the nearest one
the format can hold for that scale.

======================  ======  ========  ======================================================
name                    bits    group     values
======================  ======  ========  ======================================================
``int8``                8       channel   q = round(w / s) in [-127, 127], s = max|w| / 127
``int8-g32``            8       32        the same per 32 k (GGUF's Q8_0)
``int4`` (``int4-g32``) 4       32        llama.cpp's Q4_0 rule: s = -m / 8 for the signed m of
                                          largest magnitude, q = round(w / s) in [-8, 7]
``int4-g128``           4       128       the same per 128 k (GPTQ's and AWQ's usual group)
======================  ======  ========  ======================================================
"""

from __future__ import annotations

from typing import Any

import torch

from funcspec.kernels import quant as qk
from funcspec.kernels.cpu import huge_empty

SCHEMES = {"int8": (8, None), "int8-g32": (8, 32), "int4": (4, 32), "int4-g32": (4, 32), "int4-g128": (4, 128)}
"""``quantization=`` names funcspec quantizes to on load: name -> (bits, group; ``None``: per channel)."""

STORED = frozenset({"gguf", "ascend", "gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors", "fp8",
                    "bitsandbytes", "modelopt", "experts_int8"})
"""vLLM's ``quantization`` names of formats a checkpoint is stored in: they say how to read the weights, not
how to quantize them. The format is read from the checkpoint itself (``funcspec.checkpoints.quantized``:
GPTQ, AWQ, compressed-tensors, vLLM-Ascend; and GGUF files); naming one checks that the checkpoint is stored
that way, as vLLM does. ``fp8``, ``bitsandbytes``, ``modelopt`` and ``experts_int8`` are names funcspec knows
but does not read."""


def on_load(name, field: str = "quantization"):
    """The scheme to quantize to on load for a ``quantization`` value: one of :data:`SCHEMES`, or ``None`` for
    ``None`` and the stored formats (:data:`STORED`); any other value is a ``ValueError`` naming ``field``."""
    if name is None or name in STORED:
        return None
    if name not in SCHEMES:
        raise ValueError(f"{field} must be one of {sorted(SCHEMES)} (quantized on load), a stored format vLLM "
                         f"names ({sorted(STORED)}), or None; got {name!r}")
    return name


def check_scheme(name) -> None:
    """``ValueError`` for a scheme :func:`quantize` does not know (``None``: no quantization)."""
    if name is not None and name not in SCHEMES:
        raise ValueError(f"quantization scheme must be one of {sorted(SCHEMES)} (or None), got {name!r}")


def quantizes(weight: torch.Tensor, name: str) -> bool:
    """Whether a linear's weight [N, K] takes format ``name``: K must hold whole groups of 32."""
    bits, group = SCHEMES[name]
    k = weight.shape[1]
    return k % qk.AB == 0 and k % (group or k) == 0


def scheme_format(weight: torch.Tensor, name: str) -> qk.QuantFormat:
    """The format a linear's weight [N, K] takes under scheme ``name``."""
    n, k = weight.shape
    bits, group = SCHEMES[name]
    return qk.QuantFormat(bits, group or k, n, k, False, name)


def quantize(p: dict, name: str) -> dict:
    """A linear's params ``{"weight", "bias"?}`` quantized to ``name``: ``{"qweight", "scales", "bias"?, "format"}``
    (packed for the kernel)."""
    w = p["weight"].detach().float()  # [N, K]
    fmt = scheme_format(w, name)
    n, k, bits, group = fmt.out_features, fmt.in_features, fmt.bits, fmt.group
    qk.check_shape(n, k, bits, group)
    g = w.view(n, k // group, group)  # [N, K/G, G]
    if bits == 8:
        scale = (g.abs().amax(-1) / 127.0).half()  # [N, K/G]
        lo, hi = -127, 127
    else:  # llama.cpp's Q4_0: the value of largest magnitude maps to -8
        idx = g.abs().argmax(-1, keepdim=True)
        scale = (torch.gather(g, -1, idx).squeeze(-1) / -8.0).half()
        lo, hi = -8, 7
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    zero = qk.ZEROS[bits]
    q = (torch.round(g * inv).clamp(lo, hi) + zero).to(torch.uint8).view(n, k)
    qweight, scales, _ = qk.pack(q, scale, None, bits)
    out = {"qweight": qweight, "scales": scales, "format": fmt}
    if p.get("bias") is not None:
        out["bias"] = p["bias"]
    return out


def linear(q: torch.Tensor, scales: torch.Tensor, bits: int, name: str, zeros=None, offsets=None, perm=None,
           bias=None) -> dict:
    """A quantized linear's params, packed for the kernel, from values as a checkpoint stores them.

    q [N, K] unsigned values (below 2^bits); scales [N, K/G] (G = K / its columns). Either ``zeros`` [N, K/G],
    integer zero points (W = s (q - z)), or ``offsets`` [N, K/G] (W = s q - o, GGUF's K-quants), or neither: the
    format's own zero (:data:`funcspec.kernels.quant.ZEROS`). Zeros that all equal it are symmetric; others become
    offsets s z, rounded to fp16 as every scale is (a relative 2^-11 of s z, far below a step s). ``perm`` [K]:
    the input order the values are stored in (GPTQ's act-order, :func:`act_order`): the columns are taken in that
    order, and the product gathers x the same way.
    """
    n, k = q.shape
    group = k // scales.shape[1]
    qk.check_shape(n, k, bits, group)
    if zeros is not None and not bool((zeros == qk.ZEROS[bits]).all()):
        offsets = scales.float() * zeros.float()
    qk.check_shape(n, k, bits, group, offsets is not None)
    if perm is not None:
        q = q[:, perm]
    qweight, s, o = qk.pack(q.to(torch.uint8), scales, offsets, bits)
    p = {"qweight": qweight, "scales": s, "format": qk.QuantFormat(bits, group, n, k, o is not None, name)}
    if o is not None:
        p["offsets"] = o
    if perm is not None:
        p["perm"] = perm
    if bias is not None:
        p["bias"] = bias
    return p


def act_order(g_idx, k: int, group: int, where: str):
    """The input permutation that makes GPTQ's act-order groups (``g_idx`` [K]: each input's group) contiguous, or
    ``None`` when they already are (``g_idx[k] = k // G``). ``ValueError`` when its groups do not hold G inputs
    each."""
    if g_idx is None:
        return None
    g = g_idx.long().flatten()
    natural = torch.arange(k) // group
    if g.shape != (k,):
        raise ValueError(f"{where}: g_idx must be [{k}], got {list(g_idx.shape)}")
    if torch.equal(g, natural):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], natural):
        raise ValueError(f"{where}: g_idx does not hold {group} inputs in each of its {k // group} groups")
    return perm


def dequantize(p: dict, dtype=torch.float32) -> torch.Tensor:
    """A quantized linear's W [N, K] in ``dtype``, its inputs in their original order (``perm`` undone; a
    tensor-parallel shard's zero inputs, ``perm`` entries equal to its length, dropped)."""
    w = qk.dequantize(p["qweight"], p["scales"], p.get("offsets"), p["format"], dtype)
    if "perm" not in p:
        return w
    k = len(p["perm"])
    out = w.new_empty(w.shape[0], k + 1)  # [N, K + 1]: the last column takes the zero inputs' columns
    out[:, p["perm"]] = w
    return out[:, :k - int((p["perm"] == k).sum())].contiguous()


def same_format(ps: list[dict]) -> bool:
    """Whether quantized linears ``ps`` can be one product: one format and one input order."""
    f = [p["format"] for p in ps]
    perms = [p.get("perm") for p in ps]
    return len({(x.bits, x.group, x.in_features, x.asym) for x in f}) == 1 and (
        all(x is None for x in perms) or all(x is not None and torch.equal(x, perms[0]) for x in perms))  # type: ignore[arg-type]  # all set


def fuse(ps: list[dict]) -> dict:
    """Quantized linears of one input and one format as one product (q/k/v, gate/up): their packed column blocks
    one after another, so each output but the last takes whole blocks of 32 (:func:`funcspec.kernels.quant.widths`)."""
    f = [p["format"] for p in ps]
    if not same_format(ps):
        raise ValueError(f"fused quantized layers must share one format and input order, got {f}")
    out: dict[str, Any] = {key: torch.cat([p[key] for p in ps]) for key in ("scales", "offsets") if key in ps[0]}
    q = [p["qweight"] for p in ps]  # the stream: in huge pages, as each member's was
    out["qweight"] = torch.cat(q, out=huge_empty((sum(t.shape[0] for t in q), *q[0].shape[1:]), torch.uint8,
                                                 q[0].device))
    sizes = [x.out_features for x in f]
    biases = [p.get("bias") for p in ps]
    if any(b is not None for b in biases):
        dtype = next(b.dtype for b in biases if b is not None)
        parts = [torch.zeros(n, dtype=dtype) if b is None else b for n, b in zip(sizes, biases)]
        out["bias"] = torch.cat([torch.nn.functional.pad(b, (0, w - n)) for b, n, w in zip(parts, sizes,
                                                                                           qk.widths(sizes))])
    out["format"] = qk.QuantFormat(f[0].bits, f[0].group, sum(qk.widths(sizes)), f[0].in_features, f[0].asym,
                                   f[0].name)
    if "perm" in ps[0]:
        out["perm"] = ps[0]["perm"]
    return out


def members(fused: dict, fmts: list) -> list[dict]:
    """The members of a :func:`fuse`-d group (formats ``fmts``, in order) as views into its tensors: each takes
    its own column blocks, so a path that multiplies one member alone (a DFlash context's k and v) reads the
    fused copy, and no second one exists."""
    out, b0, c0 = [], 0, 0
    for f, w in zip(fmts, qk.widths([x.out_features for x in fmts])):
        nb = -(-f.out_features // qk.QB)
        p = {key: fused[key][b0:b0 + nb] for key in ("qweight", "scales", "offsets") if key in fused}
        if "perm" in fused:
            p["perm"] = fused["perm"]
        if "bias" in fused:
            p["bias"] = fused["bias"][c0:c0 + f.out_features]
        p["format"] = f
        out.append(p)
        b0, c0 = b0 + nb, c0 + w
    return out
