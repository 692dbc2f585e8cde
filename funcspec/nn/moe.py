"""Mixture-of-experts feed-forward: one router for every family, routed experts, shared experts.

A sparse layer's params (HF names, experts stacked as transformers holds them):
``gate.weight`` [E, H] (the router; GLM-4.5 / DeepSeek-V3 add
``gate.e_score_correction_bias`` [E]), ``experts.gate_up_proj.weight``
[E, 2I, H] and ``experts.down_proj.weight`` [E, H, I], and optionally a shared
expert that every token runs (``shared_expert`` with Qwen2-MoE's sigmoid
``shared_expert_gate``, or GLM's ``shared_experts``).

The families differ only in :class:`MoEConfig`: Qwen2/Qwen3-MoE and Mixtral
score with a softmax, GLM-4.5 and DeepSeek-V3 with a sigmoid plus a bias that
steers selection only, DeepSeek-V2 and V3 pick experts only from the best
``topk_group`` of ``n_group`` groups. Every op here has static shapes: the
expert ids are data (``[T, top_k]``), so one captured graph serves any routing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from funcspec.parallel import SINGLE, TPGroup, all_reduce

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A decoder's static MoE configuration (``num_experts == 0``: a dense model).

    Attributes:
        num_experts: E, routed experts per sparse layer.
        top_k: experts per token (``num_experts_per_tok``).
        intermediate_size: I, each routed expert's width (``moe_intermediate_size``).
        sparse_layers: the layers whose MLP is a MoE (the others are dense, of the model's ``intermediate_size``).
        scoring: ``softmax`` over the router logits, or ``sigmoid`` of each.
        norm_topk_prob: renormalise the selected experts' scores to sum to 1.
        n_group, topk_group: selection only among the ``topk_group`` best of ``n_group`` equal groups (1, 1: none).
        group_score: a group's score, its best expert's (``max``, DeepSeek-V2) or its best two's sum (``top2``, V3).
        routed_scaling_factor: multiplies the routing weights (after any renormalisation).
        correction_bias: the router has ``e_score_correction_bias``, added to the scores for selection only.
        shared_intermediate_size: the shared expert's width (0: none).
        shared_gate: the shared expert's output is scaled by sigmoid(``shared_expert_gate`` x) (Qwen2-MoE).
        expert_parallel: under tensor parallelism each rank holds ``num_experts / n`` whole experts (vLLM's
            ``enable_expert_parallel``) instead of a ``1/n`` slice of every expert's ``intermediate_size``.
    """

    num_experts: int = 0
    top_k: int = 0
    intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    expert_parallel: bool = False


DENSE = MoEConfig()


def check(m: MoEConfig, where: str) -> None:
    """``ValueError`` naming the field of an inconsistent ``m`` (``where``: the config's file)."""
    if m.num_experts < 1:
        raise ValueError(f"{where}: num_experts must be positive in a MoE model, got {m.num_experts}")
    if not 1 <= m.top_k <= m.num_experts:
        raise ValueError(f"{where}: num_experts_per_tok must be in [1, {m.num_experts}] (the number of experts), "
                         f"got {m.top_k}")
    if m.intermediate_size < 1:
        raise ValueError(f"{where}: moe_intermediate_size must be positive, got {m.intermediate_size}")
    if m.scoring not in SCORINGS:
        raise ValueError(f"{where}: scoring_func must be one of {SCORINGS}, got {m.scoring!r}")
    if m.n_group < 1 or m.num_experts % m.n_group:
        raise ValueError(f"{where}: n_group={m.n_group} must divide the {m.num_experts} routed experts")
    if not 1 <= m.topk_group <= m.n_group:
        raise ValueError(f"{where}: topk_group must be in [1, n_group={m.n_group}], got {m.topk_group}")
    per_group = m.num_experts // m.n_group
    if m.top_k > m.topk_group * per_group:
        raise ValueError(f"{where}: num_experts_per_tok={m.top_k} exceeds the {m.topk_group * per_group} experts "
                         f"of the topk_group={m.topk_group} groups it may choose from")
    if m.n_group > 1 and m.group_score == "top2" and per_group < 2:
        raise ValueError(f"{where}: n_group={m.n_group} leaves {per_group} expert per group; a group's score sums "
                         f"its best two")


def route(m: MoEConfig, logits: torch.Tensor, bias: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts ids [T, k] int64 and their weights [T, k] fp32 of router logits [T, E].

    The one router of every family: scores (softmax or sigmoid, fp32), plus
    ``bias`` for the choice only; group-limited selection; top-k; the chosen
    experts' own scores, renormalised if asked, times the scaling factor.
    """
    scores = logits.float().softmax(-1) if m.scoring == "softmax" else logits.float().sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias.float()  # [T, E]
    if m.n_group > 1:
        choice = _limit_to_groups(m, choice)
    ids = choice.topk(m.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(-1, ids)  # [T, k]
    if m.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * m.routed_scaling_factor


def _limit_to_groups(m: MoEConfig, choice: torch.Tensor) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside its token's ``topk_group`` best groups at -inf."""
    t = choice.shape[0]
    grouped = choice.view(t, m.n_group, m.num_experts // m.n_group)  # [T, G, E/G]
    if m.group_score == "max":
        group_scores = grouped.amax(-1)  # [T, G]
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
    best = group_scores.topk(m.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, best, True)  # [T, G]
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, m.num_experts)


def router_logits(m: MoEConfig, ops, p: dict, x: torch.Tensor) -> torch.Tensor:
    """The router's logits [T, E] of x [T, H]: in the model's dtype for softmax scoring (as Qwen and Mixtral),
    in fp32 for sigmoid scoring (GLM-4.5 and DeepSeek-V3 keep their router in fp32)."""
    if m.scoring == "sigmoid":
        if p["weight"].dtype != torch.float32:  # static: a router loaded in the model's half dtype
            return ops.linear(x.float(), {"weight": p["weight"].float()})
        return ops.linear(x.float(), p)
    return ops.linear(x, p)


def local_experts(ids: torch.Tensor, weights: torch.Tensor, held: int, tp: TPGroup
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` [T, k] as indices into this rank's ``held`` experts (rank r holds ``[r·held, (r+1)·held)``), -1
    where the expert is another rank's, and ``weights`` [T, k] zeroed there: such a slot adds nothing here, and
    the kernels skip it without reading any expert for it."""
    local = ids - tp.rank * held  # [T, k]
    mine = (local >= 0) & (local < held)  # [T, k]
    return torch.where(mine, local, -1), weights * mine


def sparse_block(m: MoEConfig, ops, p: dict, x: torch.Tensor, dense_mlp: Callable, tp: TPGroup = SINGLE
                 ) -> torch.Tensor:
    """A MoE feed-forward of x [B, T, H] -> [B, T, H]: routed experts, plus the shared expert if any.

    ``dense_mlp(p, x)``: the model's dense MLP, which runs the shared expert. Under ``tp`` every rank routes
    every token (the router is replicated), runs its part of the experts (whole experts under expert
    parallelism, a slice of each otherwise) and the partial outputs are summed by one all-reduce: at decode
    sizes cheaper than dispatching tokens to their experts' ranks and back (``funcspec bench ep-comm``).
    """
    x2 = x.reshape(-1, x.shape[-1])  # [B·T, H]
    logits = router_logits(m, ops, p["gate"], x2)  # [B·T, E]
    ids, weights = route(m, logits, p["gate"].get("e_score_correction_bias"))  # [B·T, k] each
    if m.expert_parallel and tp.size > 1:
        ids, weights = local_experts(ids, weights, m.num_experts // tp.size, tp)
    y = all_reduce(ops.experts(x2, ids, weights, p["experts"]), tp).view(x.shape)  # [B, T, H]
    if "shared_expert" in p:  # Qwen2-MoE: gated by a sigmoid of x
        gate = torch.sigmoid(ops.linear(x, p["shared_expert_gate"]))  # [B, T, 1]
        y = y + gate * dense_mlp(p["shared_expert"], x)
    elif "shared_experts" in p:  # GLM-4.5, DeepSeek
        y = y + dense_mlp(p["shared_experts"], x)
    return y
