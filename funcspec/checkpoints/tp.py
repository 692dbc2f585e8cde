"""Tensor-parallel sharding of a target checkpoint (Megatron layout, :mod:`funcspec.parallel`).

Per decoder layer, rank r of n keeps::

    q_proj, k_proj, v_proj  rows of its KV heads h_kv in [r·H_kv/n, (r+1)·H_kv/n), and the
                            query heads of those KV heads (GQA groups stay whole), bias too
    o_proj                  the matching input columns; its bias whole (added after the all-reduce)
    gate_proj, up_proj      rows [r·I/n, (r+1)·I/n), bias too
    down_proj               the matching input columns; its bias whole
    everything else         replicated (embeddings, LM head, norms, q/k norms, MoE routers)

An MLA layer (DeepSeek, :mod:`funcspec.nn.deepseek`) splits as vLLM splits it, by heads::

    q_proj / q_b_proj       rows of its heads h in [r·H/n, (r+1)·H/n) (each head's nope + rope rows)
    kv_b_proj               rows of the same heads (each head's W_UK and W_UV), float always
    o_proj                  the matching input columns
    q_a_proj, kv_a_proj_with_mqa, their norms, V3.2's indexer   replicated

so every rank computes the whole latent and its latent cache holds all of it
(the cache has no head axis to split); only the absorbed per-head products and
o_proj are divided. ``kv_b_proj`` is never quantized on load: its heads are
read as ``W_UK`` / ``W_UV`` views (:data:`funcspec.quant.prepare.INDEXED`).

A MoE layer's stacked experts are split by expert under expert parallelism
(``MoEConfig.expert_parallel``: rank r holds experts ``[r·E/n, (r+1)·E/n)``
whole), else like an MLP: each expert's gate/up rows and down columns of its
``[r·I/n, (r+1)·I/n)`` block. Its shared expert is an MLP, split as one.
Quantized experts (:func:`funcspec.kernels.moe.stack_quantized`) split the same
way: whole experts, or each expert's gate and up column blocks and down's
input groups, refused by :func:`check_quantized` where I/n is not whole
groups and blocks of 32.

Query head j belongs to KV head ``j // G`` (G = H / H_kv), so the query
heads of a contiguous block of KV heads are a contiguous block too: every
column-parallel weight is one contiguous slice of rows.

A quantized linear is split the same way, its quantization groups whole on
each rank (:mod:`funcspec.quant.shard`); a row-parallel split that would cut
a group is a ``ValueError`` naming the layer and the sizes, raised by
:func:`check_quantized` before any rank starts. A scheme quantized on load is
applied to the whole layer before the split, so each rank holds exactly its
slice of what one rank would run (a per-channel scale spans all of K). The
fused ``qkv_proj`` / ``gate_up_proj`` are built per rank afterwards, by
``prepare_params``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from funcspec.checkpoints.llama import Model
from funcspec.kernels import moe
from funcspec.kernels import quant as qk
from funcspec.nn.llama import ModelConfig
from funcspec.parallel import TPGroup
from funcspec.quant import formats, shard
from funcspec.quant.prepare import INDEXED, quantized_experts, quantizes_experts

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
"""Output-sharded layers: weight rows and bias sliced (MLA's ``q_b_proj`` and ``kv_b_proj`` by heads)."""

ROW = ("o_proj", "down_proj")
"""Input-sharded layers: weight columns sliced, bias replicated."""


def check_size(cfg: ModelConfig, size: int, model: str = "target", field: str = "tensor_parallel_size") -> None:
    """Refuse a ``size`` (the ``field``) that ``model`` cannot be split by (``ValueError`` naming the field)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{field} must be an int >= 1, got {size!r}")
    m, mla = cfg.moe, cfg.mla.kv_lora_rank > 0
    heads = [("num_attention_heads", cfg.num_heads)] if mla else \
        [("num_key_value_heads", cfg.num_kv_heads), ("num_attention_heads", cfg.num_heads)]
    sizes = heads + [("intermediate_size", cfg.intermediate_size)]
    if m.num_experts:
        sizes += [("num_experts" if m.expert_parallel else "moe_intermediate_size",
                   m.num_experts if m.expert_parallel else m.intermediate_size),
                  ("shared expert's intermediate size", m.shared_intermediate_size)]
    for name, n in sizes:
        if n % size:
            raise ValueError(f"{field}={size} must divide the {model}'s {name}={n} "
                             f"(each rank holds whole {'heads' if mla else 'KV heads'})")


def shard_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """Rank ``tp.rank``'s config: its share of heads, KV heads and the MLP's intermediate size. An MLA model
    keeps its ``num_kv_heads`` (unread: its cache is the one replicated latent)."""
    check_size(cfg, tp.size)
    m = cfg.moe
    moe = dataclasses.replace(m, shared_intermediate_size=m.shared_intermediate_size // tp.size,
                              intermediate_size=m.intermediate_size // (1 if m.expert_parallel else tp.size))
    kv_heads = cfg.num_kv_heads if cfg.mla.kv_lora_rank else cfg.num_kv_heads // tp.size
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=kv_heads,
                               intermediate_size=cfg.intermediate_size // tp.size, tp=tp, moe=moe)


def _slice(x: torch.Tensor, dim: int, tp: TPGroup, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rank ``tp.rank``'s contiguous block of ``x`` along ``dim`` (of the indices ``order`` when given), in its own
    storage.

    NOTE: cloned, not a view: a view would keep the whole weight alive, and the
    point of sharding is that a rank holds 1/n of it.
    """
    n = x.shape[dim] // tp.size
    if order is not None:
        return x.index_select(dim, order[tp.rank * n:(tp.rank + 1) * n])
    return x.narrow(dim, tp.rank * n, n).clone()


def _stored_order(mlp: dict, size: int) -> Optional[torch.Tensor]:
    """``down_proj``'s act-order input order where its blocks hold whole groups: gate/up then hand each rank its
    block of features in that order (:mod:`funcspec.quant.shard`); ``None`` otherwise."""
    p = mlp.get("down_proj")
    if not isinstance(p, dict) or "perm" not in p or shard.input_split_error(p["format"], size) is not None:
        return None
    return p["perm"]


def _quantized(p: dict, scheme) -> dict:
    """Linear ``p`` as it will run: quantized to ``scheme`` (on the whole weight) where the scheme takes it."""
    return formats.quantize(p, scheme) if "qweight" not in p and _format(p, scheme) is not None else p


def _format(p: Optional[dict], scheme):
    """The quantized format linear ``p`` runs in (``scheme`` applied on load), or ``None`` for a float one."""
    if p is None:
        return None
    if "qweight" in p:
        return p["format"]
    return formats.scheme_format(p["weight"], scheme) if scheme and formats.quantizes(p["weight"], scheme) else None


def check_quantized(params: dict, size: int, scheme=None, field: str = "tensor_parallel_size",
                    expert_parallel: bool = False) -> None:
    """Refuse a ``size`` (the ``field``) that would cut a quantization group of a row-parallel layer of ``params``
    (quantized, or quantized to ``scheme`` on load), or quantized experts' blocks: a ``ValueError`` naming the
    layer and the sizes."""
    if size == 1:
        return
    for i, block in enumerate(params["model"]["layers"]):
        experts = block.get("mlp", {}).get("experts")
        why = None if expert_parallel or experts is None else experts_split_error(experts, size, scheme)
        if why is not None:
            raise ValueError(f"{field}={size} cannot split model.layers.{i}.mlp.experts: {why} (each expert's "
                             f"intermediate size is split; enable_expert_parallel=True splits whole experts)")
        for path, p in _row_layers(block):
            fmt = _format(p, scheme)
            why = None if fmt is None else shard.input_split_error(fmt, size, "perm" in p)
            if why is not None:
                raise ValueError(f"{field}={size} cannot split model.layers.{i}.{path}: {why}")


SHARED = ("shared_expert", "shared_experts")
"""A MoE layer's shared expert (Qwen2-MoE's, and GLM-4.5's and DeepSeek's): a dense MLP, split as one."""


def _row_layers(block: dict):
    """``(path, params)`` of each row-parallel linear of decoder block ``block``, a shared expert's included."""
    parts = [(part, block.get(part, {})) for part in ("self_attn", "mlp")]
    parts += [(f"mlp.{name}", block["mlp"][name]) for name in SHARED if name in block.get("mlp", {})]
    for part, layers in parts:
        for name in ROW:
            if name in layers:
                yield f"{part}.{name}", layers[name]


def experts_split_error(experts: dict, size: int, scheme=None) -> Optional[str]:
    """Why quantized stacked experts (or float ones that ``scheme`` quantizes on load) cannot have each expert's
    intermediate size I split into ``size`` (gate and up in whole column blocks of 32, down's inputs in whole
    groups), or ``None`` (float experts: always)."""
    gate_up, down = experts["gate_up_proj"], experts["down_proj"]
    if "qweight" in gate_up:
        i, fmt = gate_up["format"].out_features, down["format"]
    elif scheme and quantizes_experts(gate_up["weight"], down["weight"], scheme):
        i, fmt = down["weight"].shape[2], formats.scheme_format(down["weight"][0], scheme)
    else:
        return None
    if i % size or (i // size) % qk.QB:
        return f"its intermediate size {i} / {size} is not a whole number of blocks of {qk.QB}"
    return shard.input_split_error(fmt, size)


def _shard_quantized_experts(experts: dict, tp: TPGroup, expert_parallel: bool) -> dict:
    """:func:`shard_experts` of quantized experts (exact: a shard dequantizes to the slice of the whole)."""
    gate_up, down = experts["gate_up_proj"], experts["down_proj"]
    if expert_parallel:
        def whole(p):
            return {k: _slice(v, 0, tp) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
        return {"gate_up_proj": whole(gate_up), "down_proj": whole(down)}
    why = experts_split_error(experts, tp.size)
    if why is not None:
        raise ValueError(f"cannot split quantized experts over {tp.size} ranks: {why}")
    parts = [moe.quantized_expert(gate_up, down, e) for e in range(gate_up["qweight"].shape[0])]
    return moe.stack_quantized([shard.split_outputs(g, tp.rank, tp.size) for g, _, _ in parts],
                               [shard.split_outputs(u, tp.rank, tp.size) for _, u, _ in parts],
                               [shard.split_inputs(d, tp.rank, tp.size) for _, _, d in parts])


def shard_experts(experts: dict, tp: TPGroup, expert_parallel: bool, scheme=None) -> dict:
    """A MoE layer's stacked experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) for rank ``tp.rank``:
    its whole experts under expert parallelism, else its block of every expert's intermediate size, quantized
    to ``scheme`` first where it takes them (a per-channel scale of ``down_proj`` spans all of I: quantized
    after the split, a rank's scales would not be one rank's)."""
    gate_up, down = experts["gate_up_proj"], experts["down_proj"]
    if scheme and not expert_parallel and "qweight" not in gate_up \
            and quantizes_experts(gate_up["weight"], down["weight"], scheme):
        experts = quantized_experts(gate_up["weight"], down["weight"], scheme)
    if "qweight" in experts["gate_up_proj"]:
        return _shard_quantized_experts(experts, tp, expert_parallel)
    gate_up, down = experts["gate_up_proj"]["weight"], experts["down_proj"]["weight"]
    if expert_parallel:
        return {"gate_up_proj": {"weight": _slice(gate_up, 0, tp)}, "down_proj": {"weight": _slice(down, 0, tp)}}
    e, two_i, h = gate_up.shape
    halves = _slice(gate_up.view(e, 2, two_i // 2, h), 2, tp)  # [E, 2, I/n, H]: gate rows, then up rows
    return {"gate_up_proj": {"weight": halves.reshape(e, -1, h)}, "down_proj": {"weight": _slice(down, 2, tp)}}


def shard_layer(block: dict, tp: TPGroup, scheme=None, expert_parallel: bool = False) -> dict:
    """One decoder block's params (``self_attn`` and ``mlp`` sub-dicts) for rank ``tp.rank``, its sharded linears
    quantized to ``scheme`` first where it applies."""
    out = {}
    for part, layers in block.items():
        if part not in ("self_attn", "mlp"):
            out[part] = layers
            continue
        order = _stored_order(layers, tp.size) if part == "mlp" else None  # [I] or None
        out[part] = {}
        for name, p in layers.items():
            if name == "experts":
                out[part][name] = shard_experts(p, tp, expert_parallel, scheme)
                continue
            if name in SHARED:  # a dense MLP
                out[part][name] = shard_layer({"mlp": p}, tp, scheme)["mlp"]
                continue
            if name in COLUMN + ROW and name not in INDEXED:  # MLA's kv_b_proj stays float
                p = _quantized(p, scheme)
            if name in COLUMN:
                out[part][name] = shard.split_outputs(p, tp.rank, tp.size, order) if "qweight" in p else \
                    {k: _slice(v, 0, tp, order) for k, v in p.items()}
            elif name in ROW:
                out[part][name] = shard.split_inputs(p, tp.rank, tp.size, order is not None) if "qweight" in p \
                    else {k: _slice(v, 1, tp) if k == "weight" else v for k, v in p.items()}
            else:
                out[part][name] = p
    return out


def shard_params(params: dict, tp: TPGroup, scheme=None, expert_parallel: bool = False) -> dict:
    """A decoder's params pytree (HF names) for rank ``tp.rank`` (the input is not modified); ``scheme``: the
    quantization the engine applies on load (:data:`funcspec.quant.formats.SCHEMES`), applied before the split;
    ``expert_parallel``: MoE experts split whole (:func:`shard_experts`)."""
    if tp.size == 1:
        return params
    m = params["model"]
    layers = [shard_layer(b, tp, scheme, expert_parallel) for b in m["layers"]]
    return {**params, "model": {**m, "layers": layers}}


def shard_model(model: Model, tp: TPGroup, scheme=None) -> Model:
    """``model`` with rank ``tp.rank``'s config and params (the input is not modified; one rank: itself)."""
    if tp.size == 1:
        return model
    return dataclasses.replace(model, cfg=shard_config(model.cfg, tp),
                               params=shard_params(model.params, tp, scheme, model.cfg.moe.expert_parallel))
