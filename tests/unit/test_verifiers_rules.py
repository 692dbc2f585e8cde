"""Exact behaviour of the verifiers: hand tables, sentinels, mixed batches, K=0, config errors."""

from __future__ import annotations

import math

import pytest
import torch

import funcspec.verifiers as verifiers
from funcspec import rng
from funcspec.sampling import target_probs
from funcspec.types import PLACEHOLDER, Proposal, Sampling
from funcspec.verifiers import common, entropy, synthetic

P = PLACEHOLDER
SAMPLED = ("standard", "block", "magicmtp", "entropy")
"""Rules that reduce to greedy verification on temperature-0 rows."""


def peaked_logits(argmax: list[int], vocab: int = 8, batch: int = 1) -> torch.Tensor:
    """Logits [batch, len(argmax), V] whose position i peaks at ``argmax[i]``."""
    logits = torch.zeros(batch, len(argmax), vocab)
    logits[:, torch.arange(len(argmax)), torch.tensor(argmax)] = 4.0
    return logits


# drafts, expected tokens, expected num_emitted; the target argmax is [1, 2, 3, 4]
GREEDY_TABLE = [
    ([1, 2, 3], [1, 2, 3, 4], 4),  # all accepted: bonus argmax
    ([1, 5, 3], [1, 2, P, P], 2),  # mismatch at 1: target argmax there, then PLACEHOLDER
    ([7, 2, 3], [1, P, P, P], 1),  # mismatch at 0
    ([P, 2, 3], [1, P, P, P], 1),  # PLACEHOLDER draft is always rejected
    ([1, 2, P], [1, 2, 3, P], 3),
]


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("method", ("greedy",) + SAMPLED)
def test_greedy_table(method, with_probs):
    drafts = torch.tensor([row[0] for row in GREEDY_TABLE])  # [5, 3]
    batch = drafts.shape[0]
    logits = peaked_logits([1, 2, 3, 4], batch=batch)
    # draft probabilities that would change the outcome if greedy rows used them
    probs = torch.softmax(torch.randn(batch, 3, 8, generator=torch.Generator().manual_seed(0)) * 3, -1)
    tokens, num = verifiers.rejection_sample(
        rng.key(0), logits, drafts, probs if with_probs else None, method=method, temperature=0.0
    )
    assert tokens.dtype == torch.int64 and num.dtype == torch.int32
    assert tokens.tolist() == [row[1] for row in GREEDY_TABLE]
    assert num.tolist() == [row[2] for row in GREEDY_TABLE]


def test_greedy_method_ignores_temperature():
    drafts = torch.tensor([row[0] for row in GREEDY_TABLE])
    logits = peaked_logits([1, 2, 3, 4], batch=drafts.shape[0])
    tokens, num = verifiers.rejection_sample(rng.key(5), logits, drafts, method="greedy", temperature=1.5)
    assert tokens.tolist() == [row[1] for row in GREEDY_TABLE]
    assert num.tolist() == [row[2] for row in GREEDY_TABLE]


def test_magicmtp_active_from_k3_and_falls_back_below():
    torch.manual_seed(1)
    b, v = 4000, 6
    logits = torch.randn(b, 3, v)
    drafts = torch.randint(0, v, (b, 2))
    probs = torch.softmax(torch.randn(b, 2, v), -1)
    key = rng.split(rng.key(2), b)
    # K = 2: MagicMTP is standard (and entropy verify with entropy=True)
    for ent, fallback in ((False, "standard"), (True, "entropy")):
        got = verifiers.rejection_sample(key, logits, drafts, probs, method="magicmtp", entropy=ent)
        want = verifiers.rejection_sample(key, logits, drafts, probs, method=fallback)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    # K = 3: it is a different rule (accepts more)
    logits3, drafts3 = torch.randn(b, 4, v), torch.randint(0, v, (b, 3))
    probs3 = torch.softmax(torch.randn(b, 3, v), -1)
    _, n_mtp = verifiers.rejection_sample(key, logits3, drafts3, probs3, method="magicmtp")
    _, n_std = verifiers.rejection_sample(key, logits3, drafts3, probs3, method="standard")
    assert n_mtp.float().mean() > n_std.float().mean() + 0.05


@pytest.mark.parametrize("method", ("greedy",) + SAMPLED + ("synthetic",))
def test_k0_emits_bonus(method):
    torch.manual_seed(2)
    b, v = 64, 10
    logits = torch.randn(b, 1, v)
    temp = torch.where(torch.arange(b) % 2 == 0, 0.0, 0.8)
    key = rng.split(rng.key(3), b)
    extra = {"synthetic_acceptance_rates": ()} if method == "synthetic" else {}
    tokens, num = verifiers.rejection_sample(key, logits, torch.zeros(b, 0, dtype=torch.long), method=method,
                                             temperature=temp, **extra)
    assert tokens.shape == (b, 1) and num.tolist() == [1] * b
    if method == "greedy":
        want = logits[:, 0].argmax(-1)
    else:
        # the bonus is a race over p_0 on stream STREAM_FINAL
        want = rng.categorical(rng.fold_in(key, common.STREAM_FINAL), target_probs(logits, temp)[:, 0])
    assert torch.equal(tokens[:, 0], want)
    assert torch.equal(tokens[0::2, 0], logits[0::2, 0].argmax(-1))


@pytest.mark.parametrize("method", SAMPLED + ("synthetic",))
def test_placeholder_draft_always_rejected(method):
    """With p = q every real draft is accepted (ratio 1), so only the PLACEHOLDER stops a row."""
    b, v = 3000, 8
    torch.manual_seed(3)
    logits = torch.randn(b, 4, v)
    probs = torch.softmax(logits[:, :3], -1)
    drafts = rng.categorical(rng.split(rng.key(9), b).unsqueeze(1).expand(b, 3), probs)  # [B, 3]
    drafts[:, 1] = PLACEHOLDER
    extra = {"synthetic_acceptance_rates": (1.0, 1.0, 1.0)} if method == "synthetic" else {}
    tokens, num = verifiers.rejection_sample(rng.key(4), logits, drafts, probs, method=method, **extra)
    assert num.tolist() == [2] * b
    assert torch.equal(tokens[:, 0], drafts[:, 0])
    assert (tokens[:, 1] >= 0).all() and (tokens[:, 2:] == PLACEHOLDER).all()


def test_zero_draft_probability_is_rejected():
    b, v = 500, 8
    logits = torch.randn(b, 2, v)
    drafts = torch.full((b, 1), 3)
    probs = torch.full((b, 1, v), 1.0 / (v - 1))
    probs[:, :, 3] = 0.0  # q(draft) = 0
    for method in ("standard", "block", "entropy"):
        tokens, num = verifiers.rejection_sample(rng.key(1), logits, drafts, probs, method=method)
        assert num.tolist() == [1] * b, method


@pytest.mark.parametrize("method", SAMPLED)
def test_recovered_token_never_equals_one_hot_draft(method):
    torch.manual_seed(4)
    b, k, v = 30000, 3, 8
    logits = torch.randn(b, k + 1, v)
    drafts = torch.randint(0, v, (b, k))
    tokens, num = verifiers.rejection_sample(rng.key(6), logits, drafts, None, method=method, temperature=1.0)
    rejected = (num - 1).long()  # position of the recovered token
    rows = torch.nonzero(rejected < k).squeeze(1)
    assert rows.numel() > 10000
    assert not (tokens[rows, rejected[rows]] == drafts[rows, rejected[rows]]).any()


@pytest.mark.parametrize("method", SAMPLED + ("synthetic",))
def test_mixed_greedy_and_sampled_rows(method):
    """Each row's result depends only on its own key and settings, never on batch composition."""
    torch.manual_seed(5)
    b, k, v = 64, 4, 8
    greedy_rows = torch.arange(b) % 3 == 0
    logits = torch.randn(b, k + 1, v) * 2
    drafts = torch.where(torch.rand(b, k) < 0.5, logits[:, :k].argmax(-1), torch.randint(0, v, (b, k)))
    probs = torch.softmax(torch.randn(b, k, v), -1)
    key = rng.split(rng.key(7), b)
    extra = {"synthetic_acceptance_rates": (0.9, 0.8, 0.5, 0.2)} if method == "synthetic" else {}
    temp = torch.where(greedy_rows, 0.0, 0.9)
    mixed = verifiers.rejection_sample(key, logits, drafts, probs, method=method, temperature=temp, **extra)
    all_greedy = verifiers.rejection_sample(key, logits, drafts, probs, method=method, temperature=0.0, **extra)
    all_sampled = verifiers.rejection_sample(key, logits, drafts, probs, method=method, temperature=0.9, **extra)
    for got, g, s in zip(mixed, all_greedy, all_sampled):
        assert torch.equal(got[greedy_rows], g[greedy_rows])
        assert torch.equal(got[~greedy_rows], s[~greedy_rows])
    if method != "synthetic":  # greedy rows are exactly greedy verification
        want = verifiers.rejection_sample(key, logits, drafts, method="greedy")
        assert all(torch.equal(x[greedy_rows], y[greedy_rows]) for x, y in zip(mixed, want))


def test_synthetic_greedy_rows_emit_target_argmax_on_rejection():
    b, v = 2000, 8
    logits = peaked_logits([1, 2, 3], vocab=v, batch=b)
    drafts = torch.tensor([[5, 6]]).expand(b, 2)  # both wrong, accepted by rate anyway
    # conditional rates (0.6, 0.5): 1, 2 and 3 tokens are all common
    tokens, num = verifiers.rejection_sample(rng.key(3), logits, drafts, method="synthetic", temperature=0.0,
                                             synthetic_acceptance_rates=(0.6, 0.3))
    want = {1: [1, P, P], 2: [5, 2, P], 3: [5, 6, 3]}
    for n, row in want.items():
        assert (num == n).sum() > 100
        assert (tokens[num == n] == torch.tensor(row)).all()


def test_synthetic_on_an_all_greedy_bucket_skips_probabilities_but_not_one_token():
    """``cfg.greedy`` (every row greedy, as an engine's greedy bucket) gives the general rule's verdict exactly:
    drafts equal to the argmax or not, ``PLACEHOLDER`` drafts, tied logits, rates 1 and 0."""
    torch.manual_seed(8)
    b, k, v = 3000, 4, 6
    logits = torch.randint(0, 3, (b, k + 1, v)).float()  # many ties: the first index must win
    drafts = torch.where(torch.rand(b, k) < 0.5, logits[:, :k].argmax(-1), torch.randint(0, v, (b, k)))
    drafts = torch.where(torch.rand(b, k) < 0.1, P, drafts)
    key = rng.split(rng.key(5), b)
    proposal, sampling = Proposal.chain(drafts, None), Sampling.full(b, temperature=0.0)
    for rates in [(0.9, 0.7, 0.4, 0.2), (1.0, 1.0, 1.0, 1.0), (1.0, 0.0, 0.0, 0.0)]:
        vin = common.VerifyInput(key, logits, proposal, sampling)
        general = verifiers.verify(verifiers.VerifyConfig("synthetic", synthetic_rates=rates), vin)
        greedy = verifiers.verify(verifiers.VerifyConfig("synthetic", synthetic_rates=rates, greedy=True), vin)
        assert all(torch.equal(x, y) for x, y in zip(general, greedy))
    assert len(set(general[1].tolist())) == 2 and len(set(greedy[1].tolist())) == 2  # rates 1, 0: 1 or 2 tokens


def test_seeded_runs_are_deterministic():
    torch.manual_seed(6)
    b, k, v = 256, 4, 12
    logits, drafts = torch.randn(b, k + 1, v), torch.randint(0, v, (b, k))
    probs = torch.softmax(torch.randn(b, k, v), -1)
    for method in SAMPLED:
        one = verifiers.rejection_sample(rng.key(11), logits, drafts, probs, method=method)
        two = verifiers.rejection_sample(rng.key(11), logits, drafts, probs, method=method)
        split = verifiers.rejection_sample(rng.split(rng.key(11), b), logits, drafts, probs, method=method)
        other = verifiers.rejection_sample(rng.key(12), logits, drafts, probs, method=method)
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(one, two, split))
        assert not torch.equal(one[0], other[0])


def test_output_layout():
    """Accepted drafts, one final token, then PLACEHOLDER; num_emitted counts the non-PLACEHOLDER prefix."""
    torch.manual_seed(7)
    b, k, v = 2000, 5, 6
    logits = torch.randn(b, k + 1, v) * 3
    drafts = torch.where(torch.rand(b, k) < 0.9, logits[:, :k].argmax(-1), torch.randint(0, v, (b, k)))
    for method in SAMPLED:
        tokens, num = verifiers.rejection_sample(rng.key(1), logits, drafts, method=method)
        pos = torch.arange(k + 1)
        n = num.long().unsqueeze(1)
        assert ((tokens >= 0) == (pos < n)).all()
        accepted = pos[:k] < n - 1
        assert torch.equal(tokens[:, :k][accepted], drafts[accepted])
        assert set(num.tolist()) == set(range(1, k + 2))


# -- entropy threshold ------------------------------------------------------------------


def test_entropy_threshold_by_hand():
    cfg = verifiers.VerifyConfig("entropy", posterior_threshold=0.95, posterior_alpha=0.4)
    v = 16
    flat = torch.zeros(1, 2, v)  # H = log 16: threshold exp(-0.4 log 16) = 16^-0.4 = 0.3299
    peaked = torch.full((1, 2, v), -1e4)
    peaked[..., 3] = 0.0  # H = 0: exp(0) = 1, capped at 0.95
    two = torch.zeros(1, 2, v)
    two[..., 2:] = -1e4  # two equal tokens: H = log 2, exp(-0.4 log 2) = 2^-0.4 = 0.7579
    thr = torch.cat([entropy.threshold(cfg, x) for x in (flat, peaked, two)], 1)  # [1, 3]
    assert thr.tolist()[0] == pytest.approx([16 ** -0.4, 0.95, 2 ** -0.4], abs=1e-6)
    lenient = verifiers.VerifyConfig("entropy", posterior_threshold=0.5, posterior_alpha=0.0)
    assert entropy.threshold(lenient, flat).tolist() == [[0.5]]


def test_entropy_uses_raw_logits_before_temperature():
    """A flat raw distribution lowers the threshold even when temperature makes p peaked."""
    b, v = 20000, 16
    logits = torch.zeros(b, 2, v)
    logits[:, :, 0] = 0.5  # nearly flat raw distribution: thr = exp(-0.4 H) = 0.33
    drafts = torch.ones(b, 1, dtype=torch.long)
    probs = torch.full((b, 1, v), (1 - 1e-4) / (v - 1))
    probs[:, :, 1] = 1e-4  # at temperature 0.05, p(1) = 4.5e-5: ratio p/q = 0.45
    key = rng.split(rng.key(8), b)
    thr = entropy.threshold(verifiers.VerifyConfig("entropy"), logits)[:, 0]  # [B]
    assert thr[0].item() == pytest.approx(math.exp(-0.4 * entropy_of(torch.softmax(logits[0, 0], -1))), abs=1e-6)
    ratio = target_probs(logits, 0.05)[:, 0, 1] / probs[:, 0, 1]  # [B]
    assert 0.4 < ratio[0].item() < 0.5
    u = rng.uniform(rng.fold_in(key, common.STREAM_ACCEPT), 1)[:, 0]
    _, num = verifiers.rejection_sample(key, logits, drafts, probs, method="entropy", temperature=0.05)
    assert torch.equal(num == 2, ratio >= thr * u)
    # thr 0.33 < ratio: always accepted; a threshold from the processed p (H = 0) would be 0.95
    assert (num == 2).all()
    _, num_std = verifiers.rejection_sample(key, logits, drafts, probs, method="standard", temperature=0.05)
    assert (num_std == 2).float().mean() < 0.5


def entropy_of(p: torch.Tensor) -> float:
    return float(-(p * torch.log(p)).sum())


# -- synthetic helpers ------------------------------------------------------------------


def test_rates_from_length():
    assert synthetic.rates_from_length(3.4, 5) == pytest.approx((1, 1, 0.4, 0, 0))
    assert synthetic.rates_from_length(1, 3) == (0.0, 0.0, 0.0)
    assert synthetic.rates_from_length(4, 3) == (1.0, 1.0, 1.0)
    assert synthetic.rates_from_length(2.5, 3) == (1.0, 0.5, 0.0)
    assert synthetic.rates_from_length(1, 0) == ()
    assert synthetic.validate_synthetic(None, 3.4, 5) == pytest.approx((1, 1, 0.4, 0, 0))
    assert synthetic.validate_synthetic([0.9, 0.5], None, 2) == (0.9, 0.5)
    assert synthetic.conditional_rates((0.8, 0.4, 0.0, 0.0)) == pytest.approx((0.8, 0.5, 0.0, 0.0))


@pytest.mark.parametrize("rates, length, k, field", [
    (None, None, 3, "exactly one of synthetic_acceptance_rates or synthetic_acceptance_length"),
    ((1.0, 1.0, 1.0), 2.0, 3, "exactly one of synthetic_acceptance_rates or synthetic_acceptance_length"),
    ((1.0, 0.5), None, 3, "synthetic_acceptance_rates must have length K=3"),
    ((1.0, 0.5, 1.5), None, 3, r"synthetic_acceptance_rates\[2\] must be in \[0, 1\]"),
    ((1.0, -0.1, 0.0), None, 3, r"synthetic_acceptance_rates\[1\] must be in \[0, 1\]"),
    ((0.5, 0.7, 0.1), None, 3, "synthetic_acceptance_rates must be non-increasing"),
    (None, 0.5, 3, r"synthetic_acceptance_length must be in \[1, K\+1\]"),
    (None, 4.5, 3, r"synthetic_acceptance_length must be in \[1, K\+1\]"),
    # One check for config, VerifyConfig and the engine: no strings, bools or sets.
    ("0.9", None, 1, "synthetic_acceptance_rates must be a list of numbers"),
    ((True, 0.5), None, 2, "synthetic_acceptance_rates must be a list of numbers"),
    ({0.5}, None, 1, "synthetic_acceptance_rates must be a list of numbers"),
    (None, "2", 3, "synthetic_acceptance_length must be a number"),
])
def test_validate_synthetic_errors(rates, length, k, field):
    with pytest.raises(ValueError, match=field):
        synthetic.validate_synthetic(rates, length, k)


# -- config and input validation --------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(method="typical"), "method must be one of"),
    (dict(posterior_threshold=1.5), r"posterior_threshold must be in \(0, 1\], got 1.5"),
    (dict(posterior_threshold=0.0), r"posterior_threshold must be in \(0, 1\], got 0.0"),
    (dict(posterior_alpha=-0.1), "posterior_alpha must be >= 0, got -0.1"),
    (dict(method="block", entropy=True), "entropy=True combines only with method"),
    (dict(method="standard", entropy=True), "entropy=True combines only with method"),
    (dict(method="synthetic"), "synthetic_rates must be given exactly when method is 'synthetic'"),
    (dict(method="standard", synthetic_rates=(0.5,)), "synthetic_rates must be given exactly when"),
    (dict(method="synthetic", synthetic_rates=(0.5, 0.9)), "synthetic_rates must be non-increasing"),
    (dict(method="synthetic", synthetic_rates=(1.2,)), r"synthetic_rates\[0\] must be in \[0, 1\]"),
])
def test_verify_config_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        verifiers.VerifyConfig(**kwargs)


def test_verify_config_is_hashable_and_normalises_rates():
    cfg = verifiers.VerifyConfig("synthetic", synthetic_rates=[1, 0.5])
    assert cfg.synthetic_rates == (1.0, 0.5)
    assert hash(cfg) == hash(verifiers.VerifyConfig("synthetic", synthetic_rates=(1.0, 0.5)))
    assert set(verifiers.VERIFIERS) == {"greedy", "standard", "block", "magicmtp", "entropy", "synthetic", "tree"}
    assert verifiers.VerifyConfig("tree", depth=2).depth == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="tree"), "depth must be given exactly when method is 'tree'"),
    (dict(method="standard", depth=2), "depth must be given exactly when method is 'tree'"),
    (dict(method="tree", depth=0), "depth must be an int >= 1, got 0"),
])
def test_the_tree_rule_takes_a_depth_and_only_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        verifiers.VerifyConfig(**kwargs)


def test_rejection_sample_refuses_the_tree_rule_by_name():
    with pytest.raises(ValueError, match="method 'tree' verifies token trees"):
        verifiers.rejection_sample(rng.key(0), **GOOD, method="tree")


B, K, V = 2, 3, 8
GOOD = dict(target_logits=torch.zeros(B, K + 1, V), draft_tokens=torch.zeros(B, K, dtype=torch.long))


@pytest.mark.parametrize("change, field", [
    (dict(target_logits=torch.zeros(B, K, V)), "draft_tokens"),
    (dict(target_logits=torch.zeros(B, K + 1)), "target_logits must be a float"),
    (dict(target_logits=torch.zeros(B, K + 1, V, dtype=torch.long)), "target_logits must be a float"),
    (dict(draft_tokens=torch.zeros(B + 1, K, dtype=torch.long)), r"draft_tokens \(proposal.tokens\) must be"),
    (dict(draft_tokens=torch.zeros(B, K)), r"draft_tokens \(proposal.tokens\) must be an integer"),
    (dict(draft_probs=torch.zeros(B, K, V + 1)), r"draft_probs \(proposal.probs\) must be \[B, K, V\] = \[2, 3, 8\]"),
    (dict(key=rng.split(rng.key(0), B + 1)), r"key must be a scalar key or a \[B\] = \[2\] key tensor"),
    (dict(method="nope"), "method must be one of"),
    (dict(posterior_threshold=2.0), "posterior_threshold must be in"),
    (dict(posterior_alpha=-1.0), "posterior_alpha must be >= 0"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=torch.ones(B + 1)), r"temperature must be a number or a \[B\] = \[2\] tensor"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(method="synthetic"), "exactly one of synthetic_acceptance_rates or synthetic_acceptance_length"),
    (dict(method="synthetic", synthetic_acceptance_rates=(1.0, 1.0)),
     "synthetic_acceptance_rates must have length K=3"),
    (dict(method="synthetic", synthetic_acceptance_length=5.0), "synthetic_acceptance_length must be in"),
    (dict(synthetic_acceptance_length=2.0), "apply only to method 'synthetic'"),
    (dict(method="block", entropy=True), "entropy=True combines only with method"),
])
def test_rejection_sample_errors_name_the_field(change, field):
    args = dict(GOOD, key=rng.key(0), draft_probs=None)
    args.update(change)
    positional = [args.pop(n) for n in ("key", "target_logits", "draft_tokens", "draft_probs")]
    with pytest.raises(ValueError, match=field):
        verifiers.rejection_sample(*positional, **args)


def test_verify_checks_key_and_proposal_shapes():
    cfg = verifiers.VerifyConfig("standard")
    sampling = Sampling.full(B)
    logits = GOOD["target_logits"]
    VerifyInput = verifiers.VerifyInput
    with pytest.raises(ValueError, match=r"key must be a \[B\] = \[2\] key tensor"):
        verifiers.verify(cfg, VerifyInput(rng.key(0), logits, Proposal.chain(GOOD["draft_tokens"]), sampling))
    with pytest.raises(ValueError, match=r"draft_probs \(proposal.probs\)"):
        verifiers.verify(cfg, VerifyInput(rng.split(rng.key(0), B), logits,
                                    Proposal.chain(GOOD["draft_tokens"], torch.zeros(B, K, V - 1)), sampling))
    synth = verifiers.VerifyConfig("synthetic", synthetic_rates=(1.0, 1.0))
    with pytest.raises(ValueError, match="synthetic_rates must have length K=3"):
        verifiers.verify(synth, VerifyInput(rng.split(rng.key(0), B), logits, Proposal.chain(GOOD["draft_tokens"]),
                                      sampling))
    tree = verifiers.VerifyConfig("tree", depth=3)
    with pytest.raises(ValueError, match=r"keys must be \[B, D\+1\] = \[2, 4\] \(decoding's key per depth\), got None"):
        verifiers.verify(tree, VerifyInput(rng.split(rng.key(0), B), logits, Proposal.chain(GOOD["draft_tokens"]),
                                     sampling))
