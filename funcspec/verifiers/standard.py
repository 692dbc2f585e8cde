"""Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023; lossless).

For i = 0..K-1 in order, accept draft ``x_i`` iff ``q(x_i) > 0`` and
``p(x_i) / q(x_i) >= u_i``. The first rejection emits a recovered token from
``norm(max(0, p_i - q_i))``; if all K are accepted, the bonus comes from ``p_K``.
Uses stream 0 (u) and stream 1 (final race) of ``common``.
"""

from __future__ import annotations

import torch

from funcspec.types import Proposal, Sampling
from funcspec.verifiers import common


def verify(cfg, key: torch.Tensor, target_logits: torch.Tensor, proposal: Proposal,
           sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard rejection sampling; reads only ``cfg.filters``."""
    inp = common.prepare(target_logits, proposal, sampling, key, cfg.filters)
    u = common.acceptance_uniforms(key, inp.drafts.shape[1])  # [B, K]
    return common.first_rejection(key, inp, inp.supported & (inp.ratio >= u))
