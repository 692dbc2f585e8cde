"""GGUF mixtures of experts as llama.cpp's converter writes them (qwen3moe, qwen2moe, glm4moe, Mixtral as llama
with experts): the config from the ``{arch}.expert_*`` keys, float files equal to the HF checkpoint, Q8_0 / Q4_0
experts kept quantized per expert and stacked (the router float), close to the float model, and greedy
speculation equal to greedy AR on the file."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from funcspec import LLM, Engine, SamplingParams, load_model
from funcspec.checkpoints import gguf_write
from funcspec.nn.llama import forward, init_kv_cache

from test_moe import make_moe

gguf = pytest.importorskip("gguf")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 1, 5, 9, 3], [4, 7, 4, 7, 2]]
TOKENS = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_moe")
    for family in ("qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral"):
        make_moe(root / family, family, **OVERRIDES.get(family, {}))
    return root


def _logits(model):
    kv = init_kv_cache(model.cfg, 1, 16)
    return forward(model.cfg, model.params, kv, TOKENS, torch.arange(1), torch.zeros(1, dtype=torch.long))[0]


@pytest.mark.filterwarnings("ignore:.*vocabulary could not be converted")  # transformers: no glm4moe vocabulary
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral"])
def test_a_float_moe_gguf_is_the_hf_checkpoint(sources, family):
    path = gguf_write.write(sources / family, sources / f"{family}-f32.gguf", "float32")
    model, ref = load_model(path), load_model(sources / family)
    assert dataclasses.replace(model.cfg, rms_norm_eps=ref.cfg.rms_norm_eps) == ref.cfg  # eps stored in f32
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == \
        {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "glm4_moe": "glm4moe", "mixtral": "llama"}[family]
    torch.testing.assert_close(_logits(model), _logits(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_quantized_qwen3_moe_gguf_keeps_its_experts_quantized_and_speculation_equals_ar(sources, kind):
    path = gguf_write.write(sources / "qwen3_moe", sources / f"qwen3_moe-{kind}.gguf", kind)
    reader = gguf.GGUFReader(str(path))
    exps = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert exps.tensor_type.name == kind.upper() and [int(x) for x in exps.shape] == [64, 32, 8]  # ggml: ne0 first
    llm = LLM(model=str(path), quantization="gguf", enforce_eager=True, max_num_seqs=2, max_model_len=96)
    model = llm.engine.model
    mlp = model.params["model"]["layers"][0]["mlp"]
    gate_up, down = mlp["experts"]["gate_up_proj"], mlp["experts"]["down_proj"]
    assert gate_up["format"].name == down["format"].name == f"gguf-{kind}"
    assert gate_up["qweight"].shape[:2] == (8, 2) and (down["format"].out_features, down["format"].in_features) \
        == (64, 32)
    assert "qweight" not in mlp["gate"]  # the router: f32 in the file, float here
    assert model.quantization.method == "gguf"
    diff = (_logits(load_model(path)) - _logits(load_model(sources / "qwen3_moe"))).abs().max().item()
    assert diff < {"q8_0": 0.15, "q4_0": 0.8}[kind]  # logits span about +-1.5
    ar = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    eng = Engine(str(path), spec, max_num_seqs=2, max_model_len=96, backend="eager")
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar


@pytest.mark.filterwarnings("ignore:.*vocabulary could not be converted")
@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe", "mixtral"])
def test_other_moe_architectures_load_quantized(sources, family):
    """Qwen2-MoE's shared expert and its gate, GLM's shared experts, correction bias and dense first layer,
    Mixtral's permuted q/k: Q8_0 files load with the experts quantized, close to the float model."""
    path = gguf_write.write(sources / family, sources / f"{family}-q8_0.gguf", "q8_0")
    model = load_model(path)
    mlp = model.params["model"]["layers"][model.cfg.moe.sparse_layers[0]]["mlp"]
    assert mlp["experts"]["gate_up_proj"]["format"].name == "gguf-q8_0"
    if family == "qwen2_moe":
        assert mlp["shared_expert"]["down_proj"]["format"].name == "gguf-q8_0"
        assert mlp["shared_expert_gate"]["weight"].shape == (1, 64)
    if family == "glm4_moe":
        assert mlp["gate"]["e_score_correction_bias"].shape == (8,) and "qweight" in mlp["shared_experts"]["up_proj"]
    diff = (_logits(model) - _logits(load_model(sources / family))).abs().max().item()
    assert diff < 0.6  # GLM's sigmoid router with its correction bias flips a close choice or two


def test_experts_of_mixed_kinds_become_float(sources, tmp_path):
    """A layer whose expert tensors are not all block types with a kernel (F32 gate here) loads as float experts,
    the quantized ones dequantized."""
    floats = load_model(sources / "qwen3_moe").params["model"]["layers"][0]["mlp"]["experts"]
    gate = floats["gate_up_proj"]["weight"][:, :32].contiguous().numpy()  # [E, I, H]: layer 0's gate as F32
    _rewrite(gguf_write.write(sources / "qwen3_moe", sources / "qwen3_moe-q8_0.gguf", "q8_0"), tmp_path / "mixed.gguf",
             lambda i, t: gate if t.name == "blk.0.ffn_gate_exps.weight" else None)
    model = load_model(tmp_path / "mixed.gguf")
    experts = model.params["model"]["layers"][0]["mlp"]["experts"]
    assert experts["gate_up_proj"]["weight"].shape == (8, 64, 64)
    assert "qweight" in model.params["model"]["layers"][2]["mlp"]["experts"]["gate_up_proj"]


def _rewrite(src_path, out_path, replace) -> None:
    """A qwen3moe GGUF file copied from ``src_path`` to ``out_path``, its metadata as it is and tensor i (``t``)
    replaced by ``replace(i, t)``: ``None`` (kept), an array (written as it is), or ``(raw blocks, block type)``."""
    src = gguf.GGUFReader(str(src_path))
    w = gguf.GGUFWriter(str(out_path), "qwen3moe")
    for key, field in src.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(key, field.contents())
            else:
                w.add_key_value(key, field.contents(), vtype)
    for i, t in enumerate(src.tensors):
        new = replace(i, t)
        if isinstance(new, tuple):
            w.add_tensor(t.name, new[0], raw_shape=new[0].shape, raw_dtype=new[1])
        elif new is not None:
            w.add_tensor(t.name, new)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=None if t.tensor_type.name == "F32" else t.data.shape,
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_k_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K (144 bytes) or Q6_K (210 bytes) blocks of 256 values [rows, K/256 x bytes], small fp16 scales."""
    g = np.random.default_rng(seed)
    size = 144 if kind == "Q4_K" else 210
    b = g.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    if kind == "Q4_K":
        b[..., 0:2] = np.float16(0.002).reshape(1).view(np.uint8)
        b[..., 2:4] = np.float16(0.001).reshape(1).view(np.uint8)
    else:
        b[..., 192:208] = g.integers(1, 8, (rows, k // 256, 16), dtype=np.uint8)  # small positive int8 scales
        b[..., 208:210] = np.float16(0.002).reshape(1).view(np.uint8)
    return b.reshape(rows, -1)


def test_q4_k_experts_with_q6_k_down_run_losslessly(tmp_path):
    """A Q4_K_M-like qwen3moe (gate/up experts Q4_K, down experts Q6_K: random blocks, gguf-py has no K-quant
    quantizer): they load quantized in those formats and ngram speculation equals AR."""
    make_moe(tmp_path / "hf", "qwen3_moe", hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
             num_hidden_layers=2, mlp_only_layers=[])
    def k_blocks(i, t):
        kind = "Q6_K" if "ffn_down_exps" in t.name else "Q4_K" if "_exps" in t.name else None
        if kind is None:
            return None
        e, n, k = np.asarray(t.data).shape
        raw = _random_k_blocks(kind, e * n, k, seed=i).reshape(e, n, -1)
        return raw, gguf.GGMLQuantizationType[kind]

    _rewrite(gguf_write.write(tmp_path / "hf", tmp_path / "f32.gguf", "float32"), tmp_path / "k.gguf", k_blocks)
    model = load_model(tmp_path / "k.gguf")
    experts = model.params["model"]["layers"][0]["mlp"]["experts"]
    assert experts["gate_up_proj"]["format"].name == "gguf-q4_k" and experts["gate_up_proj"]["format"].asym
    assert (experts["down_proj"]["format"].name, experts["down_proj"]["format"].group) == ("gguf-q6_k", 16)
    ar = [o.outputs[0].token_ids for o in Engine(model, max_num_seqs=2, backend="eager").generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    eng = Engine(model, spec, max_num_seqs=2, backend="eager")
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
