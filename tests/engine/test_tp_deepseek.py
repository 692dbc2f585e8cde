"""Tensor parallelism of DeepSeek targets (MLA, DeepSeekMoE) and msmodelslim's W8A8 layout of them.

MLA splits by heads as vLLM splits it: q_b_proj and kv_b_proj by rows, o_proj
by columns, the latent's projections, norms and V3.2's indexer replicated, so
every rank caches the whole latent. Two ranks on gloo emit one rank's greedy
tokens, float and quantized (msmodelslim's W8A8 as stored, int8 on load), with
routed experts split by tensor or by expert parallelism; the trained zoo
DeepSeek-V3 drafts with its own MTP layer on two ranks as on one.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import transformers

from conftest import run_ranks
from funcspec import Engine, SamplingParams, load_model
from funcspec.checkpoints import quantized_write as qw
from funcspec.checkpoints.quantized import DESCRIPTION, layer_report
from funcspec.checkpoints.tp import shard_layer, shard_model
from funcspec.parallel import TPGroup
from funcspec.quant import formats

from spec_cases import random_moe

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8]]
ENGINE = dict(max_num_seqs=2,
              compilation_config={"batch_sizes": [2], "capture": "lazy"}, max_model_len=40, backend="eager")
# Sizes a W8A8 split keeps whole: o_proj's 4 heads x 16 inputs, the dense MLP's 128 and the shared expert's 64
# in blocks of 32 per rank; q_lora_rank and kv_lora_rank whole blocks of 32 (the int8 kernel's).
V3 = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
          tie_word_embeddings=False, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
          n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=16, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)


V32 = dict(index_n_heads=8, index_head_dim=32, index_topk=6)
"""V3.2's indexer: each query reads its 6 best positions of up to 18, so the selection matters."""


def make_v3(path, seed: int = 0, v32: bool = False, **overrides) -> None:
    """A tiny random DeepSeek-V3 (``v32``: V3.2, with its indexer) at ``path``: weights scaled up for wide greedy
    margins, the correction bias and the indexer's LayerNorm random so that they count."""
    config, model = (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM) if v32 else \
        (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
    model = random_moe(model, config(**{**V3, **(V32 if v32 else {}), **overrides}), seed, positive_bias=True)
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """The float V3, msmodelslim's W8A8 of it (attention static, MLPs dynamic) and a W8A8 storing kv_b_proj
    quantized too; V2-Lite (one q_proj) float; V3.2 float and as msmodelslim's W8A8 (its indexer's wq_b W8A8)."""
    root = tmp_path_factory.mktemp("tp_deepseek")
    make_v3(root / "float")
    make_v3(root / "lite", seed=1, q_lora_rank=None)
    make_v3(root / "v32", seed=2, v32=True)
    qw.write_ascend(root / "float", root / "w8a8", **qw.DEEPSEEK_MIX)
    qw.write_ascend(root / "float", root / "absorbed", **qw.DEEPSEEK_MIX, absorbed=True)
    qw.write_ascend(root / "v32", root / "v32-w8a8", **qw.DEEPSEEK_MIX)
    return {name: str(root / name) for name in ("float", "lite", "w8a8", "absorbed", "v32", "v32-w8a8")}


# ----------------------------------------------------------------------------- shards
@pytest.mark.parametrize("name", ["float", "lite", "v32"])
def test_mla_shards_split_heads_and_replicate_the_latent(targets, name):
    """q_b_proj (V2-Lite: q_proj) and kv_b_proj by heads' rows, o_proj by columns; q_a_proj, kv_a_proj_with_mqa,
    their norms and V3.2's indexer whole on each rank; the config halves the heads and keeps the latent's and the
    indexer's sizes."""
    model = load_model(targets[name])
    shards = [shard_model(model, TPGroup(2, r, "g")) for r in range(2)]
    assert (shards[1].cfg.num_heads, shards[1].cfg.num_kv_heads, shards[1].cfg.mla) == (2, 4, model.cfg.mla)
    full, parts = model.params["model"]["layers"][1]["self_attn"], \
        [s.params["model"]["layers"][1]["self_attn"] for s in shards]
    q = "q_proj" if name == "lite" else "q_b_proj"
    for layer, dim, rows in ((q, 0, 16 + 8), ("kv_b_proj", 0, 16 + 16), ("o_proj", 1, 16)):
        w = full[layer]["weight"]
        assert torch.equal(torch.cat([p[layer]["weight"] for p in parts], dim), w), layer
        assert torch.equal(parts[1][layer]["weight"], w.narrow(dim, 2 * rows, 2 * rows)), layer  # heads 2, 3
    for layer in ("kv_a_proj_with_mqa", "kv_a_layernorm") + (() if name == "lite" else ("q_a_proj", "q_a_layernorm")):
        assert all(torch.equal(p[layer]["weight"], full[layer]["weight"]) for p in parts), layer
    if name == "v32":
        assert all(p["indexer"] is full["indexer"] for p in parts)


def test_kv_b_proj_stays_float_when_the_rest_is_quantized_on_load(targets):
    block = load_model(targets["float"]).params["model"]["layers"][1]
    attn = shard_layer(block, TPGroup(2, 0, "g"), "int8")["self_attn"]
    assert "qweight" in attn["q_b_proj"] and "qweight" in attn["o_proj"]
    assert torch.equal(attn["kv_b_proj"]["weight"], block["self_attn"]["kv_b_proj"]["weight"][:64])


def test_mla_tensor_parallel_size_must_divide_the_heads(targets):
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 must divide the target's num_attention_heads=4 "
                                         r"\(each rank holds whole heads\)"):
        Engine(targets["float"], tensor_parallel_size=3, enforce_eager=True)
    assert not dist.is_initialized()


def test_a_shared_expert_split_that_cuts_a_block_is_refused_before_any_rank_starts(tmp_path):
    """Expert parallelism splits the routed experts whole, but the shared expert by its intermediate size: 32 / 2
    int8 inputs are not a block of 32."""
    make_v3(tmp_path / "float", moe_intermediate_size=32)
    qw.write_ascend(tmp_path / "float", tmp_path / "w8a8", **qw.DEEPSEEK_MIX)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split model\.layers\.1\.mlp\.shared_experts"
                                         r"\.down_proj: a shard of 16 inputs \(32 / 2\) is not a multiple of 32"):
        Engine(str(tmp_path / "w8a8"), quantization="ascend", tensor_parallel_size=2, enable_expert_parallel=True,
               enforce_eager=True)
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- msmodelslim's W8A8
def test_msmodelslim_w8a8_keeps_kv_b_proj_and_the_routers_float(targets):
    """The description names the attention's linears W8A8 (static activations), the MLPs' and experts' W8A8_DYNAMIC,
    kv_b_proj and the routers FLOAT; funcspec loads them so."""
    desc = json.loads(open(os.path.join(targets["w8a8"], DESCRIPTION)).read())
    want = {"self_attn.q_a_proj": "W8A8", "self_attn.q_b_proj": "W8A8", "self_attn.kv_a_proj_with_mqa": "W8A8",
            "self_attn.o_proj": "W8A8", "self_attn.kv_b_proj": "FLOAT", "self_attn.kv_a_layernorm": "FLOAT",
            "mlp.gate": "FLOAT", "mlp.experts.7.down_proj": "W8A8_DYNAMIC",
            "mlp.shared_experts.up_proj": "W8A8_DYNAMIC"}
    assert {name: desc[f"model.layers.1.{name}.weight"] for name in want} == want
    assert desc["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"  # a dense first layer's MLP
    assert desc["model.layers.1.self_attn.o_proj.input_offset"] == "W8A8"  # static activations
    report = layer_report(load_model(targets["w8a8"]).params)
    assert report["float"] == ["lm_head", "model.layers.*.self_attn.kv_b_proj (x 3)", "model.layers.*.mlp.gate (x 2)"]
    assert "model.layers.*.self_attn.q_b_proj (x 3)" in report["quantized"]["ascend-w8a8 (8-bit, group per channel)"]


def test_a_stored_quantized_kv_b_proj_is_dequantized_at_load(targets):
    """MLA reads kv_b_proj per head as a matrix: a file that stores it int8 loads as its dequantized float values."""
    from safetensors import safe_open

    key = "model.layers.1.self_attn.kv_b_proj"
    with safe_open(os.path.join(targets["absorbed"], "model.safetensors"), "pt") as f:
        want = f.get_tensor(key + ".weight").float() * f.get_tensor(key + ".weight_scale").float()  # [N, K]
    got = load_model(targets["absorbed"]).params["model"]["layers"][1]["self_attn"]["kv_b_proj"]
    assert set(got) == {"weight"} and torch.equal(got["weight"], want)
    assert formats.quantizes(got["weight"], "int8")  # a float matrix, as the absorbed views read it


# ----------------------------------------------------------------------------- two ranks
CASES = {  # name -> (checkpoint, quantization, enable_expert_parallel)
    "float": ("float", None, False), "float-ep": ("float", None, True), "lite": ("lite", None, False),
    "w8a8": ("w8a8", "ascend", False), "w8a8-ep": ("w8a8", "ascend", True), "absorbed": ("absorbed", "ascend", True),
    "int8": ("float", "int8", False), "int8-ep": ("float", "int8", True),
    "v32": ("v32", None, False), "v32-w8a8-ep": ("v32-w8a8", "ascend", True),
}


def _tokens(eng) -> list:
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]


def _rank(rank: int, port: int, targets: dict, out: str) -> None:
    """One torchrun-style rank: a TP=2 engine per case, its tokens and what it holds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for name, (path, scheme, ep) in CASES.items():
        eng = Engine(targets[path], quantization=scheme, tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
        attn = eng.params["target"]["model"]["layers"][1]["self_attn"]
        kv = eng.state.kv
        res[name] = {"tokens": _tokens(eng), "latent": list(kv.latent.shape),
                     "index": None if kv.index is None else list(kv.index.shape),
                     "kv_b_proj": list(attn["kv_b_proj"]["weight"].shape)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_emits_tp1_greedy_tokens_on_deepseek(targets, tmp_path):
    """Float (V3, V2-Lite, V3.2), msmodelslim's W8A8 (kv_b_proj float, or stored int8 and dequantized) and int8 on
    load, routed experts split by tensor or expert parallelism: both ranks emit one rank's greedy tokens, each
    caches the whole latent [L, S+1, 1, T, R + rope] (V3.2: and index keys, each rank selecting the same
    positions) and holds half of kv_b_proj's heads."""
    ref = {name: _tokens(Engine(targets[path], quantization=scheme, **ENGINE))
           for name, (path, scheme, _) in CASES.items()}
    ranks = run_ranks(_rank, (targets,), tmp_path, 600)
    assert ranks[0] == ranks[1]
    for name, want in ref.items():
        assert want[0] != want[1] and len(want[0]) == 10, name
        got = ranks[0][name]
        assert got["tokens"] == want, name
        assert [got["latent"][i] for i in (0, 2, 4)] == [3, 1, 32 + 8], name  # every layer's whole latent
        assert got["kv_b_proj"] == [2 * (16 + 16), 32], name
        assert (got["index"] and [got["index"][i] for i in (0, 2, 4)]) == ([3, 1, 32] if "v32" in name else None)


def test_tp2_mtp_on_the_trained_zoo_target_as_msmodelslim_w8a8(tmp_path):
    """The zoo's trained DeepSeek-V3 with its MTP layer, written as msmodelslim's W8A8 (the MTP layer float, as
    msmodelslim keeps it): ``mtp`` K = 2 from the target's own layer, replicated on two ranks with expert
    parallelism, accepts drafts and emits one rank's greedy tokens."""
    from funcspec import LLM, zoo
    path = str(qw.write_ascend(zoo.model_path("mtp_target"), tmp_path / "w8a8", **qw.DEEPSEEK_MIX))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = ["The future of AI is", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for size in (1, 2):
        with LLM(path, quantization="ascend", tensor_parallel_size=size, enable_expert_parallel=True,
                 speculative_config=spec, enforce_eager=True, max_num_seqs=2, max_model_len=64) as llm:
            out[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert llm.engine.stats()["mean_acceptance_length"] > 1.2, size
    assert out[2] == out[1]
