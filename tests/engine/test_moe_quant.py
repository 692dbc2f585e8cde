"""Mixture-of-experts checkpoints stored quantized: GPTQ, AWQ, compressed-tensors and vLLM-Ascend experts load as
stacked quantized experts (the router float), close to the float model, and greedy speculation equals greedy AR on
them; act-order experts fall back to float with a warning; tensor and expert parallelism equal one rank."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from funcspec import Engine, load_model
from funcspec.checkpoints import quantized_write as qw
from funcspec.checkpoints.quantized import layer_report
from funcspec.nn.llama import forward, init_kv_cache

from spec_cases import GREEDY, _ids, _prompts, _spec
from test_moe import make_moe

CASES = {  # name -> (family, writer, options, the experts' format name)
    "gptq-int4-g32": ("qwen3_moe", qw.write_gptq, {"group": 32}, "gptq-int4-g32"),
    "gptq-int8-g32-asym-mixtral": ("mixtral", qw.write_gptq, {"bits": 8, "group": 32, "sym": False},
                                   "gptq-int8-g32"),
    "awq-int4-g32": ("qwen3_moe", qw.write_awq, {"group": 32}, "awq-int4-g32"),
    "ct-w4a16-g32-qwen2": ("qwen2_moe", qw.write_compressed_tensors, {"group": 32}, "ct-w4a16-g32"),
    "ct-w8a8-glm": ("glm4_moe", qw.write_compressed_tensors, {"scheme": "w8a8"}, "ct-w8a8"),
    "ascend-w8a8": ("qwen3_moe", qw.write_ascend, {}, "ascend-w8a8"),
    "ascend-w8a8-dynamic": ("qwen3_moe", qw.write_ascend, {"kind": "W8A8_DYNAMIC"}, "ascend-w8a8_dynamic"),
}
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}}  # whole groups of 32 in the shared expert
TOKENS = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
ENGINE = dict(max_num_seqs=4, max_model_len=96, backend="eager")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_quant")
    for family in {c[0] for c in CASES.values()}:
        make_moe(root / family, family, **OVERRIDES.get(family, {}))
    return root


def _logits(model):
    kv = init_kv_cache(model.cfg, 1, 16)
    return forward(model.cfg, model.params, kv, TOKENS, torch.arange(1), torch.zeros(1, dtype=torch.long))[0]


def _mlp(model, layer=None):
    return model.params["model"]["layers"][model.cfg.moe.sparse_layers[0] if layer is None else layer]["mlp"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_moe_checkpoints_load_their_experts_quantized_and_speculation_equals_ar(sources, tmp_path, case):
    family, writer, options, name = CASES[case]
    path = writer(sources / family, tmp_path / case, **options)
    model = load_model(path)
    mlp = _mlp(model)
    gate_up, down = mlp["experts"]["gate_up_proj"], mlp["experts"]["down_proj"]
    assert gate_up["format"].name == name and "weight" not in gate_up
    assert down["format"].name.startswith(name.split("-g")[0])  # down's 32 inputs: one group, named per channel
    assert (gate_up["format"].out_features, gate_up["format"].in_features) == (32, 64)
    assert gate_up["qweight"].shape[:2] == (8, 2)  # 8 experts, each its gate's block of 32 units then its up's
    assert "qweight" not in mlp["gate"] and mlp["gate"]["weight"].is_floating_point()  # the router stays float
    report = layer_report(model.params)  # funcspec inspect's table
    assert any(m.startswith("model.layers.*.mlp.experts.gate_up_proj") for ms in report["quantized"].values()
               for m in ms) and any(m.startswith("model.layers.*.mlp.gate") for m in report["float"])
    shared = mlp.get("shared_expert") or mlp.get("shared_experts")
    if shared is not None:
        assert shared["down_proj"]["format"].name.startswith(name.split("-g")[0])
    if "shared_expert_gate" in mlp:
        assert "qweight" not in mlp["shared_expert_gate"]
    diff = (_logits(model) - _logits(load_model(sources / family))).abs().max().item()
    assert diff < (0.15 if gate_up["format"].bits == 8 else 0.8)  # logits span about +-1.5
    prompts = _prompts(6, seed=2)
    want = _ids(Engine(model, **ENGINE).generate(prompts, GREEDY))
    assert _ids(Engine(model, _spec("ngram", 3), **ENGINE).generate(prompts, GREEDY)) == want


def test_act_order_experts_fall_back_to_float_with_a_warning(sources, tmp_path):
    """GPTQ's act-order gives every expert its own input order, which stacked experts cannot share: those layers'
    experts are dequantized (exactly) to float, with a warning; attention stays quantized."""
    path = qw.write_gptq(sources / "qwen3_moe", tmp_path / "act", group=32, desc_act=True)
    with pytest.warns(RuntimeWarning, match="mlp.experts are dequantized to float \\(act-order"):
        model = load_model(path)
    mlp = _mlp(model)
    assert mlp["experts"]["gate_up_proj"]["weight"].shape == (8, 64, 64)
    assert "perm" in model.params["model"]["layers"][0]["self_attn"]["q_proj"]
    assert (_logits(model) - _logits(load_model(sources / "qwen3_moe"))).abs().max().item() < 0.8


def test_a_layer_with_some_experts_left_float_is_refused_naming_them(sources, tmp_path):
    path = qw.write_gptq(sources / "qwen3_moe", tmp_path / "partial", group=32)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    one = "model.layers.0.mlp.experts.3.up_proj"
    tensors = {k: v for k, v in tensors.items() if not k.startswith(one + ".")}
    tensors[one + ".weight"] = torch.zeros(32, 64, dtype=torch.float16)
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp: some experts are quantized and others not "
                                         r"\(not quantized: \['up\[3\]'\]\)"):
        load_model(path)


# ----------------------------------------------------------------------------- tensor and expert parallelism
@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_of_a_quantized_moe_emit_one_ranks_greedy_tokens(tmp_path, expert_parallel):
    """TP = 2 (each quantized expert's gate/up column blocks and down's input groups) and EP = 2 (whole quantized
    experts) on a GPTQ int4 Qwen3-MoE: the engine emits one rank's tokens."""
    make_moe(tmp_path / "src", "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    path = qw.write_gptq(tmp_path / "src", tmp_path / "gptq", group=32)
    prompts = _prompts(2, seed=3)
    args = dict(max_num_seqs=2, max_model_len=64, backend="eager")
    want = _ids(Engine(str(path), **args).generate(prompts, GREEDY))
    eng = Engine(str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **args)
    try:
        assert _ids(eng.generate(prompts, GREEDY)) == want
        gate_up = eng.params["target"]["model"]["layers"][0]["mlp"]["experts"]["gate_up_proj"]
        assert gate_up["format"].name == "gptq-int4-g32"
        assert (gate_up["qweight"].shape[0], gate_up["format"].out_features) == ((4, 64) if expert_parallel
                                                                                 else (8, 32))
    finally:
        eng.close()


def test_a_split_that_cuts_quantized_experts_blocks_is_refused_naming_the_sizes(sources, tmp_path):
    path = qw.write_gptq(sources / "qwen3_moe", tmp_path / "gptq", group=32)  # I = 32: 16 a rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split model.layers.0.mlp.experts: its "
                                         r"intermediate size 32 / 2 is not a whole number of blocks of 32"):
        Engine(str(path), tensor_parallel_size=2, max_model_len=64, enforce_eager=True)
