"""Logit processing and first-token sampling: distribution, masking, greedy rows."""

import numpy as np
import torch
from scipy import stats

from funcspec import rng, sampling
from funcspec.kernels.argmax import first_max


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


def test_first_max_is_torchs_argmax_eager_and_compiled():
    """The greedy argmax every greedy draw, draft and verification takes is torch's index, ties (the first), NaN
    (the first NaN), -inf rows, signed zeros, in bf16 and fp32, whether eager or compiled (two passes there)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4099, generator=g)  # [rows, V]: odd V, a partial last vector
    x[0, [7, 4000]] = 9.0  # a tie: the first
    x[1, [3, 2000]] = float("nan")  # NaN wins, the first one
    x[2] = float("-inf")  # nothing finite: index 0
    x[3] = 0.0
    x[3, 5] = -0.0  # zeros of both signs tie
    x[4, 4098] = 50.0  # the last index
    x[5, :] = 1.0  # all equal
    x[6, 10] = float("inf")
    compiled = torch.compile(lambda a, b: (first_max(a), first_max(b)), backend="inductor", fullgraph=True)
    for got in (first_max(x), first_max(x.bfloat16()), *compiled(x, x.bfloat16())):
        assert got.dtype == torch.int64 and got.shape == (9,)
    for want, got in zip((x.argmax(-1), x.bfloat16().argmax(-1)), compiled(x, x.bfloat16())):
        assert torch.equal(got, want), (got, want)
    assert x.argmax(-1)[:7].tolist() == [7, 3, 0, 0, 4098, 0, 10]
