"""Block verification (Sun et al. 2024, arXiv 2403.10444; lossless).

Verifies the K drafts jointly instead of stopping at the first failure.
1-indexed as in the paper, with ``P_i``/``Q_i`` the target/draft distributions
at draft position i (0-indexed position i-1):

    p_0 = 1,  p_i = min(1, p_{i-1} · P_i(x_i) / Q_i(x_i))
    h_i = Z_i / (Z_i + 1 - p_i),  Z_i = Σ_x max(0, p_i·P_{i+1}(x) - Q_{i+1}(x))   (i < K)
    h_K = p_K

``τ`` is the *last* i with ``u_i <= h_i`` (0 if none). Emit ``x_1..x_τ``, then
a token from ``norm(max(0, p_τ·P_{τ+1} - Q_{τ+1}))``, or from ``P_{K+1}`` if
``τ = K``. Expected accepted drafts are never below standard verification's.

A ``PLACEHOLDER`` at position i has ``Q_i = 0``, so ``p_i = 0`` and
``h_{i-1} = p_{i-1}``: the block is exactly Sun's algorithm with ``γ = i-1``.
Uses stream 0 (``u_i``) and stream 1 (final race) of ``common``.
"""

from __future__ import annotations

import torch

from funcspec.verifiers import common


def continue_probs(inp: common.Inputs, cum: torch.Tensor) -> torch.Tensor:
    """h [B, K] from the cumulative acceptance ``cum [B, K]`` = (p_1..p_K)."""
    k = cum.shape[1]
    w = cum[:, :-1]  # [B, K-1]  p_1..p_{K-1}
    pos = torch.arange(1, max(k, 1), device=cum.device).expand(cum.shape[0], -1)  # [B, K-1] positions 2..K (1-indexed)
    z = common.minus_q(inp, w.unsqueeze(-1) * inp.p[:, 1:k], pos).sum(dim=-1)  # [B, K-1]
    # NOTE: at p_i = 1 the formula is Z/Z (or 0/0 when Z = 0); h = 1 there, so
    # a fully accepted prefix is never cut short. For p_i < 1 the denominator
    # is at least 1 - p_i > 0.
    h = torch.where(w >= 1.0, 1.0, z / (z + 1.0 - w))  # [B, K-1]
    return torch.cat([h, cum[:, k - 1:]], dim=1)  # [B, K]


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Block verification; reads only ``cfg.filters``."""
    key = vin.key
    inp = common.prepare(vin.logits, vin.proposal, vin.sampling, key, cfg.filters)
    batch, k = inp.drafts.shape
    cum = common.cumulative_ratio(inp.ratio)  # [B, K]
    u = common.acceptance_uniforms(key, k)  # [B, K]
    tau = common.num_through_last(u <= continue_probs(inp, cum))  # [B]
    weight = torch.cat([cum.new_ones(batch, 1), cum], dim=1)  # [B, K+1]  p_0..p_K
    return common.finish(key, inp, tau, weight)
