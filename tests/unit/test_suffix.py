"""Suffix decoding cache: golden replay against arctic-inference 0.3.0, behaviour, hand cases."""

import json
import random
from pathlib import Path

import pytest

from funcspec.suffix_tree import SuffixDecodingCache

# Recorded from arctic-inference 0.3.0; kept in the repository so a bare clone runs it.
GOLDEN = Path(__file__).resolve().parent / "data" / "suffix_golden.json"


def _golden_cases():
    if not GOLDEN.is_file():
        pytest.fail(f"golden file missing: {GOLDEN}")
    return json.loads(GOLDEN.read_text())["cases"]


def test_golden_replay_matches_arctic():
    """Replay every recorded op; every speculate must reproduce arctic's draft."""
    checked = 0
    for ci, case in enumerate(_golden_cases()):
        cache = SuffixDecodingCache(case["max_tree_depth"], case["max_cached_requests"])
        for ei, ev in enumerate(case["events"]):
            op, req = ev["op"], ev["req_id"]
            if op == "start_request":
                cache.start_request(req, ev["prompt"])
            elif op == "add_active_response":
                cache.add_active_response(req, ev["token_ids"])
            elif op in ("stop_request", "evict_cached_response"):
                getattr(cache, op)(req)
            elif op == "speculate":
                got = cache.speculate(req, ev["context"], ev["max_spec_tokens"],
                                      ev["max_spec_factor"], ev["max_spec_offset"],
                                      ev["min_token_prob"])
                exp, where = ev["expect"], f"case {ci} event {ei}"
                assert got.token_ids == exp["token_ids"], where
                assert got.match_len == exp["match_len"], where
                assert got.probs == pytest.approx(exp["probs"], abs=1e-5), where
                assert got.score == pytest.approx(exp["score"], abs=1e-5), where
                assert got.parents == list(range(-1, len(got.token_ids) - 1)), where
                checked += 1
            else:
                pytest.fail(f"unknown op {op!r} in case {ci} event {ei}")
    assert checked == 809


def _response(task: int, n: int = 120) -> list[int]:
    """The 'model': the same response for the same task every round, built from phrases."""
    rng = random.Random(task)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(3, 8))] for _ in range(6)]
    out = []
    while len(out) < n:
        out += rng.choice(phrases)
    return out[:n]


def _run_round(cache: SuffixDecodingCache, rnd: int, tasks, k: int = 8) -> float:
    """Serve each task once as the engine would; return accepted / drafted tokens."""
    drafted = accepted = 0
    for task in tasks:
        req, prompt, truth = f"task{task}-round{rnd}", [100 + task, 101, 102], _response(task)
        cache.start_request(req, prompt)
        out = truth[:1]  # prefill emits the first token without a draft
        cache.add_active_response(req, out)
        while len(out) < len(truth):
            context = (prompt + out)[-cache.max_tree_depth:]
            draft = cache.speculate(req, context, max_spec_tokens=k).token_ids
            n = 0
            while n < len(draft) and len(out) + n < len(truth) and draft[n] == truth[len(out) + n]:
                n += 1
            drafted, accepted = drafted + len(draft), accepted + n
            new = truth[len(out):len(out) + n + 1]  # accepted tokens plus the bonus token
            cache.add_active_response(req, new)
            out += new
        cache.stop_request(req)
    assert drafted > 0
    return accepted / drafted


def test_repeated_rounds_raise_acceptance():
    cache = SuffixDecodingCache()
    rates = [_run_round(cache, rnd, tasks=range(3)) for rnd in range(4)]
    assert rates[-1] > rates[0]
    assert rates[-1] > 0.6
    assert not cache.active_requests and len(cache.cached_requests) == 12


def test_max_spec_factor_and_offset_cap_the_draft():
    cache = SuffixDecodingCache(max_tree_depth=8)
    cache.start_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])

    def draft(**kw):
        return cache.speculate("r", [5, 1, 2], **{"max_spec_tokens": 8, **kw})

    # [5, 1, 2] is absent and the whole context is never matched: best match is [1, 2].
    assert draft().token_ids == [3, 4] and draft().match_len == 2
    assert draft(max_spec_factor=0.5).token_ids == [3]
    assert draft(max_spec_offset=1.0).token_ids == [3, 4, 5]
    assert draft(max_spec_offset=1.0, max_spec_tokens=2).token_ids == [3, 4]
    # Depth 8 holds at most 8 tokens per suffix: [1, 2] + 6 more.
    assert draft(max_spec_factor=4.0).token_ids == [3, 4, 5, 6, 7, 8]


def test_min_token_prob_cuts_the_path():
    cache = SuffixDecodingCache(max_tree_depth=8)
    cache.start_request("r", [1, 2, 1, 2, 1, 2, 1, 3])  # after 1: 2 three times, 3 once

    def draft(p):
        return cache.speculate("r", [0, 1], max_spec_factor=8.0, min_token_prob=p)

    assert draft(0.6).token_ids == [2, 1] and draft(0.6).probs == [0.75, 0.75]
    d = draft(0.4)
    assert d.token_ids == [2, 1, 2, 1] and d.probs == [0.75, 0.75, 0.5, 0.5]
    assert d.score == 2.5 and d.parents == [-1, 0, 1, 2]
    assert draft(0.1).token_ids == [2, 1, 2, 1, 2, 1, 3]


@pytest.mark.parametrize("prompt,first", [
    ([1, 5, 1, 6, 1, 7, 1, 5, 1, 7], 5),  # 7 catches up from inside its group: goes behind 5
    ([1, 5, 1, 6, 1, 7, 1, 5, 1, 6], 6),  # 6 heads its group when it catches up: goes first
])
def test_equal_counts_follow_arctic_sibling_order(prompt, first):
    cache = SuffixDecodingCache()
    cache.start_request("r", prompt)
    assert cache.speculate("r", [0, 1]).token_ids == [first]


def test_global_cache_evicts_fifo():
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=2)
    for req, resp in [("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])]:
        cache.start_request(req, [0])
        cache.add_active_response(req, resp)
        cache.stop_request(req)
    assert list(cache.cached_requests) == ["b", "c"]

    cache.start_request("d", [0])
    assert list(cache.cached_requests) == ["c", "d"]  # b went when d took a slot
    assert cache.speculate("d", [0, 7, 8]).token_ids == [9]
    assert cache.speculate("d", [0, 4, 5]).token_ids == []
    cache.stop_request("d")

    cache.start_request("c", [0])  # reusing an id drops its old response, re-queues it
    assert list(cache.cached_requests) == ["d", "c"]
    assert cache.speculate("c", [0, 7, 8]).token_ids == []
    cache.evict_cached_response("c")
    cache.add_active_response("c", [7, 8, 9])  # evicted while active: local tree only
    assert list(cache.cached_requests) == ["d"] and list(cache.active_requests) == ["c"]


def test_misuse_is_refused():
    cache = SuffixDecodingCache(max_cached_requests=0)
    cache.start_request("r", [1, 2])
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("r", [1])
    with pytest.raises(ValueError, match="not active"):
        cache.speculate("x", [1, 2])
    with pytest.raises(ValueError, match="not cached"):
        cache.evict_cached_response("r")  # global cache disabled
    cache.stop_request("r")
    with pytest.raises(ValueError, match="not active"):
        cache.add_active_response("r", [3])
