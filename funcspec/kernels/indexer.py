"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer scores every cached position and keeps the
top-k; attention then reads only those positions' latents (:func:`sparse_attention`).

For a query token with per-head index queries ``q`` [Hi, Di] and head weights
``w`` [Hi], cached position ``j`` with index key ``k_j`` [Di] scores
``sum_h w_h · relu(scale · q_h · k_j)``, and attention reads only the
``topk`` best-scoring positions among those the query may see. This module is
that scoring and selection, the part an accelerator replaces with one kernel
(Ascend: ``torch_npu``'s ``npu_lightning_indexer``, which vLLM-Ascend calls);
:func:`reference` is its math in torch, what :meth:`funcspec.kernels.Ops.lightning_indexer`
runs here. The projections that make q, k and w are the model's
(:mod:`funcspec.nn.dsa`).

Shapes are static: ``topk`` and the read length are Python ints, so a
bucket's graph selects ``min(topk, T_read)`` positions whatever the lengths.
Ties are broken by position, the earlier one first (:func:`order_keys`), so the
selection depends neither on the bucket's read length nor on the top-k
kernel's algorithm: AR and verification in different context buckets select
alike.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 24
"""Most fp32 per-head scores one pass materialises (64 MiB): longer blocks (a long prefill) are scored in
chunks of query rows, each of ``SCORE_ELEMENTS // (Hi · T_read)`` rows."""


def scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Index scores [B, T, T_read] fp32 of queries q [B, T, Hi, Di] over keys [B, T_read, Di], with head weights
    [B, T, Hi] (any scale folded in), ``-inf`` where not visible [B, T, T_read].

    In transformers' order: ``relu((q · k) · scale)`` per head, then the heads'
    weighted sum as one product, all in fp32.
    """
    t, hi, tr = q.shape[1], q.shape[2], keys.shape[1]
    rows = max(1, SCORE_ELEMENTS // (hi * tr))  # static: query rows per pass
    kt = keys.float().transpose(1, 2)  # [B, Di, T_read]
    parts = []
    for r in range(0, t, rows):
        qr = q[:, r:r + rows].float()  # [B, t', Hi, Di]
        # NOTE: one GEMM of the block's t'·Hi queries: a [B, t', Hi, Di] @ [B, 1, Di, T_read] product broadcast
        # the keys per query token, which made a verify block's scoring several times a decode step's
        s = torch.relu(torch.matmul(qr.flatten(1, 2), kt) * scale).unflatten(1, qr.shape[1:3])  # [B, t', Hi, T_read]
        parts.append(torch.matmul(weights[:, r:r + rows].float().unsqueeze(-2), s).squeeze(-2))  # [B, t', T_read]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, T, T_read]
    return out.masked_fill(~visible, float("-inf"))


def order_keys(s: torch.Tensor) -> torch.Tensor:
    """int64 keys [..., N] that order the fp32 scores s [..., N] as their values do, ties by position (the
    earlier first), every key distinct: the top-k of the keys is one set whatever the algorithm.

    The fp32 bits as an int32 that orders like the float (negatives' magnitude
    bits flipped; -0.0 first made +0.0), shifted above the reversed position.
    """
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 == +0.0: one key
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # [..., N]
    pos = torch.arange(s.shape[-1], device=s.device)  # [N]
    return ordered * (1 << 32) + ((1 << 31) - 1 - pos)


def top_positions(s: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(topk, T_read)`` best positions of scores s [B, T, T_read]: ``idx`` [B, T, k] int64 and ``valid``
    [B, T, k] bool (a row that sees fewer than k positions fills the rest with positions it may not read)."""
    k = min(topk, s.shape[-1])  # static
    idx = order_keys(s).topk(k, dim=-1).indices  # [B, T, k]
    return idx, visible.gather(-1, idx)


def reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor, topk: int,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k positions (``idx``, ``valid`` [B, T, min(topk, T_read)]) of queries q [B, T, Hi, Di] over keys
    [B, T_read, Di] with head weights [B, T, Hi] where visible [B, T, T_read]: :func:`scores`, then
    :func:`top_positions`."""
    return top_positions(scores(q, keys, weights, visible, scale), visible, topk)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, r: int, scale: float) -> torch.Tensor:
    """Latent attention of q [B, T, H, D] over each query token's own selected latents keys [B, T, k, D] (their
    first ``r`` dims are the values) where valid [B, T, k]; -> [B, T, H, r]. Scores and softmax in fp32."""
    s = torch.einsum("bthd,btkd->bthk", q.float(), keys.float()) * scale  # [B, T, H, k]
    # NOTE: a finite floor, not -inf: a padding row that sees nothing stays finite.
    p = s.masked_fill(~valid.unsqueeze(2), torch.finfo(torch.float32).min).softmax(-1)
    return torch.einsum("bthk,btkr->bthr", p.to(keys.dtype), keys[..., :r]).to(q.dtype)  # [B, T, H, r]
