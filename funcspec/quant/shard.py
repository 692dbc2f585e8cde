"""Tensor-parallel shards of a quantized linear (:mod:`funcspec.checkpoints.tp` applies them per layer).

A column-parallel layer (q/k/v, gate/up) keeps a block of output rows: its
rows of values, scales, offsets and bias; the input order (``perm``) is the
whole layer's, since every rank reads all of x. A row-parallel layer
(``o_proj``, ``down_proj``) keeps a block of input columns, and a group's
scale covers G consecutive inputs, so the block must hold whole groups
(vLLM's rule): its values and its groups' scales and offsets; the bias stays
whole (``nn.llama.row_parallel`` adds it once, after the all-reduce). A
per-channel scale (one group over all of K) is the same on every rank.

GPTQ's act-order stores the inputs in another order (``perm``), group after
group. Where the layer before is column-parallel over features a rank
computes alone (gate/up before ``down_proj``), that layer hands each rank its
outputs in this order (``split_outputs(..., order=perm)``), so the rank's
inputs are one block of the stored order, whole groups, and the shard reads x
as it comes (``split_inputs(..., stored=True)``): the ranks' blocks of 32
inputs are one rank's, bit for bit. Elsewhere (``o_proj``, whose inputs are
whole heads) a rank's inputs hold part of many groups: vLLM keeps every
group's scale on every rank; here each group's part becomes whole blocks of
32 inputs (``kernels.quant.AB``) with the group's scale, the last one padded
with zero inputs (``perm`` entries equal to its own length read a zero that
``Ops`` appends to x, so a pad adds exactly nothing). The kernel then
quantizes the activations over other blocks than one rank does: close to one
rank's product, not its bits.

Shards are exact: they unpack the kernel's layout, slice and repack it, so a
shard dequantizes to the slice of the whole layer's weight, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from funcspec.kernels import quant as qk


def _unpacked(p: dict) -> tuple:
    """``p``'s values q [N, K] uint8, scales and offsets [N, K/G] (offsets ``None`` for symmetric formats)."""
    return qk.unpack(p["qweight"], p["scales"], p.get("offsets"), p["format"])


def _packed(p: dict, q, s, o, fmt: qk.QuantFormat, **kept) -> dict:
    """A quantized linear's params from q, s, o in the kernel's layout, with ``kept`` tensors (bias, perm)."""
    qweight, scales, offsets = qk.pack(q, s, o, fmt.bits)
    out = {"qweight": qweight, "scales": scales, "format": fmt}
    if offsets is not None:
        out["offsets"] = offsets
    out.update({k: v for k, v in kept.items() if v is not None})
    return out


def split_outputs(p: dict, rank: int, size: int, order: Optional[torch.Tensor] = None) -> dict:
    """Rank ``rank``'s block of outputs of quantized linear ``p`` split into ``size``: a column-parallel shard (any
    row count: the kernel pads its column blocks itself). ``order`` [N]: the output order the blocks are taken in
    (the next layer's act-order ``perm``), else the outputs' own."""
    n = p["format"].out_features // size
    q, s, o = _unpacked(p)  # [N, K], [N, K/G] each
    rows = torch.arange(rank * n, (rank + 1) * n) if order is None else order[rank * n:(rank + 1) * n]  # [N/size]
    bias = p.get("bias")
    return _packed(p, q[rows], s[rows], None if o is None else o[rows],
                   dataclasses.replace(p["format"], out_features=n), perm=p.get("perm"),
                   bias=None if bias is None else bias[rows])


def input_split_error(fmt: qk.QuantFormat, size: int, scattered: bool = False) -> Optional[str]:
    """Why inputs of ``fmt`` cannot be split into ``size`` equal blocks of whole groups, or ``None`` when they can.
    ``scattered``: an act-order split that pads each group's part (the module's note) needs only K to divide."""
    k = fmt.in_features
    if k % size:
        return f"its {k} inputs do not split into {size} equal shards"
    n = k // size
    if scattered:
        return None
    if fmt.group != k and n % fmt.group:
        return (f"a shard of {n} inputs ({k} / {size}) is not a multiple of its quantization group of "
                f"{fmt.group} ({fmt.name or 'quantized'}): each rank must hold whole groups")
    if n % qk.AB:
        return (f"a shard of {n} inputs ({k} / {size}) is not a multiple of {qk.AB}, the quantized kernel's "
                f"block of inputs ({fmt.name or 'quantized'})")
    return None


def split_inputs(p: dict, rank: int, size: int, stored: bool = False) -> dict:
    """Rank ``rank``'s block of inputs of quantized linear ``p`` split into ``size``: a row-parallel shard, its bias
    whole. An act-order layer's block is of its stored order where ``stored`` (x arrives in it, ``perm`` is
    dropped), else of its inputs, each group's part padded (the module's note). ``ValueError`` when the blocks do
    not hold whole groups (:func:`input_split_error`)."""
    f = p["format"]
    scattered = "perm" in p and not stored
    why = input_split_error(f, size, scattered)
    if why is not None:
        raise ValueError(f"cannot split a quantized linear [{f.out_features}, {f.in_features}] over {size} ranks: "
                         f"{why}")
    n = f.in_features // size
    if scattered:
        return _split_scattered(p, rank * n, n)
    q, s, o = _unpacked(p)  # [N, K], [N, K/G] each
    one = f.group == f.in_features  # per channel: one scale per output, on every rank
    g = slice(None) if one else slice(rank * n // f.group, (rank + 1) * n // f.group)
    fmt = dataclasses.replace(f, in_features=n, group=n if one else f.group)
    return _packed(p, q[:, rank * n:(rank + 1) * n], s[:, g], None if o is None else o[:, g], fmt,
                   bias=p.get("bias"))


def _split_scattered(p: dict, start: int, n: int) -> dict:
    """:func:`split_inputs` of an act-order layer: each group's inputs in [start, start + n), in stored order, as
    blocks of 32 with the group's scale; the last block of a group padded with zero inputs (see the module)."""
    f, perm = p["format"], p["perm"]  # perm [K]: stored column j holds input perm[j]
    q, s, o = _unpacked(p)
    mine = ((perm >= start) & (perm < start + n)).view(-1, f.group)  # [K/G, G]
    cols, groups = [], []
    for g, row in enumerate(mine):
        j = torch.nonzero(row).flatten() + g * f.group  # this group's stored columns on the rank
        blocks = -(-len(j) // qk.AB)
        cols.append(torch.nn.functional.pad(j, (0, blocks * qk.AB - len(j)), value=-1))
        groups += [g] * blocks
    idx = torch.cat(cols)  # [K'] stored columns, -1 for a pad
    k, pad = len(idx), idx < 0
    local = torch.where(pad, k, perm[idx.clamp(min=0)] - start)  # [K'] the rank's inputs; k: the zero input
    groups = torch.tensor(groups, dtype=torch.long)  # type: ignore[assignment]  # [K'/32], as a tensor
    qs = q[:, idx.clamp(min=0)].masked_fill(pad, 0)  # [N, K'] (a pad's value meets a zero input)
    fmt = dataclasses.replace(f, in_features=k, group=qk.AB)
    return _packed(p, qs, s[:, groups], None if o is None else o[:, groups], fmt, perm=local, bias=p.get("bias"))
