"""``funcspec bench moe`` at a tiny shape: one row per T with the union, the kernel's GB/s against the bound, the
reference's time, and the files it writes."""

import json

import pytest

from funcspec.kernels import build


@pytest.mark.skipif(not build.supported(), reason="no AVX512-BF16 and VNNI here: the routed-expert kernel is never "
                                                   "built")
def test_bench_moe_rows_and_files(tmp_path):
    args = ["bench", "moe", "--hidden", "128", "--experts", "16", "--top-k", "4", "--intermediate", "96",
            "--tokens", "1,3", "--reps", "3", "--reference-reps", "1", "--threads", "1",
            "--out", str(tmp_path)]
    from funcspec.cli import build_parser

    o = build_parser().parse_args(args)
    result = o.func(o)
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [1, 3] and rows[0]["mean_union"] == 4
    assert 4 <= rows[1]["mean_union"] <= 12 and rows[1]["expected_union"] == pytest.approx(16 * (1 - 0.75 ** 3))
    assert rows[0]["union_mib"] == pytest.approx(4 * 3 * 128 * 96 * 2 / 2**20)
    assert all(r["kernel_ms"] > 0 and r["gb_per_s"] > 0 and r["of_bound"] > 0 and r["reference_ms"] > 0
               for r in rows)
    (js,) = tmp_path.glob("moe-*.json")
    assert json.loads(js.read_text())["shape"]["experts"] == 16
    md = js.with_suffix(".md").read_text()
    assert "| T | mean union (expected)" in md and "avx512_bf16=" in md and "avx512_vnni=" in md


@pytest.mark.skipif(not build.supported(), reason="no AVX512-BF16 and VNNI here: the routed-expert kernel is never "
                                                   "built")
def test_bench_moe_quantized_counts_the_quantized_bytes(tmp_path):
    """--quantization int4: an expert's bytes are its 4-bit values and fp16 scales per 32 (gate, up and down)."""
    args = ["bench", "moe", "--hidden", "128", "--experts", "16", "--top-k", "4", "--intermediate", "96",
            "--tokens", "1", "--reps", "2", "--reference-reps", "1", "--threads", "1", "--quantization", "int4",
            "--out", str(tmp_path)]
    from funcspec.cli import build_parser

    o = build_parser().parse_args(args)
    result = o.func(o)
    per_expert = 3 * 128 * 96 // 2 + 3 * 128 * 96 // 32 * 2  # values + scales
    assert result["shape"]["quantization"] == "int4" and result["shape"]["expert_bytes"] == per_expert
    assert result["rows"][0]["union_mib"] == pytest.approx(4 * per_expert / 2**20)
    assert "experts int4 (quantized on load)" in next(tmp_path.glob("moe-*.md")).read_text()
