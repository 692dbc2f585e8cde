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
    """Start the BESIDE requests, step ``steps`` times, call ``poison(engine)``, then step until every request is
    done; returns the outputs by request id (``poison``'s own requests included)."""
    ids = [engine.add_request(p, sp) for p, sp in BESIDE]
    done = {}
    for _ in range(steps):
        done.update((o.request_id, o) for o in engine.step())
    assert all(engine.scheduler.running[i].output_ids for i in range(2)), "the long requests run before the poison"
    poison(engine)
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
