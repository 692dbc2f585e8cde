"""DFlash block drafter (z-lab, arXiv 2602.06036) and DSpark's heads (deepseek-ai/DeepSpec).

One forward drafts a whole block (no causal mask inside it)::

    ctx    = hidden_norm(fc(concat(target hidden states at target_layer_ids)))   # committed tokens
    x      = embed([anchor, MASK, ..., MASK])          # the target's embedding
    layer  : Q from rms(x); K/V = [k_proj(ctx); k_proj(rms(x))] with k_norm and RoPE at true positions
    h      = norm(x);  logits = lm_head(h)             # the target's LM head

Each layer's context K/V is kept per slot in :class:`ContextKV`, so a step only
projects the newly committed rows. DSpark adds a Markov logit bias
``W2(W1[x_{k-1}])`` applied left to right from the anchor, and a confidence head
``sigmoid(w·[h_k; W1[x_{k-1}]])``.

Checkpoint layout (HF names, no ``model.`` prefix; z-lab ``DFlashDraftModel``,
DeepSpec ``Qwen3DSparkModel``)::

    fc.weight [H, n·H]   hidden_norm.weight [H]   norm.weight [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight [D]      (Qwen3 layers, always)
    layers.{i}.mlp.{gate,up,down}_proj.weight   layers.{i}.{input,post_attention}_layernorm.weight
    embed_tokens.weight, lm_head.weight [V, H]       optional copies of the target's (DeepSpec ships them)
    d2t [V_d] int64                                  speculators heads with a reduced draft vocabulary:
                                                     lm_head [V_d, H], target id = d + d2t[d]
  dspark only:
    markov_head.markov_w1.weight [V, r]   markov_head.markov_w2.weight [V, r]
    confidence_head.proj.weight [1, H (+r)]   confidence_head.proj.bias [1]

config.json keys are read from ``dflash_config`` first, then the top level, as
z-lab's loader does: ``mask_token_id``, ``target_layer_ids``, ``block_size``,
``num_target_layers``; DeepSpec adds ``markov_rank``, ``markov_head_type``
("vanilla"), ``enable_confidence_head``, ``confidence_head_with_markov``.
Reading and writing the layout: :mod:`funcspec.checkpoints.dflash`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

# NOTE: ``window_start`` is the draft-window rule that every head shares; it stays importable from here.
from funcspec.nn.llama import (FULL_READ, KVRead, ModelConfig, apply_rope, attend, mlp, read_cache, rms_norm,
                               rope_tables, window_start, write_kv)  # noqa: F401 (window_start: re-exported)
from funcspec.pytree import pytree_dataclass, slot_field


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static config of a DFlash / DSpark drafter.

    Attributes:
        model: the draft decoder layers (Qwen3-style: q/k norm).
        target_layer_ids: target layers whose outputs form the context (-1: embeddings).
        mask_token_id: the token id that fills the block after the anchor.
        block_size: the block the checkpoint was trained with (informational).
        markov_rank: DSpark Markov head rank r; 0 for none (DFlash).
        confidence: DSpark confidence head input: "none", "hidden" or "hidden_markov".
        hidden_layers: the target hidden indices read (``nn.llama.forward``'s ``hidden_layers``; z-lab's
            id j is index j + 1).
        draft_vocab: the LM head covers a reduced vocabulary, mapped to target ids through ``d2t``.
    """

    model: ModelConfig
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    markov_rank: int = 0
    confidence: str = "none"
    hidden_layers: tuple[int, ...] = ()
    draft_vocab: bool = False


@pytree_dataclass
class ContextKV:
    """Per-slot context keys/values of every draft layer.

    Attributes:
        k: [L_d, S+1, H_kv, T_max, D] RoPE'd keys; positions < the slot's length are committed tokens.
        v: [L_d, S+1, H_kv, T_max, D] values.
    """

    k: torch.Tensor = slot_field(axis=1)
    v: torch.Tensor = slot_field(axis=1)


def init_context_kv(cfg: DFlashConfig, num_slots: int, max_len: int, dtype, device) -> ContextKV:
    """Zeroed context K/V [L_d, S+1, H_kv, T_max, D] for ``num_slots`` slots plus the scratch slot."""
    m = cfg.model
    shape = (m.num_layers, num_slots + 1, m.num_kv_heads, max_len, m.head_dim)
    return ContextKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


# ----------------------------------------------------------------------------- forward


def _keys_values(m: ModelConfig, p: dict, x: torch.Tensor, cos, sin):
    """k (k_norm, RoPE) and v [B, T, H_kv, D] of x [B, T, H]."""
    b, t, _ = x.shape
    k = m.ops.linear(x, p["k_proj"]).view(b, t, m.num_kv_heads, m.head_dim)
    v = m.ops.linear(x, p["v_proj"]).view(b, t, m.num_kv_heads, m.head_dim)
    return apply_rope(rms_norm(k, p["k_norm"]["weight"], m.rms_norm_eps), cos, sin), v


def write_context(cfg: DFlashConfig, params: dict, kv: ContextKV, raw: torch.Tensor, slots, starts) -> ContextKV:
    """Project raw target features [B, T, n·H] into every layer's context K/V at ``starts[b] + t``.

    Donates: kv.
    """
    m = cfg.model
    pos = starts.unsqueeze(1) + torch.arange(raw.shape[1], device=raw.device)  # [B, T]
    ctx = rms_norm(m.ops.linear(raw, params["fc"]), params["hidden_norm"]["weight"], m.rms_norm_eps)  # [B, T, H]
    cos, sin = rope_tables(m, pos, ctx.dtype)
    for i, p in enumerate(params["layers"]):
        k, v = _keys_values(m, p["self_attn"], ctx, cos, sin)
        write_kv(kv.k, i, slots, pos, k.to(kv.k.dtype))
        write_kv(kv.v, i, slots, pos, v.to(kv.v.dtype))
    return kv


def block_forward(cfg: DFlashConfig, params: dict, kv: ContextKV, tokens, slots, starts, first=None,
                  read: KVRead = FULL_READ):
    """Run the block tokens [B, T] at positions ``starts[b] + t``; returns (h [B, T, H] normed, kv).

    Every block token sees the context at positions ``[first, starts)`` and the
    whole block. The block's own K/V are written at its positions; they are
    scratch that the next committed context overwrites.

    Donates: kv.
    """
    m, (b, t) = cfg.model, tokens.shape
    pos = starts.unsqueeze(1) + torch.arange(t, device=tokens.device)  # [B, T]
    x = params["embed_tokens"]["weight"][tokens]  # [B, T, H]
    cos, sin = rope_tables(m, pos, x.dtype)
    t_read = kv.k.shape[3] if read.length is None else read.length
    j = torch.arange(t_read, device=tokens.device).view(1, -1)  # [1, T_read]
    visible = j < (starts + t).view(-1, 1)  # [B, T_read]: non-causal inside the block
    if first is not None:
        visible = visible & (j >= first.view(-1, 1))
    visible = visible.unsqueeze(1).expand(b, t, t_read)  # [B, T, T_read]
    for i, p in enumerate(params["layers"]):
        a = p["self_attn"]
        h = rms_norm(x, p["input_layernorm"]["weight"], m.rms_norm_eps)
        q = m.ops.linear(h, a["q_proj"]).view(b, t, m.num_heads, m.head_dim)
        q = apply_rope(rms_norm(q, a["q_norm"]["weight"], m.rms_norm_eps), cos, sin)
        k, v = _keys_values(m, a, h, cos, sin)
        write_kv(kv.k, i, slots, pos, k.to(kv.k.dtype))
        write_kv(kv.v, i, slots, pos, v.to(kv.v.dtype))
        keys, vals = read_cache(kv.k, i, slots, read), read_cache(kv.v, i, slots, read)  # [B, H_kv, T_read, D]
        x = x + m.ops.linear(attend(m.ops, q, keys, vals, visible), a["o_proj"])
        x = x + mlp(m, p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], m.rms_norm_eps))
    return rms_norm(x, params["norm"]["weight"], m.rms_norm_eps), kv


def logits(cfg: DFlashConfig, params: dict, h: torch.Tensor) -> torch.Tensor:
    """float32 logits [..., V] of normed hidden states h [..., H] (the target's LM head)."""
    return cfg.model.ops.linear(h, params["lm_head"]).float()


def target_ids(cfg: DFlashConfig, params: dict, d: torch.Tensor) -> torch.Tensor:
    """Target token ids of LM-head rows d [...] (the same ids without a reduced draft vocabulary)."""
    return d + params["d2t"][d] if cfg.draft_vocab else d


def max_prob(x: torch.Tensor) -> torch.Tensor:
    """Head-free confidence [...]: ``max softmax(x)`` clamped to [1e-6, 1] (vLLM-Ascend's DFlash proxy)."""
    return torch.softmax(x.float(), dim=-1).amax(-1).clamp(1e-6, 1.0)


# ----------------------------------------------------------------------------- DSpark heads


def markov_decode(cfg: DFlashConfig, params: dict, base: torch.Tensor, anchor: torch.Tensor, choose: Callable):
    """Apply the Markov bias left to right: ``U_k + W2(W1[x_{k-1}])`` with ``x_{-1}`` = anchor.

    Args:
        base: [B, K, V] backbone logits U.
        anchor: [B] the pending token.
        choose: ``choose(k, logits [B, V]) -> (token [B], extra)`` picks ``x_k``;
            ``extra`` is a tensor, or ``None`` at every k.

    Returns:
        tokens [B, K], corrected logits [B, K, V], the extras stacked on dim 1,
        and ``W1[x_{k-1}]`` [B, K, r] (``None`` without a Markov head).
    """
    prev, toks, outs, extras, embs = anchor, [], [], [], []
    for k in range(base.shape[1]):
        step = base[:, k]
        if cfg.markov_rank:
            emb = params["markov_head"]["markov_w1"]["weight"][prev]  # [B, r]
            step = step + cfg.model.ops.linear(emb, params["markov_head"]["markov_w2"]).float()
            embs.append(emb)
        prev, extra = choose(k, step)
        toks.append(prev)
        outs.append(step)
        extras.append(extra)
    return (torch.stack(toks, 1), torch.stack(outs, 1), None if extras[0] is None else torch.stack(extras, 1),
            torch.stack(embs, 1) if embs else None)


def confidence(cfg: DFlashConfig, params: dict, h: torch.Tensor, prev_emb: Optional[torch.Tensor]) -> torch.Tensor:
    """DSpark's per-token confidence [B, K] = ``sigmoid(w·[h_k; W1[x_{k-1}]] + b)``."""
    feats = torch.cat([h, prev_emb.to(h.dtype)], dim=-1) if cfg.confidence == "hidden_markov" else h  # type: ignore[union-attr]  # a markov head: prev_emb given
    return torch.sigmoid(cfg.model.ops.linear(feats, params["confidence_head"]["proj"]).squeeze(-1).float())
