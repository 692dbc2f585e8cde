"""Greedy verification (lossless for greedy decoding).

Accept drafts while ``draft == argmax p``. The first mismatch emits the target
argmax there; if all K match, the bonus is the argmax at position K. Every row
is treated as greedy, whatever its sampling settings. Draws no randomness.
"""

from __future__ import annotations

import torch

from funcspec.types import Proposal, Sampling
from funcspec.verifiers import common


def verify(cfg, key: torch.Tensor, target_logits: torch.Tensor, proposal: Proposal,
           sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification; ``cfg``, ``key`` and ``sampling`` are unused."""
    common.check_inputs(key, target_logits, proposal.tokens, proposal.probs)
    # NOTE: argmax takes the first index on ties, the same rule as target_probs'
    # one-hot at temperature 0 and greedy autoregressive decoding. O(K·V): no
    # probabilities.
    return common.match(proposal.tokens, target_logits.argmax(dim=-1))  # [B, K+1]
