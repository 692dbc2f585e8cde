"""Medusa heads (FasterDecoding/Medusa ``medusa_model.py``): pure functions under the published key names.

Layout (``medusa_head`` is ``ModuleList[Sequential(ResBlock × n, Linear)]``), N heads, n layers::

    medusa_head.{k}.{j}.linear.weight [H, H], medusa_head.{k}.{j}.linear.bias [H]   j < n
    medusa_head.{k}.{n}.weight [V, H]                                               (no bias)
    config.json: medusa_num_heads = N, medusa_num_layers = n (vLLM's num_heads /
    num_hidden_layers are accepted too)

    head_k(h) = W_k · ResBlocks(h),  ResBlock(x) = x + SiLU(linear(x))

Head k reads the target's final normed hidden state h_t and predicts token
t+k+2 (the target's own lm_head predicts t+1).

NOTE: FasterDecoding ships the heads as ``medusa_lm_head.pt`` (a pickled
state dict); funcspec reads the same key names from ``model.safetensors``.
vLLM's re-keyed Medusa layout (``blocks.{k}.layers.{j}``, ``lm_heads.{k}``) is not read.
Reading and writing the layout: :mod:`funcspec.checkpoints.medusa`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from funcspec.nn.llama import linear, project


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """N heads of n ResBlocks each, over hidden size H and vocabulary V."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int


def head_logits(cfg: MedusaConfig, params, h: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [B, V] float32 of head ``k`` for hidden states h [B, H]."""
    p = params["medusa_head"][k]
    for j in range(cfg.num_layers):
        h = h + F.silu(linear(h, p[j]["linear"]))  # [B, H]
    return project(h, p[cfg.num_layers]["weight"]).float()
