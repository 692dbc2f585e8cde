"""Confidence-based verify length (vLLM-Ascend ``DynamicSpecScheduler``; DSpark / DFlash).

Each step every row drafts K tokens with a per-token confidence ``t [B, K]``
(DSpark: its confidence head; DFlash: ``max softmax``). Then::

    s = cumprod(t, 1)                                  survival [B, K], non-increasing in a row
    every interval steps (host):  k = ceil(#(s >= threshold) / B); k even and < K -> k+1
                                  budget_k = clamp(k, min_k, K)
    every step (in the graph):    each row gets min_k; the B·(budget_k - min_k) largest
                                  entries of s[:, min_k:] add one token each to their row

A row's survival is non-increasing, so its winners are always its leading
columns, and the result is a verify *length*: the step masks drafts at
positions >= ``verify_len`` to ``PLACEHOLDER`` (``step.mask_beyond``), which every
verifier rejects, emitting a token from the target there. Verification stays
lossless; a row emits at most ``verify_len + 1`` tokens.

:func:`allocate` is the in-graph half (no host sync; ``budget_k`` is a tensor so a
new budget never recompiles); :class:`ConfidenceScheduler` is the host half.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # an annotation only: config parses user input, above the step
    from funcspec.config import DynamicSpecConfig


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """Prefix survival [B, K] = ``cumprod(clamp(t, 1e-6, 1), 1)`` of token confidences t [B, K]."""
    return torch.cumprod(confidence.float().clamp(1e-6, 1.0), dim=1)


def allocate(survival: torch.Tensor, budget_k, min_k: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-row verify lengths [B] int64 from survival [B, K] (pure, graph-capturable).

    Args:
        survival: [B, K] prefix survival probabilities.
        budget_k: the per-request budget, an int or an int64 tensor [] (an input,
            so a new budget reuses the captured graph).
        min_k: static minimum per row (clamped to K).
        valid: [B] bool, False on padding rows: they never win budget, count
            toward the total, or verify anything (length 0).

    Returns:
        verify_len [B] in [min_k, K] on valid rows.
    """
    b, max_k = survival.shape
    min_k = min(min_k, max_k)
    valid = torch.ones(b, dtype=torch.bool, device=survival.device) if valid is None else valid
    base = torch.where(valid, min_k, 0).to(torch.int64)  # [B]
    if max_k == min_k:
        return base
    # NOTE: survival >= 0, so -1 puts padding rows after every real candidate.
    cand = torch.where(valid.view(-1, 1), survival[:, min_k:].float(), -1.0).reshape(-1)  # [B·(K-min_k)]
    # NOTE: a full stable sort rather than topk(k) keeps k static and breaks ties
    # by (row, column) order; the winners are the first n_valid·extra entries.
    order = torch.sort(cand, descending=True, stable=True).indices
    extra = (torch.as_tensor(budget_k, device=survival.device) - min_k).clamp(min=0)
    wins = torch.arange(order.shape[0], device=survival.device) < valid.sum() * extra  # [B·(K-min_k)]
    base = base.scatter_add(0, torch.div(order, max_k - min_k, rounding_mode="floor"), wins.to(torch.int64))
    return torch.where(valid, base.clamp(min_k, max_k), 0)


def initial_budget(cfg: DynamicSpecConfig, max_k: int) -> int:
    """``max(min_k, min(initial_verify_budget_per_req, K))``."""
    return max(min(cfg.min_verify_tokens, max_k), min(cfg.initial_verify_budget_per_req, max_k))


def next_budget(survival_rows, threshold: float, min_k: int, max_k: int) -> Optional[int]:
    """The budget from survival rows [n, K] of the real requests (host); ``None`` when n = 0."""
    s = torch.as_tensor(survival_rows, dtype=torch.float32)
    if s.numel() == 0:
        return None
    k = math.ceil(int((s >= threshold).sum()) / s.shape[0])
    if k % 2 == 0 and k < max_k:
        # vLLM-Ascend: an odd K gives an even verify width (K + 1), which its kernels run faster.
        k += 1
    return max(min(min_k, max_k), min(k, max_k))


class ConfidenceScheduler:
    """Host side of the confidence-based verify length: holds ``budget_k``.

    Args:
        cfg: the parsed ``dynamic_spec_config``.
        num_speculative_tokens: the drafts per row, K (``max_k``).

    Call :meth:`observe` once per decoding step with that step's confidences;
    every ``budget_update_interval``-th call recomputes ``budget_k`` (as
    vLLM-Ascend's counter does). The engine feeds ``budget_k`` to the next step's
    graph as a tensor input.
    """

    def __init__(self, cfg: DynamicSpecConfig, num_speculative_tokens: int):
        self.cfg, self.max_k = cfg, num_speculative_tokens
        self.min_k = min(cfg.min_verify_tokens, num_speculative_tokens)
        self.budget_k = initial_budget(cfg, num_speculative_tokens)

    def observe(self, step: int, confidence_rows) -> int:
        """Record step ``step`` (0-based); ``confidence_rows`` [n_real, K] floats of the real rows.

        NOTE: funcspec reads confidences after the step, so a new budget applies
        from the next step; vLLM-Ascend applies it within the step it is computed in.
        """
        if (step + 1) % self.cfg.budget_update_interval == 0:
            rows = torch.as_tensor(confidence_rows, dtype=torch.float32)
            if rows.numel():
                k = next_budget(survival(rows), self.cfg.budget_threshold, self.min_k, self.max_k)
                self.budget_k = self.budget_k if k is None else k
        return self.budget_k

    def budget_tensor(self, device=None) -> torch.Tensor:
        """``budget_k`` as the int64 [] graph input."""
        return torch.tensor(self.budget_k, dtype=torch.int64, device=device)
