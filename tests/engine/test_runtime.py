"""The runtime: every graph compiled while the engine starts, none afterwards; lazy capture; the compile cache."""

import os

import pytest
import torch

from funcspec import LLM, Engine, SamplingParams, sampling

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 17, 33, 5, 17], list(range(10, 25)), [44, 9, 71, 8, 44, 9], [3] * 7]
LONG = [7, 8, 9, 10, 11] * 14  # 70 tokens


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _mixed(eng):
    """Batch 4 greedy, one top-p request, two plain-temperature ones, then 3 long prompts: every batch size
    1..4 as requests finish, all three sampling modes, and contexts from 5 to 90 tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return (_ids(eng.generate(PROMPTS, [greedy, greedy, SamplingParams(temperature=0.0, max_tokens=5,
                                                                       ignore_eos=True), greedy]))
            + _ids(eng.generate(PROMPTS[:1], SamplingParams(temperature=0.9, top_p=0.8, max_tokens=10, seed=1,
                                                            ignore_eos=True)))
            + _ids(eng.generate(PROMPTS[1:3], SamplingParams(temperature=0.7, max_tokens=8, seed=2,
                                                             ignore_eos=True)))
            + _ids(eng.generate([LONG] * 3, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))))


def test_after_startup_a_mixed_workload_compiles_nothing_and_a_second_start_loads_it(tiny_llama, tmp_path, monkeypatch,
                                                                                  rows_free_ops):
    """The engine compiles B = 1 and a symbolic batch, greedy and filtered, at one context length, with one
    helper process: it compiles two of the four graphs (one per batch bucket, dealt in turn) and files them, and
    the engine loads them; then the mixed workload (batches 1-4, greedy / top-p / plain temperature, 5-90
    tokens of context) compiles nothing, its plain-temperature requests run in the filtered graph, and every
    token equals the eager engine's.

    Then the step store: an identical engine started again loads its graphs (nothing traced) and runs the same
    workload to the same tokens, compiling nothing; another K is another key, compiled anew;
    ``FUNCSPEC_GRAPH_STORE=0`` compiles without the store. NOTE: one test, so that the four graphs are compiled
    once, in an inductor cache of its own (nothing of the rest of the suite's is loaded)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = dict(backend="inductor", max_num_seqs=4, max_model_len=96, ops=rows_free_ops)
    eng = Engine(tiny_llama, NGRAM, compilation_config={"compile_helpers": 1}, **args)
    t = 96 + 2 + 1  # max_model_len + K + 1: the one context bucket
    assert eng.plan.bucket_plan.context_buckets == (t,) and eng.startup_seconds > 0
    assert sorted(eng.runner.compiled) == [(0, 2, t, "filtered"), (0, 2, t, "greedy"),
                                           (1, 2, t, "filtered"), (1, 2, t, "greedy")]
    made = [(g.stats.compiles, g.stats.loaded, g.stats.helper) for _, g in sorted(eng.runner.compiled.items())]
    assert made == [(1, False, None), (0, True, 1), (1, False, None), (0, True, 1)]
    assert [g["helper"] for g in eng.stats()["graphs"].values()].count(1) == 2
    with torch.compiler.set_stance("fail_on_recompile"):
        out = _mixed(eng)
    assert len(eng.runner.compiled) == 4 and eng.stats()["recompiles"] == 0
    # the plain-temperature rows ran as random buckets, in the filtered graph (EnginePlan.graph_modes)
    assert {key[3] for key in eng.graphs} == {"greedy", "random", "filtered"}
    assert all(g is eng.runner.compiled[eng.plan.bucket_plan.graph_batch(key[0]), 2, t, "filtered"]
               for key, g in eng.graphs.items() if key[3] == "random")
    assert {"B1_K2", "B2_K2", "B3_K2", "B4_K2"} <= set(eng.stats()["buckets_used"])
    assert out == _mixed(Engine(tiny_llama, NGRAM, backend="eager", max_num_seqs=4, max_model_len=96,
                                ops=rows_free_ops))

    again = Engine(tiny_llama, NGRAM, compilation_config={"compile_helpers": 1}, **args)  # all filed: no helper
    assert [(g.stats.loaded, g.stats.helper) for g in again.runner.compiled.values()] == [(True, None)] * 4
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _mixed(again) == out
    assert again.stats()["recompiles"] == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    other = Engine(tiny_llama, {**NGRAM, "num_speculative_tokens": 1}, compilation_config={"capture": "lazy"}, **args)
    other.generate(PROMPTS[:1], greedy)
    assert [g.stats.loaded for g in other.runner.compiled.values()] == [False]
    monkeypatch.setenv("FUNCSPEC_GRAPH_STORE", "0")
    plain = Engine(tiny_llama, NGRAM, compilation_config={"capture": "lazy"}, **args)
    assert _ids(plain.generate(PROMPTS[:1], greedy)) == _ids(eng.generate(PROMPTS[:1], greedy))  # one graph
    assert [(g.stats.compiles, g.stats.loaded) for g in plain.runner.compiled.values()] == [(1, False)]


def test_capture_logprobs_compiles_the_logprobs_graph_at_startup(tiny_llama, traced_codegen):
    """``capture_logprobs`` (what ``funcspec serve`` sets): a request with logprobs then compiles nothing either.
    NOTE: which graphs start-up captures, and that none recompiles, is Dynamo's: its graphs stand in for inductor's
    codegen (``traced_codegen``); logprobs graphs compile by real inductor in tests/engine/test_logprobs.py."""
    eng = Engine(tiny_llama, backend="inductor", max_num_seqs=1, max_model_len=32,
                 compilation_config={"capture_logprobs": True})
    assert sorted(key[3] for key in eng.runner.compiled) == ["filtered", "filtered_logprobs", "greedy"]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True))
    assert len(eng.runner.compiled) == 3 and len(out[0].outputs[0].logprobs) == 4
    assert LLM(tiny_llama, max_num_seqs=1, max_model_len=32, enforce_eager=True,
               compilation_config={"capture_logprobs": True}).engine.startup_modes[-1].name == "filtered_logprobs"


def test_lazy_capture_compiles_each_graph_on_first_use(tiny_llama, traced_codegen):
    """Nothing at start-up; the first greedy request captures its one graph, not the filtered one a start-up
    capture adds (Dynamo's graph in place of inductor's codegen, as in the test above)."""
    eng = Engine(tiny_llama, backend="inductor", max_num_seqs=1, max_model_len=32,
                 compilation_config={"capture": "lazy"})
    assert eng.runner.compiled == {} and eng.startup_seconds == 0.0
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert list(eng.runner.compiled) == [(1, 0, 33, "greedy")]
    llm = LLM(tiny_llama, max_num_seqs=2, max_model_len=32, compilation_config={"capture": "lazy"})
    assert llm.engine.backend == "inductor" and llm.engine.runner.compiled == {}
    with pytest.raises(ValueError, match="capture must be one of \\('startup', 'lazy'\\), got 'eventually'"):
        Engine(tiny_llama, compilation_config={"capture": "eventually"}, enforce_eager=True)


def test_symbolic_batch_only_where_two_buckets_share_it(tiny_llama):
    """One bucket above 1 stays a static graph; eager and device graphs never take a symbolic batch."""
    one = Engine(tiny_llama, backend="inductor", max_num_seqs=4,
                 compilation_config={"batch_sizes": [4], "capture": "lazy"})
    assert not one.plan.bucket_plan.symbolic_batch and one.runner.graph_key(4, 0, 10, sampling.GREEDY)[0] == 4
    eager = Engine(tiny_llama, backend="eager", max_num_seqs=4)
    assert not eager.plan.bucket_plan.symbolic_batch and eager.plan.bucket_plan.batch_buckets == (1, 2, 4)


def test_precompile_writes_a_compile_cache_that_a_fresh_machine_starts_from(tiny_llama, tmp_path, monkeypatch,
                                                                           capsys):
    """`funcspec precompile` writes torch's cache entries and the compiled steps; an engine on an empty
    inductor cache (a second machine) given that file traces and compiles nothing, and decodes as eager does.
    It compiles in its own process, whatever FUNCSPEC_COMPILE_HELPERS says: torch records only that process's
    cache entries."""
    from funcspec.capture import helpers
    from funcspec.cli import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # restored after the test
    monkeypatch.setenv(helpers.ENV, "1")
    monkeypatch.setattr(helpers.Helpers, "start", lambda *a: pytest.fail("precompile started a helper"))
    out = tmp_path / "cache.zip"
    main(["precompile", tiny_llama, "--max-num-seqs", "1", "--max-model-len", "32", "--out", str(out)])
    assert os.environ[helpers.ENV] == "1"
    printed = capsys.readouterr().out
    assert "captured 2 graph(s)" in printed and "B1_K0_T33_greedy" in printed and out.stat().st_size > 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "second-machine"))
    eng = Engine(tiny_llama, backend="inductor", max_num_seqs=1, max_model_len=32,
                 compilation_config={"compile_cache": str(out)})
    assert eng.compile_cache["bytes"] == out.stat().st_size and eng.compile_cache["steps"] == 2
    assert [(g.stats.loaded, g.stats.compiles) for g in eng.runner.compiled.values()] == [(True, 0)] * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eager = Engine(tiny_llama, backend="eager", max_num_seqs=1, max_model_len=32)
    assert _ids(eng.generate(PROMPTS[:1], greedy)) == _ids(eager.generate(PROMPTS[:1], greedy))
    with pytest.raises(ValueError, match="compile_cache: .*missing.zip is not a file written by `funcspec precompile`"):
        Engine(tiny_llama, compilation_config={"compile_cache": str(tmp_path / "missing.zip")}, enforce_eager=True)


def test_bench_runtime_splits_a_step_into_graph_and_host(tiny_llama):
    from funcspec.bench import runtime

    eng = Engine(tiny_llama, backend="eager", max_num_seqs=4, max_model_len=64)
    row = runtime.host_split(eng, [5, 6, 7], batch=4, steps=16)
    assert row["batch"] == 4 and row["steps"] >= 14
    assert 0 < row["graph_ms"] <= row["step_ms"] and row["host_ms"] >= 0
    assert row["host_fraction"] == pytest.approx(row["host_ms"] / row["step_ms"])
    assert [m[0] for m in runtime.models(["zoo"])] == ["zoo-eagle3", "zoo-ar"]
    with pytest.raises(ValueError, match="--models: 'gpt5' is neither 'zoo' nor a bench scale shape"):
        runtime.models(["gpt5"])


def test_bench_runtime_contention_pairs_quiet_and_busy_runs():
    """A contention row's slowdown is the median of each quiet/busy pair's ratio; the report names every setting's
    environment; other work's share is the machine's busy time less this process's and its children's."""
    import os
    import statistics

    from funcspec.bench import runtime
    from funcspec.bench.scale import machine_info

    children = [{"quiet": [1000.0, 900.0], "busy": [500.0, 100.0], "others": [0.0] * 4},
                {"quiet": [800.0, 1200.0], "busy": [400.0, 300.0], "others": [0.1, 0.0, 0.2, 0.0]}]
    row = runtime._contention_row("spin", {"GOMP_SPINCOUNT": "1000"}, children)
    assert row["slowdown"] == statistics.median([2.0, 9.0, 2.0, 4.0]) and row["slowdown_range"] == [2.0, 9.0]
    assert (row["quiet_tokens_per_s"], row["busy_tokens_per_s"], row["others_median"]) == (950.0, 350.0, 0.0)
    result = {"machine": machine_info(), "rows": [], "threads": 2, "max_tokens": 8,
              "contention": {"busy": 2, "rounds": 2, "max_tokens": 8, "pairs": 2, "rows": [row]}}
    text = runtime.markdown(result)
    assert "| spin | GOMP_SPINCOUNT=1000 | 950 (800-1200) | 350 (100-500) | 3.0x (2.0-9.0) | 0% |" in text
    assert "| model |" not in text  # no model rows: no table for them
    # (wall s, machine busy CPU s, ours): 2 s of wall, 3 CPU s busy of which 1 ours -> 2 CPU s of others
    assert runtime._others_share((10.0, 100.0, 5.0), (12.0, 103.0, 6.0)) == pytest.approx(2 / (2 * os.cpu_count()))
    assert runtime._others_share((0.0, 0.0, 0.0), (1.0, 1.0, 2.0)) == 0.0  # never below 0


def test_bench_runtime_stops_children_that_outlive_their_time(tmp_path, monkeypatch):
    """A child that never finishes (a start-up stuck on a lock) fails the bench within the time limit, naming its
    arguments, and every child is stopped with it; a failing child's error names its exit status."""
    import sys
    import time

    from funcspec.bench import runtime

    started = tmp_path / "started"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho $$ >> {started}\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"child --startup-only still running after 2 s; stopped"):
        runtime._spawn_all([["--startup-only"], ["--startup-only"]], None, 1, timeout=2.0)
    assert time.monotonic() - t0 < 30
    pids = [int(p) for p in started.read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # killed and reaped: no such process is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    fake.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"child failed \(3\):\nboom"):
        runtime._spawn_all([["--startup-only"]], None, 1)
