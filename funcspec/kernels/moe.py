"""Routed expert products of a mixture-of-experts layer: ``[T, top_k]`` tokens-to-experts, static shapes.

A MoE layer's experts are held stacked, as transformers holds them:
``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``down_proj`` [E, H, I]. Token t routed to experts ``ids[t]`` with weights
``weights[t]`` gets ``sum_j weights[t, j] · down_e(silu(gate_e x_t) · up_e x_t)``,
``e = ids[t, j]``.

The expert ids are data, not shapes: every function here has the same shapes
whatever the routing, so one captured graph serves every step of a bucket.
A step should cost the bytes of the experts it selects (the union over its
tokens), not all E, and never a copy of them. The paths, one per device
(:meth:`funcspec.kernels.Ops.experts` picks one statically):

- :func:`experts_op`, the CPU kernel (:file:`moe.cpp`): the selected experts'
  weights, packed once at load (:func:`pack_gate_up`, :func:`pack_down`:
  stream.py's column blocks), streamed once per call for all their tokens.
  A token's result does not depend on the tokens beside it, so AR and
  verification agree bit for bit.
- :func:`qexperts_op`, the same CPU kernel on quantized experts
  (:func:`stack_quantized`: the int8/int4 family of :mod:`funcspec.kernels.quant`,
  which GGUF, GPTQ, AWQ and compressed-tensors experts are read into), with
  :func:`quantized_reference` its math in torch.
- :func:`grouped` (CUDA): the slots sorted by expert (:func:`sort_by_expert`,
  no host sync) through two ``torch._grouped_mm`` calls, then back in slot order.
- :func:`npu_experts` (Ascend): torch_npu's routing, grouped matmul and
  finalize ops, called as vLLM-Ascend calls them.
- :func:`reference`: every expert on every token, weighted; any device.

The device paths round as their grouped GEMMs do and promise no per-token bit
independence (a GEMM may tile by group size).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from funcspec.kernels import build, quant, stream

DTYPES = stream.DTYPES
HALF = stream.BLOCK // 2
"""Intermediate units per packed gate_up block: its 64 outputs are 32 gate rows, then the 32 up rows of the
same units (moe.cpp's ``HALF``)."""
SERIAL_MACS = 1 << 15
"""Routed experts of fewer multiply-adds run on one thread (the streaming products' threshold, torch_ops.cpp)."""
SERIAL_QUANT_WEIGHTS = 1 << 17
"""Quantized routed experts of fewer weights read run on one thread (the quantized products' threshold)."""


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The routed experts of x [T, H] (ids, weights [T, k]; gate_up [E, 2I, H], down [E, H, I]) -> [T, H].

    Every expert runs on every token, weighted by the token's routing weight
    for it (0 when it is not routed there): E products whatever the routing, a
    path with no data-dependent shape, for any device. Summed in fp32, in
    expert order.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(gate_up.shape[0]):
        w = (weights.float() * (ids == e)).sum(-1, keepdim=True)  # [T, 1]: 0 unless routed to e
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)  # [T, I] each
        out = out + w * F.linear(F.silu(gate) * up, down[e]).float()
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- the CPU kernel


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """gate_up [E, 2I, H] in the kernel's layout: [E, I'/32, H'/P, 64, P] (stream.py's blocks).

    Block b of an expert holds its gate rows 32b..32b+31, then its up rows
    32b..32b+31, so the thread that computes a block has both halves of
    silu(gate) · up for those units. I is zero-padded to I' (a multiple of 32).
    """
    e, two_i, h = weight.shape
    gate, up = weight.detach().reshape(e, 2, two_i // 2, h).unbind(1)  # [E, I, H] each
    pad = -gate.shape[1] % HALF
    halves = [F.pad(w, (0, 0, 0, pad)).view(e, -1, HALF, h) for w in (gate, up)]  # [E, I'/32, 32, H] each
    packed = stream.pack_weight(torch.stack(halves, 2).view(-1, h))  # [E·I'/32, H'/P, 64, P]
    return packed.view(e, -1, *packed.shape[1:])


def pack_down(weight: torch.Tensor) -> torch.Tensor:
    """down [E, H, I] in the kernel's layout: [E, H'/64, I'/P, 64, P], I zero-padded to I' as in
    :func:`pack_gate_up` and H to whole blocks of 64."""
    e, h, i = weight.shape
    w = F.pad(weight.detach(), (0, -i % HALF, 0, -h % stream.BLOCK))  # [E, H', I']
    packed = stream.pack_weight(w.reshape(-1, w.shape[-1]))  # [E·H'/64, I'/P, 64, P]
    return packed.view(e, -1, *packed.shape[1:])


def _check(x, ids, weights, gate_up, down) -> None:
    """The kernel reads raw memory: a wrong dtype or shape must fail here, not read out of bounds."""
    if x.dtype not in DTYPES or x.dim() != 2 or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"experts: x [T, H] and the packed experts must all be bfloat16 or float32, got x "
                         f"{x.dtype} {list(x.shape)}, gate_up {gate_up.dtype} and down {down.dtype}")
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != x.shape[0] \
            or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"experts: ids must be int64 [{x.shape[0]}, k] and weights of their shape, got ids "
                         f"{ids.dtype} {list(ids.shape)} and weights {list(weights.shape)}")
    pair, h = (2 if x.dtype == torch.bfloat16 else 1), x.shape[1]
    steps, blocks = (h + h % pair) // pair, -(-h // stream.BLOCK)
    if gate_up.dim() != 5 or gate_up.shape[2:] != (steps, stream.BLOCK, pair) or not gate_up.is_contiguous():
        raise ValueError(f"experts: gate_up must be packed [E, I'/32, {steps}, 64, {pair}] for x [T, {h}] "
                         f"(pack_gate_up), got {list(gate_up.shape)}")
    e, units = gate_up.shape[0], gate_up.shape[1] * HALF
    if down.shape != (e, blocks, units // pair, stream.BLOCK, pair) or not down.is_contiguous():
        raise ValueError(f"experts: down must be packed [{e}, {blocks}, {units // pair}, 64, {pair}] to match "
                         f"gate_up (pack_down), got {list(down.shape)}")


def _experts(x, ids, weights, gate_up, down) -> torch.Tensor:
    _check(x, ids, weights, gate_up, down)
    x, ids = x.contiguous(), ids.contiguous()
    w = weights.to(torch.float32).contiguous()  # [T, k]
    out = torch.empty_like(x)  # [T, H]
    (t, k), h, units = ids.shape, x.shape[1], gate_up.shape[1] * HALF
    lib = build.loaded(streamed=True)
    fn = lib.funcspec_experts_bf16 if x.dtype == torch.bfloat16 else lib.funcspec_experts_f32
    threads = 1 if t * k * 3 * units * h < SERIAL_MACS else torch.get_num_threads()
    fn(x.data_ptr(), ids.data_ptr(), w.data_ptr(), gate_up.data_ptr(), down.data_ptr(), out.data_ptr(), t, k, h,
       gate_up.shape[0], units, threads)
    return out


def _experts_meta(x, ids, weights, gate_up, down) -> torch.Tensor:
    return torch.empty_like(x)


# NOTE: a raw Library op, as funcspec::stream_linear: opaque to torch.compile, and cheaper to call than
# torch.library.custom_op's Python wrapper.
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("routed_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down) -> Tensor")
_LIB.impl("routed_experts", _experts, "CPU")
_LIB.impl("routed_experts", _experts_meta, "Meta")


def experts_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """The routed experts of x [T, H] (bf16 or fp32; ids int64 and weights [T, k]) through the CPU kernel, on the
    experts packed by :func:`pack_gate_up` and :func:`pack_down`. Returns [T, H]; ids outside [0, E) add nothing.

    Needs :func:`funcspec.kernels.build.available`; a token's result is bitwise the same whatever tokens come
    with it.
    """
    return torch.ops.funcspec.routed_experts(x, ids, weights, gate_up, down)


# ----------------------------------------------------------------------------- quantized experts


def stack_quantized(gates: list, ups: list, downs: list) -> dict:
    """Per-expert quantized linears (:mod:`funcspec.kernels.quant` params: gate and up [I, H], down [H, I])
    stacked as :func:`qexperts_op` reads them: ``{"gate_up_proj": {...}, "down_proj": {...}}``, each
    ``{"qweight", "scales", "offsets"?, "format"}`` with a leading expert dimension.

    An expert's gate_up holds its gate's I/32 column blocks, then its up's; its ``format`` is the gate's (one
    half). Gate and up must share one format, every down another; I must be a multiple of 32 (down reads it
    in blocks of 32). ``ValueError`` otherwise, naming what differs.
    """
    if not gates or not len(gates) == len(ups) == len(downs):
        raise ValueError(f"quantized experts: need one gate, up and down per expert, got {len(gates)}, {len(ups)} "
                         f"and {len(downs)}")
    for name, ps in (("gate", gates), ("up", ups), ("down", downs)):
        extra = sorted({k for p in ps for k in p} - {"qweight", "scales", "offsets", "format"})
        if extra:
            raise ValueError(f"quantized experts: the {name} projections hold {extra} (act-order or a bias), "
                             f"which routed experts do not read")
    fmt, down_fmt = gates[0]["format"], downs[0]["format"]
    if any(p["format"] != fmt for p in gates + ups) or any(p["format"] != down_fmt for p in downs):
        raise ValueError(f"quantized experts: every expert's gate and up must share one format and every down "
                         f"another; got {sorted({str(p['format']) for p in gates + ups + downs})}")
    i, h = fmt.out_features, fmt.in_features
    if i % quant.QB or (down_fmt.out_features, down_fmt.in_features) != (h, i):
        raise ValueError(f"quantized experts: the intermediate size ({i}) must be a multiple of {quant.QB} and down "
                         f"[{down_fmt.out_features}, {down_fmt.in_features}] must be [{h}, {i}]")

    def stacked(parts, f):
        out = {"qweight": torch.stack([torch.cat([p["qweight"] for p in ps]) for ps in parts]),
               "scales": torch.stack([torch.cat([p["scales"] for p in ps]) for ps in parts]), "format": f}
        if f.asym:
            out["offsets"] = torch.stack([torch.cat([p["offsets"] for p in ps]) for ps in parts])
        return out

    return {"gate_up_proj": stacked(list(zip(gates, ups)), fmt), "down_proj": stacked([[d] for d in downs], down_fmt)}


def expert_bytes(p: dict) -> int:
    """One expert's bytes in a MoE layer's prepared experts ``p`` (``gate_up_proj``, ``down_proj``): its float
    weights, or its quantized blocks (a stack's ``format`` is one half of gate_up): what a step that selects it
    streams."""
    gate_up, down = p["gate_up_proj"], p["down_proj"]
    if "qweight" in gate_up:
        return 2 * gate_up["format"].bytes + down["format"].bytes
    return sum(w["weight"][0].numel() * w["weight"].element_size() for w in (gate_up, down))


def quantized_expert(gate_up: dict, down: dict, e: int) -> tuple:
    """Expert e's ``(gate, up, down)`` quantized linears (views into stacks made by :func:`stack_quantized`)."""
    blocks = gate_up["qweight"].shape[1] // 2

    def part(p, lo, hi):
        return {**{k: p[k][e, lo:hi] for k in ("qweight", "scales", "offsets") if k in p}, "format": p["format"]}

    return part(gate_up, 0, blocks), part(gate_up, blocks, 2 * blocks), part(down, 0, down["qweight"].shape[1])


def quantized_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: dict, down: dict
                        ) -> torch.Tensor:
    """The routed experts of x [T, H] on stacked quantized experts, in torch: every expert on every token
    (:func:`funcspec.kernels.quant.reference`'s math), each slot taking its expert's output, summed as
    :func:`slot_sum`. Any device; a check of :func:`qexperts_op`."""
    y = torch.zeros(*ids.shape, x.shape[-1], dtype=x.dtype, device=x.device)  # [T, k, H]
    for e in range(gate_up["qweight"].shape[0]):
        gate, up, dn = quantized_expert(gate_up, down, e)
        out = quant.reference(F.silu(quant.reference(x, gate)) * quant.reference(x, up), dn)  # [T, H]
        y = torch.where((ids == e).unsqueeze(-1), out.unsqueeze(1), y)
    return slot_sum(y, weights)


def _check_quantized(x, ids, weights, gate_up: dict, down: dict) -> None:
    """The kernel reads raw memory: a wrong dtype or shape must fail here, not read out of bounds."""
    if x.dtype not in DTYPES or x.dim() != 2:
        raise ValueError(f"qexperts: x must be bfloat16 or float32 [T, H], got {x.dtype} {list(x.shape)}")
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != x.shape[0] \
            or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"qexperts: ids must be int64 [{x.shape[0]}, k] and weights of their shape, got ids "
                         f"{ids.dtype} {list(ids.shape)} and weights {list(weights.shape)}")
    gf, df = gate_up["format"], down["format"]
    e, (i, h) = gate_up["qweight"].shape[0], (gf.out_features, gf.in_features)
    if h != x.shape[1] or (df.out_features, df.in_features) != (h, i) or i % quant.QB:
        raise ValueError(f"qexperts: x [T, {x.shape[1]}] needs gate/up [I, {x.shape[1]}] and down [{x.shape[1]}, I] "
                         f"with I a multiple of {quant.QB}; got {gf} and {df}")
    for name, p, f, blocks in (("gate_up", gate_up, gf, 2 * i // quant.QB), ("down", down, df, -(-h // quant.QB))):
        k = f.in_features
        want = {"qweight": (torch.uint8, (e, blocks, k * f.bits // 32, quant.QB, 4)),
                "scales": (torch.float16, (e, blocks, k // f.group, quant.QB))}
        if f.asym:
            want["offsets"] = want["scales"]
        elif "offsets" in p:
            raise ValueError(f"qexperts: {name} has offsets, unexpected for {f}")
        for key, (dtype, shape) in want.items():
            t = p.get(key)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise ValueError(f"qexperts: {name} {key} must be contiguous {dtype} {list(shape)} for {f}, got {got}")


def _qexperts(x, ids, weights, gu_q, gu_s, gu_o, dn_q, dn_s, dn_o, gu_bits: int, gu_group: int, dn_bits: int,
              dn_group: int) -> torch.Tensor:
    x, ids = x.contiguous(), ids.contiguous()
    w = weights.to(torch.float32).contiguous()  # [T, k]
    out = torch.empty_like(x)  # [T, H]
    (t, k), h, e, units = ids.shape, x.shape[1], gu_q.shape[0], gu_q.shape[1] * quant.QB // 2
    lib = build.loaded()
    fn = lib.funcspec_qexperts_bf16 if x.dtype == torch.bfloat16 else lib.funcspec_qexperts_f32
    threads = 1 if t * k * 3 * units * h < SERIAL_QUANT_WEIGHTS else torch.get_num_threads()

    def ptr(a):
        return None if a is None else a.data_ptr()

    fn(x.data_ptr(), ids.data_ptr(), w.data_ptr(), gu_q.data_ptr(), gu_s.data_ptr(), ptr(gu_o), dn_q.data_ptr(),
       dn_s.data_ptr(), ptr(dn_o), out.data_ptr(), t, k, h, e, units, gu_bits, gu_group, dn_bits, dn_group, threads)
    return out


def _qexperts_meta(x, ids, weights, *rest) -> torch.Tensor:
    return torch.empty_like(x)


_LIB.define("routed_qexperts(Tensor x, Tensor ids, Tensor weights, Tensor gu_q, Tensor gu_s, Tensor? gu_o, "
            "Tensor dn_q, Tensor dn_s, Tensor? dn_o, int gu_bits, int gu_group, int dn_bits, int dn_group) -> Tensor")
_LIB.impl("routed_qexperts", _qexperts, "CPU")
_LIB.impl("routed_qexperts", _qexperts_meta, "Meta")


def qexperts_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: dict, down: dict
                ) -> torch.Tensor:
    """The routed experts of x [T, H] (bf16 or fp32; ids int64 and weights [T, k]) through the CPU kernel, on
    experts stacked by :func:`stack_quantized`. Returns [T, H]; ids outside [0, E) add nothing.

    Each selected expert's quantized weights are read once per call; a token's result is bitwise the same
    whatever tokens come with it. Needs :func:`funcspec.kernels.build.available`.
    """
    _check_quantized(x, ids, weights, gate_up, down)
    gf, df = gate_up["format"], down["format"]
    return torch.ops.funcspec.routed_qexperts(x, ids, weights, gate_up["qweight"], gate_up["scales"],
                                              gate_up.get("offsets"), down["qweight"], down["scales"],
                                              down.get("offsets"), gf.bits, gf.group, df.bits, df.group)


# ----------------------------------------------------------------------------- CUDA: grouped GEMMs


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def grouped_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`grouped` takes these operands on CUDA (static): bf16, the dtype ``torch._grouped_mm`` has
    kernels for on every CUDA build that has it, and rows of H, 2I and I elements that are whole multiples of
    16 bytes (its alignment)."""
    rows = (gate_up.shape[2], gate_up.shape[1], down.shape[2])
    return x.dtype == gate_up.dtype == down.dtype == torch.bfloat16 and all(n * 2 % 16 == 0 for n in rows)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple:
    """The slots (t, j) of ids [T, k] grouped by expert, with static shapes and no host sync:
    ``(order [S], ends [E] int32, valid [S])``, S = T·k.

    ``order`` lists the flat slots t·k + j expert after expert (in slot order
    within one; ids outside [0, E) last, ``valid`` false), ``ends[e]`` is where
    expert e's group ends in it (``torch._grouped_mm``'s ``offs``).
    """
    flat = ids.reshape(-1)  # [S]
    valid = (flat >= 0) & (flat < num_experts)  # [S]
    key = torch.where(valid, flat, num_experts)  # [S]: invalid slots sort last
    order = torch.argsort(key, stable=True)  # [S]
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts = counts.index_add(0, key, torch.ones_like(key, dtype=torch.int32))  # [E + 1]: fixed size
    return order, counts[:num_experts].cumsum(0, dtype=torch.int32), valid


def slot_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] · y[t, j] for y [T, k, H] -> [T, H]: fp32, j = 0..k-1 in order, rounded once."""
    out = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)  # [T, H]
    for j in range(y.shape[1]):
        out = out + weights[:, j:j + 1].float() * y[:, j].float()
    return out.to(y.dtype)


def grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            mm: Callable | None = None) -> torch.Tensor:
    """The routed experts (as :func:`reference`) as two grouped GEMMs over the slots sorted by expert:
    ``mm(a [S, K], b [E, K, N], offs=ends [E]) -> [S, N]``, by default ``torch._grouped_mm`` (CUDA; also on CPU
    in recent torch). The weights are read as they lie (transposed views), never copied."""
    mm = torch._grouped_mm if mm is None else mm
    t, k = ids.shape
    order, ends, valid = sort_by_expert(ids, gate_up.shape[0])  # [S], [E], [S]
    xs = x.index_select(0, order // k)  # [S, H]: each slot's token, expert after expert
    gate, up = mm(xs, gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)  # [S, I] each
    ys = mm(F.silu(gate) * up, down.transpose(-2, -1), offs=ends)  # [S, H]
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # [S, H]: back in slot order
    y = torch.where(valid.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))  # rows past ends
    return slot_sum(y.view(t, k, -1), weights)


# ----------------------------------------------------------------------------- Ascend NPU


def npu_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, npu=None) -> torch.Tensor:
    """The routed experts (as :func:`reference`) through torch_npu's MoE ops, as vLLM-Ascend's all-gather path
    calls them: ``npu_moe_init_routing`` sorts the slots by expert, ``npu_moe_compute_expert_tokens`` gives each
    expert's group end, two ``npu_grouped_matmul`` with ``npu_swiglu`` between, and ``npu_moe_finalize_routing``
    weighs the slots back into token order. ``npu`` is torch_npu (imported here by default; tests pass a stand-in).
    Ids must lie in [0, E)."""
    if npu is None:
        npu = importlib.import_module("torch_npu")  # NOTE: lazily: importing torch_npu without CANN breaks torch
    t, k = ids.shape
    row_idx = torch.arange(t * k, dtype=torch.int32, device=x.device).view(k, t).t().contiguous()  # [T, k]: j·T + t
    ids32 = ids.to(torch.int32)  # [T, k]
    xs, src_to_dst, sorted_ids = npu.npu_moe_init_routing(x, row_idx=row_idx, expert_idx=ids32, active_num=t)
    ends = npu.npu_moe_compute_expert_tokens(sorted_ids, gate_up.shape[0]).to(torch.int64)  # [E] group ends

    def gmm(a, w):  # a [S, K], w [E, N, K] -> [S, N]
        return npu.npu_grouped_matmul(x=[a], weight=[w.transpose(1, 2)], split_item=2, group_list_type=0,
                                      group_type=0, group_list=ends)[0]

    ys = gmm(npu.npu_swiglu(gmm(xs, gate_up)), down)  # [S, H], expert after expert
    return npu.npu_moe_finalize_routing(ys, skip1=None, skip2=None, bias=None, scales=weights.to(ys.dtype),
                                        expanded_src_to_dst_row=src_to_dst, export_for_source_row=ids32)

