"""Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023; lossless).

For i = 0..K-1 in order, accept draft ``x_i`` iff ``q(x_i) > 0`` and
``p(x_i) / q(x_i) >= u_i``. The first rejection emits a recovered token from
``norm(max(0, p_i - q_i))``; if all K are accepted, the bonus comes from ``p_K``.
Uses stream 0 (u) and stream 1 (final race) of ``common``.

Deterministic drafts (``proposal.probs is None``: q is one-hot) given with
decoding's keys (``VerifyInput.keys``) take the same rule with another coupling of its randomness:
draw ``y_i ~ p_i`` exactly as autoregressive decoding draws position i (its key,
its race), accept ``x_i`` iff ``x_i = y_i``, and emit ``y`` at the first
mismatch. ``P(accept) = p(x_i)`` as above, and ``y`` conditioned on ``y != x_i``
is the residual ``norm(max(0, p_i - q_i))``, so the law of the output (and of
the acceptance) is unchanged; but the emitted tokens are now *the* tokens that
autoregressive decoding with the same seed emits, token for token. A block of
no drafts (K = 0) is decoding itself: its one token is decoding's draw.
"""

from __future__ import annotations

from funcspec import sampling as sampling_lib
from funcspec.verifiers import common


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Standard rejection sampling; reads only ``cfg.filters``. With ``vin.keys`` (decoding's key at
    each position), deterministic drafts and empty blocks take :func:`autoregressive_draws`."""
    proposal = vin.proposal
    if vin.keys is not None and (proposal.probs is None or proposal.tokens.shape[1] == 0):  # static
        return autoregressive_draws(cfg, vin)
    inp = common.prepare(vin.logits, proposal, vin.sampling, vin.key, cfg.filters)
    u = common.acceptance_uniforms(vin.key, inp.drafts.shape[1])  # [B, K]
    return common.first_rejection(vin.key, inp, inp.supported & (inp.ratio >= u))


def autoregressive_draws(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Deterministic drafts against the target's own draws y [B, K+1], each made as autoregressive
    decoding makes it (``sampling.sample`` with that position's key; greedy rows take argmax)."""
    s, keys = vin.sampling, vin.keys
    common.check_inputs(keys[:, 0], vin.logits, vin.proposal.tokens, vin.proposal.probs)  # type: ignore[index]  # sampled: keys
    mode = sampling_lib.Mode(greedy=False, filters=cfg.filters)
    y = sampling_lib.sample(keys, vin.logits, s.temperature, s.top_k, s.top_p, mode)  # type: ignore[arg-type]  # [B, K+1]
    return common.match(vin.proposal.tokens, y)
