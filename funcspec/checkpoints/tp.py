"""Tensor-parallel sharding of a target checkpoint (Megatron layout, :mod:`funcspec.parallel`).

Per decoder layer, rank r of n keeps::

    q_proj, k_proj, v_proj  rows of its KV heads h_kv in [r·H_kv/n, (r+1)·H_kv/n), and the
                            query heads of those KV heads (GQA groups stay whole), bias too
    o_proj                  the matching input columns; its bias whole (added after the all-reduce)
    gate_proj, up_proj      rows [r·I/n, (r+1)·I/n), bias too
    down_proj               the matching input columns; its bias whole
    everything else         replicated (embeddings, LM head, norms, q/k norms)

Query head j belongs to KV head ``j // G`` (G = H / H_kv), so the query
heads of a contiguous block of KV heads are a contiguous block too: every
column-parallel weight is one contiguous slice of rows.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.checkpoints.llama import Model
from funcspec.nn.llama import ModelConfig
from funcspec.parallel import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Output-sharded layers: weight rows and bias sliced."""

ROW = ("o_proj", "down_proj")
"""Input-sharded layers: weight columns sliced, bias replicated."""


def check_size(cfg: ModelConfig, size: int, model: str = "target", field: str = "tensor_parallel_size") -> None:
    """Refuse a ``size`` (the ``field``) that ``model`` cannot be split by (``ValueError`` naming the field)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{field} must be an int >= 1, got {size!r}")
    if size > 1 and cfg.moe.num_experts:
        raise ValueError(f"{field}={size} with a mixture-of-experts {model} is not supported yet: its experts are "
                         f"not split across ranks (run it on one rank)")
    for name, n in (("num_key_value_heads", cfg.num_kv_heads), ("num_attention_heads", cfg.num_heads),
                     ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"{field}={size} must divide the {model}'s {name}={n} "
                             f"(each rank holds whole KV heads)")


def shard_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """Rank ``tp.rank``'s config: its share of heads, KV heads and the MLP's intermediate size."""
    check_size(cfg, tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=cfg.num_kv_heads // tp.size,
                               intermediate_size=cfg.intermediate_size // tp.size, tp=tp)


def _slice(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """Rank ``tp.rank``'s contiguous block of ``x`` along ``dim``, in its own storage.

    NOTE: cloned, not a view: a view would keep the whole weight alive, and the
    point of sharding is that a rank holds 1/n of it.
    """
    n = x.shape[dim] // tp.size
    return x.narrow(dim, tp.rank * n, n).clone()


def shard_layer(block: dict, tp: TPGroup) -> dict:
    """One decoder block's params (``self_attn`` and ``mlp`` sub-dicts) for rank ``tp.rank``."""
    out = {}
    for part, layers in block.items():
        if part not in ("self_attn", "mlp"):
            out[part] = layers
            continue
        out[part] = {}
        for name, p in layers.items():
            if name in COLUMN:
                out[part][name] = {k: _slice(v, 0, tp) for k, v in p.items()}
            elif name in ROW:
                out[part][name] = {k: _slice(v, 1, tp) if k == "weight" else v for k, v in p.items()}
            else:
                out[part][name] = p
    return out


def shard_params(params: dict, tp: TPGroup) -> dict:
    """A decoder's params pytree (HF names) for rank ``tp.rank`` (the input is not modified)."""
    if tp.size == 1:
        return params
    m = params["model"]
    return {**params, "model": {**m, "layers": [shard_layer(b, tp) for b in m["layers"]]}}


def shard_model(model: Model, tp: TPGroup) -> Model:
    """``model`` with rank ``tp.rank``'s config and params (the input is not modified; one rank: itself)."""
    if tp.size == 1:
        return model
    return dataclasses.replace(model, cfg=shard_config(model.cfg, tp), params=shard_params(model.params, tp))
