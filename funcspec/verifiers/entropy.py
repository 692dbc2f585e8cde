"""Entropy verification (vLLM-Ascend ``enable_entropy_verify``; lossy).

Standard rejection sampling with the uniform scaled down by an entropy-aware
threshold: accept iff ``q > 0`` and ``p/q >= thr·u``, where

    H   = -Σ_v p_raw(v) · log(p_raw(v) + 1e-10),  p_raw = softmax(raw fp32 logits)
    thr = min(exp(-posterior_alpha · H), posterior_threshold)

``p_raw`` is taken before temperature, top-k and top-p. An uncertain target
(high H) lowers the threshold and accepts more. Greedy rows are unchanged: their
ratio is 0 or 1, and ``thr·u < 1``. Uses stream 0 (u) and stream 1 (final race).
"""

from __future__ import annotations

import torch

from funcspec.verifiers import common

EPSILON = 1e-10
"""Inside the log, as in vLLM-Ascend, so zero-probability tokens add 0 to H."""


def threshold(cfg, target_logits: torch.Tensor) -> torch.Tensor:
    """thr [B, K] for the K draft positions of raw logits [B, K+1, V]."""
    raw = torch.softmax(target_logits[:, :-1].float(), dim=-1)  # [B, K, V]
    entropy = -(raw * torch.log(raw + EPSILON)).sum(dim=-1)  # [B, K]
    return torch.clamp(torch.exp(-cfg.posterior_alpha * entropy), max=cfg.posterior_threshold)


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Entropy verification with ``cfg.posterior_threshold`` and ``cfg.posterior_alpha``."""
    key = vin.key
    inp = common.prepare(vin.logits, vin.proposal, vin.sampling, key, cfg.filters)
    u = common.acceptance_uniforms(key, inp.drafts.shape[1])  # [B, K]
    thr = threshold(cfg, vin.logits)  # [B, K]
    return common.first_rejection(key, inp, inp.supported & (inp.ratio >= thr * u))
