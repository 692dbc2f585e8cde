"""DeepSeek-V3 multi-token prediction (MTP) module: a pure function under DeepSeek's key names.

Layout (DeepSeek-V3 checkpoints; vLLM ``deepseek_mtp.py``), L = the target's
``num_hidden_layers``, one module ``model.layers.{L}``::

    enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H]
    shared_head.norm.weight [H], shared_head.head.weight [V, H]
    embed_tokens.weight [V, H] (optional: shared with the target, as DeepSeek-V3 does)
    self_attn.*, mlp.*, input_layernorm.weight, post_attention_layernorm.weight   (the block)

    x_t = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])     embed zeroed at position 0 (as vLLM)
    g_t = block(x_t)                                        fed back as h at the next step
    logits = shared_head.head(shared_head.norm(g_t))

NOTE: funcspec's block is a Llama block of the target's family (no MLA, no
MoE) under DeepSeek's key names. h_t for the first step is the target's final
normed hidden state (what vLLM's DeepSeek model returns to its MTP drafter).
Further MTP modules (``num_nextn_predict_layers`` > 1) are not read: the
first one is applied autoregressively for every draft step. Reading and writing
the layout: :mod:`funcspec.checkpoints.mtp`.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.nn.llama import (FULL_READ, KVRead, ModelConfig, TreeMask, decoder_layer, linear, project, rms_norm,
                               rope_tables)


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Static config: ``model`` the block's dims (``num_layers`` 1); ``layer`` = L, its checkpoint index."""

    model: ModelConfig
    layer: int


def _module(cfg: MTPConfig, params) -> dict:
    return params["model"]["layers"][str(cfg.layer)]


def target_features(cfg: MTPConfig, params, feats: torch.Tensor) -> torch.Tensor:
    """MTP reads the target's hidden state as is."""
    return feats


def forward(cfg: MTPConfig, params, kv, tokens, h, slots, starts, window=None, read: KVRead = FULL_READ,
            tree: TreeMask | None = None):
    """Run the module over tokens [B, T] (x_{t+1}) and hidden states h [B, T, H] (h_t) at starts[b] + t.

    Returns ``(g [B, T, H], kv)``. ``window`` is ignored (vLLM-Ascend turns the
    draft window off for MTP). ``tree``: tree attention over the module's own
    drafts (RoPE at its positions). Donates: kv.k, kv.v.
    """
    m, p = cfg.model, _module(cfg, params)
    pos = starts.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
    emb = p["embed_tokens"]["weight"][tokens].masked_fill((pos == 0).unsqueeze(-1), 0.0)  # [B, T, H]
    e = rms_norm(emb, p["enorm"]["weight"], m.rms_norm_eps)
    x = linear(torch.cat([e, rms_norm(h.to(emb.dtype), p["hnorm"]["weight"], m.rms_norm_eps)], -1), p["eh_proj"])
    cos, sin = rope_tables(m, pos if tree is None else tree.positions, x.dtype)
    return decoder_layer(m, p, kv, 0, x, slots, pos, cos, sin, read=read, tree=tree), kv


def draft_logits(cfg: MTPConfig, params, g: torch.Tensor) -> torch.Tensor:
    """float32 logits [.., V] of module outputs g [.., H] through its ``shared_head``."""
    head = _module(cfg, params)["shared_head"]
    return project(rms_norm(g, head["norm"]["weight"], cfg.model.rms_norm_eps), head["head"]["weight"]).float()


def draft_tokens(cfg: MTPConfig, params, g: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B] int64 from module outputs g [B, H]."""
    return torch.argmax(draft_logits(cfg, params, g), dim=-1)


def draft_top(cfg: MTPConfig, params, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely drafts [.., k] int64 (best first) and their log-probabilities [.., k] from module
    outputs g [.., H]: tree children and their EAGLE-2 scores."""
    top = torch.topk(torch.log_softmax(draft_logits(cfg, params, g), dim=-1), k, dim=-1)
    return top.indices, top.values
