"""``prepare_params``: a params pytree with the packed copies its ``Ops`` streams, made once at load.

A linear's params ``{"weight", "bias"?}`` gain ``packed``, the weight in the
kernel's layout (:meth:`funcspec.kernels.Ops.layout`). Layers that read one
input are packed side by side into one stream where the kernel fuses them:
q/k/v as ``qkv_proj`` and gate/up as ``gate_up_proj`` (vLLM's names), each
``{"packed", "bias"?}`` beside the layers, whose own weights stay for the
other paths. A decoder with tied embeddings gains an ``lm_head`` holding the
embedding, so its LM head packs like any linear. Tables read by row
(:data:`INDEXED`) are never packed.

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
from funcspec.kernels import stream

INDEXED = ("embed_tokens", "markov_w1")
"""Weights read by row (embeddings), never multiplied: not packed."""

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Fused groups of layers that read one input: the group's name -> its layers, in output order."""


def prepare_params(params, ops: Ops, memo: Optional[dict] = None):
    """``params`` with every linear's packed copy for ``ops`` and the fused groups (see the module docstring).

    ``memo`` (a dict, shared across calls) makes a container or weight that
    several params pytrees share prepared once: the drafter's copy of the
    target's LM head is the target's packed one.
    """
    memo = {} if memo is None else memo
    if isinstance(params, dict) and "model" in params and "lm_head" not in params \
            and isinstance(params["model"], dict) and "embed_tokens" in params["model"]:
        params = {**params, "lm_head": {"weight": params["model"]["embed_tokens"]["weight"]}}  # tied
    return _prepare(params, ops, memo, None)


def _is_linear(node) -> bool:
    w = node.get("weight") if isinstance(node, dict) else None
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point()


def _pack(weight: torch.Tensor, ops: Ops, memo: dict) -> torch.Tensor:
    key = ("pack", id(weight))
    if key not in memo:
        memo[key] = (weight, ops.pack(weight))  # NOTE: the weight is kept so that its id is not reused
    return memo[key][1]


def _prepare(node, ops: Ops, memo: dict, name):
    if isinstance(node, (list, tuple)):
        return type(node)(_prepare(x, ops, memo, name) for x in node)
    if not isinstance(node, dict):
        return node
    key = ("node", id(node))
    if key in memo:
        return memo[key][1]
    if _is_linear(node) and name not in INDEXED:
        out = dict(node)
        if ops.layout(node["weight"]) is not None:
            out["packed"] = _pack(node["weight"], ops, memo)
    else:
        fused = {group: members for group, members in FUSED.items() if _fuses(node, members, ops)}
        inside = {m for members in fused.values() for m in members}
        out = {k: dict(v) if k in inside else _prepare(v, ops, memo, k) for k, v in node.items()}
        for group, members in fused.items():
            ps = [node[m] for m in members]
            sizes = [p["weight"].shape[0] for p in ps]
            out[group] = {"packed": stream.pack_weights([p["weight"] for p in ps])}
            bias = stream.group_bias(sizes, [p.get("bias") for p in ps], ps[0]["weight"].dtype)
            if bias is not None:
                out[group]["bias"] = bias
    memo[key] = (node, out)
    return out


def _fuses(node: dict, members, ops: Ops) -> bool:
    """Whether ``node``'s layers ``members`` are packed as one stream: all there, one dtype and input, streamed."""
    ps = [node.get(m) for m in members]
    if not all(_is_linear(p) for p in ps):
        return False
    w = [p["weight"] for p in ps]
    return all(ops.layout(x) == "stream" and x.dtype == w[0].dtype and x.shape[1] == w[0].shape[1] for x in w)
