"""``funcspec bench scale`` end to end on the tiny shape (eager only: compiles are too slow for CI)."""

import importlib.util
import json

import pytest
import torch

from funcspec.bench import scale, timing
from funcspec.bench.scale import hf, llamacpp, measure

TINY = dict(shape="tiny", backends="eager", sweep_backend="eager", alphas="0.8", ks="1,2", contexts="16,32",
            batches="1,2", new_tokens=8, prompt_tokens=16, copy_mb=16, profile_steps=2, reps=2)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One full run (every phase) and the directory it wrote to."""
    cache, out = tmp_path_factory.mktemp("scale-cache"), tmp_path_factory.mktemp("scale-out")
    res = scale.run(cache_dir=str(cache), out=str(out), **TINY)
    return res, cache, out


def test_writes_json_markdown_and_png(result):
    res, _, out = result
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".md", ".png"]
    stem = next(out.glob("*.json")).stem
    assert stem.startswith("scale-tiny-float32-")
    assert json.loads(next(out.glob("*.json")).read_text())["shape"] == "tiny"
    md = next(out.glob("*.md")).read_text()
    assert "alternating runs of batch 1 and batch 2" in md
    for heading in ("## Decode ms/token", "## Synthetic-acceptance sweep", "## Context sweep", "## Batch sweep",
                    "top ops by self CPU time", "## Machine"):
        assert heading in md
    assert res["phases"] == list(scale.DEFAULT_PHASES) and "quant" not in res


def test_funcspec_ar_reproduces_hf_greedy_and_is_bounded(result):
    res, _, _ = result
    hf, (ar,) = res["hf"], res["ar"]
    assert len(hf["tokens"]) == 8 and ar["tokens"] == hf["tokens"]
    assert ar["tokens_equal_hf"] is True and ar["first_mismatch_hf"] is None and res["hf_match"] is True
    assert ar["backend"] == "eager" and ar["ms_per_token"] > 0 and ar["step_ms"] > 0
    bw = res["bandwidth"]
    assert bw["gb_per_s"] > 0 and bw["bound_ms_per_token"] == pytest.approx(
        res["weight_bytes"] / (bw["gb_per_s"] * 1e9) * 1e3)
    assert 0 < ar["pct_of_bound"] and ar["speedup_vs_hf"] > 0


def test_sweep_rows_have_tau_cost_and_ideal(result):
    rows = result[0]["sweep"]["rows"]
    assert [(r["alpha"], r["k"]) for r in rows] == [(0.8, 1), (0.8, 2)]
    for r in rows:
        assert r["tau"] > 1 and r["expected_tau"] == pytest.approx(1 + sum(0.8 ** (i + 1) for i in range(r["k"])))
        assert r["step_cost_ratio"] > 0 and r["ideal_speedup"] == pytest.approx(r["tau"] / r["step_cost_ratio"])
        assert r["achieved_over_ideal"] == pytest.approx(r["achieved_speedup"] / r["ideal_speedup"])


def test_context_batch_and_profile(result):
    res = result[0]
    assert [r["context"] for r in res["context"]["rows"]] == [16, 32]
    assert res["context"]["max_model_len"] == 32 + 8 + 64  # one engine sized for the largest prompt
    assert all(r["ms_per_token"] > 0 for r in res["context"]["rows"])
    for r in res["context"]["rows"]:  # two passes (ascending, descending), their mean, the ratio to the shortest
        assert len(r["ms_per_token_passes"]) == 2
        assert r["ms_per_token"] == pytest.approx(sum(r["ms_per_token_passes"]) / 2)
    short, long_ = res["context"]["rows"]
    p = res["context"]["paired"]  # the longest prompt against the shortest, alternating on the one engine
    assert (p["context"], p["shortest"], p["rounds"]) == (32, 16, 3) and len(p["ours_ms"]) == 3 and p["ratio"] > 0
    assert short["vs_shortest"] == 1.0 and long_["vs_shortest"] == pytest.approx(long_["ms_per_token"] / short["ms_per_token"])
    assert [r["batch"] for r in res["batch"]["rows"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in res["batch"]["rows"])
    p = res["batch"]["paired"]  # batch 2 against batch 1, alternating on the warm engine
    assert p["batch"] == 2 and p["rounds"] == 3 and len(p["ours_ms"]) == len(p["theirs_ms"]) == 3
    assert p["tokens_per_s_ratio"] == pytest.approx(2 * p["ratio"]) and p["ratio"] > 0
    ops = res["profile"]["ops"]
    assert 0 < len(ops) <= 12 and all(o["op"] and o["calls_per_step"] > 0 for o in ops)
    assert ops == sorted(ops, key=lambda o: -o["ms_per_step"]) and sum(o["pct"] for o in ops) <= 100.0 + 1e-6


def test_machine_info_and_llamacpp_note(result):
    res = result[0]
    m = res["machine"]
    assert set(m["flags"]) == {"avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert m["threads"] == torch.get_num_threads() and m["torch"] == torch.__version__ and m["cpu_capability"]
    assert m["llc_mib"] == scale.llc_mib() >= 0
    assert len(m["load_average"]) == len(m["load_average_end"]) == 3  # other work on the cores, start and end
    assert res["bandwidth"]["copy_mb"] == 16  # as asked; unasked, the tensor outgrows the cache (DRAM's bandwidth)
    assert scale.default_copy_mb() == max(256, 4 * m["llc_mib"])
    if importlib.util.find_spec("llama_cpp") is None:
        assert res["llamacpp"] == {"status": "skipped", "note": "skipped: llama-cpp-python not installed"}


def test_reports_name_the_cpu_kind_and_the_kernels_chosen(result, monkeypatch):
    """A result records what ran: the CPU's kind, the kernel build and why, the paths ``resolve`` took."""
    from funcspec.kernels import build

    k = result[0]["machine"]["kernels"]
    assert k["cpu_kind"] == build.cpu_kind() and k["runs"] == build.builds()
    assert k["build"] == (build.builds()[0] if build.available() else None) and k["why"]
    assert set(k["ops"]) >= {"stream", "decode_attention", "quantized", "routed_experts"}
    line = scale.kernel_line(result[0]["machine"])
    assert line.startswith(f"- Kernels: CPU kind {k['cpu_kind']}; build ") and line in scale.markdown(result[0])
    monkeypatch.setenv(build.SWITCH, "0")
    assert build.explain()["build"] is None and build.explain()["why"] == f"{build.SWITCH}=0 turns the kernels off"
    if "portable" in build.builds():
        monkeypatch.setenv(build.SWITCH, "portable")
        assert build.explain()["why"] == f"{build.SWITCH}=portable names it"


def test_checkpoint_is_cached_and_reused(result):
    _, cache, _ = result
    path = scale.checkpoint_dir("tiny", "float32", cache)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert scale.build_checkpoint("tiny", "float32", cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_typed_context_fields_and_the_ar_row_measured_once(result):
    """The phases share a ScaleContext: the main prompt and engine length fixed at the start, an AR row (and
    its warm engine) measured once per backend, and bench.quant's keys."""
    from funcspec.checkpoints import load_model

    res, cache, _ = result
    path = scale.checkpoint_dir("tiny", "float32", cache)
    ctx = scale.ScaleContext.create("tiny", "float32", path, new_tokens=8, prompt_tokens=16, seed=0, reps=1)
    assert ctx.prompt == scale.make_prompts("tiny", 1, 16, 0)[0] and len(ctx.prompt) == 16
    assert ctx.max_len == 16 + 8 + 8 and ctx.prompt_ids == (3, 512)
    assert (ctx.model, ctx.hf, ctx.ar_rows, ctx.ar_engines) == (None, None, {}, {})
    ctx.model = load_model(path)
    row = measure.ar_row(ctx, "eager")
    assert measure.ar_row(ctx, "eager") is row and list(ctx.ar_rows) == list(ctx.ar_engines) == ["eager"]
    assert row["backend"] == "eager" and row["tokens"] == res["hf"]["tokens"]  # the run's prompt: HF's tokens
    assert ctx.quant_keys() == {"model": ctx.model, "path": path, "n": 8, "p": 16, "reps": 1, "max_len": 32,
                                "prompt": ctx.prompt, "prompt_ids": (3, 512), "seed": 0}
    with pytest.raises(TypeError, match="unexpected keyword argument 'n'"):  # a named field, not a free key
        scale.ScaleContext(**{**vars(ctx), "n": 8})


def test_phases_subset_and_bad_options(tmp_path):
    res = scale.run(cache_dir=str(tmp_path / "c"), out=str(tmp_path / "o"), **{**TINY, "phases": "hf,ar"})
    assert "sweep" not in res and "bandwidth" not in res and res["ar"][0]["pct_of_bound"] is None
    assert res["ar"][0]["tokens_equal_hf"] is True
    res = scale.run(cache_dir=str(tmp_path / "c"), out=str(tmp_path / "p"), **{**TINY, "phases": "ar"})
    row = next(line for line in next((tmp_path / "p").glob("*.md")).read_text().splitlines()
               if line.startswith("| funcspec AR"))
    assert row.split(" | ")[5] == "-"  # no hf phase: no ratio to HF, and no stray "x"
    with pytest.raises(ValueError, match="phases"):
        scale.run(**{**TINY, "phases": "nope"})
    with pytest.raises(ValueError, match="shape"):
        scale.run(shape="gpt-5")


def test_gguf_export_permutes_q_and_k_like_llama_cpp():
    """The q/k row permutation and the llama3 rope factors, checked without the gguf package."""
    from funcspec.checkpoints import gguf_write as gguf, model_config

    w = torch.arange(8 * 3).reshape(8, 3)  # 2 heads of head_dim 4: rows (0 1 2 3) (4 5 6 7)
    assert gguf.rope_permute(w, 2)[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]  # halves interleaved per head
    cfg = model_config({"architectures": ["LlamaForCausalLM"], **scale.SHAPES["llama-3.2-1b"].config,
                        "num_hidden_layers": 0})
    out = gguf.tensors(cfg, {"model.embed_tokens.weight": torch.zeros(1), "model.norm.weight": torch.zeros(1)})
    factors = out["rope_freqs.weight"]
    assert set(out) == {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"}  # tied: no output.weight
    assert factors.shape == (32,) and factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(32.0)


def test_mismatch_with_hf_raises_after_writing_unless_allowed(tmp_path, monkeypatch):
    real = scale.hf_greedy

    def shifted(*args, **kwargs):  # HF "disagrees" from token 3 on
        out = real(*args, **kwargs)
        out["tokens"] = out["tokens"][:3] + [(t + 1) % 512 for t in out["tokens"][3:]]
        return out

    monkeypatch.setattr(hf, "hf_greedy", shifted)  # where the hf phase looks it up
    opts = {**TINY, "phases": "hf,ar", "cache_dir": str(tmp_path / "c"), "out": str(tmp_path / "o"), "reps": 1}
    with pytest.raises(RuntimeError, match="differs from HF greedy at token 3"):
        scale.run(**opts)
    assert len(list((tmp_path / "o").glob("*.json"))) == 1  # the results are written first
    res = scale.run(**opts, allow_mismatch=True)
    assert res["ar"][0]["tokens_equal_hf"] is False and res["ar"][0]["first_mismatch_hf"] == 3
    assert res["hf_match"] is False


def test_bfloat16_checkpoint_runs(tmp_path):
    res = scale.run(**{**TINY, "dtype": "bfloat16", "phases": "hf,ar", "reps": 1, "allow_mismatch": True},
                    cache_dir=str(tmp_path / "c"), out=str(tmp_path / "o"))
    assert res["dtype"] == "bfloat16" and res["weight_bytes"] == 2 * res["params"]
    assert (tmp_path / "c" / "tiny-bfloat16" / "config.json").exists()
    assert len(res["ar"][0]["tokens"]) == 8


def test_llamacpp_phase_with_a_fake_binding(tmp_path, monkeypatch):
    """The llama.cpp orchestration (greedy settings, timing, HF check, ratio, report) with a stand-in binding."""
    import sys
    import types

    hf_tokens, seen = [], {}
    real = scale.hf_greedy

    def keep(*args, **kwargs):
        out = real(*args, **kwargs)
        hf_tokens[:] = out["tokens"]
        return out

    class Llama:
        def __init__(self, model_path, **kwargs):
            seen.update(kwargs, model_path=model_path)

        def reset(self):
            pass

        def generate(self, tokens, **kwargs):
            assert kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
            yield from hf_tokens

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setitem(sys.modules, "gguf", types.SimpleNamespace())
    monkeypatch.setattr(hf, "hf_greedy", keep)
    monkeypatch.setattr(llamacpp, "write_gguf", lambda ckpt, kind: tmp_path / f"model-{kind}.gguf")
    res = scale.run(**{**TINY, "phases": "hf,ar,llamacpp", "reps": 1}, cache_dir=str(tmp_path / "c"),
                    out=str(tmp_path / "o"))
    lc = res["llamacpp"]
    assert lc["status"] == "ran" and lc["tokens"] == res["hf"]["tokens"] and lc["tokens_equal_hf"] is True
    assert lc["ms_per_token"] > 0 and lc["funcspec_over_llamacpp"] > 0
    assert seen["type_k"] == 0 and seen["type_v"] == 0 and seen["logits_all"] is False  # f32 KV for f32 weights
    backends = [a["backend"] for a in res["ar"]]
    assert sorted(lc["paired"]) == sorted(TINY["backends"].split(","))
    for p in lc["paired"].values():  # each AR engine timed again, alternating with llama.cpp
        assert p["rounds"] == 3 and len(p["ours_ms"]) == len(p["theirs_ms"]) == 3 and p["ratio"] > 0
    md = next((tmp_path / "o").glob("*.md")).read_text()
    assert "| llama.cpp |" in md and md.count("Paired (3 alternating runs") == len(backends)


def test_paired_ratios_cancel_drift():
    """A machine slowing down 3x over the runs: separate medians mislead, the pairs' ratio does not."""
    speed = iter([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])  # each run is slower than the last pair's
    ours = lambda: 2.0 * next(speed)  # noqa: E731
    theirs = lambda: 1.0 * next(speed)  # noqa: E731
    p = timing.paired_ratios(ours, theirs, 3)
    assert p["ours_ms"] == [2.0, 4.0, 6.0] and p["theirs_ms"] == [1.0, 2.0, 3.0] and p["ratio"] == 2.0


def test_gguf_file_round_trips(tmp_path):
    import gguf  # a [test] dependency: the writer is checked in CI, llama.cpp itself is not
    ckpt = scale.build_checkpoint("tiny", "float32", tmp_path)
    reader = gguf.GGUFReader(str(scale.write_gguf(ckpt, "float32")))
    names = {t.name: t for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= set(names)
    assert names["token_embd.weight"].shape.tolist() == [64, 512]  # GGUF lists dims innermost first


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_count_active_experts_and_no_untied_embedding(tmp_path, tied):
    """A decode step streams the LM head (the embedding when tied; an untied embedding only by one row) and
    top_k of E experts per sparse layer."""
    import transformers

    from funcspec.bench.scale.checkpoint import weight_bytes

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                                      tie_word_embeddings=tied)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(str(tmp_path))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.model.embed_tokens.weight.numel()
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once by parameters()
    want = total - experts + experts * 2 // 8 - (0 if tied else embed)
    assert weight_bytes(tmp_path, "bfloat16") == (want, 2 * want)


@pytest.mark.filterwarnings("ignore:.*vocabulary could not be converted")  # transformers: no deepseek2 vocabulary
def test_deepseek_shape_runs_with_its_latent_cache_and_a_gguf_file(tmp_path):
    """The DeepSeek-V2-Lite shape's structure at test size: funcspec AR reproduces HF greedy, the context phase
    measures the latent cache (not the K/V it expands to), and the quant phase runs the Q8_0 GGUF file
    (paired with llama.cpp on that file where llama-cpp-python is installed)."""
    res = scale.run(shape="deepseek-tiny", phases="hf,ar,context,quant", backends="eager", sweep_backend="eager",
                    contexts="8,16", new_tokens=4, prompt_tokens=8, reps=1, quantization="q8_0", quant_parts="",
                    cache_dir=str(tmp_path / "c"), out=str(tmp_path / "o"))
    hf_cfg = scale.SHAPES["deepseek-tiny"].config
    assert res["arch"] == "deepseek_v2" and res["ar"][0]["tokens_equal_hf"] is True
    layers, heads = hf_cfg["num_hidden_layers"], hf_cfg["num_attention_heads"]
    latent = layers * (hf_cfg["kv_lora_rank"] + hf_cfg["qk_rope_head_dim"]) * 4  # float32
    kv = layers * heads * (hf_cfg["qk_nope_head_dim"] + hf_cfg["qk_rope_head_dim"] + hf_cfg["v_head_dim"]) * 4
    c = res["context"]
    assert c["cache_bytes_per_token"] == latent and c["cache_bytes_from_config"] == {"latent": latent, "kv": kv}
    assert [r["context"] for r in c["rows"]] == [8, 16] and all(r["ms_per_token"] > 0 for r in c["rows"])
    (row,) = res["quant"]["rows"]
    assert row["format"] == "q8_0" and row["llamacpp_file"] == "model-q8_0.gguf" and row["ms_per_token"] > 0
    assert ("paired" in row) == (importlib.util.find_spec("llama_cpp") is not None)
    md = next((tmp_path / "o").glob("*.md")).read_text()
    assert f"the latent is {latent} bytes per token, the K/V it expands to {kv}" in md
    assert "decode at 16 tokens of context is **" in md
