"""Synthetic acceptance (vLLM ``rejection_sample_method="synthetic"``; lossy).

Each draft is accepted with a configured probability, whatever the target says,
so the pipeline can be driven at a known acceptance rate for benchmarks. The
unconditional rate of reaching position ``i`` is ``r_i``; position ``i`` is
accepted with the conditional rate ``c_i = r_i / r_{i-1}`` (``r_{-1} = 1``,
``c_i = 0`` once a rate is 0), so ``P(num_accepted > i) = r_i``.

Accept draft ``i`` iff ``u_i < c_i`` and it is not ``PLACEHOLDER``. The first
rejection emits the recovered token (on greedy rows: the target argmax); if all
K are accepted the bonus token is emitted. When every row is greedy
(``cfg.greedy``) that final token is the argmax at its position, so no
probabilities are built.

The pure-Python helpers :func:`check_rates`, :func:`rates_from_length` and
:func:`validate_synthetic` are the one validation of synthetic rates: config,
``VerifyConfig`` and the engine call them (config adds its field path).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from funcspec.kernels.argmax import first_max
from funcspec.verifiers import common


def _is_real(value) -> bool:
    """True for a real number that is not a bool (``True`` is not a rate)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def rates_from_length(length: float, k: int) -> tuple[float, ...]:
    """Per-position acceptance rates [K] that give mean acceptance length ``length``.

    With ``d = length - 1`` accepted drafts on average and ``n = floor(d)``, the
    rates are ``[1]*n + [d-n] + [0]*(k-n-1)``, truncated to ``k``: for
    ``length=3.4, k=5`` that is ``(1, 1, 0.4, 0, 0)`` (up to float rounding).
    """
    if not _is_real(length):
        raise ValueError(f"synthetic_acceptance_length must be a number, got {length!r}")
    length = float(length)
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be in [1, K+1] = [1, {k + 1}], got {length}")
    d = length - 1.0
    n = math.floor(d)
    rates = [1.0] * n + [d - n] + [0.0] * (k - n - 1)
    return tuple(rates[:k])


def check_rates(rates, k: int | None = None, name: str = "synthetic_acceptance_rates") -> tuple[float, ...]:
    """``rates``, a list of numbers, as floats each in [0, 1] and non-increasing (length ``k`` if given).

    The one check of synthetic rates: ``funcspec.config``, ``VerifyConfig``,
    ``rejection_sample`` and ``Engine.set_synthetic_acceptance_rates`` all call
    it. Errors name the field ``name`` (``VerifyConfig`` calls it ``synthetic_rates``).
    """
    # float() alone would accept strings and bools, and a set has no positions.
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence) or not all(_is_real(r) for r in rates):
        raise ValueError(f"{name} must be a list of numbers, got {rates!r}")
    rates = tuple(float(r) for r in rates)
    if k is not None and len(rates) != k:
        raise ValueError(f"{name} must have length K={k}, got {len(rates)}")
    for i, r in enumerate(rates):
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"{name}[{i}] must be in [0, 1], got {r}")
    for i in range(1, len(rates)):
        if rates[i] > rates[i - 1]:
            raise ValueError(f"{name} must be non-increasing, got {rates[i]} after {rates[i - 1]} at index {i}")
    return rates


def validate_synthetic(rates, length, k: int) -> tuple[float, ...]:
    """The validated rates [K] from exactly one of ``rates`` or ``length``.

    Raises:
        ValueError: naming ``synthetic_acceptance_rates`` or
            ``synthetic_acceptance_length`` when both or neither are given,
            they are not numbers, a rate is outside [0, 1], the rates
            increase, their count is not K, or the length is outside [1, K+1].
    """
    if (rates is None) == (length is None):
        raise ValueError(
            "exactly one of synthetic_acceptance_rates or synthetic_acceptance_length must be given, "
            f"got synthetic_acceptance_rates={rates!r} and synthetic_acceptance_length={length!r}"
        )
    if rates is not None:
        return check_rates(rates, k)
    return rates_from_length(length, k)


def conditional_rates(rates: tuple[float, ...]) -> tuple[float, ...]:
    """``c_i = r_i / r_{i-1}`` with ``r_{-1} = 1``; 0 after a zero rate."""
    prev = (1.0,) + rates[:-1]
    return tuple(r / p if p > 0 else 0.0 for r, p in zip(rates, prev))


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Synthetic verification. Uses stream 0 (u) and 1 (final race).

    The conditional rates are ``vin.rates`` [K] float32, a runtime tensor (the
    engine passes its current rates, so one graph serves any rates); else ``cfg.synthetic_rates``.
    """
    key, cond = vin.key, vin.rates
    k = vin.proposal.tokens.shape[1]
    if cond is None:
        if cfg.synthetic_rates is None:
            raise ValueError("synthetic_rates must be set for method 'synthetic'")
        cond = conditional_tensor(check_rates(cfg.synthetic_rates, k, "synthetic_rates"), vin.logits.device)
    if cfg.greedy:
        # NOTE: every row greedy: the general rule's final token is the argmax there (its one-hot p leaves a
        # residual at the argmax, or none, and then p itself); only that row's argmax is taken.
        common.check_inputs(key, vin.logits, vin.proposal.tokens, vin.proposal.probs)
        drafts = vin.proposal.tokens.long()  # [B, K]
        passed = common.acceptance_uniforms(key, k) < cond  # [B, K]
        num_accepted = common.num_leading(passed & (drafts != common.PLACEHOLDER))  # [B]
        rows = torch.arange(drafts.shape[0], device=drafts.device)  # [B]
        final = first_max(vin.logits[rows, num_accepted])  # [B]
        return common.along_chain(*common.emit(drafts, num_accepted, final))
    inp = common.prepare(vin.logits, vin.proposal, vin.sampling, key, cfg.filters)
    u = common.acceptance_uniforms(key, k)  # [B, K]
    return common.first_rejection(key, inp, inp.valid & (u < cond))


def conditional_tensor(rates: tuple[float, ...], device=None) -> torch.Tensor:
    """The conditional rates [K] as float32, so comparing with float32 uniforms is the same on every backend."""
    return torch.tensor(conditional_rates(rates), dtype=torch.float32, device=device)
