"""Hostile input to the engine (issue 40): no request can fail, or change, another.

A corpus of what a tester throws at ``SamplingParams``, ``LLM.generate`` and ``Engine.add_request``: wrong
types, bools for ints, NaN and inf, integers past int64, negative counts, prompts of megabytes, lone
surrogates, stop lists of thousands, token ids past the vocabulary. Each row asserts the exception type and a
message naming the field. The engine rows run beside two long requests, one greedy and one seeded top-p, that
were already decoding: both must finish with exactly the tokens they produce alone.

Then what validation cannot catch: a request whose own host work fails (its prefill hook, its stop rule) is
finished alone with ``finish_reason="error"``, and the requests beside it finish as if it had never been there.

Everything runs on the zoo target (``models/target``) with the eager backend: no graph is compiled.
"""

from __future__ import annotations

import re
import warnings

import pytest

import funcspec
from funcspec import SamplingParams, zoo
from funcspec.config.sampling_params import MAX_STOPS
from funcspec.scheduler import token_span

MAX_MODEL_LEN = 128
VOCAB = 4096
INT64_MAX = 2**63 - 1
BESIDE = [("def parse(line):\n", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
          ("import os\nimport sys\n", SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40,
                                                     ignore_eos=True))]
"""The two long requests every engine row runs beside: a greedy one and a seeded top-p one."""


@pytest.fixture(scope="module")
def llm():
    """One eager engine with 4 slots; ``llm.solo`` holds each BESIDE request's tokens run alone."""
    llm = funcspec.LLM(str(zoo.model_path("target")), enforce_eager=True, max_num_seqs=4,
                       max_model_len=MAX_MODEL_LEN)
    llm.solo = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in BESIDE]
    return llm


def run_beside(engine, poison, steps: int = 3) -> dict:
    """Start the BESIDE requests, step ``steps`` times, call ``poison(engine)`` (which returns the outputs of any
    steps it runs), then step until every request is done; returns the outputs by request id (``poison``'s own
    requests included) and ``"beside"``: the BESIDE requests' outputs."""
    ids = [engine.add_request(p, sp) for p, sp in BESIDE]
    done = {}
    for _ in range(steps):
        done.update((o.request_id, o) for o in engine.step())
    assert all(engine.scheduler.running[i].output_ids for i in range(2)), "the long requests run before the poison"
    done.update((o.request_id, o) for o in poison(engine) or ())
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    done["beside"] = [done[i] for i in ids]
    return done


def assert_unchanged(llm, done: dict) -> None:
    """The BESIDE requests finished with their solo tokens, and the engine holds nothing afterwards."""
    assert [o.outputs[0].token_ids for o in done["beside"]] == llm.solo
    assert [o.outputs[0].finish_reason for o in done["beside"]] == ["length", "length"]
    sched = llm.engine.scheduler
    assert not sched.running and not sched.waiting and sorted(sched.free_slots) == [0, 1, 2, 3]


def escaped(**fields) -> SamplingParams:
    """Valid params whose fields are then set past the checks (``object.__setattr__`` on the frozen dataclass):
    values that reach the engine without SamplingParams having seen them."""
    params = SamplingParams(max_tokens=5)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


# ----------------------------------------------------------------------------- SamplingParams alone

P = "SamplingParams."
SAMPLING = [
    # temperature: a finite float32, not a bool
    ({"temperature": 1e39}, rf"^{P}temperature must be in \[0, 3.40282e\+38\], got 1e\+39$"),
    ({"temperature": 3.5e38}, rf"^{P}temperature must be in \[0, 3.40282e\+38\], got 3.5e\+38$"),
    ({"temperature": 10**400}, rf"^{P}temperature must be a finite number, got an integer of about 401 digits$"),
    ({"temperature": float("inf")}, rf"^{P}temperature must be a finite number, got inf$"),
    ({"temperature": float("-inf")}, rf"^{P}temperature must be a finite number, got -inf$"),
    ({"temperature": float("nan")}, rf"^{P}temperature must be a finite number, got nan$"),
    ({"temperature": -1e-30}, rf"^{P}temperature must be in \[0, "),
    ({"temperature": True}, rf"^{P}temperature must be a finite number, got True$"),
    ({"temperature": "0.7"}, rf"^{P}temperature must be a finite number, got '0.7'$"),
    ({"temperature": None}, rf"^{P}temperature must be a finite number, got None$"),
    ({"temperature": [1.0]}, rf"^{P}temperature must be a finite number, got \[1.0\]$"),
    # top_p
    ({"top_p": float("nan")}, rf"^{P}top_p must be a finite number, got nan$"),
    ({"top_p": 1e-400}, rf"^{P}top_p must be in \(0, 1\], got 0.0$"),  # the literal is 0.0
    ({"top_p": 1 + 1e-15}, rf"^{P}top_p must be in \(0, 1\]"),
    ({"top_p": False}, rf"^{P}top_p must be a finite number, got False$"),
    # top_k: an int64 >= -1
    ({"top_k": 2**63}, rf"^{P}top_k must be <= {INT64_MAX}, got {2**63}$"),
    ({"top_k": 10**5000}, rf"^{P}top_k must be <= {INT64_MAX}, got an integer of about 5001 digits$"),
    ({"top_k": -2}, rf"^{P}top_k must be >= -1, got -2$"),
    ({"top_k": -(2**64)}, rf"^{P}top_k must be >= -1, got {-(2**64)}$"),
    ({"top_k": True}, rf"^{P}top_k must be an integer, got True$"),
    ({"top_k": 5.0}, rf"^{P}top_k must be an integer, got 5.0$"),
    ({"top_k": "5"}, rf"^{P}top_k must be an integer, got '5'$"),
    ({"top_k": "x" * 10**6}, rf"^{P}top_k must be an integer, got 'x{{76}}\.\.\.$"),  # cut, not a megabyte
    # seed: an int64 or None
    ({"seed": 2**63}, rf"^{P}seed must be <= {INT64_MAX} or None, got {2**63}$"),
    ({"seed": -(2**63) - 1}, rf"^{P}seed must be >= {-(2**63)} or None, got {-(2**63) - 1}$"),
    ({"seed": True}, rf"^{P}seed must be an integer or None, got True$"),
    ({"seed": 1.5}, rf"^{P}seed must be an integer or None, got 1.5$"),
    ({"seed": "7"}, rf"^{P}seed must be an integer or None, got '7'$"),
    # lengths and counts
    ({"max_tokens": 0}, rf"^{P}max_tokens must be >= 1, got 0$"),
    ({"max_tokens": -(2**70)}, rf"^{P}max_tokens must be >= 1, got {-(2**70)}$"),
    ({"max_tokens": True}, rf"^{P}max_tokens must be an integer, got True$"),
    ({"max_tokens": 16.0}, rf"^{P}max_tokens must be an integer, got 16.0$"),
    ({"max_tokens": "16"}, rf"^{P}max_tokens must be an integer, got '16'$"),
    ({"min_tokens": -1}, rf"^{P}min_tokens must be >= 0, got -1$"),
    ({"min_tokens": False}, rf"^{P}min_tokens must be an integer, got False$"),
    ({"min_tokens": 17}, rf"^{P}min_tokens must be <= max_tokens \(16\), got 17$"),
    ({"n": 0}, rf"^{P}n must be >= 1, got 0$"),
    ({"n": True}, rf"^{P}n must be an integer, got True$"),
    ({"n": 2.0}, rf"^{P}n must be an integer, got 2.0$"),
    ({"logprobs": 21}, rf"^{P}logprobs must be <= 20 or None, got 21$"),
    ({"logprobs": -1}, rf"^{P}logprobs must be >= 0 or None, got -1$"),
    ({"logprobs": True}, rf"^{P}logprobs must be an integer or None, got True$"),
    ({"prompt_logprobs": 10**30}, rf"^{P}prompt_logprobs must be <= 20 or None, got {10**30}$"),
    ({"ignore_eos": 1}, rf"^{P}ignore_eos must be a bool, got 1$"),
    ({"ignore_eos": "false"}, rf"^{P}ignore_eos must be a bool, got 'false'$"),
    # stop strings: non-empty, valid Unicode, at most MAX_STOPS
    ({"stop": 123}, rf"^{P}stop must be a non-empty string or a list of them, got 123$"),
    ({"stop": {"a"}}, rf"^{P}stop must be a non-empty string or a list of them, got {{'a'}}$"),
    ({"stop": b"a"}, rf"^{P}stop must be a non-empty string or a list of them, got b'a'$"),
    ({"stop": ""}, rf"^{P}stop\[0\] must be a non-empty string, got ''$"),
    ({"stop": ["ok", None]}, rf"^{P}stop\[1\] must be a non-empty string, got None$"),
    ({"stop": ["\ud800"]}, rf"^{P}stop\[0\] must be valid Unicode text: '\\ud800' at position 0 is a lone "
                           r"surrogate$"),
    ({"stop": ["ok", "x\udfff"]}, rf"^{P}stop\[1\] must be valid Unicode text: '\\udfff' at position 1"),
    ({"stop": ["s"] * (MAX_STOPS + 1)}, rf"^{P}stop holds {MAX_STOPS + 1} entries; at most {MAX_STOPS} are "
                                        r"accepted"),
    ({"stop": [str(i) for i in range(100_000)]}, rf"^{P}stop holds 100000 entries"),
    # stop token ids: int64s >= 0, at most MAX_STOPS
    ({"stop_token_ids": "7"}, rf"^{P}stop_token_ids must be a list of token ids, got '7'$"),
    ({"stop_token_ids": 7}, rf"^{P}stop_token_ids must be a list of token ids, got 7$"),
    ({"stop_token_ids": [1, -1]}, rf"^{P}stop_token_ids\[1\] must be a token id in \[0, 2\*\*63\), got -1$"),
    ({"stop_token_ids": [True]}, rf"^{P}stop_token_ids\[0\] must be a token id in \[0, 2\*\*63\), got True$"),
    ({"stop_token_ids": [2.0]}, rf"^{P}stop_token_ids\[0\] must be a token id in \[0, 2\*\*63\), got 2.0$"),
    ({"stop_token_ids": [2**63]}, rf"^{P}stop_token_ids\[0\] must be a token id in \[0, 2\*\*63\), got "
                                  rf"{2**63}$"),
    ({"stop_token_ids": list(range(10_000))}, rf"^{P}stop_token_ids holds 10000 entries; at most {MAX_STOPS}"),
    # logit processors funcspec does not run: refused at any value but the neutral one
    ({"repetition_penalty": float("nan")}, rf"^{P}repetition_penalty=nan is not supported"),
    ({"min_p": 10**5000}, rf"^{P}min_p=an integer of about 5001 digits is not supported"),
]


def _ids(rows) -> list[str]:
    """``<field>-<i>`` ids (a row's value may be a megabyte, or an int too long for ``repr``)."""
    return [f"{next(iter(kwargs))}-{i}" for i, (kwargs, _) in enumerate(rows)]


@pytest.mark.parametrize(("kwargs", "match"), SAMPLING, ids=_ids(SAMPLING))
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert type(err.value) is ValueError
    assert re.search(match, str(err.value)), str(err.value)
    assert len(str(err.value)) < 300  # a message never echoes a client's megabytes


def test_the_edges_of_every_range_are_accepted():
    """The largest and smallest values the ranges name are accepted, stored as given."""
    p = SamplingParams(temperature=3.4028234663852886e38, top_k=INT64_MAX, seed=-(2**63), top_p=1e-300,
                       stop=["s"] * MAX_STOPS, stop_token_ids=[INT64_MAX] * MAX_STOPS, logprobs=20)
    assert (p.temperature, p.top_k, p.seed, p.top_p) == (3.4028234663852886e38, INT64_MAX, -(2**63), 1e-300)
    assert SamplingParams(seed=INT64_MAX, top_k=-1).top_k == 0


def test_a_tiny_temperature_is_raised_to_vllms_floor_with_one_warning():
    """vLLM's ``_MAX_TEMP``: a temperature in (0, 0.01) runs at 0.01, with one warning naming the value; 0 stays
    greedy and 0.01 is taken silently."""
    for t in (1e-38, 1e-40, 5e-324, 0.0099):
        with pytest.warns(UserWarning) as seen:
            p = SamplingParams(temperature=t)
        assert p.temperature == 0.01 and not p.greedy
        assert [str(w.message) for w in seen] == [f"SamplingParams.temperature={t!r} is below 0.01, which makes "
                                                  f"inf or NaN probabilities; raised to 0.01"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SamplingParams(temperature=0.01).temperature == 0.01 and SamplingParams(temperature=0.0).greedy


# ----------------------------------------------------------------------------- the engine, beside two requests

HUGE_TEXT = "x" * 3_900_000  # the 3.9 MB prompt that took 7-9 s to tokenize before it was refused
CONTEXT = rf"^This model's maximum context length \(max_model_len\) is {MAX_MODEL_LEN} tokens\. However, you requested"
ADMISSION = [
    # (prompt, params, message): refused by Engine.add_request while the BESIDE requests run
    ("def f(x):", SamplingParams(max_tokens=100_000),
     CONTEXT + r" 100005 tokens \(5 in the prompt, 100000 in the completion: SamplingParams\.max_tokens\)"),
    ("def f(x):", SamplingParams(max_tokens=10**5000),
     CONTEXT + r" an integer of about 5001 digits tokens \(5 in the prompt, an integer of about 5001 digits in"),
    ([5] * (MAX_MODEL_LEN - 16) + [6], SamplingParams(),  # the default max_tokens (16) passes the context by one
     CONTEXT + r" 129 tokens \(113 in the prompt, 16 in the completion"),
    (HUGE_TEXT, SamplingParams(max_tokens=1),  # "at least": refused before it was tokenized
     rf"^prompt of at least \d+ tokens does not fit max_model_len={MAX_MODEL_LEN}"),
    ({"prompt": HUGE_TEXT}, None, rf"^prompt of at least \d+ tokens does not fit max_model_len={MAX_MODEL_LEN}"),
    ([7] * 5000, SamplingParams(max_tokens=1), rf"^prompt of 5000 tokens does not fit max_model_len={MAX_MODEL_LEN}"),
    ([5, VOCAB], None, rf"^prompt_token_ids must be in \[0, {VOCAB}\), got {VOCAB} at position 1$"),
    ([5, -1], None, rf"^prompt_token_ids must be in \[0, {VOCAB}\), got -1 at position 1$"),
    ([2**63], None, rf"^prompt_token_ids must be in \[0, {VOCAB}\), got {2**63} at position 0$"),
    ([10**5000], None, rf"^prompt_token_ids must be in \[0, {VOCAB}\), got an integer of about 5001 digits"),
    ({"prompt_token_ids": [3, 2**64]}, None, rf"^prompt_token_ids must be in \[0, {VOCAB}\), got {2**64}"),
    ([True, 5], None, r"^prompt\[0\] must be a token id \(an integer\), got True$"),
    ([5, 6.0], None, r"^prompt\[1\] must be a token id \(an integer\), got 6.0$"),
    ([5, None], None, r"^prompt\[1\] must be a token id \(an integer\), got None$"),
    ("", None, r"^prompt must not be empty$"),
    ([], None, r"^prompt must not be empty$"),
    ("def f\ud800(x):", None, r"^prompt must be valid Unicode text: '\\ud800' at position 5 is a lone surrogate$"),
    ({"prompt": "\udc80"}, None, r"^prompt\['prompt'\] must be valid Unicode text: '\\udc80' at position 0"),
    (b"def f(x):", None, r"^prompt must be .*, got bytes$"),
    (None, None, r"^prompt must be .*, got None$"),
    ("def f(x):", SamplingParams(n=5), r"^SamplingParams\.n=5 must be <= max_num_seqs=4"),
    ("def f(x):", SamplingParams(n=2**70), rf"^SamplingParams\.n={2**70} must be <= max_num_seqs=4"),
    ("def f(x):", {"temperature": 0.0}, r"^sampling_params must be a SamplingParams, got dict$"),
    # values past SamplingParams' checks (a frozen dataclass changed by object.__setattr__): the engine checks
    # the params it runs again, so nothing unchecked reaches the prefill that writes them to tensors
    ("def f(x):", escaped(top_k=2**63), rf"^SamplingParams\.top_k must be <= {INT64_MAX}, got {2**63}$"),
    ("def f(x):", escaped(temperature=1e39), r"^SamplingParams\.temperature must be in \[0, 3.40282e\+38\]"),
    ("def f(x):", escaped(temperature=float("nan")), r"^SamplingParams\.temperature must be a finite number"),
    ("def f(x):", escaped(top_p=0.0), r"^SamplingParams\.top_p must be in \(0, 1\], got 0.0$"),
    ("def f(x):", escaped(seed=2**64), rf"^SamplingParams\.seed must be <= {INT64_MAX} or None, got {2**64}$"),
    ("def f(x):", escaped(stop_token_ids=(-5,)), r"^SamplingParams\.stop_token_ids\[0\] must be a token id"),
    ("def f(x):", escaped(logprobs=10**6), r"^SamplingParams\.logprobs must be <= 20 or None, got 1000000$"),
    ("def f(x):", escaped(max_tokens=0), r"^SamplingParams\.max_tokens must be >= 1, got 0$"),
]


@pytest.mark.parametrize(("prompt", "params", "match"), ADMISSION, ids=[f"row{i}" for i in range(len(ADMISSION))])
def test_refused_requests_leave_the_running_ones_unchanged(llm, prompt, params, match):
    """Every row is refused by ``add_request`` with a ValueError naming the field; the two requests that were
    decoding beside it finish with their solo tokens, and the refused call took no request id."""
    def poison(engine):
        counter = engine.scheduler.counter
        with pytest.raises(ValueError) as err:
            engine.add_request(prompt, params)
        assert type(err.value) is ValueError
        assert re.search(match, str(err.value)), str(err.value)
        assert len(str(err.value)) < 400 and engine.scheduler.counter == counter

    assert_unchanged(llm, run_beside(llm.engine, poison))


def test_a_generate_call_with_a_poisoned_request_is_refused_whole(llm):
    """``LLM.generate`` checks every request before any runs (vLLM's contract): a poisoned one refuses the call,
    nothing is queued, and the same call without it gives each request its solo tokens."""
    prompts = [p for p, _ in BESIDE]
    params = [sp for _, sp in BESIDE]
    for bad in (escaped(top_k=2**63), SamplingParams(max_tokens=MAX_MODEL_LEN)):
        with pytest.raises(ValueError, match=r"top_k|maximum context length"):
            llm.generate(prompts + ["def f(x):"], params + [bad])
        assert not llm.engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == llm.solo


def test_a_long_text_prompt_is_refused_without_being_tokenized(llm):
    """The zoo's byte-level BPE maps a token to at most ``token_span`` characters, so a text of more than
    ``max_model_len`` times that many cannot fit: the 3.9 MB prompt is refused from its length alone."""
    sched = llm.engine.scheduler
    span = token_span(sched.tokenizer)
    assert span == max(len(t) for t in sched.tokenizer.get_vocab())
    assert sched.token_floor(HUGE_TEXT) == -(-len(HUGE_TEXT) // span) >= MAX_MODEL_LEN
    assert sched.token_floor("x" * (MAX_MODEL_LEN * span)) == MAX_MODEL_LEN  # the floor is tight at the limit
    # the floor never exceeds the real count, on the prompts of this file and on the worst case, one long token
    for text in [p for p, _ in BESIDE] + ["def f(x):", " " * 39 * 3, "-" * 32 * 3]:
        assert sched.token_floor(text) <= len(sched.tokenizer(text)["input_ids"]), text


def test_the_context_is_a_hard_limit_and_max_tokens_none_fills_it(llm):
    """A prompt plus ``max_tokens`` exactly at ``max_model_len`` runs to its end; one token more is refused,
    naming both numbers; ``max_tokens=None`` decodes up to the context, as vLLM."""
    prompt = [5, 6, 7, 8]
    fits = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(prompt), ignore_eos=True)
    out = llm.generate([prompt], fits)[0].outputs[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - len(prompt) and out.finish_reason == "length"
    with pytest.raises(ValueError, match=CONTEXT + rf" {MAX_MODEL_LEN + 1} tokens \(4 in the prompt, 125 in"):
        llm.generate([prompt], SamplingParams(max_tokens=MAX_MODEL_LEN - len(prompt) + 1))
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert full.token_ids == out.token_ids and full.finish_reason == "length"


# ----------------------------------------------------------------------------- extreme values that run

def _tokens(llm, params, prompt="def parse(line):\n") -> list[int]:
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def test_extreme_sampling_values_decode_what_their_limits_decode(llm):
    """Values at the edges decode as the limit they stand for, never garbage: a temperature below 0.01 as 0.01
    (it decoded every token as id 0), a top_k of int64's largest as top-k off, a top_p that is 0 in float32 as
    the most likely token alone (greedy), the largest float32 temperature without NaN, and seeds at int64's
    edges."""
    sampled = dict(max_tokens=24, ignore_eos=True, seed=3)
    with pytest.warns(UserWarning, match="raised to 0.01"):
        tiny = SamplingParams(temperature=1e-40, **sampled)
    at_floor = _tokens(llm, tiny)
    assert at_floor == _tokens(llm, SamplingParams(temperature=0.01, **sampled)) and set(at_floor) != {0}
    assert _tokens(llm, SamplingParams(temperature=1.0, top_k=INT64_MAX, **sampled)) == \
        _tokens(llm, SamplingParams(temperature=1.0, top_k=0, **sampled))
    assert _tokens(llm, SamplingParams(temperature=1.0, top_k=VOCAB, **sampled)) == \
        _tokens(llm, SamplingParams(temperature=1.0, **sampled))
    greedy = _tokens(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert _tokens(llm, SamplingParams(temperature=1.0, top_p=1e-300, **sampled)) == greedy
    hot = _tokens(llm, SamplingParams(temperature=3.4028234663852886e38, **sampled))
    assert len(hot) == 24 and all(0 <= t < VOCAB for t in hot)
    for seed in (INT64_MAX, -(2**63)):
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed)
        assert _tokens(llm, params) == _tokens(llm, params)


# ----------------------------------------------------------------------------- failures no check can catch

class FailingHook:
    """A prefill hook (as ``extract_hidden_states``' writer) that fails for the prompt ``"poison"``: a disk full
    while one request's hidden states are written."""

    layers = ()

    def __call__(self, reqs, tokens, lens, hiddens):
        if any(r.prompt == "poison" for r in reqs):
            raise OSError("No space left on device")


class FailingStops:
    """A request's stop-string state whose ``feed`` raises on its ``at``-th token: the request's own host work
    failing in the middle of a decode step."""

    def __init__(self, at: int):
        self.left = at

    def feed(self, chunk: str):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("stop rule failed")
        return None


@pytest.fixture
def hooked(llm):
    """The module's engine with :class:`FailingHook` installed (removed afterwards)."""
    hooks = llm.engine.runner.prefill_hooks
    llm.engine.runner.prefill_hooks = hooks + (FailingHook(),)
    yield llm
    llm.engine.runner.prefill_hooks = hooks


def _assert_failed_alone(out, message: str) -> None:
    (seq,) = out.outputs
    assert seq.finish_reason == "error" and seq.error == message and seq.stop_reason is None


def test_a_request_whose_prefill_fails_is_finished_alone(hooked):
    """Through ``add_request``/``step`` and through ``LLM.generate``: the failing request ends with
    ``finish_reason="error"`` and the error, the others finish with their solo tokens, and its slot serves the
    next request."""
    llm = hooked
    added = {}

    def poison(engine):
        with pytest.warns(UserWarning, match="failed and was finished alone: OSError: No space left on device"):
            added["id"] = engine.add_request("poison", SamplingParams(max_tokens=5, n=2))
            return engine.step()  # admitted and failed in this step

    done = run_beside(llm.engine, poison)
    assert_unchanged(llm, done)
    out = done[added["id"]]
    assert [s.finish_reason for s in out.outputs] == ["error", "error"] and out.outputs[0].token_ids == []
    with pytest.warns(UserWarning, match="OSError"):
        outs = llm.generate([BESIDE[0][0], "poison", BESIDE[1][0]], [BESIDE[0][1], SamplingParams(), BESIDE[1][1]])
    _assert_failed_alone(outs[1], "OSError: No space left on device")
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == llm.solo


def test_a_request_whose_step_work_fails_is_finished_alone(llm):
    """A request whose own host work raises in the middle of a decode step (its stop rule, here) is finished
    alone with the tokens it had; the step's other rows keep theirs, and every later step runs without it."""
    added = {}

    def poison(engine):
        added["id"] = engine.add_request("def f(x):", SamplingParams(temperature=0.0, max_tokens=30, stop=["\x00"]))
        engine.scheduler.waiting[-1].stops = FailingStops(at=6)
        with pytest.warns(UserWarning, match="RuntimeError: stop rule failed"):
            return [out for _ in range(6) for out in engine.step()]  # the prefill emits one token, each step one

    done = run_beside(llm.engine, poison)
    assert_unchanged(llm, done)
    out = done[added["id"]]
    _assert_failed_alone(out, "RuntimeError: stop rule failed")
    assert out.outputs[0].token_ids == _tokens(llm, SamplingParams(temperature=0.0, max_tokens=6), "def f(x):")
