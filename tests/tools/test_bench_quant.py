"""``funcspec bench scale --phases quant`` and ``funcspec bench quality`` at tiny size (eager; llama.cpp's own
quantizer and timings are not part of CI, so GGUF files come from gguf's Q8_0 / Q4_0)."""

import json
import shutil
from argparse import Namespace

import pytest
import torch

from funcspec import zoo
from funcspec.bench import quant, scale

TINY = dict(shape="tiny", backends="eager", sweep_backend="eager", batches="1,2", new_tokens=8, prompt_tokens=16,
            copy_mb=16, reps=2, phases="bandwidth,ar,quant", quantization="int8,int4,q8_0,q4_0,ct-w8a8", quant_k=2,
            quant_alpha=0.8, quant_parts="heads,batch")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_has_llamacpp", lambda: False)
        out = tmp_path_factory.mktemp("quant-out")
        res = scale.run(cache_dir=str(tmp_path_factory.mktemp("quant-cache")), out=str(out), **TINY)
    return res, out


def test_quant_phase_rows_per_format(result):
    res, out = result
    q = res["quant"]
    assert [r["format"] for r in q["rows"]] == ["int8", "int4", "q8_0", "q4_0", "ct-w8a8"]
    assert q["k"] == 2 and q["alpha"] == 0.8 and q["unquantized_ms_per_token"] == res["ar"][0]["ms_per_token"]
    by = {r["format"]: r for r in q["rows"]}
    # int4 in groups of 32 streams about half of int8's bytes; GGUF Q8_0 / Q4_0 the same as int8 / int4 g32
    # (the lm_head and norms are in every count, so the ratios are not exact)
    assert by["int4"]["streamed_bytes"] < 0.75 * by["int8"]["streamed_bytes"]
    assert by["q4_0"]["streamed_bytes"] < 0.75 * by["q8_0"]["streamed_bytes"]
    # compressed-tensors W8A8 per channel streams what funcspec's own int8 does but for its lm_head [512, 64], kept
    # in bf16 as published files keep it (int8 quantizes it too); it pairs with llama.cpp's Q8_0
    assert 0 < by["ct-w8a8"]["streamed_bytes"] - by["int8"]["streamed_bytes"] < 512 * 64
    assert by["ct-w8a8"]["source"] == "published" and by["ct-w8a8"]["llamacpp_file"] == "model-q8_0.gguf"
    for r in q["rows"]:
        assert r["ms_per_token"] > 0 and r["bound_ms"] > 0 and r["pct_of_bound"] > 0
        assert "llamacpp_ms_per_token" not in r  # no llama.cpp here: no pairing
        assert set(r["speculation"]) == {"echo", "eagle3", "eagle3-quantized", "dflash"}
        for s in r["speculation"].values():
            assert s["k"] == 2 and 0 < s["tau"] <= 3 and s["speedup_vs_ar"] > 0 and s["vs_llamacpp_ar"] is None
        assert r["batch"]["batch"] == 2 and r["batch"]["tokens_per_s_ratio"] > 0
    # the EAGLE-3 head quantized like the target: its own scheme, else funcspec's of the same bits
    assert {f: by[f]["speculation"]["eagle3-quantized"]["head_quantization"] for f in by} == {
        "int8": "int8", "int4": "int4", "q8_0": "int8", "q4_0": "int4-g128", "ct-w8a8": "int8"}
    assert by["q4_0"]["speculation"]["eagle3"]["head_quantization"] is None
    md = next(out.glob("*.md")).read_text()
    assert "## Quantized formats (eager, batch 1)" in md and "| q4_0 |" in md and "EAGLE-3 (quantized) K=2" in md


def test_speculation_pairs_with_llamacpps_ar_in_alternating_runs(tmp_path, monkeypatch):
    """Each speculation's ratio to llama.cpp's AR is the median of alternating pairs, as funcspec AR's is: a
    llama.cpp session (here a stand-in of 5 ms/token) runs between funcspec's decodes."""
    calls = []

    def session(gguf_path, ctx):
        def gen():
            calls.append(gguf_path.name)
            return list(range(ctx["n"])), 0.01, 5.0
        gen.repacked = False
        return gen

    monkeypatch.setattr(quant, "_has_llamacpp", lambda: False)  # GGUF files from gguf, not llama.cpp's quantizer
    monkeypatch.setattr(quant, "_llamacpp", lambda path, ctx: None if path is None else session(path, ctx))
    res = scale.run(cache_dir=str(tmp_path / "cache"), out=str(tmp_path / "out"),
                    **{**TINY, "phases": "quant", "quantization": "q8_0", "quant_parts": "heads"})
    (row,) = res["quant"]["rows"]
    assert row["llamacpp_ms_per_token"] == 5.0 and row["paired"]["theirs_ms"] == [5.0] * 3
    for name, s in row["speculation"].items():
        pairs = s["llamacpp_paired"]
        assert pairs["rounds"] == 3 and pairs["theirs_ms"] == [5.0] * 3 and len(pairs["ours_ms"]) == 3, name
        assert s["vs_llamacpp_ar"] == pytest.approx(5.0 / sorted(pairs["ours_ms"])[1]), name
    # a warm-up and 2 timed runs for the AR column, its 3 pairs, then 3 pairs per head
    assert calls == ["model-q8_0.gguf"] * (3 + 3 + 3 * len(row["speculation"]))


def test_gguf_formats_without_llamacpp(tmp_path, monkeypatch):
    monkeypatch.setattr(quant, "_has_llamacpp", lambda: False)
    with pytest.raises(ValueError, match="'q4_k_m' is made by llama.cpp's quantizer"):
        quant.gguf_file(zoo.model_path("target"), "q4_k_m", 1, tmp_path)


@pytest.fixture(scope="module")
def zoo_quality(tmp_path_factory):
    from funcspec.bench.spec import load_prompts
    from funcspec.checkpoints import load_model

    model = zoo.model_path("target")
    seqs = load_prompts("heldout", load_model(str(model)).tokenizer, 4, 96)
    cache = tmp_path_factory.mktemp("quality-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_has_llamacpp", lambda: False)
        rows = quant.quality(model, seqs, ["int8", "int4", "q8_0", "q4_0", "gptq-int4", "awq-int4", "ascend-w8a8"],
                             cache_dir=cache)
    return rows, cache, seqs


def test_quality_of_the_zoo_target(zoo_quality):
    rows, cache, seqs = zoo_quality
    assert [r["format"] for r in rows] == ["unquantized", "int8", "int4", "q8_0", "q4_0", "gptq-int4", "awq-int4",
                                           "ascend-w8a8"]
    base = rows[0]
    assert base["greedy_agreement"] == 1.0 and base["tokens"] == sum(len(s) - 1 for s in seqs)
    by = {r["format"]: r for r in rows}
    # 8-bit per channel / per 32: within 0.01 nats of the float model; 4-bit in groups of 32: within 0.1
    for f in ("int8", "q8_0", "ascend-w8a8"):
        assert abs(by[f]["cross_entropy"] - base["cross_entropy"]) < 0.01 and by[f]["greedy_agreement"] > 0.97
    for f in ("int4", "q4_0", "gptq-int4", "awq-int4"):
        assert abs(by[f]["cross_entropy"] - base["cross_entropy"]) < 0.1 and by[f]["greedy_agreement"] > 0.8
    for r in rows[1:]:  # W8A16 / W4A16 on the same weights: as close as W8A8 / W4A8 or closer
        assert abs(r["cross_entropy_weights_only"] - base["cross_entropy"]) < \
            abs(r["cross_entropy"] - base["cross_entropy"]) + 0.005
    assert sorted(p.name for p in cache.iterdir()) == ["model-q4_0.gguf", "model-q8_0.gguf", "published-ascend-w8a8",
                                                       "published-awq-int4", "published-gptq-int4"]


def test_bench_quality_cli_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quant, "_has_llamacpp", lambda: False)
    model = tmp_path / "target"
    shutil.copytree(zoo.model_path("target"), model)
    args = Namespace(model=str(model), formats="int8", prompts="heldout", num=1, tokens=32, out=str(tmp_path / "o"),
                     cache_dir=None, threads=1)
    res = quant.run_quality(args)
    assert list(res["sources"]) == ["heldout"] and [r["format"] for r in res["sources"]["heldout"]] == \
        ["unquantized", "int8"]
    assert json.loads(next((tmp_path / "o").glob("quality-*.json")).read_text()) == res
    assert "## Quality: heldout (1 sequences of 32 tokens)" in next((tmp_path / "o").glob("quality-*.md")).read_text()
    with pytest.raises(SystemExit, match="formats \\['fp3'\\] unknown"):
        quant.run_quality(Namespace(**{**vars(args), "formats": "int8,fp3"}))


def test_streamed_bytes_count_the_top_k_experts_a_token_reads():
    """A MoE layer's stacked experts count top_k experts' bytes, float or quantized; the router counts whole."""
    from funcspec.bench.quant import streamed_bytes
    from funcspec.kernels import Ops
    from funcspec.quant import prepare_params

    e, h, i = 8, 64, 32
    layer = {"gate": {"weight": torch.zeros(e, h)},
             "experts": {"gate_up_proj": {"weight": torch.zeros(e, 2 * i, h)},
                         "down_proj": {"weight": torch.zeros(e, h, i)}}}
    assert streamed_bytes(layer, top_k=2) == 4 * (e * h + 2 * 3 * h * i)
    q = prepare_params(layer, Ops(), quantization="int8")  # per channel: 1 byte a value, an fp16 scale per row
    assert "qweight" in q["experts"]["gate_up_proj"] and "qweight" not in q["gate"]
    assert streamed_bytes(q, top_k=2) == 4 * e * h + 2 * (3 * h * i + 2 * (2 * i + h))
