"""Statistical tests: losslessness of standard and block verification, acceptance rates.

Construction for the distribution tests. The target logits are the same for
every row and do not depend on the prefix, so the target's distribution over the
first two tokens is ``p0 ⊗ p1`` (p = ``target_probs`` at positions 0 and 1).
Drafts are sampled from q (also prefix-independent). A verify step emits 1..K+1
tokens; when it emits only one, the second token is what the *next* step would
emit first, which the marginal test shows is a draw from the target at that
position, so it is drawn from ``p1`` with an independent key. The joint of
(token 0, token 1) must then be ``p0 ⊗ p1`` exactly for a lossless rule.
"""

from __future__ import annotations

import pytest
import torch

import funcspec.verifiers as verifiers
from funcspec import rng
from funcspec.sampling import sample, target_probs
from funcspec.types import Proposal, Sampling
from funcspec.verifiers import common, standard

from chi_square import chi2_pvalue

N = 30000
ALPHA = 1e-4
K = 3
SEED_WEIGHT = 1  # a case where p_τ < 1 at τ < K is common (not every seed has one)


def make_case(seed: int, vocab: int, n: int = N, k: int = K):
    """Shared target logits [N, K+1, V] with zeros (top-k), draft q [N, K, V] and drafts [N, K] ~ q."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(k + 1, vocab, generator=gen) * 1.5
    logits = base.expand(n, k + 1, vocab)
    q_logits = base[:k] + torch.randn(k, vocab, generator=gen)  # a draft that roughly agrees with p
    q_logits[:, torch.randperm(vocab, generator=gen)[:2]] = float("-inf")  # q misses some tokens p has
    q = torch.softmax(q_logits, -1)  # [K, V]
    # the test's own draws may use torch's RNG; only the verifiers must use funcspec.rng
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [N, K]
    return logits, q.expand(n, k, vocab), drafts


def emitted_pairs(method: str, seed: int, vocab: int, with_probs: bool, top_k: int, n: int = N, k: int = K):
    """(tokens, num_emitted, p [K+1, V], pair [N, 2]) for one run of ``method``."""
    logits, q, drafts = make_case(seed, vocab, n, k)
    tokens, num = verifiers.rejection_sample(rng.key(seed), logits, drafts, q if with_probs else None,
                                             method=method, temperature=0.9, top_k=top_k)
    p = target_probs(logits[:1], 0.9, top_k)[0]  # [K+1, V]
    # the next step's first token where this step emitted only one
    fresh = torch.multinomial(p[1], n, replacement=True, generator=torch.Generator().manual_seed(seed))  # [N]
    second = torch.where(num >= 2, tokens[:, 1], fresh)
    return tokens, num, p, torch.stack([tokens[:, 0], second], 1)


def joint_pvalue(pair: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of the (token 0, token 1) pairs [N, 2] against p0 ⊗ p1."""
    vocab = p.shape[-1]
    joint = torch.bincount(pair[:, 0] * vocab + pair[:, 1], minlength=vocab * vocab)
    return chi2_pvalue(joint, torch.outer(p[0], p[1]))


def assert_in_support(tokens: torch.Tensor, num: torch.Tensor, p: torch.Tensor):
    """Every emitted token has positive target probability at its position."""
    pos = torch.arange(tokens.shape[1])
    emitted = pos < num.long().unsqueeze(1)  # [N, K+1]
    prob = p[pos, tokens.clamp(min=0)]  # [N, K+1]
    assert (prob[emitted] > 0).all()


@pytest.mark.parametrize("with_probs", [True, False], ids=["q", "onehot"])
@pytest.mark.parametrize("vocab", [8, 16])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_lossless_marginal_and_joint(method, vocab, with_probs):
    tokens, num, p, pair = emitted_pairs(method, seed=vocab, vocab=vocab, with_probs=with_probs, top_k=vocab - 3)
    assert (p == 0).sum() >= 3 * (K + 1)  # top-k made zeros the drafts do propose
    assert_in_support(tokens, num, p)
    marginal = torch.bincount(tokens[:, 0], minlength=vocab)
    assert chi2_pvalue(marginal, p[0]) > ALPHA
    assert joint_pvalue(pair, p) > ALPHA
    assert (num >= 2).float().mean() > 0.15  # many rows emit token 1 themselves: the joint is not trivial


def autoregressive_keyed(seed: int, vocab: int, top_k: int, n: int = N, k: int = K):
    """Standard verification of deterministic drafts [N, K] with per-position keys [N, K+1]: (tokens, num,
    p, pair, keys, logits), as ``emitted_pairs``."""
    logits, _, drafts = make_case(seed, vocab, n, k)
    keys = rng.split(rng.key(seed), n * (k + 1)).view(n, k + 1)  # [N, K+1]: AR's key at each position
    cfg = verifiers.VerifyConfig("standard")
    sampling = Sampling.full(n, temperature=0.9, top_k=top_k)
    block = verifiers.VerifyInput(rng.split(rng.key(seed + 1), n), logits, Proposal.chain(drafts), sampling, keys)
    tokens, num, path = standard.verify(cfg, block)
    assert path.tolist() == [list(range(k + 1))] * n  # a chain's accepted path is its first positions
    p = target_probs(logits[:1], 0.9, top_k)[0]  # [K+1, V]
    fresh = torch.multinomial(p[1], n, replacement=True, generator=torch.Generator().manual_seed(seed))  # [N]
    second = torch.where(num >= 2, tokens[:, 1], fresh)
    return tokens, num, p, torch.stack([tokens[:, 0], second], 1), keys, logits, sampling


@pytest.mark.parametrize("vocab", [8, 16])
def test_deterministic_drafts_drawn_as_decoding_draws_are_lossless_and_accept_as_often(vocab):
    """Drafts checked against the target's own keyed draws: the law of standard rejection sampling (chi-square),
    its acceptance (paired with the uniform rule on the same drafts), and each emitted token is the draw that
    decoding without speculation makes at its position with its key."""
    tokens, num, p, pair, keys, logits, sampling = autoregressive_keyed(vocab, vocab, top_k=vocab - 3)
    assert_in_support(tokens, num, p)
    assert chi2_pvalue(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > ALPHA
    assert joint_pvalue(pair, p) > ALPHA
    _, uniform_num, *_ = emitted_pairs("standard", seed=vocab, vocab=vocab, with_probs=False, top_k=vocab - 3)
    diff = num.double().mean() - uniform_num.double().mean()
    se = (num.double().var() / N + uniform_num.double().var() / N) ** 0.5
    assert abs(diff) < 4 * se, (diff, se)
    draws = sample(keys, logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [N, K+1] decoding's draws
    emitted = torch.arange(K + 1) < num.long().unsqueeze(1)
    assert torch.equal(tokens[emitted], draws[emitted])


def broken_residual_from_p(inp, p_row, pos, weight):
    """Recovered token from p instead of max(0, p - q): biased towards draft-heavy tokens."""
    return p_row


@pytest.mark.parametrize("method", ["standard", "block"])
def test_chi_square_rejects_a_broken_verifier(monkeypatch, method):
    """The same statistic detects a verifier that draws the recovered token from p."""
    monkeypatch.setattr(common, "residual", broken_residual_from_p)
    tokens, _, p, _ = emitted_pairs(method, seed=8, vocab=8, with_probs=True, top_k=5)
    assert chi2_pvalue(torch.bincount(tokens[:, 0], minlength=8), p[0]) < ALPHA


def test_block_residual_needs_the_block_weight(monkeypatch):
    """Block verification with standard's residual (``p_τ`` ignored) fails the joint test."""
    real = common.residual
    monkeypatch.setattr(common, "residual", lambda inp, p, pos, w: real(inp, p, pos, torch.ones_like(w)))
    _, _, p, pair = emitted_pairs("block", seed=SEED_WEIGHT, vocab=6, with_probs=True, top_k=0, k=2)
    assert joint_pvalue(pair, p) < ALPHA


def toy_case(n: int):
    """Sun et al.'s example: P = [1/3, 2/3], Q = [2/3, 1/3] at every position, γ = 2."""
    big_p = torch.tensor([1 / 3, 2 / 3])
    big_q = torch.tensor([2 / 3, 1 / 3])
    logits = big_p.log().expand(n, 3, 2)
    q = big_q.expand(n, 2, 2)
    drafts = torch.multinomial(big_q, 2 * n, replacement=True, generator=torch.Generator().manual_seed(77))
    return logits, q, drafts.view(n, 2)


def test_block_beats_standard_on_suns_toy_case():
    logits, q, drafts = toy_case(100000)
    mean = {}
    for method in ("standard", "block"):
        _, num = verifiers.rejection_sample(rng.key(5), logits, drafts, q, method=method)
        mean[method] = (num - 1).double().mean().item()
    assert mean["standard"] == pytest.approx(10 / 9, abs=0.01)
    assert mean["block"] == pytest.approx(11 / 9, abs=0.01)


def test_block_never_worse_than_standard():
    gains = []
    for seed in range(3):
        vocab = 6 + 3 * seed
        logits, q, drafts = make_case(100 + seed, vocab, n=10000, k=4)
        _, std = verifiers.rejection_sample(rng.key(seed), logits, drafts, q, method="standard")
        _, blk = verifiers.rejection_sample(rng.key(seed), logits, drafts, q, method="block")
        diff = (blk - std).double()  # paired: same drafts and uniforms
        se = diff.std().item() / diff.numel() ** 0.5
        assert diff.mean().item() > -3 * se, (seed, diff.mean().item(), se)
        gains.append(diff.mean().item())
    assert sum(gains) > 0.05


RATES = (0.9, 0.7, 0.4, 0.1)


def test_synthetic_per_position_acceptance():
    n, k, vocab = 60000, len(RATES), 4
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, k + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    temp = torch.where(torch.arange(n) % 4 == 0, 0.0, 1.0)  # greedy rows too: acceptance ignores the target
    tokens, num = verifiers.rejection_sample(rng.key(2), logits, drafts, method="synthetic", temperature=temp,
                                             synthetic_acceptance_rates=RATES)
    accepted = (num - 1).long()
    for i, rate in enumerate(RATES):
        assert (accepted > i).double().mean().item() == pytest.approx(rate, abs=1e-2)
    # rates ending in zero: nothing is ever accepted past them
    _, num = verifiers.rejection_sample(rng.key(2), logits[:5000], drafts[:5000], method="synthetic",
                                        synthetic_acceptance_rates=(1.0, 0.5, 0.0, 0.0))
    assert set(num.tolist()) == {2, 3}


def test_synthetic_acceptance_length():
    n, k, vocab = 50000, 5, 2
    logits = torch.randn(n, k + 1, vocab)
    drafts = torch.randint(0, vocab, (n, k))
    _, num = verifiers.rejection_sample(rng.key(4), logits, drafts, method="synthetic",
                                        synthetic_acceptance_length=3.4)
    assert set(num.tolist()) == {3, 4}  # rates (1, 1, 0.4, 0, 0)
    assert num.double().mean().item() == pytest.approx(3.4, abs=1e-2)
