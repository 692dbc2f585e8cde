"""The engine's public surface: add_request/step, Engine.bucket, incremental detokenization."""

import random

import pytest
import torch

from funcspec import Engine, SamplingParams
from funcspec.scheduler import Detokenizer, StopStrings
from funcspec.token_tree import Chain
from funcspec.verifiers import VerifyConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_add_request_and_step_match_generate(tiny_llama, tiny_draft):
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2}
    prompts = [[5, 6, 7], [9, 8, 7, 6], [3, 4]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 12, 9)]
    want = [o.outputs[0].token_ids for o in
            Engine(tiny_llama, speculative_config=spec, max_num_seqs=2, max_model_len=64,
                   enforce_eager=True).generate(prompts, params)]
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert ids == ["0", "1", "2"] and eng.has_unfinished_requests()
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in done and out.outputs[0].finish_reason == "length"
            done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == want
    assert eng.step() == []  # nothing left: a no-op


def test_bucket_is_the_step_the_engine_runs(tiny_llama):
    """Calling bucket.fn on live rows yields the tokens that Engine.step would have emitted."""
    prompt = [5, 6, 7, 8]
    ref = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    want = ref.generate([prompt], GREEDY)[0].outputs[0].token_ids
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    eng.add_request(prompt, GREEDY)
    eng.step()  # prefill + one decode step: two tokens
    got = list(eng.running[0].output_ids)
    for _ in range(5):
        bucket = eng.bucket(1, 0, live=1)
        assert bucket.key == (1, 0, eng.t_max, "filtered") and bucket.name == f"B1_K0_T{eng.t_max}_filtered"
        out, new_state = bucket.fn(*bucket.args)
        assert new_state.kv.lens[0] == len(prompt) + len(got)
        got.append(int(out.tokens[0, 0]))
        eng.runner.state = new_state
    assert got == want[:len(got)]


def test_one_step_serves_chains_and_trees_and_refuses_drafts_without_parents(tiny_llama, monkeypatch):
    """Every bucket's proposal carries parents (a chain's are i - 1) and its rule returns the accepted path;
    a proposer that hands the step drafts without parents is refused, by name, while the step is traced."""
    from funcspec.proposers import echo
    from funcspec.types import Proposal

    eng = Engine(tiny_llama, {"method": "echo", "num_speculative_tokens": 2}, max_num_seqs=2, max_model_len=64,
                 enforce_eager=True)
    eng.add_request([5, 6, 7, 8], GREEDY)
    eng.step()
    bucket = eng.bucket(1, 2, live=1)
    sc = bucket.fn.args[0]
    assert sc.tree == Chain(2) and sc.verify == VerifyConfig("standard")  # the filtered mode: filters on
    out, _ = bucket.fn(*bucket.args)
    assert out.tokens.shape == (1, 3) and out.num_drafts.tolist() == [2]
    monkeypatch.setattr(echo, "propose", lambda cfg, params, state, ctx, k: (Proposal(ctx.history[ctx.slots, :k]),
                                                                              state))
    bucket = eng.bucket(1, 2, live=1)
    with pytest.raises(ValueError, match=r"^funcspec.proposers.echo.propose returned drafts without parents: every "
                                         r"proposal carries them"):
        bucket.fn(*bucket.args)


def test_bucket_refuses_bad_arguments(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    with pytest.raises(ValueError, match=r"k must be one of this engine's K values \(0,\)"):
        eng.bucket(1, 3)
    with pytest.raises(ValueError, match=r"live rows must be in \[0, 2\]"):
        eng.bucket(2, 0, live=3)
    with pytest.raises(ValueError, match=r"mode must be a funcspec.sampling.Mode .*'greedy'"):
        eng.bucket(1, 0, mode="greedy")  # a name: sampling.MODES["greedy"] is the Mode


def test_incremental_text_equals_a_full_decode(default_model):
    """The streamed text of any id sequence is the tokenizer's decode of all of it, fast and slow paths."""
    tok = Engine(default_model, max_num_seqs=1, max_model_len=32, enforce_eager=True).model.tokenizer
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        for slow in (False, True):
            d = Detokenizer(tok)
            if slow:
                d.stream = None
            for t in ids:
                d.step(t)
            assert d.text == tok.decode(ids, skip_special_tokens=True), (trial, slow)


def test_stop_strings_decode_each_token_once(default_model, monkeypatch):
    """Stop strings are found without re-decoding the output: the tokenizer decodes once, at the end."""
    eng = Engine(default_model, max_num_seqs=1, max_model_len=128, enforce_eager=True)
    tok = eng.model.tokenizer
    calls = {"decode": 0}
    real = type(tok).decode

    def counting(self, *a, **k):
        calls["decode"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(type(tok), "decode", counting)
    out = eng.generate("def main():", SamplingParams(temperature=0.0, max_tokens=60, stop=["\x00never"],
                                                     ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    assert calls["decode"] == 1  # the final text


def test_stop_string_split_across_chunks():
    s = StopStrings(("abc", "zz"))
    assert s.feed("xxa") is None and s.feed("b") is None
    assert s.feed("cab") == (2, "abc")
    s = StopStrings(("zz",))
    assert [s.feed(c) for c in ("z", "z", "z")] == [None, (0, "zz"), (1, "zz")]
    s = StopStrings(("abc", "b"))
    assert s.feed("ab") == (1, "b")  # the earliest start wins


def test_a_stop_string_completed_before_min_tokens_is_not_found_again():
    """As in vLLM: only text that a token adds can complete a stop string."""
    s = StopStrings(("ab",))
    assert s.feed("ab") == (0, "ab")
    assert s.feed("x") is None and s.feed("y") is None


def test_stop_strings_without_a_tokenizer_are_refused(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=1, max_model_len=32, enforce_eager=True)
    assert eng.model.tokenizer is None
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["x"]))
    assert not eng.has_unfinished_requests()


def test_stats_counts_waiting_and_running_sequences_as_requests_come_and_go(tiny_llama):
    """``Engine.stats()`` counts the sequences waiting for a slot and those in one (a request's ``n``
    completions each), at every step; ``waiting_ids`` names the waiting ones; a snapshot does not change later."""
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)

    def counts():
        st = eng.stats()
        return st["waiting"], st["running"]

    assert counts() == (0, 0) and eng.waiting_ids() == set()
    for m in (3, 8, 8):
        eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
    eng.add_request([9, 8], SamplingParams(temperature=0.0, max_tokens=2, n=2, ignore_eos=True))
    first = eng.stats()
    assert counts() == (5, 0) and eng.waiting_ids() == {"0", "1", "2", "3", "3.1"}
    eng.step()  # admits requests 0 and 1 (two slots); each has its first token and one more
    assert counts() == (3, 2) and eng.waiting_ids() == {"2", "3", "3.1"}
    assert (first["waiting"], first["running"], first["steps"]) == (5, 0, 0) and eng.stats()["steps"] == 1
    eng.step()  # request 0 has its 3 tokens: its slot is free after the step
    assert counts() == (3, 1)
    eng.abort_request("3")  # both waiting completions leave the queue
    assert counts() == (1, 1) and eng.waiting_ids() == {"2"}
    eng.step()  # request 2 takes the free slot
    assert counts() == (0, 2)
    while eng.has_unfinished_requests():
        eng.step()
    assert counts() == (0, 0)


def test_stats_keeps_each_buckets_step_times_in_a_bounded_window(tiny_llama):
    """``bucket_timings`` holds each bucket's recent step times, never more than its window, while ``calls``
    counts every step; ``graphs`` names each graph's bucket key and its compiled-step file (none when eager)."""
    import collections
    import statistics

    from funcspec.bench.timing import new_replays
    from funcspec.capture.window import WINDOW, Window

    eng = Engine(tiny_llama, max_num_seqs=1, max_model_len=64, enforce_eager=True)
    eng.runner.replay_ms = collections.defaultdict(lambda: Window(4))  # a small window, to overflow it
    greedy = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    eng.generate([[1, 2, 3]], greedy)  # 10 steps after the prefill's token
    st = eng.stats()
    ((name, bucket),) = st["bucket_timings"].items()
    ((graph_name, graph),) = st["graphs"].items()
    assert name == graph_name == "B1_K0_T65_greedy" and bucket["key"] == graph["key"] == (1, 0, 65, "greedy")
    assert bucket["calls"] == 10 and len(bucket["replay_ms"]) == 4 and all(ms > 0 for ms in bucket["replay_ms"])
    assert bucket["replay_ms_median"] == round(statistics.median(bucket["replay_ms"]), 4)
    assert graph["stored"] is None and graph["calls"] == 10 and graph["backend"] == "eager"
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = eng.stats()
    assert len(st["bucket_timings"][name]["replay_ms"]) == 4 and after["bucket_timings"][name]["calls"] == 12
    assert new_replays(st, after) == {name: list(after["bucket_timings"][name]["replay_ms"][-2:])}
    assert new_replays(after, after) == {} and len(new_replays({"bucket_timings": {}}, after)[name]) == 4
    assert Engine(tiny_llama, max_num_seqs=1, max_model_len=64,
                  enforce_eager=True).runner.replay_ms.default_factory().maxlen == WINDOW


def test_step_timings_are_kept_in_bounded_windows(tiny_llama):
    """Per-step replay times are kept for the last ``WINDOW`` steps only (a server steps forever), per graph and
    per bucket, while ``calls`` still counts every step; ``since`` gives what came after a mark."""
    from funcspec.capture.window import WINDOW, Window

    window = Window(4)
    for x in range(10):
        window.append(x)
    assert list(window) == [6, 7, 8, 9] and window.total == 10
    assert window.since(7) == [7, 8, 9] and window.since(2) == [6, 7, 8, 9] and window.since(10) == []
    eng = Engine(tiny_llama, max_num_seqs=1, max_model_len=64, enforce_eager=True)
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    (graph,) = eng.runner.compiled.values()
    (bucket,) = eng.runner.replay_ms.values()
    for kept in (graph.stats.replay_ms, bucket):
        assert isinstance(kept, Window) and kept.maxlen == WINDOW and kept.total == len(kept) == 9
    assert [g["calls"] for g in eng.stats()["graphs"].values()] == [9]
