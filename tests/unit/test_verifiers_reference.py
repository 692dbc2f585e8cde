"""The vectorised rules equal a slow per-row Python reference, draw for draw.

The reference is written from the definitions (the published rejection-sampling and block-verification rules), loops
over rows and positions, and consumes the same random numbers under the same
key derivation: ``u = rng.uniform(fold_in(key, 0), K)`` and
``E = rng.exponential(fold_in(key, 1), V)``, the final token being
``argmax(dist / E)``. Arithmetic is float32, like the vectorised code.
"""

from __future__ import annotations

import pytest
import torch

import funcspec.verifiers as verifiers
from funcspec import rng
from funcspec.capture.backends import INDUCTOR_OPTIONS
from funcspec.sampling import target_probs
from funcspec.types import PLACEHOLDER, Proposal, Sampling
from funcspec.verifiers.synthetic import conditional_rates

ALPHA, THRESHOLD = 0.4, 0.95
RATES = (0.9, 0.7, 0.7, 0.2)


class Row:
    """One row's inputs and random numbers, with the primitives every rule shares."""

    def __init__(self, b, key, logits, drafts, probs, temp, top_k, top_p):
        self.k, self.vocab = drafts.shape[1], logits.shape[-1]
        self.greedy = bool(temp[b] <= 0)
        self.logits = logits[b]  # [K+1, V]
        self.p = target_probs(logits[b:b + 1], temp[b:b + 1], top_k[b:b + 1], top_p[b:b + 1])[0]  # [K+1, V]
        self.drafts = [int(d) for d in drafts[b]]
        self.probs = None if probs is None else probs[b]
        self.u = rng.uniform(rng.fold_in(key[b], 0), self.k)  # [K]
        self.e = rng.exponential(rng.fold_in(key[b], 1), self.vocab)  # [V]

    def q(self, i: int) -> torch.Tensor:
        """Draft distribution [V] at position i: zero for PLACEHOLDER, one-hot if deterministic or greedy."""
        d = self.drafts[i]
        if d == PLACEHOLDER:
            return torch.zeros(self.vocab)
        if self.probs is None or self.greedy:
            return torch.nn.functional.one_hot(torch.tensor(d), self.vocab).float()
        return self.probs[i].float()

    def ratio(self, i: int) -> torch.Tensor:
        """p(x_i) / q(x_i) as a float32 scalar; 0 for PLACEHOLDER or q(x_i) = 0."""
        d = self.drafts[i]
        if d == PLACEHOLDER or self.q(i)[d] <= 0:
            return torch.tensor(0.0)
        return self.p[i, d] / self.q(i)[d]

    def supported(self, i: int) -> bool:
        d = self.drafts[i]
        return d != PLACEHOLDER and bool(self.q(i)[d] > 0)

    def threshold(self, i: int) -> torch.Tensor:
        raw = torch.softmax(self.logits[i].float(), -1)
        h = -(raw * torch.log(raw + 1e-10)).sum()
        return torch.clamp(torch.exp(-ALPHA * h), max=THRESHOLD)

    def final(self, a: int, weight=None) -> int:
        """Race over max(0, w·p_a - q_a) (p_K for the bonus); p_a if that is empty."""
        if a == self.k:
            dist = self.p[a]
        else:
            w = torch.tensor(1.0) if weight is None else weight
            dist = torch.clamp(w * self.p[a] - self.q(a), min=0.0)
            if not (dist > 0).any():
                dist = self.p[a]
        return int(torch.argmax(dist / self.e))

    def output(self, a: int, final: int) -> list[int]:
        return self.drafts[:a] + [final] + [PLACEHOLDER] * (self.k - a)

    def cumulative(self) -> list[torch.Tensor]:
        """π_i = min(1, π_{i-1}·ratio_i), π_{-1} = 1."""
        out, prev = [], torch.tensor(1.0)
        for i in range(self.k):
            prev = torch.clamp(prev * self.ratio(i), max=1.0)
            out.append(prev)
        return out


def ref_greedy(r: Row) -> list[int]:
    am = [int(x) for x in r.logits.argmax(-1)]
    a = 0
    while a < r.k and r.drafts[a] == am[a]:
        a += 1
    return r.output(a, am[a])


def ref_standard(r: Row, entropy: bool = False) -> list[int]:
    a = 0
    while a < r.k and r.supported(a) and r.ratio(a) >= (r.threshold(a) if entropy else 1.0) * r.u[a]:
        a += 1
    return r.output(a, r.final(a))


def ref_block(r: Row) -> list[int]:
    pi = r.cumulative()
    tau = 0
    for i in range(r.k):  # τ is the LAST i (1-indexed) with u_i <= h_i
        if i == r.k - 1:
            h = pi[i]
        elif pi[i] >= 1:
            h = torch.tensor(1.0)
        else:
            z = torch.clamp(pi[i] * r.p[i + 1] - r.q(i + 1), min=0.0).sum()
            h = z / (z + 1.0 - pi[i])
        if r.u[i] <= h:
            tau = i + 1
    weight = torch.tensor(1.0) if tau == 0 else pi[tau - 1]
    return r.output(tau, r.final(tau, weight))


def ref_magicmtp(r: Row, entropy: bool = False) -> list[int]:
    if r.k < 3:
        return ref_standard(r, entropy)
    pi, big_u, last = r.cumulative(), torch.tensor(1.0), -1
    for i in range(r.k):
        big_u = big_u * r.u[i]
        bound = r.threshold(i) * big_u if entropy else big_u
        if r.supported(i) and pi[i] >= bound:
            last = i
    return r.output(last + 1, r.final(last + 1))


def ref_synthetic(r: Row) -> list[int]:
    cond = torch.tensor(conditional_rates(RATES[:r.k]), dtype=torch.float32)
    a = 0
    while a < r.k and r.drafts[a] != PLACEHOLDER and r.u[a] < cond[a]:
        a += 1
    return r.output(a, r.final(a))


REFERENCES = {
    "greedy": ref_greedy,
    "standard": ref_standard,
    "block": ref_block,
    "magicmtp": ref_magicmtp,
    "magicmtp+entropy": lambda r: ref_magicmtp(r, entropy=True),
    "entropy": lambda r: ref_standard(r, entropy=True),
    "synthetic": ref_synthetic,
}


def config(name: str, k: int) -> verifiers.VerifyConfig:
    method, _, extra = name.partition("+")
    return verifiers.VerifyConfig(method, THRESHOLD, ALPHA, entropy=extra == "entropy",
                                  synthetic_rates=RATES[:k] if method == "synthetic" else None)


def random_inputs(seed: int, batch: int, k: int, vocab: int):
    """Inputs that exercise every branch: greedy rows, PLACEHOLDERs, q = 0 at a draft, top-k/top-p zeros."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    probs = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, generator=gen), -1)
    near = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.15, logits[:, :k].argmax(-1), near)
    drafts[torch.rand(batch, k, generator=gen) < 0.08] = PLACEHOLDER
    zero_q = torch.rand(batch, k, generator=gen) < 0.05
    probs = probs.masked_fill(zero_q.unsqueeze(-1) & (torch.arange(vocab) == drafts.clamp(min=0).unsqueeze(-1)), 0.0)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3])[torch.randint(0, 4, (batch,), generator=gen)]
    top_k = torch.tensor([0, 3, 0, 5])[torch.randint(0, 4, (batch,), generator=gen)]
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.95])[torch.randint(0, 4, (batch,), generator=gen)]
    key = rng.split(rng.key(seed), batch)
    return key, logits, drafts, probs, temp, top_k, top_p


@pytest.mark.parametrize("k", [4, 2, 0])
@pytest.mark.parametrize("with_probs", [True, False], ids=["q", "onehot"])
def test_vectorised_equals_loop_reference(with_probs, k):
    key, logits, drafts, probs, temp, top_k, top_p = random_inputs(10 + k, batch=60, k=k, vocab=9)
    probs = probs if with_probs else None
    rows = [Row(b, key, logits, drafts, probs, temp, top_k, top_p) for b in range(len(key))]
    for name, ref in REFERENCES.items():
        cfg = config(name, k)
        tokens, num = verifiers.rejection_sample(
            key, logits, drafts, probs, method=cfg.method, temperature=temp, top_k=top_k, top_p=top_p,
            posterior_threshold=THRESHOLD, posterior_alpha=ALPHA, entropy=cfg.entropy,
            synthetic_acceptance_rates=cfg.synthetic_rates)
        want = [ref(r) for r in rows]
        assert tokens.tolist() == want, name
        assert num.tolist() == [sum(t != PLACEHOLDER for t in w) for w in want], name
        if k == 4:  # the inputs reach the interesting branches
            assert 1 < len(set(num.tolist())), name


COMPILED_CASES = [  # (rule, K, with draft probs): both q paths are exercised across the rules
    ("greedy", 2, False), ("standard", 2, True), ("block", 2, False), ("entropy", 2, False),
    ("synthetic", 2, True), ("magicmtp", 3, False), ("magicmtp+entropy", 3, True),
]


COMPILE_OPTIONS = INDUCTOR_OPTIONS
"""The options the engine's graphs compile with. NOTE: inductor inlines funcspec.rng's hash chains into every
consumer and re-traces them at codegen; storing intermediates of more than 8 ops cuts this test's cold compile
several fold. The default options were also checked bit-identical (same cases, two shapes)."""


@pytest.mark.slow
def test_compiled_equals_eager_for_every_rule():
    """Every rule inside ONE ``torch.compile(fullgraph=True, dynamic=False)`` graph, bit-identical to eager.

    Slow: one cold inductor compile of all rules (~40 s of CPU on 2 cores; seconds with a
    warm inductor cache). K = 2, and K = 3 (the smallest K at which MagicMTP is active).
    """

    def all_rules(inputs, sampling):
        out = []
        for name, k, with_probs in COMPILED_CASES:
            key, logits, drafts, probs = inputs[k]
            proposal = Proposal.chain(drafts, probs if with_probs else None)
            out.append(verifiers.verify(config(name, k), verifiers.VerifyInput(key, logits, proposal, sampling)))
        return out

    compiled = torch.compile(all_rules, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
    for seed in (1, 2):  # the second call reuses the graph: no recompile
        inputs = {}
        for k in (2, 3):
            key, logits, drafts, probs, temp, top_k, top_p = random_inputs(seed, batch=24, k=k, vocab=9)
            inputs[k] = (key, logits, drafts, probs)
        sampling = Sampling(temp, top_k, top_p)
        eager = all_rules(inputs, sampling)
        with torch.compiler.set_stance("fail_on_recompile" if seed > 1 else "default"):
            got = compiled(inputs, sampling)
        for (name, _, _), (t_eager, n_eager, p_eager), (t_comp, n_comp, p_comp) in zip(COMPILED_CASES, eager, got):
            assert torch.equal(t_eager, t_comp) and torch.equal(n_eager, n_comp) and torch.equal(p_eager, p_comp), name
            assert t_comp.dtype == torch.int64 and n_comp.dtype == torch.int32
