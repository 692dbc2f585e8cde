"""Functional DeepSeek-V2 / V3 / V3.2 decoder: multi-head latent attention (MLA) over a latent cache.

The block is the Llama one (:mod:`funcspec.nn.llama`: pre-norm residuals, the
MoE of :mod:`funcspec.nn.moe`) with MLA for attention. A token caches one
latent, ``[c; k_pe]`` of ``kv_lora_rank + qk_rope_head_dim`` values, where
``c = kv_a_layernorm(kv_a_proj(x)[:R])`` and ``k_pe`` is the one rotated key
that every head shares. ``kv_b_proj`` [H·(nope+v), R] holds each head's
``W_UK`` [nope, R] and ``W_UV`` [v, R]; attention never expands the latent::

    q_lat = q_nope W_UK                                [H, R]   (W_UK absorbed into the query)
    score_j = (q_lat · c_j + q_pe · k_pe_j) · scale
    out = (softmax(score) · c) W_UV^T                  [H, v]   (W_UV absorbed into the output)

That is multi-query attention with one key head ``[c; k_pe]`` whose values are
its first R dims (:func:`funcspec.nn.llama.attend`), so every decode step,
verify block and token tree reads only the latent cache. A long prefill (more
than ``MATH_TOKENS_MAX`` tokens) expands the latents it reads to per-head keys
and values instead: its H·T queries would each score R + rope dims.
"""

from __future__ import annotations

from typing import Optional

import torch

from funcspec.nn import dsa
from funcspec.nn.llama import (FULL_READ, MATH_TOKENS_MAX, KVRead, ModelConfig, TreeMask, apply_rope, attend,
                               feed_forward, read_cache, rms_norm, row_parallel, visible_keys, write_kv, zeros)
from funcspec.nn.llama import forward as llama_forward
from funcspec.pytree import pytree_dataclass, slot_field


@pytree_dataclass
class LatentCache:
    """Static-shape latent cache for all slots (slot ``S`` is the scratch slot).

    Attributes:
        latent: [L, S+1, 1, T_max, R + rope] each token's ``[c; k_pe]``.
        index: [L, S+1, 1, T_max, D_idx] V3.2's indexer keys, or ``None`` without an indexer.
        lens: [S+1] int64 committed tokens per slot.
    """

    latent: torch.Tensor = slot_field(axis=1)
    index: Optional[torch.Tensor] = slot_field(axis=1)
    lens: torch.Tensor = slot_field()

    def entries(self) -> tuple[torch.Tensor, ...]:
        """The per-position leaves [L, S+1, 1, T_max, D] that rollback and tree commits move."""
        return (self.latent,) if self.index is None else (self.latent, self.index)


def init_latent_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype=torch.float32, device=None
                      ) -> LatentCache:
    """An empty latent cache with ``num_slots`` real slots plus the scratch slot."""
    m = cfg.mla
    rows = (cfg.num_layers, num_slots + 1, 1, max_len)
    index = zeros(rows + (m.index_head_dim,), dtype, device) if m.index_topk else None
    return LatentCache(zeros(rows + (m.kv_lora_rank + m.qk_rope_head_dim,), dtype, device), index,
                       torch.zeros(num_slots + 1, dtype=torch.int64, device=device))


def latent_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes one token takes in the cache, every layer: its latent and (V3.2) indexer key."""
    m = cfg.mla
    return cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim + (m.index_head_dim if m.index_topk else 0)) \
        * itemsize


def expanded_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes one token would take with the latent expanded to every head's key and value (what MLA saves)."""
    m = cfg.mla
    return cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * itemsize


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE: x [B, T, H, D] rotated in adjacent pairs (x0, x1), (x2, x3), ...; cos/sin [B, T, 1, D]
    (``cat(freqs, freqs)``). The output lists the pairs' first parts, then their second parts: queries and keys
    share that order, so their products are those of the interleaved layout."""
    c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]  # [B, T, 1, D/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def absorbed(cfg: ModelConfig, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK`` [H, nope, R] and ``W_UV`` [H, v, R]: views of this rank's heads of ``kv_b_proj``."""
    m = cfg.mla
    w = p["kv_b_proj"]["weight"].view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]


def mla_project(cfg: ModelConfig, p: dict, x: torch.Tensor, cos, sin):
    """The queries' parts q_nope [B, T, H, nope] and q_pe [B, T, H, rope] (rotated), the latents [B, T, 1, R + rope]
    of x [B, T, hidden], and the query's low-rank state [B, T, q_lora] (V3.2's indexer reads it; ``None`` without
    ``q_lora_rank``)."""
    m, ops = cfg.mla, cfg.ops
    q_low = None
    if m.q_lora_rank:
        q_low = rms_norm(ops.linear(x, p["q_a_proj"]), p["q_a_layernorm"]["weight"], cfg.rms_norm_eps)
        q = ops.linear(q_low, p["q_b_proj"])
    else:
        q = ops.linear(x, p["q_proj"])
    q = q.unflatten(-1, (cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim))  # [B, T, H, nope + rope]
    q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    c, k_pe = ops.linear(x, p["kv_a_proj_with_mqa"]).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, p["kv_a_layernorm"]["weight"], cfg.rms_norm_eps)  # [B, T, R]
    rope = rope_pairs if m.rope_interleave else apply_rope
    q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe.unsqueeze(2), cos, sin)  # [B, T, H, rope], [B, T, 1, rope]
    return q_nope, q_pe, torch.cat([c.unsqueeze(2), k_pe], -1), q_low


def mla_query_latent(cfg: ModelConfig, p: dict, x: torch.Tensor, cos, sin):
    """The absorbed queries [B, T, H, R + rope] (``W_UK`` folded into q_nope) and the latents [B, T, 1, R + rope]
    of x [B, T, hidden], plus the query's low-rank state (:func:`mla_project`)."""
    q_nope, q_pe, latent, q_low = mla_project(cfg, p, x, cos, sin)
    w_uk, _ = absorbed(cfg, p)
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk.to(q_nope.dtype))  # [B, T, H, R]
    return torch.cat([q_lat, q_pe], -1), latent, q_low


def expanded_out(cfg: ModelConfig, p: dict, q_nope, q_pe, latent_cache: torch.Tensor, slots, pos, read: KVRead,
                 tree: Optional[TreeMask]) -> torch.Tensor:
    """o_proj of attention over the latents expanded to every head's keys and values: a long prefill's path,
    where H·T queries make attending in latent space (R + rope dims a score) cost more than expanding once.
    q_nope [B, T, H, nope], q_pe [B, T, H, rope]; the layer's cache [S+1, 1, T_max, R + rope]; [B, T, hidden]."""
    m = cfg.mla
    lat = read_cache(latent_cache.unsqueeze(0), 0, slots, read)[:, 0]  # [B, T_read, R + rope]
    c, k_pe = lat.to(q_nope.dtype).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    w_uk, w_uv = absorbed(cfg, p)
    k_nope = torch.einsum("bjr,hnr->bhjn", c, w_uk.to(c.dtype))  # [B, H, T_read, nope]
    vals = torch.einsum("bjr,hvr->bhjv", c, w_uv.to(c.dtype))  # [B, H, T_read, v]
    keys = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, cfg.num_heads, -1, -1)], -1)  # [B, H, T_read, nope+rope]
    visible = visible_keys(pos, keys.shape[2], None, tree)  # [B, T, T_read]
    out = attend(cfg.ops, torch.cat([q_nope, q_pe], -1), keys, vals, visible, m.softmax_scale)  # [B, T, H·v]
    return row_parallel(cfg, out, p["o_proj"])  # [B, T, hidden]


def mla_out(cfg: ModelConfig, p: dict, q: torch.Tensor, latent_cache: torch.Tensor, slots, pos, read: KVRead,
            tree: Optional[TreeMask], select=None) -> torch.Tensor:
    """o_proj of latent attention of q [B, T, H, R + rope] over one layer's latent cache [S+1, 1, T_max, R + rope]
    (already holding this step's latents); [B, T, hidden]. ``select(visible)``: V3.2's positions each query reads,
    ``idx``, ``valid`` [B, T, k] (or ``None``: all of them), whose latents alone are gathered and attended."""
    m = cfg.mla
    keys = read_cache(latent_cache.unsqueeze(0), 0, slots, read)  # [B, 1, T_read, R + rope]
    visible = visible_keys(pos, keys.shape[2], None, tree)  # [B, T, T_read]
    picked = None if select is None else select(visible)
    if picked is None:
        out = attend(cfg.ops, q, keys, keys[..., : m.kv_lora_rank], visible, m.softmax_scale)  # [B, T, H·R]
        out = out.unflatten(-1, (cfg.num_heads, m.kv_lora_rank))  # [B, T, H, R]
    else:
        out = dsa.attend_selected(cfg.ops, m, q, keys, *picked)  # [B, T, H, R]
    _, w_uv = absorbed(cfg, p)
    o = torch.einsum("bthr,hvr->bthv", out, w_uv.to(out.dtype))  # [B, T, H, v]
    return row_parallel(cfg, o.flatten(2), p["o_proj"])  # [B, T, hidden]


def attention(cfg: ModelConfig, p: dict, kv: LatentCache, layer: int, x, slots, pos, cos, sin,
              read: KVRead = FULL_READ, tree: Optional[TreeMask] = None) -> torch.Tensor:
    """MLA for x [B, T, hidden] written at cache positions pos [B, T]: writes the latents, attends; [B, T, hidden].
    With V3.2's indexer (``cfg.mla.index_topk``) it writes the index keys too and attends only over each query's
    selected positions (:func:`funcspec.nn.dsa.sparse_positions`), gathering only their latents."""
    if x.shape[1] > MATH_TOKENS_MAX and not cfg.mla.index_topk:  # static: a long prefill expands the latent
        q_nope, q_pe, latent, _ = mla_project(cfg, p, x, cos, sin)
        write_kv(kv.latent, layer, slots, pos, latent.to(kv.latent.dtype))
        return expanded_out(cfg, p, q_nope, q_pe, kv.latent[layer], slots, pos, read, tree)
    q, latent, q_low = cfg.ops.mla_prolog(mla_query_latent, cfg, p, x, cos, sin)
    write_kv(kv.latent, layer, slots, pos, latent.to(kv.latent.dtype))
    select = None
    if cfg.mla.index_topk:  # V3.2: the indexer writes its key, then picks the positions attention reads
        ix = p["indexer"]
        write_kv(kv.index, layer, slots, pos, dsa.index_key(cfg.ops, ix, x, cos, sin).to(kv.index.dtype))  # type: ignore[arg-type, union-attr]  # V3.2: an index cache

        def select(visible):
            return dsa.sparse_positions(cfg.ops, cfg.mla, ix, kv.index[layer], x, q_low, slots, cos, sin, visible,  # type: ignore[index]  # as above
                                        read)
    return mla_out(cfg, p, q, kv.latent[layer], slots, pos, read, tree, select)


def decoder_layer(cfg: ModelConfig, p: dict, kv: LatentCache, layer: int, x, slots, pos, cos, sin, window=None,
                  read: KVRead = FULL_READ, attn_in: Optional[torch.Tensor] = None, tree: Optional[TreeMask] = None):
    """One pre-norm DeepSeek block over the residual stream x [B, T, hidden] (``window`` is ignored: no draft
    window applies to an MLA model; ``attn_in`` replaces the attention's normed input, as for Llama blocks)."""
    if attn_in is None:
        attn_in = rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps)
    h = x + attention(cfg, p["self_attn"], kv, layer, attn_in, slots, pos, cos, sin, read, tree)
    return h + feed_forward(cfg, p["mlp"], rms_norm(h, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps))


def forward(cfg: ModelConfig, params: dict, kv: LatentCache, tokens, slots, starts, hidden_layers=(),
            read: KVRead = FULL_READ, window=None, tree: Optional[TreeMask] = None):
    """:func:`funcspec.nn.llama.forward` with DeepSeek blocks: logits [B, T, V] fp32, hiddens, kv.

    Donates: kv's latent (and indexer) leaves.
    """
    return llama_forward(cfg, params, kv, tokens, slots, starts, hidden_layers, read, window, tree,  # type: ignore[arg-type]  # a LatentCache
                         layer=decoder_layer)
