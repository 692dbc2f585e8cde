"""Greedy verification (lossless for greedy decoding).

Accept drafts while ``draft == argmax p``. The first mismatch emits the target
argmax there; if all K match, the bonus is the argmax at position K. Every row
is treated as greedy, whatever its sampling settings. Draws no randomness.
"""

from __future__ import annotations

from funcspec.kernels.argmax import first_max
from funcspec.verifiers import common


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Greedy verification; reads only the logits and the drafts."""
    common.check_inputs(vin.key, vin.logits, vin.proposal.tokens, vin.proposal.probs)
    # NOTE: argmax takes the first index on ties, the same rule as target_probs'
    # one-hot at temperature 0 and greedy autoregressive decoding. O(K·V): no
    # probabilities.
    return common.match(vin.proposal.tokens, first_max(vin.logits))  # [B, K+1]
