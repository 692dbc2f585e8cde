"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which cached positions each query reads.

An indexer is a small multi-query scorer beside a layer's MLA. Its params, under
HF's names (``self_attn.indexer``)::

    wq_b.weight [H_idx·D_idx, q_lora_rank]     from the attention's q latent q_a_layernorm(q_a_proj(x))
    wk.weight [D_idx, H]                       one key per token, the indexer cache's entry
    k_norm.weight, k_norm.bias [D_idx]         LayerNorm, eps 1e-6
    weights_proj.weight [H_idx, H]             a weight per indexer head and token (fp32 in HF)

The score of cached position j for the query at token t is
``sum_h w[t, h] · H_idx^-1/2 · relu(D_idx^-1/2 · q[t, h] · k[j])``; attention then
reads the ``index_topk`` best positions among those the query may see. RoPE
rotates the first ``qk_rope_head_dim`` dims of q and k, half-split (not the
interleaved pairs of the MLA itself). HF's reference skips DeepSeek's Hadamard
rotation and fp8 scoring (a rotation keeps dot products), and so does this module.

The static config is the model's :class:`funcspec.nn.llama.ModelConfig` with its
``mla`` fields ``index_n_heads``, ``index_head_dim``, ``index_topk`` and
``qk_rope_head_dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from funcspec.nn.llama import MATH_TOKENS_MAX, apply_rope

K_NORM_EPS = 1e-6
"""The indexer's key LayerNorm epsilon (fixed in DeepSeek's reference and HF, not in the config)."""


def index_keys(cfg, p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer key [B, T, 1, D_idx] of each token of x [B, T, H]: what the indexer cache holds per position.

    cos/sin [B, T, 1, R] (R = ``qk_rope_head_dim``) rotate its first R dims, half-split.
    """
    k = cfg.ops.linear(x, p["wk"])  # [B, T, D_idx]
    k = F.layer_norm(k, k.shape[-1:], p["k_norm"]["weight"], p["k_norm"]["bias"], K_NORM_EPS)
    return apply_rope(k.unsqueeze(2), cos, sin)  # [B, T, 1, D_idx]


def index_queries(cfg, p: dict, q_low: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer queries [B, T, H_idx, D_idx] from the attention's q latent [B, T, q_lora_rank], RoPE applied."""
    q = cfg.ops.linear(q_low, p["wq_b"]).unflatten(-1, (cfg.mla.index_n_heads, cfg.mla.index_head_dim))
    return apply_rope(q, cos, sin)  # [B, T, H_idx, D_idx]


def head_weights(cfg, p: dict, x: torch.Tensor) -> torch.Tensor:
    """Each indexer head's weight [B, T, H_idx] fp32 for x [B, T, H], with HF's 1/sqrt(H_idx) folded in.

    x takes the projection's dtype first: HF keeps ``weights_proj`` in fp32 in a bf16 model.
    """
    w = p["weights_proj"]
    dtype = w["weight"].dtype if "weight" in w else x.dtype
    return cfg.ops.linear(x.to(dtype), w).float() * cfg.mla.index_n_heads ** -0.5


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores [B, T, T_read] fp32 of queries q [B, T, H_idx, D] with head weights [B, T, H_idx] over keys
    [B, 1, T_read, D], in HF's order: per head relu(q·k / sqrt(D)), then the heads' weighted sum."""
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, T, H_idx, T_read]
    return torch.matmul(weights.unsqueeze(-2), F.relu(s)).squeeze(-2)  # [B, T, T_read]


def scores(cfg, p: dict, x, q_low, cos, sin, keys: torch.Tensor) -> torch.Tensor:
    """:func:`index_scores` of the tokens x [B, T, H] (q latent [B, T, q_lora_rank]) over keys [B, 1, T_read, D]."""
    return index_scores(index_queries(cfg, p, q_low, cos, sin), head_weights(cfg, p, x), keys)


def top_positions(s: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best positions [B, T, k] int64 of scores s [B, T, T_read] among the visible ones, and which of them
    are visible [B, T, k] bool (a query that sees fewer than k positions fills the rest with unseen ones).

    k is static (at most T_read): one fixed-size top-k per context bucket.
    """
    top = s.masked_fill(~visible, float("-inf")).topk(k, dim=-1)  # [B, T, k]
    return top.indices, torch.gather(visible, -1, top.indices)


def select(cfg, p: dict, x, q_low, cos, sin, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``visible`` [B, T, T_read] bool restricted to each query's ``index_topk`` best-scored positions.

    x [B, T, H] and the q latent q_low [B, T, q_lora_rank] are the layer's attention inputs, cos/sin the
    RoPE tables [B, T, 1, R] at their positions, keys [B, 1, T_read, D_idx] the indexer cache as read.
    A position the query cannot see never counts; a query that sees at most ``index_topk`` keeps
    them all, as HF's top-k of ``min(index_topk, T)`` under the causal mask does. Where the read
    length is at most ``index_topk`` (static) nothing is scored: every visible position is kept.
    """
    k = min(cfg.mla.index_topk, keys.shape[2])
    if k == keys.shape[2]:
        return visible
    idx, _ = top_positions(scores(cfg, p, x, q_low, cos, sin, keys), visible, k)
    return visible & torch.zeros_like(visible).scatter(-1, idx, True)  # [B, T, T_read]


def sparse_read(cfg, p: dict, x, q_low, cos, sin, keys: torch.Tensor, q: torch.Tensor, latents: torch.Tensor,
                visible: torch.Tensor):
    """What a layer's latent attention reads under DSA: ``(q, latents, visible)`` for :func:`nn.llama.attend`.

    q [B, T, H, D] are its queries over latents [B, 1, T_read, D] where visible [B, T, T_read]; the other
    arguments are :func:`select`'s. Decode and verify blocks (up to ``MATH_TOKENS_MAX`` tokens, static)
    gather each query's ``index_topk`` selected latents and attend over those alone, one query a row:
    q [B·T, 1, H, D] over [B·T, 1, index_topk, D], so a step reads the selected positions, not the
    context. A long prefill masks the whole read instead (:func:`select`), where a gather per query would
    cost more than the context. Where the read length is at most ``index_topk`` nothing changes.
    """
    b, t, h, d = q.shape
    k = min(cfg.mla.index_topk, latents.shape[2])
    if k == latents.shape[2]:
        return q, latents, visible
    if t > MATH_TOKENS_MAX:
        return q, latents, select(cfg, p, x, q_low, cos, sin, keys, visible)
    idx, seen = top_positions(scores(cfg, p, x, q_low, cos, sin, keys), visible, k)  # [B, T, k]
    rows = torch.gather(latents[:, 0], 1, idx.flatten(1).unsqueeze(-1).expand(-1, -1, d))  # [B, T·k, D]
    return q.reshape(b * t, 1, h, d), rows.view(b * t, 1, k, d), seen.view(b * t, 1, k)
