"""DeepSeek-V2 / V3 GGUF files as llama.cpp's converter writes ``deepseek2``: the MLA keys (one latent KV head,
``kv_b_proj`` split per head into ``attn_k_b`` / ``attn_v_b``), the MoE keys and tensors, YaRN. Read back, a
float file is the HF checkpoint (config fields, every tensor, funcspec's greedy tokens), a quantized one keeps its
experts quantized and speculates losslessly, and llama.cpp (where llama-cpp-python is installed) runs the float
file with transformers' logits and funcspec's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from funcspec import LLM, Engine, SamplingParams, load_model
from funcspec.checkpoints import experts, gguf_deepseek, gguf_write
from funcspec.checkpoints import gguf as ggufmod
from funcspec.checkpoints.files import read_config, read_weights

from spec_cases import random_moe

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256)
"""Every width a multiple of 32, so that every 2-D and 3-D weight has Q8_0 / Q4_0 blocks."""

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
KINDS = {
    "v2-lite": ("DeepseekV2", dict(q_lora_rank=None, n_shared_experts=2)),
    "v2-yarn": ("DeepseekV2", dict(q_lora_rank=None, n_shared_experts=2, rope_parameters=YARN)),
    "v3": ("DeepseekV3", dict(q_lora_rank=32, n_shared_experts=1, n_group=2, topk_group=1, initializer_range=0.06)),
}
"""V2-Lite (no q_lora_rank, softmax router), the same with YaRN, and V3 (q_lora_rank, sigmoid router with its
correction bias, grouped top-k)."""

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
          "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
          "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "rope_parameters", "model_type",
          "architectures", "tie_word_embeddings", "bos_token_id", "eos_token_id", "max_position_embeddings")
PROMPT = [5, 9, 17, 33, 65, 12, 7, 100, 200, 150]
PROMPTS = [PROMPT, [4, 7, 4, 7, 2, 8, 4, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NO_VOCAB = "ignore:.*vocabulary could not be converted"  # transformers converts no deepseek2 vocabulary


def make_deepseek(path, kind: str):
    """A tiny random DeepSeek of ``kind`` (:data:`KINDS`) saved to ``path``; its weights scaled up (wide greedy
    margins) and V3's correction bias random, so that it changes which experts are chosen."""
    family, extra = KINDS[kind]
    model = random_moe(getattr(transformers, f"{family}ForCausalLM"),
                       getattr(transformers, f"{family}Config")(**{**BASE, **extra}))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_deepseek")
    for kind in KINDS:
        make_deepseek(root / kind, kind)
    return root


def _file(sources, kind: str, store: str):
    return gguf_write.write(sources / kind, sources / f"{kind}-{store}.gguf", store)


def _stacked(path) -> dict:
    hf = read_config(path)[1]
    return experts.stack(read_weights(path), experts.MoEConfig(hf["n_routed_experts"]), str(path))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_float_deepseek_gguf_is_the_hf_checkpoint(sources, kind):
    hf, floats, quantized = ggufmod.read(_file(sources, kind, "float32"))
    ref = read_config(sources / kind)[1]
    assert {k: hf[k] for k in FIELDS} == {k: ref[k] for k in FIELDS}
    assert hf["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"])  # stored in f32
    assert hf["scoring_func"] == ("sigmoid" if kind == "v3" else "softmax")
    want = _stacked(sources / kind)
    assert quantized == {} and sorted(floats) == sorted(want)
    for key, w in want.items():
        assert torch.equal(floats[key], w), key


def _greedy(model, spec=None) -> list[list[int]]:
    eng = Engine(model, spec, max_num_seqs=2, max_model_len=64, backend="eager")
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]


@pytest.mark.filterwarnings(NO_VOCAB)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_funcspec_runs_a_float_file_as_the_hf_checkpoint(sources, kind):
    model, ref = load_model(_file(sources, kind, "float32")), load_model(sources / kind)
    assert model.cfg.mla == ref.cfg.mla and model.cfg.moe == ref.cfg.moe and model.cfg.rope_scaling == \
        ref.cfg.rope_scaling
    assert _greedy(model) == _greedy(ref)


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_the_file_holds_llama_cpps_mla_layout(sources, kind):
    """One latent KV head of kv_lora_rank + rope dims, the heads' own sizes in the _mla keys, kv_b_proj split per
    head (W_UK transposed), dense first layers, the MoE keys, and q_lora_rank 0 for a Lite model."""
    reader = gguf.GGUFReader(str(_file(sources, kind, "float32")))
    meta = {k[len("deepseek2."):]: f.contents() for k, f in reader.fields.items() if k.startswith("deepseek2.")}
    assert reader.fields["general.architecture"].contents() == "deepseek2"
    assert (meta["attention.head_count"], meta["attention.head_count_kv"]) == (4, 1)
    assert (meta["attention.key_length"], meta["attention.value_length"]) == (32 + 16, 32)
    assert (meta["attention.key_length_mla"], meta["attention.value_length_mla"]) == (32 + 16, 32)
    assert (meta["attention.kv_lora_rank"], meta["attention.q_lora_rank"]) == (32, 0 if kind == "v2-lite" else 32)
    assert (meta["rope.dimension_count"], meta["leading_dense_block_count"]) == (16, 1)
    assert (meta["expert_count"], meta["expert_used_count"], meta["expert_feed_forward_length"]) == (8, 2, 32)
    assert meta["expert_shared_count"] == (2 if kind == "v2-lite" else 1)
    assert meta["expert_gating_func"] == (1 if kind == "v2-lite" else 2)  # softmax, sigmoid
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}  # ggml: ne0 (contiguous) first
    assert shapes["blk.0.attn_k_b.weight"] == [32, 32, 4] and shapes["blk.0.attn_v_b.weight"] == [32, 32, 4]
    assert "blk.0.ffn_gate.weight" in shapes and "blk.0.ffn_gate_exps.weight" not in shapes
    assert shapes["blk.1.ffn_gate_exps.weight"] == [64, 32, 8] and shapes["blk.1.ffn_down_exps.weight"] == [32, 64, 8]
    assert ("blk.1.exp_probs_b.bias" in shapes) == (kind == "v3")
    assert ("blk.1.attn_q_a.weight" in shapes) == (kind == "v3") != ("blk.1.attn_q.weight" in shapes)


def test_kv_b_proj_splits_per_head_and_joins_back():
    w = torch.arange(4 * (3 + 5) * 6, dtype=torch.float32).reshape(4 * 8, 6)  # 4 heads, nope 3, v 5, rank 6
    k_b, v_b = gguf_deepseek.split_kv_b(w, 4, 3, 5)
    assert k_b.shape == (4, 6, 3) and v_b.shape == (4, 5, 6)
    assert torch.equal(k_b[1, :, 0], w[8]) and torch.equal(v_b[1, 0], w[8 + 3])  # head 1's first nope, first v row
    assert torch.equal(gguf_deepseek.join_kv_b(k_b, v_b), w)


@pytest.mark.parametrize("store", ["q8_0", "q4_0"])
def test_a_quantized_file_keeps_its_experts_quantized(sources, store):
    """Experts quantized per expert and stacked, linears quantized, the router float; kv_b_proj (split in the
    file) back as floats within the format's rounding."""
    hf, floats, quantized = ggufmod.read(_file(sources, "v3", store))
    moe = quantized["model.layers.1.mlp.experts"]
    assert moe["gate_up_proj"]["format"].name == moe["down_proj"]["format"].name == f"gguf-{store}"
    assert moe["gate_up_proj"]["qweight"].shape[0] == 8
    for module in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
                   "mlp.shared_experts.down_proj"):
        assert quantized[f"model.layers.1.{module}"]["format"].name == f"gguf-{store}"
    assert "model.layers.0.mlp.gate_proj" in quantized  # the dense first layer
    assert floats["model.layers.1.mlp.gate.weight"].shape == (8, 64)  # f32 in the file
    ref = _stacked(sources / "v3")
    assert torch.equal(floats["model.layers.1.mlp.gate.e_score_correction_bias"],
                       ref["model.layers.1.mlp.gate.e_score_correction_bias"])
    for layer in range(3):
        key = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        err = (floats[key] - ref[key]).abs().max() / ref[key].abs().max()
        assert err < {"q8_0": 0.01, "q4_0": 0.1}[store]


def test_a_file_from_before_the_split_reads_the_same(sources, tmp_path):
    """Older converters wrote kv_b_proj whole (attn_kv_b) with the heads' sizes in key_length / value_length."""
    src = gguf.GGUFReader(str(_file(sources, "v2-lite", "float32")))
    w = gguf.GGUFWriter(str(tmp_path / "legacy.gguf"), "deepseek2")
    dropped = ("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in dropped:
            continue
        value = {"deepseek2.attention.key_length": 32 + 16, "deepseek2.attention.value_length": 32}.get(key)
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents() if value is None else value, field.types[0])
    tensors = {t.name: np.asarray(t.data) for t in src.tensors}
    for i in range(3):
        k_b, v_b = (torch.from_numpy(tensors.pop(f"blk.{i}.attn_{n}_b.weight").copy()) for n in "kv")
        tensors[f"blk.{i}.attn_kv_b.weight"] = gguf_deepseek.join_kv_b(k_b, v_b).numpy()
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf, floats, _ = ggufmod.read(tmp_path / "legacy.gguf")
    ref = read_config(sources / "v2-lite")[1]
    assert {k: hf[k] for k in FIELDS} == {k: ref[k] for k in FIELDS}
    want = _stacked(sources / "v2-lite")
    assert all(torch.equal(floats[k], want[k]) for k in want) and sorted(floats) == sorted(want)


@pytest.mark.filterwarnings(NO_VOCAB)
@pytest.mark.parametrize("store", ["q8_0", "q4_0"])
def test_funcspec_speculates_losslessly_on_a_quantized_file(sources, store):
    """The V3 file through the vLLM-shaped facade: its experts quantized in the engine, its logits near the float
    model's, and ngram speculation equal to AR on the file."""
    path = _file(sources, "v3", store)
    llm = LLM(model=str(path), quantization="gguf", enforce_eager=True, max_num_seqs=2, max_model_len=64)
    mlp = llm.engine.model.params["model"]["layers"][1]["mlp"]
    assert mlp["experts"]["gate_up_proj"]["format"].name == f"gguf-{store}"
    ar = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert _greedy(str(path), {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}) == ar


@pytest.mark.filterwarnings(NO_VOCAB)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_llama_cpp_runs_the_file_as_transformers_and_funcspec_do(sources, kind):
    """llama.cpp's deepseek2 (its absorbed MLA, its router, its YaRN) on the float file: transformers' and
    funcspec's greedy tokens, and transformers' logits to float rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(sources / kind), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
        logits = model(torch.tensor([PROMPT])).logits[0]
    llm = llama_cpp.Llama(model_path=str(_file(sources, kind, "float32")), n_ctx=128, n_threads=2, verbose=False,
                          logits_all=True, type_k=0, type_v=0)
    got = []
    for t in llm.generate(PROMPT, temp=0.0, top_k=1, repeat_penalty=1.0):
        got.append(t)
        if len(got) == len(want) or t == 2:
            break
    assert got == want == _greedy(load_model(_file(sources, kind, "float32")))[0]
    llm.reset()
    llm.eval(PROMPT)
    theirs = torch.from_numpy(np.array(llm.scores[:len(PROMPT)]))
    torch.testing.assert_close(theirs, logits, atol=1e-4, rtol=1e-4)
