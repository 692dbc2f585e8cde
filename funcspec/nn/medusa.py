"""Medusa heads (FasterDecoding/Medusa ``medusa_model.py``; vLLM ``medusa.py``): pure functions.

funcspec's names (``funcspec.checkpoints.layouts`` maps FasterDecoding's
``{k}.{j}.linear.*`` and vLLM's ``blocks.{k}.layers.{j}`` onto them), N heads of n ResBlocks::

    medusa_head.{k}.{j}.linear.weight [H, H], .bias [H] (optional: vLLM's medusa_fc_bias)   j < n
    medusa_head.{k}.{n}.weight [V_d, H]         head k's own vocabulary projection, or
    lm_head.weight [V_d, H]                     one projection for every head (vLLM original_lm_head,
                                                FasterDecoding's "version 2" heads: the target's)
    token_map [V_d] int64                       optional (vLLM truncated_vocab_size): target id of row d

    head_k(h) = W_k · ResBlocks(h),  ResBlock(x) = x + SiLU(linear(x))
    draft_k   = argmax head_k(h), mapped through token_map when there is one

Head k reads the target's final normed hidden state h_t and predicts token
t+k+2 (the target's own lm_head predicts t+1). Reading and writing the
layouts: :mod:`funcspec.checkpoints.medusa`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from funcspec.kernels import REFERENCE, Ops, first_max


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """N heads of n ResBlocks each, over hidden size H.

    Attributes:
        num_heads: N.
        num_layers: n, the ResBlocks of each head.
        hidden_size: H.
        vocab_size: V_d, the rows of a head's projection (V, or vLLM's truncated vocabulary).
        shared_head: every head projects through one ``lm_head`` instead of its own.
        token_map: drafts are mapped to target ids through ``token_map``.
        ops: the kernels its products take (the target's).
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_head: bool = False
    token_map: bool = False
    ops: Ops = REFERENCE


def head_logits(cfg: MedusaConfig, params, h: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [B, V_d] float32 of head ``k`` for hidden states h [B, H]."""
    p = params["medusa_head"][k]
    for j in range(cfg.num_layers):
        h = h + F.silu(cfg.ops.linear(h, p[j]["linear"]))  # [B, H]
    return cfg.ops.linear(h, params["lm_head"] if cfg.shared_head else p[cfg.num_layers]).float()


def draft_tokens(cfg: MedusaConfig, params, h: torch.Tensor, k: int) -> torch.Tensor:
    """Head ``k``'s greedy draft [B] int64 (target ids) for hidden states h [B, H]."""
    d = first_max(head_logits(cfg, params, h, k))  # [B] head-vocabulary ids
    return params["token_map"][d] if cfg.token_map else d
