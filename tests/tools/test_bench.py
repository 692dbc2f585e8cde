"""The benchmarks run end to end and write what they promise (eager backend, tiny model: fast)."""

import json
from pathlib import Path

import pytest
import torch

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
    res = spec.run(tiny_llama, methods=["ngram", "draft_model"], ks=(1, 2), batches=(2,), prompts="repetitive",
                   num_prompts=3, max_tokens=8, heads={"draft_model": tiny_draft}, out_dir=tmp_path)
    rows = {(r["engine"], r["method"], r["k"]): r for r in res["rows"]}
    assert set(rows) == {("funcspec", "ar", 0), ("funcspec", "ngram", 1), ("funcspec", "ngram", 2),
                         ("funcspec", "draft_model", 1), ("funcspec", "draft_model", 2), ("hf", "greedy", 0),
                         ("hf", "greedy, batch 2", 0), ("hf", "prompt_lookup", 1), ("hf", "prompt_lookup", 2),
                         ("hf", "assistant", 1), ("hf", "assistant", 2)}
    assert all(r["matches_ar_greedy"] for r in res["rows"]), "every engine must reproduce AR greedy"
    assert rows[("funcspec", "ar", 0)]["speedup_vs_funcspec_ar"] == 1.0
    assert all(r["tokens"] == 3 * 8 for r in res["rows"])
    draft = rows[("funcspec", "draft_model", 2)]
    assert len(draft["per_position_acceptance"]) == 2 and 1.0 <= draft["tau"] <= 3.0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md", ".png"]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| funcspec | draft_model | 2 | 2 |" in md and "| hf | assistant | 2 | 1 |" in md


def test_bench_spec_refuses_a_neural_method_without_a_checkpoint(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"methods \['eagle3'\] need a checkpoint"):
        spec.run(tiny_llama, methods=["eagle3"], prompts="repetitive", num_prompts=1, out_dir=tmp_path)
    with pytest.raises(ValueError, match="prompts: 'nope.txt'"):
        spec.load_prompts("nope.txt", None, 1, 8)


def test_bench_spec_puts_each_tree_beside_its_chain_at_equal_n(tiny_llama, tmp_path):
    from funcspec import load_model
    from funcspec.checkpoints import init_draft_head

    head = str(init_draft_head("eagle", load_model(tiny_llama), tmp_path / "eagle"))
    tree = {"speculative_token_tree": "[(0,), (1,), (0, 0)]"}
    res = spec.run(tiny_llama, methods=[], ks=(), batches=(2,), prompts="repetitive", num_prompts=2, max_tokens=8,
                   heads={"eagle": head}, hf=False, out_dir=tmp_path / "out", trees=[("eagle", tree)])
    ar, chain, row = res["rows"]
    assert (chain["method"], chain["k"], chain["tree"]) == ("eagle", 3, None)  # the chain at K = N = 3
    assert (row["method"], row["k"], row["tree"]) == ("eagle", 3, tree)
    assert row["speedup_vs_chain"] == row["tokens_per_s"] / chain["tokens_per_s"]
    assert row["tau_vs_chain"] == row["tau"] / chain["tau"] and row["matches_ar_greedy"]
    assert spec.label(row) == "funcspec eagle tree N3 B2"
    assert "| eagle | 3 | 2 |" in next((tmp_path / "out").glob("*.md")).read_text()


def test_package_prompts_are_a_second_corpus_outside_the_stdlib():
    import numpy

    from funcspec import load_model
    from funcspec.train import data
    from funcspec.zoo import model_path

    tok = load_model(model_path("target")).tokenizer
    prompts = spec.load_prompts("package:numpy", tok, 3, 16)
    files = data.package_files("numpy")
    root = Path(numpy.__file__).parent
    assert files == sorted(files) and all(root in f.parents and "tests" not in f.parts for f in files)
    assert [len(p) for p in prompts] == [16] * 3 and all(p[0] == tok.bos_token_id for p in prompts)
    first = next(f for f in files if len(tok.encode(data.read_text(f), add_special_tokens=False)) >= 15)
    assert prompts[0][1:] == tok.encode(data.read_text(first), add_special_tokens=False)[:15]
    assert spec._corpus("package:numpy") == f"numpy {numpy.__version__} (installed package, outside the stdlib)"
    with pytest.raises(ValueError, match="prompts: package 'no_such_pkg' is not an installed package"):
        spec.load_prompts("package:no_such_pkg", tok, 1, 8)


def test_bench_spec_runs_quantized_targets_with_stored_and_quantized_heads(tiny_llama, tiny_draft, tmp_path):
    res = spec.run(tiny_llama, methods=["ngram", "draft_model"], ks=(2,), batches=(2,), prompts="repetitive",
                   num_prompts=2, max_tokens=8, heads={"draft_model": tiny_draft}, hf=False, out_dir=tmp_path,
                   quantization="int8", draft_quantizations=(None, "int4"))
    rows = [(r["method"], r["quantization"], r["draft_quantization"]) for r in res["rows"]]
    assert rows == [("ar", "int8", None), ("ngram", "int8", None), ("draft_model", "int8", None),
                    ("draft_model", "int8", "int4")]
    assert all(r["matches_ar_greedy"] for r in res["rows"]), "lossless against AR on the same int8 weights"
    assert res["quantization"] == "int8" and spec.label(res["rows"][3]) == "funcspec draft_model (int4 head) K2 B2"
    md = next(tmp_path.glob("*.md")).read_text()
    assert md.startswith("Target quantized on load: int8") and "| funcspec | draft_model (int4 head) | 2 | 2 |" in md
    with pytest.raises(ValueError, match="draft_quantizations must be one of"):
        spec.run(tiny_llama, methods=["ngram"], draft_quantizations=("int3",), out_dir=tmp_path)


def test_bench_ep_comm_times_both_collectives_per_case(tmp_path):
    """Two gloo ranks time both patterns for every (T, dtype) case, and the report tabulates each."""
    import argparse

    from funcspec.bench import ep

    ep.run(argparse.Namespace(tokens="1,3", hidden=32, top_k=2, dtypes="float32,bfloat16", rounds=3,
                              out=str(tmp_path)))
    (path,) = tmp_path.glob("ep-comm-*.json")
    r = json.loads(path.read_text())
    assert [(x["tokens"], x["dtype"]) for x in r["rows"]] == [(1, "float32"), (3, "float32"), (1, "bfloat16"),
                                                              (3, "bfloat16")]
    assert all(x["all_reduce_us"] > 0 and x["all_to_all_us"] > 0 for x in r["rows"])
    assert path.with_suffix(".md").read_text().count("| 32 | 2 |") == 4


def test_mean_union_counts_distinct_experts_per_window():
    from funcspec.bench.routing import mean_union

    ids = torch.tensor([[0, 1], [1, 2], [0, 1], [3, 4]])  # windows of 2: {0,1,2} {0,1,2} {0,1,3,4}
    assert mean_union(ids, 5, 1) == 2.0 and mean_union(ids, 5, 2) == pytest.approx((3 + 3 + 4) / 3)
    assert mean_union(ids, 5, 4) == 5.0


def test_bench_routing_records_every_sparse_layer(tmp_path):
    """On a Qwen3-MoE with layer 1 dense: two sparse layers' unions per K, between the two bounds."""
    import argparse

    import transformers

    from funcspec.bench import routing

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(tmp_path / "moe"))
    routing.run(argparse.Namespace(model=str(tmp_path / "moe"), ks="0,1,4", tokens=72, seed=0, dtype="float32",
                                   time=True, reps=2, out=str(tmp_path)))
    (path,) = tmp_path.glob("routing-*.json")
    r = json.loads(path.read_text())
    assert r["sparse_layers"] == [0, 2] and [x["k"] for x in r["rows"]] == [0, 1, 4]
    assert r["rows"][0]["per_layer"] == [2.0, 2.0]  # one token: its top-2
    for x in r["rows"]:
        assert len(x["per_layer"]) == 2 and x["correlated"] <= x["mean_union"] <= x["independent"]
    steps = r["steps"]  # AR reads top-2 in each sparse layer; a step's bytes grow with the experts it reads
    assert [x["k"] for x in steps] == [0, 1, 4] and steps[0]["experts_read"] == 4 and steps[0]["bytes_over_ar"] == 1
    assert all(x["step_ms"] > 0 and (x["bytes"] > steps[0]["bytes"]) == (x["experts_read"] > 4) for x in steps)


def test_llama_cpp_runs_on_plain_buffers_where_its_repacked_decode_crashes(monkeypatch, tmp_path):
    """The probe's child killed by a signal (as by llama.cpp's repacked decode on an AMX Xeon VM) says no, one
    that exits, even with an error, says yes; a Llama loaded meanwhile gets ``use_extra_bufts`` as asked, and
    the defaults come back; a binding without those defaults is left alone."""
    import sys
    import types

    from funcspec.bench import timing

    for i, (probe, repacks) in enumerate((("import os; os.abort()", False), ("pass", True),
                                          ("raise SystemExit(1)", True))):
        monkeypatch.setattr(timing, "_REPACK_PROBE", probe)
        timing.llamacpp_repacks.cache_clear()
        assert timing.llamacpp_repacks(str(tmp_path / f"{i}.gguf")) is repacks
    timing.llamacpp_repacks.cache_clear()
    low = types.ModuleType("llama_cpp.llama_cpp")
    low.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", low)
    sys.modules["llama_cpp"].llama_cpp = low
    default = low.llama_model_default_params
    for repack in (False, True):
        with timing._llamacpp_buffers(repack):
            assert low.llama_model_default_params().use_extra_bufts is repack
        assert low.llama_model_default_params is default
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace())  # a stand-in without the defaults
    with timing._llamacpp_buffers(False):
        pass
