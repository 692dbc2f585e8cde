"""``funcspec bench serve`` at a small size: the zoo target with its EAGLE-3 head, eager, a pool of 4 requests,
10 mixed jobs at concurrency 2. Behaviour, not speed: nothing lost or duplicated, every completed request equal
to its solo run (and the solo runs to an in-process ``LLM``), no compile after start-up, and every field of
the report (JSON and markdown) present."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")  # brings httpx2, the bench's client
pytest.importorskip("fastapi")

from funcspec.bench import serve  # noqa: E402
from funcspec.cli import build_parser  # noqa: E402


def test_pool_and_jobs_mix_every_kind():
    bodies = serve.pool(8)
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) == 8
    assert {b["temperature"] > 0 for b in bodies} == {True, False}
    assert all(b["seed"] for b in bodies if b["temperature"] > 0)  # sampled requests are seeded
    plan = serve.jobs(10, bodies, seed=0)
    assert len(plan) == 10 and {k for k, _ in plan} == set(serve.KINDS)
    assert serve.jobs(10, bodies, seed=0) == plan
    assert all(bodies[i]["ignore_eos"] and bodies[i]["max_tokens"] >= 48 for k, i in plan if k == "disconnect")
    for variant in serve.INVALID:
        body, status = serve.invalid_body(variant, 256)
        assert status in (400, 404, 422)
    assert serve.parse_levels("1:4,16:1000") == [(1, 4), (16, 1000)]
    with pytest.raises(ValueError, match="CONCURRENCY:REQUESTS"):
        serve.parse_levels("0:4")


def test_memory_quarters():
    flat = serve.memory([(t, 100.0 + (t > 5) * 1.0) for t in range(9)])
    assert flat["flat"] and flat["rss_start_mib"] == 100.0 and flat["rss_end_mib"] == 101.0
    leak = serve.memory([(t, 100.0 + 10 * t) for t in range(9)])
    assert not leak["flat"] and leak["growth_q2_to_q4"] > 0.05


@pytest.mark.slow
def test_bench_serve_small(tmp_path):
    args = build_parser().parse_args(
        ["bench", "serve", "--configs", "spec", "--enforce-eager", "--levels", "2:10", "--pool", "4",
         "--out", str(tmp_path), "--inductor-cache-dir", str(tmp_path / "inductor")])
    path = args.func(args)
    result = json.loads(path.read_text())
    assert path.with_suffix(".md").read_text().startswith("# funcspec bench serve")
    assert result["bench"] == "serve" and result["machine"]["flags"]
    (row,) = result["rows"]
    assert row["backend"] == "eager" and row["in_process"]["backend"] == "eager"
    assert row["reference_differs_from_in_process"] == []
    assert row["recompiles_after_startup"] == 0
    assert row["rss_start_mib"] > 0 and row["rss_end_mib"] > 0
    (level,) = row["levels"]
    assert level["concurrency"] == 2 and level["skipped"] == 0
    assert level["lost"] == 0 and level["duplicated"] == 0 and level["mismatches"] == 0
    assert level["failed"] == 0 and level["server_errors"] == 0
    assert level["completed"] + level["disconnected"] + level["rejected"] == 10
    assert level["disconnected"] >= 1 and level["rejected"] >= 1 and level["completed"] >= 1
    ended = level["server_ended"]
    assert sum(ended.values()) == level["completed"] + level["disconnected"] and ended["error"] == 0
    for key in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        assert level[key] is not None and level[key] > 0, key
    assert level["memory"]["rss_start_mib"] > 0 and level["memory"]["samples"] >= 2
    over = row["overhead"]
    assert over["mismatches"] == 0 and over["lost"] == 0 and over["completed"] == 4
    assert over["tpot_mean_ms"] > 0 and over["in_process_engine_tpot_mean_ms"] > 0
    assert over["in_server_engine_tpot_mean_ms"] > 0 and over["server_overhead"] is not None
    assert set(result["goals"]["zoo-eagle3"]) >= {"tpot_c1_over_engine", "largest_level"}
