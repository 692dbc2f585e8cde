"""Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023; lossless).

For i = 0..K-1 in order, accept draft ``x_i`` iff ``q(x_i) > 0`` and
``p(x_i) / q(x_i) >= u_i``. The first rejection emits a recovered token from
``norm(max(0, p_i - q_i))``; if all K are accepted, the bonus comes from ``p_K``.
Uses stream 0 (u) and stream 1 (final race) of ``common``.

Deterministic drafts (``proposal.probs is None``: q is one-hot) given with
``position_keys`` take the same rule with another coupling of its randomness:
draw ``y_i ~ p_i`` exactly as autoregressive decoding draws position i (its key,
its race), accept ``x_i`` iff ``x_i = y_i``, and emit ``y`` at the first
mismatch. ``P(accept) = p(x_i)`` as above, and ``y`` conditioned on ``y != x_i``
is the residual ``norm(max(0, p_i - q_i))``, so the law of the output (and of
the acceptance) is unchanged; but the emitted tokens are now *the* tokens that
autoregressive decoding with the same seed emits, token for token.
"""

from __future__ import annotations

from typing import Optional

import torch

from funcspec import sampling as sampling_lib
from funcspec.types import Proposal, Sampling
from funcspec.verifiers import common


def verify(cfg, key: torch.Tensor, target_logits: torch.Tensor, proposal: Proposal, sampling: Sampling,
           position_keys: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard rejection sampling; reads only ``cfg.filters``. ``position_keys`` [B, K+1]: the keys
    autoregressive decoding draws positions 0..K with (``step.row_keys``), for deterministic drafts."""
    if proposal.probs is None and position_keys is not None:
        return autoregressive_draws(cfg, position_keys, target_logits, proposal, sampling)
    inp = common.prepare(target_logits, proposal, sampling, key, cfg.filters)
    u = common.acceptance_uniforms(key, inp.drafts.shape[1])  # [B, K]
    return common.first_rejection(key, inp, inp.supported & (inp.ratio >= u))


def autoregressive_draws(cfg, position_keys: torch.Tensor, target_logits: torch.Tensor, proposal: Proposal,
                         sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic drafts against the target's own draws y [B, K+1], each made as autoregressive
    decoding makes it (``sampling.sample`` with that position's key; greedy rows take argmax)."""
    common.check_inputs(position_keys[:, 0], target_logits, proposal.tokens, proposal.probs)
    mode = sampling_lib.Mode(greedy=False, filters=cfg.filters)
    y = sampling_lib.sample(position_keys, target_logits, sampling.temperature, sampling.top_k, sampling.top_p,
                            mode)  # [B, K+1]
    return common.match(proposal.tokens, y)
