"""Logit processing and first-token sampling: distribution, masking, greedy rows."""

import numpy as np
import torch
from scipy import stats

from funcspec import rng, sampling


def _probs_reference(logits, t, k, p):
    """Straightforward per-row reference of temperature -> top-k -> top-p."""
    x = logits / t
    if k > 0:
        kth = torch.topk(x, k).values[-1]
        x = torch.where(x < kth, float("-inf"), x)
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    keep, mass = [], 0.0
    for i in order.tolist():
        if mass >= p:
            break
        keep.append(i)
        mass += float(probs[i])
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def test_processed_probs_match_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g) * 2
    t = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    k = torch.tensor([0, 5, 0, 3, 10, 1])
    p = torch.tensor([1.0, 1.0, 0.8, 0.5, 0.9, 1.0])
    got = sampling.target_probs(logits, t, k, p)
    for i in range(6):
        ref = _probs_reference(logits[i], float(t[i]), int(k[i]), float(p[i]))
        assert torch.allclose(got[i], ref, atol=1e-6), i


def test_temperature_zero_rows_are_greedy_one_hot():
    logits = torch.tensor([[0.1, 3.0, 2.9], [1.0, 1.0, 0.0]])
    probs = sampling.target_probs(logits, torch.tensor([0.0, 0.0]), 0, 1.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # ties take the first index


def test_first_token_distribution_chi_square_and_masking():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, generator=g) * 1.5
    n = 30_000
    keys = rng.split(rng.key(9), n)  # one seed per row
    draws = sampling.sample(keys, logits.expand(n, -1), 1.0, torch.full((n,), 6), torch.full((n,), 0.9))
    target = _probs_reference(logits, 1.0, 6, 0.9)
    counts = torch.bincount(draws, minlength=16).numpy()
    assert np.all(counts[target.numpy() == 0] == 0), "masked tokens must never appear"
    live = target.numpy() > 0
    assert stats.chisquare(counts[live], target.numpy()[live] * n).pvalue > 1e-4
