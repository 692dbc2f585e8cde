"""``prepare_params``: a params pytree with the packed (or quantized) copies its ``Ops`` streams, made once at load.

A linear's params ``{"weight", "bias"?}`` gain ``packed``, the weight in the
kernel's layout (:meth:`funcspec.kernels.Ops.layout`), or, with a
``quantization`` (:data:`funcspec.quant.formats.SCHEMES`), become a quantized
linear ``{"qweight", "scales", "bias"?, "format"}`` (the float weight is
dropped: that is the point). Layers that read one input are packed side by
side into one stream where the kernel fuses them: q/k/v as ``qkv_proj`` and
gate/up as ``gate_up_proj`` (vLLM's names), beside the layers; a float
layer's own weight stays for the other paths, a quantized layer keeps only its
``format``. Quantized linears that came quantized (GGUF) are kept as they are.
A decoder with tied embeddings gains an ``lm_head`` holding the embedding, so
its LM head packs (or quantizes) like any linear. Tables read by row
(:data:`INDEXED`) are never packed. A MoE layer's stacked experts
(``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] side by side) gain
``packed`` copies in the routed-expert kernel's layout where ``ops`` has it
(:meth:`funcspec.kernels.Ops.packs_experts`), or, with a ``quantization``, are
quantized expert by expert and stacked (:func:`quantized_experts`); the router
(``gate``) and Qwen2-MoE's ``shared_expert_gate`` stay float, as vLLM keeps them.

NOTE: the input is not modified: containers are rebuilt, tensors shared, and
the packed copies are new tensors in the params. So a weight swapped for
another tensor can never be served a stale packed copy, and the step stays a
pure function of its params; the price is the packed copy beside the weight
(the model's size again, as oneDNN's own packing costs).
"""

from __future__ import annotations

from typing import Optional

import torch

from funcspec.kernels import Ops
from funcspec.kernels import moe, stream
from funcspec.quant import formats

INDEXED = ("embed_tokens", "markov_w1", "kv_b_proj")
"""Weights read as they lie, never packed: by row (embeddings), or per head (MLA's ``kv_b_proj``, absorbed into the
query and the output as its heads' ``W_UK`` and ``W_UV``)."""

ROUTERS = ("gate", "shared_expert_gate")
"""A MoE layer's router and Qwen2-MoE's shared-expert gate: packed, never quantized (vLLM keeps them float)."""

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Fused groups of layers that read one input: the group's name -> its layers, in output order."""

EXPERTS = {"gate_up_proj": moe.pack_gate_up, "down_proj": moe.pack_down}
"""A MoE layer's stacked expert weights (3-D, side by side in one container) -> their packing for the kernel."""


def prepare_params(params, ops: Ops, memo: Optional[dict] = None, quantization: Optional[str] = None):
    """``params`` with every linear's packed copy for ``ops`` and the fused groups (see the module docstring),
    every linear quantized to ``quantization`` when given.

    ``memo`` (a dict, shared across calls) makes a container or weight that
    several params pytrees share prepared once: the drafter's copy of the
    target's LM head is the target's packed one.
    """
    formats.check_scheme(quantization)
    memo = {} if memo is None else memo
    if isinstance(params, dict) and "model" in params and "lm_head" not in params \
            and isinstance(params["model"], dict) and "embed_tokens" in params["model"]:
        params = {**params, "lm_head": {"weight": params["model"]["embed_tokens"]["weight"]}}  # tied
    return _prepare(params, ops, memo, None, quantization)


def quantized(params) -> bool:
    """Whether any linear of ``params`` is quantized (came quantized, or was)."""
    if isinstance(params, dict):
        return "qweight" in params or any(quantized(v) for v in params.values())
    return isinstance(params, (list, tuple)) and any(quantized(v) for v in params)


def _is_linear(node) -> bool:
    w = node.get("weight") if isinstance(node, dict) else None
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point()


def _memo(memo: dict, key, make):
    """``make()``, once per ``key`` (whose object is kept alive in the memo, so that its id is not reused)."""
    if key[1:] not in memo:
        memo[key[1:]] = (key[0], make())
    return memo[key[1:]][1]


def _linear(node: dict, ops: Ops, memo: dict, scheme) -> dict:
    """One linear's params, quantized to ``scheme`` or with its packed copy."""
    w = node["weight"]
    if scheme is not None and formats.quantizes(w, scheme):
        return _memo(memo, (node, "quantized", id(node), scheme), lambda: formats.quantize(node, scheme))
    out = dict(node)
    if ops.layout(w) is not None:
        out["packed"] = _memo(memo, (w, "pack", id(w)), lambda: ops.pack(w))
    return out


def _prepare(node, ops: Ops, memo: dict, name, scheme):
    if isinstance(node, (list, tuple)):
        return type(node)(_prepare(x, ops, memo, name, scheme) for x in node)
    if not isinstance(node, dict) or "qweight" in node:  # a tensor, or a linear that came quantized
        return node
    return _memo(memo, (node, "node", id(node)), lambda: _container(node, ops, memo, name, scheme))


def _container(node: dict, ops: Ops, memo: dict, name, scheme) -> dict:
    if _is_linear(node) and name not in INDEXED:
        return _linear(node, ops, memo, None if name in ROUTERS else scheme)
    if _is_experts(node):
        return _experts(node, ops, memo, scheme)
    groups = {g: ms for g, ms in FUSED.items() if all(isinstance(node.get(m), dict) for m in ms)}
    streamed = {g: ms for g, ms in groups.items() if _streams_together([node[m] for m in ms], ops)
                and not (scheme is not None and any(formats.quantizes(node[m]["weight"], scheme) for m in ms))}
    together = {m for ms in streamed.values() for m in ms}
    out = {k: dict(v) if k in together else _prepare(v, ops, memo, k, scheme) for k, v in node.items()}
    for g, ms in streamed.items():  # the members keep their weights, for the paths that do not stream
        out[g] = _stream_group([node[m] for m in ms])
    for g, ms in groups.items():
        ps = [out[m] for m in ms]
        if all("qweight" in p for p in ps) and formats.same_format(ps):
            out[g] = formats.fuse(ps)
            out.update(zip(ms, formats.members(out[g], [p["format"] for p in ps])))  # views: no second copy
    return out


def _is_experts(node: dict) -> bool:
    """A MoE layer's stacked routed experts: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] weights."""
    ws = [node[m].get("weight") for m in EXPERTS if isinstance(node.get(m), dict)]
    return len(ws) == 2 and all(isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_floating_point() for w in ws)


def _experts(node: dict, ops: Ops, memo: dict, scheme) -> dict:
    """Stacked experts quantized to ``scheme`` (:func:`quantized_experts`) where they take it, else with their
    packed copies for the routed-expert kernel where ``ops`` streams them (the container's other entries
    prepared as usual)."""
    out = {k: v if k in EXPERTS else _prepare(v, ops, memo, k, scheme) for k, v in node.items()}
    gate_up, down = node["gate_up_proj"]["weight"], node["down_proj"]["weight"]
    if scheme is not None and quantizes_experts(gate_up, down, scheme):
        return {**out, **_memo(memo, (node, "quantized_experts", id(node), scheme),
                               lambda: quantized_experts(gate_up, down, scheme))}
    for name, pack in EXPERTS.items():
        w = node[name]["weight"]
        if ops.packs_experts(w):
            packed = _memo(memo, (w, "pack_experts", id(w)), lambda: pack(w))  # noqa: B023 (called at once)
            out[name] = {**node[name], "packed": packed}
    return out


def quantizes_experts(gate_up: torch.Tensor, down: torch.Tensor, scheme: str) -> bool:
    """Whether stacked experts (gate_up [E, 2I, H], down [E, H, I]) take ``scheme``: gate, up and down each
    take it as a linear, and I is whole blocks of 32 (:func:`funcspec.kernels.moe.stack_quantized`)."""
    i = down.shape[2]
    return i % 32 == 0 and formats.quantizes(gate_up[0, :i], scheme) and formats.quantizes(down[0], scheme)


def quantized_experts(gate_up: torch.Tensor, down: torch.Tensor, scheme: str) -> dict:
    """Stacked float experts quantized to ``scheme``, expert by expert, and stacked for the kernel:
    ``{"gate_up_proj": ..., "down_proj": ...}`` (:func:`funcspec.kernels.moe.stack_quantized`)."""
    i = down.shape[2]
    one = (lambda w: formats.quantize({"weight": w}, scheme))  # noqa: E731 (a local one-liner)
    return moe.stack_quantized([one(w[:i]) for w in gate_up], [one(w[i:]) for w in gate_up], [one(w) for w in down])


def _streams_together(ps, ops: Ops) -> bool:
    """Whether float layers ``ps`` are packed as one stream: all there, one dtype and input, streamed."""
    if not all(_is_linear(p) for p in ps):
        return False
    w = [p["weight"] for p in ps]
    return all(ops.layout(x) == "stream" and x.dtype == w[0].dtype and x.shape[1] == w[0].shape[1] for x in w)


def _stream_group(ps) -> dict:
    """Float layers of one input packed side by side into one stream, with their group bias."""
    sizes = [p["weight"].shape[0] for p in ps]
    out = {"packed": stream.pack_weights([p["weight"] for p in ps])}
    bias = stream.group_bias(sizes, [p.get("bias") for p in ps], ps[0]["weight"].dtype)
    if bias is not None:
        out["bias"] = bias
    return out
