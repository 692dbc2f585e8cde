"""Logprobs, prompt logprobs and n > 1 under speculation (SamplingParams.logprobs / prompt_logprobs / n).

The property: a speculative engine returns, for every emitted token (accepted
drafts and the bonus or recovered token), the target's log-probabilities bit
for bit as decoding without speculation computes them, and the same tokens:
greedy requests, and seeded sampled ones too, because the verifier draws the
target's token at each position with the key and the race that decoding uses
there (``step.row_keys``; ``verifiers.standard.autoregressive_draws`` and the
tree rule). The exception is a drafter whose sampled drafts carry their own
distribution q (``draft_model`` and ``dspark`` in sampled buckets): standard
rejection sampling accepts ``min(1, p/q)`` of them, more than matching them
against decoding's draws would, so those requests equal plain sampling in law,
not sample by sample (tests/engine/test_spec.py checks the law); their logprobs are
checked bitwise against the target's at the same tokens (teacher-forced prompt
logprobs, which on this CPU's streaming kernels carry the same bits as decode steps).

Bitwise equality needs kernels whose rows never depend on the row count: the
weight-streaming products and the decode-attention kernel (AVX512-BF16 CPUs,
``kernels.resolve``). Elsewhere (MKL or oneDNN products, SDPA) a K+1-row verify
and a 1-row decode may round differently, and logprobs are held to
``OTHER_ATOL`` instead.

Token trees are the stated exception: greedy tokens are the same, logprobs agree
to ``TREE_ATOL``. While a tree is verified its nodes sit at cache positions
``length + node index``, not ``length + depth`` as decoded alone, and the CPU
decode-attention kernel accumulates a row's softmax and p·v sums in lanes by
key position mod 4: a query that sees an ancestor at another position sums in
another order. The accepted path's KV is then moved into place
(``nn.llama.commit_path``), but its deeper layers were computed from those
activations, so later tokens differ in the last bits too.

The per-method matrix runs on eager over the trained zoo (its heads accept
drafts, so blocks of several tokens are checked), and again on inductor, where
each method compiles lazily the one graph its mixed batch runs in. The inductor
matrix is also the suite's real-inductor greedy losslessness check of those
methods (tests/engine/test_spec.py runs them on eager at every K and batch). It
leaves out two whose compiled graph another case holds: ``dspark`` (its chain
graph at K = 3 is one of ``dspark_dynamic``'s two) and ``eagle`` (a random head
that accepts nothing here; published EAGLE-1 heads compile in
tests/engine/test_published_heads.py).
"""

from __future__ import annotations

import pytest
import torch

from funcspec import Engine, SamplingParams, kernels, zoo
from funcspec.checkpoints import eagle, save_params
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.outputs import Logprob

MAX_LEN = 128
TOP = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=TOP, prompt_logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=TOP)
TREE = "[(0,), (1,), (0, 0), (0, 0, 0)]"
TREE_ATOL = 1e-5  # see the module note: a tree step's attention sums in another order than AR's
_OPS = kernels.resolve("cpu")
EXACT = _OPS.stream and _OPS.decode_attention  # row-count-independent kernels: bit for bit
OTHER_ATOL = 1e-4  # see the module note: products whose rounding depends on the row count

# method name in the matrix -> (vLLM method, extra speculative_config keys)
METHODS = {
    "ngram": ("ngram", {}),
    "suffix": ("suffix", {}),
    "draft_model": ("draft_model", {}),
    "eagle": ("eagle", {}),
    "eagle3": ("eagle3", {}),
    "mtp": ("mtp", {}),
    "medusa": ("medusa", {}),
    "dflash": ("dflash", {}),
    "dspark": ("dspark", {}),
    "draft_model_tree": ("draft_model", {"speculative_token_tree": TREE}),
    "eagle3_tree": ("eagle3", {"speculative_token_tree": TREE}),
    "ngram_tree": ("ngram", {"speculative_token_tree": TREE}),
    "dspark_dynamic": ("dspark", {}),  # confidence-based verify length: confidences share the readback
}
MIXED = [SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=TOP), GREEDY]  # one batch
Q_DRAFTS = ("draft_model", "dspark", "dspark_dynamic")  # sampled drafts with q: equal to AR in law only
DYNAMIC = {"dynamic_spec_config": {"method": "dspark", "method_params": {
    "initial_verify_budget_per_req": 2, "budget_update_interval": 2, "budget_threshold": 0.3}}}


@pytest.fixture(scope="module")
def eagle1(zoo_target, tmp_path_factory):
    """A random EAGLE-1 head for the zoo target (the zoo trains EAGLE-3, not EAGLE-1)."""
    path = tmp_path_factory.mktemp("eagle1")
    hf, params = eagle.init_params(zoo_target.cfg, seed=1, version=1)
    save_params(path, params, hf)
    return str(path)


def _spec(name: str, eagle1: str, k: int = 3) -> dict:
    method, extra = METHODS[name]
    model = eagle1 if method == "eagle" else None
    if "speculative_token_tree" in extra:
        k = 4  # the tree's node count
    return zoo.speculative_config(method, k, model=model, **extra)


@pytest.fixture(scope="module")
def ar(zoo_target, zoo_prompts):
    """Greedy outputs without speculation: the ground truth."""
    return Engine(zoo_target, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True).generate(zoo_prompts, GREEDY)


@pytest.fixture(scope="module")
def ar_sampled(zoo_target, zoo_prompts):
    """Seeded top-p outputs without speculation."""
    return Engine(zoo_target, max_num_seqs=4, max_model_len=MAX_LEN,
                  enforce_eager=True).generate(zoo_prompts, SAMPLED)


def _lps(out):
    """(token ids, logprob dicts) of each completion."""
    return [(c.token_ids, c.logprobs) for o in out for c in o.outputs]


def _assert_close_lps(got, want, atol: float) -> None:
    """The same tokens; every returned logprob within ``atol`` of the reference's (ranks may swap on near-ties)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        for da, db in zip(a, b):
            common = set(da) & set(db)
            assert next(iter(da)) in common
            assert all(abs(da[i].logprob - db[i].logprob) <= atol for i in common)


def _teacher_forced(eng: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """The target's logprob of each of ``tokens`` after ``prompt``, from prompt logprobs (no speculation)."""
    out = eng.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return [out.prompt_logprobs[len(prompt) + j][t].logprob for j, t in enumerate(tokens)]


# ----------------------------------------------------------------------------- the output shapes


def test_logprobs_have_vllms_shapes(zoo_target, zoo_prompts, ar):
    out = ar[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 20
    for d, t in zip(c.logprobs, c.token_ids):
        assert next(iter(d)) == t  # the generated token first, then the top TOP
        assert TOP <= len(d) <= TOP + 1 and all(isinstance(v, Logprob) for v in d.values())
        ranks = sorted(v.rank for tid, v in d.items() if tid != t or v.rank <= TOP)
        assert ranks[:TOP] == list(range(1, TOP + 1))
        assert d[t].rank == 1  # greedy picks the argmax
        assert d[t].decoded_token == zoo_target.tokenizer.decode([t])
        assert d[t].logprob <= 0
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(zoo_prompts[0])
    for d, t in zip(out.prompt_logprobs[1:], zoo_prompts[0][1:]):
        assert t in d and len(d) in (2, 3)


def test_logprobs_are_the_raw_distribution_whatever_the_sampling(zoo_target, zoo_prompts):
    """vLLM's default logprobs_mode (raw_logprobs): temperature and top-k change the tokens drawn, not
    the distribution their logprobs describe."""
    eng = Engine(zoo_target, max_num_seqs=2, max_model_len=MAX_LEN, enforce_eager=True)
    sp = SamplingParams(temperature=3.0, top_k=2, seed=1, max_tokens=8, ignore_eos=True, logprobs=0)
    out = eng.generate(zoo_prompts[:1], sp)[0].outputs[0]
    torch.testing.assert_close(torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]),
                               torch.tensor(_teacher_forced(eng, zoo_prompts[0], out.token_ids)), rtol=0,
                               atol=0 if EXACT else OTHER_ATOL)
    assert all(len(d) == 1 for d in out.logprobs)  # logprobs=0: the generated token only


def test_prompt_logprobs_match_a_direct_forward(zoo_target, zoo_prompts):
    eng = Engine(zoo_target, max_num_seqs=2, max_model_len=MAX_LEN, enforce_eager=True)
    out = eng.generate(zoo_prompts, SamplingParams(max_tokens=1, prompt_logprobs=3))
    for p, o in zip(zoo_prompts, out):
        x = torch.tensor([p])
        logits, _, _ = forward(zoo_target.cfg, zoo_target.params, init_kv_cache(zoo_target.cfg, 1, len(p)), x,
                               torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        want = torch.log_softmax(logits[0, :-1].float(), -1)  # [n-1, V]: position i predicts token i+1
        got = torch.tensor([o.prompt_logprobs[i + 1][p[i + 1]].logprob for i in range(len(p) - 1)])
        torch.testing.assert_close(got, want[torch.arange(len(p) - 1), torch.tensor(p[1:])], rtol=0, atol=1e-5)
        top = torch.topk(want, 3, -1)
        for i in range(len(p) - 1):
            d = o.prompt_logprobs[i + 1]
            assert set(top.indices[i].tolist()) <= set(d)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_the_limit_raise_naming_the_field(field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be <= 20"):
        SamplingParams(**{field: 21})
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be >= 0"):
        SamplingParams(**{field: -1})
    assert getattr(SamplingParams(**{field: 20}), field) == 20


# ----------------------------------------------------------------------------- bit-equality per method


@pytest.mark.parametrize("name", list(METHODS))
def test_speculation_returns_autoregressive_logprobs_bitwise(zoo_target, zoo_prompts, ar, ar_sampled, eagle1, name):
    eng = Engine(zoo_target, speculative_config=_spec(name, eagle1), max_num_seqs=4, max_model_len=MAX_LEN,
                 additional_config=DYNAMIC if name.endswith("_dynamic") else None, enforce_eager=True)
    tree = "speculative_token_tree" in METHODS[name][1]
    out = eng.generate(zoo_prompts, GREEDY)
    if tree or not EXACT:
        _assert_close_lps(_lps(out), _lps(ar), TREE_ATOL if EXACT else OTHER_ATOL)
    else:
        assert _lps(out) == _lps(ar)  # the same tokens and the same logprob dicts, float for float
    assert [o.prompt_logprobs for o in out] == [o.prompt_logprobs for o in ar]
    if name != "eagle":  # NOTE: a random EAGLE-1 head (the zoo trains none) accepts nothing
        assert max(o.metrics["acceptance_length"] for o in out) > 1.0, "some block of several tokens was checked"
    sampled = eng.generate(zoo_prompts, SAMPLED)
    if name not in Q_DRAFTS:  # the very tokens of seeded sampling without speculation
        if tree or not EXACT:
            _assert_close_lps(_lps(sampled), _lps(ar_sampled), TREE_ATOL if EXACT else OTHER_ATOL)
        else:
            assert _lps(sampled) == _lps(ar_sampled)
        if name not in ("eagle", "ngram", "suffix"):  # the trained heads accept sampled drafts; history-based
            assert max(o.metrics["acceptance_length"] for o in sampled) > 1.0, "sampled rows accepted drafts"
        return
    plain = Engine(zoo_target, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True)
    for p, o in zip(zoo_prompts, sampled):
        c = o.outputs[0]
        got, want = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], _teacher_forced(plain, p, c.token_ids)
        if tree or not EXACT:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0,
                                       atol=TREE_ATOL if EXACT else OTHER_ATOL)
        else:
            assert got == want
    assert _lps(eng.generate(zoo_prompts, SAMPLED)) == _lps(sampled)  # seeded: reproducible


@pytest.fixture(scope="module")
def inductor_ar(zoo_target, zoo_prompts):
    """A greedy and a seeded sampled row in one batch, decoded without speculation on inductor (one graph)."""
    ar = Engine(zoo_target, max_num_seqs=2, max_model_len=MAX_LEN, backend="inductor",
                compilation_config={"capture": "lazy", "batch_sizes": [2]})
    return ar.generate(zoo_prompts, MIXED)


INDUCTOR = [name for name in METHODS if name not in ("dspark", "eagle")]  # see the module note


@pytest.mark.slow
@pytest.mark.parametrize("name", INDUCTOR)
def test_inductor_speculation_returns_autoregressive_logprobs_bitwise(zoo_target, zoo_prompts, eagle1, inductor_ar, name):
    """Every method compiled (lazy capture: the one logprobs graph the mixed batch runs in): the greedy row,
    and the sampled row of every deterministic-draft method, equal decoding without speculation on inductor,
    tokens and logprobs; a second run, under fail_on_recompile, returns the same; no recompile."""
    # NOTE: batch_sizes [2]: the row left when the other finishes runs padded in the same graph, so each
    # method compiles one graph (a cold inductor compile is the cost of this test)
    spec = Engine(zoo_target, speculative_config=_spec(name, eagle1), max_num_seqs=2, max_model_len=MAX_LEN,
                  backend="inductor", compilation_config={"capture": "lazy", "batch_sizes": [2]},
                  additional_config=DYNAMIC if name.endswith("_dynamic") else None)
    got = spec.generate(zoo_prompts, MIXED)
    rows = [1] if name in Q_DRAFTS else [0, 1]  # q-carrying drafts: the sampled row is equal in law only
    want, have = [_lps(inductor_ar)[i] for i in rows], [_lps(got)[i] for i in rows]
    if "speculative_token_tree" in METHODS[name][1] or not EXACT:
        _assert_close_lps(have, want, TREE_ATOL if EXACT else OTHER_ATOL)
    else:
        assert have == want
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _lps(spec.generate(zoo_prompts, MIXED)) == _lps(got)  # seeded: the same rows again
    assert spec.stats()["recompiles"] == 0 and {key[0] for key in spec.runner.compiled} == {2}  # padded rows only


def test_startup_capture_runs_logprobs_in_one_lazily_captured_graph(zoo_target, zoo_prompts, traced_codegen):
    """A start-up capture compiles no logprobs graph; the first logprobs step captures filtered_logprobs
    (every logprobs mode runs in it), and a step without logprobs still runs in its start-up graph."""
    eng = Engine(zoo_target, max_num_seqs=1, max_model_len=MAX_LEN, backend="inductor")
    before = set(eng.runner.compiled)
    assert not any("logprobs" in key[3] for key in before)
    eng.generate(zoo_prompts[:1], SamplingParams(temperature=0.0, max_tokens=3))
    assert set(eng.runner.compiled) == before
    eng.generate(zoo_prompts[:1], GREEDY)
    new = set(eng.runner.compiled) - before
    assert [key[3] for key in new] == ["filtered_logprobs"]
    eng.generate(zoo_prompts[:1], SAMPLED)
    assert set(eng.runner.compiled) - before == new


# ----------------------------------------------------------------------------- per-request statistics


def test_each_request_carries_its_own_acceptance(zoo_target, zoo_prompts):
    eng = Engine(zoo_target, speculative_config=zoo.speculative_config("ngram", 3), max_num_seqs=4,
                 max_model_len=MAX_LEN, enforce_eager=True)
    out = eng.generate(zoo_prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    per_pos = [o.metrics["num_accepted_tokens_per_pos"] for o in out]
    assert all(len(p) == 3 and p == sorted(p, reverse=True) for p in per_pos)
    for o, p in zip(out, per_pos):
        m = o.metrics
        assert sum(p) == m["num_accepted_tokens"]
        assert m["acceptance_length"] == (m["num_accepted_tokens"] + m["steps"]) / m["steps"]
        assert o.outputs[0].metrics["num_accepted_tokens_per_pos"] == p
    total = [sum(x) for x in zip(*per_pos)]
    spec_rows = sum(o.metrics["steps"] for o in out)
    assert eng.stats()["per_position_acceptance"] == [a / spec_rows for a in total]
