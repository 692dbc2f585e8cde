"""The chi-square goodness-of-fit helper of the distribution tests (verifiers, token trees)."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test of counts against ``probs`` (flattened).

    Cells of probability 0 must be empty (asserted) and are dropped; cells with
    expected count below 5 are pooled so the chi-square approximation holds.
    """
    observed = observed.flatten().double().numpy()
    probs = probs.flatten().double().numpy()
    assert observed[probs == 0].sum() == 0, "a zero-probability token was emitted"
    observed, probs = observed[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * observed.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(observed, expected).pvalue)
