"""The benchmarks run end to end and write what they promise (eager backend, tiny model: fast)."""

import json

from funcspec.bench import capture, spec


def test_bench_capture_writes_json_and_plot(tiny_llama, tmp_path):
    res = capture.run(tiny_llama, batches=(1, 2), ks=(0, 2), backend="eager", reps=3, prompt_len=8,
                      warm=False, out_dir=tmp_path)
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".png"]
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["buckets"]
    assert [(r["B"], r["K"], r["tokens"]) for r in rows] == [(1, 0, 1), (1, 2, 3), (2, 0, 2), (2, 2, 6)]
    assert all(r["eager_ms"] > 0 and r["replay_ms"] > 0 and r["recompiles"] == 0 for r in rows)
    assert res["backend"] == "eager"


def test_bench_spec_compares_with_hf_on_the_same_prompts(tiny_llama, tiny_draft, tmp_path):
    res = spec.run(tiny_llama, methods=["ngram", "draft_model"], k=2, batch=2, num_prompts=3, max_tokens=8,
                   draft=tiny_draft, out_dir=tmp_path)
    rows = {(r["engine"], r["method"]): r for r in res["rows"]}
    assert set(rows) == {("funcspec", "ar"), ("funcspec", "ngram"), ("funcspec", "draft_model"),
                         ("hf", "greedy"), ("hf", "greedy, batch 2"), ("hf", "prompt_lookup"), ("hf", "assistant")}
    assert all(r["matches_ar_greedy"] for r in res["rows"]), "every engine must reproduce AR greedy"
    assert rows[("funcspec", "ar")]["speedup_vs_funcspec_ar"] == 1.0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]
