"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer that picks the positions MLA reads.

Each layer's indexer (params ``self_attn.indexer``, HF names: ``wq_b``,
``wk``, ``k_norm`` (a LayerNorm with bias), ``weights_proj``) makes, per
token, ``index_n_heads`` index queries from the MLA query latent (``q_resid``,
the normed ``q_a_proj`` output), one index key from the layer input, and one
weight per head. Index keys are cached beside the latent, one
``index_head_dim`` vector per token and layer (``LatentCache.index``
[L, S+1, 1, T_max, Di] of :mod:`funcspec.nn.deepseek`: a one-head KV leaf,
written, read, rolled back and moved along a tree's path as the latent is); a
query scores every cached position it may see and attention then reads only
the ``index_topk`` best (:func:`funcspec.kernels.Ops.lightning_indexer`).

As transformers computes it: RoPE rotates the first ``qk_rope_head_dim`` dims
of index queries and keys, half-split (rotate-half, not MLA's interleaved
pairs), with the model's RoPE tables (YaRN's scaling included); the Hadamard
rotation and FP8 scores of DeepSeek's reference kernels are left out (the one
preserves dot products, the other only precision). Its weights are whole on
every rank (vLLM replicates them too; ``checkpoints.tp`` splits none of their
names), so under tensor parallelism every rank selects the same positions.

Static shapes: the selection is ``[B, T, min(index_topk, T_read)]`` per
context bucket, and a bucket whose read length is at most ``index_topk``
selects every visible position without scoring (transformers selects
``min(index_topk, length)`` of them, so all). Visibility comes from the caller
(:func:`funcspec.nn.llama.visible_keys`: causal, a draft window, or a token
tree's ancestors), so tree attention and every verifier see the selection
unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from funcspec.kernels import Ops
from funcspec.nn.llama import KVRead, MLAConfig, apply_rope, read_cache

K_NORM_EPS = 1e-6
"""The index keys' LayerNorm epsilon (fixed in transformers and DeepSeek's reference, not in config.json)."""

GATHER_ELEMENTS = 1 << 24
"""Most elements of gathered latents and their scores that one pass of :func:`attend_selected` holds (64 MiB
fp32). A block that selects more (a long prefill: T · index_topk latents) attends in chunks of query rows."""


def check_config(q_lora_rank: int, index_n_heads: int, index_head_dim: int, index_topk: int,
                 qk_rope_head_dim: int) -> None:
    """Refuse an indexer that cannot be built, naming the config field (``index_topk == 0``: no indexer)."""
    if index_topk == 0:
        return
    for name, value in (("index_topk", index_topk), ("index_n_heads", index_n_heads),
                        ("index_head_dim", index_head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int for DeepSeek Sparse Attention, got {value!r}")
    if q_lora_rank < 1:
        raise ValueError("q_lora_rank must be positive with index_topk: the indexer's queries are made from the "
                         f"query latent (q_a_proj), got q_lora_rank={q_lora_rank!r}")
    if qk_rope_head_dim > index_head_dim or qk_rope_head_dim % 2:
        raise ValueError(f"index_head_dim ({index_head_dim}) must hold the even qk_rope_head_dim "
                         f"({qk_rope_head_dim}) that RoPE rotates in the index queries and keys")


# ----------------------------------------------------------------------------- the indexer


def index_query(ops: Ops, mla: MLAConfig, p: dict, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """Index queries [B, T, Hi, Di] from the query latent q_resid [B, T, q_lora_rank], RoPE'd by cos/sin
    [B, T, 1, R] (rotate-half layout, R = qk_rope_head_dim)."""
    q = ops.linear(q_resid, p["wq_b"]).unflatten(-1, (mla.index_n_heads, mla.index_head_dim))  # [B, T, Hi, Di]
    return apply_rope(q, cos, sin)


def index_key(ops: Ops, p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The index key [B, T, 1, Di] of the layer input x [B, T, H] (what the cache holds): ``wk``, LayerNorm,
    RoPE on the first R dims."""
    k = ops.linear(x, p["wk"])  # [B, T, Di]
    k = F.layer_norm(k, k.shape[-1:], p["k_norm"]["weight"], p["k_norm"].get("bias"), K_NORM_EPS)
    return apply_rope(k.unsqueeze(2), cos, sin)  # [B, T, 1, Di]


def head_weights(ops: Ops, mla: MLAConfig, p: dict, x: torch.Tensor) -> torch.Tensor:
    """Per-head weights [B, T, Hi] fp32 of the layer input x [B, T, H], times ``Hi ** -0.5``.

    In fp32 from an fp32 input, as transformers keeps ``weights_proj``
    (``_keep_in_fp32_modules``) whatever the model's dtype."""
    w = p["weights_proj"]
    y = ops.linear(x, w) if "qweight" in w else F.linear(x.float(), w["weight"].float())
    return y.float() * mla.index_n_heads ** -0.5


def select(ops: Ops, mla: MLAConfig, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
           visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions attention reads: ``idx``, ``valid`` [B, T, min(index_topk, T_read)] of index queries q
    [B, T, Hi, Di] with weights w [B, T, Hi] over index keys [B, T_read, Di] (already holding this step's),
    among visible [B, T, T_read]."""
    return ops.lightning_indexer(q, keys, w, visible, mla.index_topk, mla.index_head_dim ** -0.5)


def selected(idx: torch.Tensor, valid: torch.Tensor, t_read: int) -> torch.Tensor:
    """[B, T, T_read] bool: the positions ``idx`` [B, T, k] marks ``valid``, as a mask for dense attention."""
    mask = torch.zeros(idx.shape[:-1] + (t_read,), dtype=torch.bool, device=idx.device)  # [B, T, T_read]
    return mask.scatter(-1, idx, valid)


def sparse_visible(ops: Ops, mla: MLAConfig, p: dict, cache: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                   slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                   read: KVRead) -> torch.Tensor:
    """Attention's visibility [B, T, T_read] under DSA: ``visible`` cut to each query's selected positions.

    ``cache`` is this layer's index keys [S+1, 1, T_max, Di], already holding
    this step's (:func:`index_key`); x [B, T, H] is the layer's (normed) input
    and q_resid [B, T, q_lora_rank] its query latent. A read of at most
    ``index_topk`` positions keeps ``visible`` as it is, unscored.
    """
    picked = sparse_positions(ops, mla, p, cache, x, q_resid, slots, cos, sin, visible, read)
    return visible if picked is None else selected(*picked, visible.shape[-1])


def sparse_positions(ops: Ops, mla: MLAConfig, p: dict, cache: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                     slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                     read: KVRead) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The positions each query reads under DSA, ``idx``, ``valid`` [B, T, index_topk] (:func:`select`), or
    ``None`` when the read holds at most ``index_topk`` positions, which are all read (arguments as
    :func:`sparse_visible`)."""
    if mla.index_topk >= visible.shape[-1]:  # static: every visible position is among the top k
        return None
    keys = read_cache(cache.unsqueeze(0), 0, slots, read)[:, 0]  # [B, T_read, Di]
    q = index_query(ops, mla, p, q_resid, cos, sin)  # [B, T, Hi, Di]
    return select(ops, mla, q, head_weights(ops, mla, p, x), keys, visible)


def attend_selected(ops: Ops, mla: MLAConfig, q: torch.Tensor, latents: torch.Tensor, idx: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Latent attention [B, T, H, R] of q [B, T, H, R + rope] over only the positions idx [B, T, k] (where valid)
    of latents [B, 1, T_read, R + rope]: each query's selected latents are gathered and attended
    (:meth:`funcspec.kernels.Ops.sparse_attention`).

    NOTE: a static number of query rows a pass, so that the gathered
    latents and scores stay within :data:`GATHER_ELEMENTS`: a block of T
    tokens gathers T · k latents, at V3.2's k = 2048 and 576 dims 4.8 GB of
    fp32 a layer for a 1024-token prefill. Decode and verify blocks take one
    pass; a query's result does not depend on the rows beside it.
    """
    b, t, k = idx.shape
    d = latents.shape[-1]
    rows = max(1, GATHER_ELEMENTS // (k * (d + q.shape[2])))  # static: query rows a pass
    parts = []
    for r in range(0, t, rows):
        n = min(rows, t - r)
        picked = latents[:, 0].gather(1, idx[:, r:r + n].reshape(b, n * k, 1).expand(-1, -1, d))  # [B, n·k, D]
        parts.append(ops.sparse_attention(q[:, r:r + n], picked.view(b, n, k, d), valid[:, r:r + n],
                                          mla.kv_lora_rank, mla.softmax_scale))  # [B, n, H, R]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
