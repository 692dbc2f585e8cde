"""Tensor parallelism of quantized targets (funcspec.quant.shard, checkpoints.tp): shards keep groups whole.

A shard dequantizes to the slice of the whole layer's weight, exactly, in
every layout (8 and 4 bits, groups, per channel, offsets, act-order); a split
that would cut a group is refused before any rank starts; and 2 ranks emit
one rank's greedy tokens for quantize-on-load int8 / int4, a GPTQ checkpoint
and a GGUF Q4_0 file. An act-order ``o_proj`` quantizes its activations over
each rank's own blocks, so there the ranks' logits are close to one rank's,
not its bits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from conftest import make_hf_model, run_ranks
from funcspec import Engine, SamplingParams, load_model
from funcspec.checkpoints import gguf_write
from funcspec.checkpoints import quantized_write as qw
from funcspec.checkpoints.tp import shard_layer, shard_model
from funcspec.kernels import Ops, quant, resolve
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.parallel import TPGroup
from funcspec.quant import formats, prepare_params, shard

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8]]
ENGINE = dict(max_num_seqs=2,
              compilation_config={"batch_sizes": [2], "capture": "lazy"}, max_model_len=40, backend="eager")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = [(8, 128, False), (8, 32, True), (8, 16, False), (4, 32, False), (4, 64, True), (4, 128, False)]


def random_linear(n: int, k: int, bits: int, group: int, asym: bool, act_order: bool = False, seed: int = 0):
    """A quantized linear [n, k] of random values, scales, zero points (``asym``) and bias; ``act_order``: its
    groups over a random permutation of the inputs, as GPTQ's ``g_idx``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=g) if asym else None
    perm = formats.act_order(torch.randperm(k, generator=g) // group, k, group, "test") if act_order else None
    return formats.linear(q, scales, bits, "test", zeros=zeros, perm=perm, bias=torch.randn(n, generator=g))


@pytest.mark.parametrize("bits, group, asym", LAYOUTS)
def test_shards_dequantize_to_the_slices_of_the_dequantized_weight_exactly(bits, group, asym):
    """Output shards (off the 32-row blocks) and input shards of whole groups; a per-channel scale on every rank."""
    n, k = 70, 256
    p = random_linear(n, k, bits, group, asym)
    w = formats.dequantize(p)  # [N, K]
    for size in (2, 4) if group <= k // 4 else (2,):
        for r in range(size):
            rows, cols = n // size, k // size
            out = shard.split_outputs(p, r, size)
            assert torch.equal(formats.dequantize(out), w[r * rows:(r + 1) * rows])
            assert torch.equal(out["bias"], p["bias"][r * rows:(r + 1) * rows])
            inp = shard.split_inputs(p, r, size)
            assert torch.equal(formats.dequantize(inp), w[:, r * cols:(r + 1) * cols])
            assert inp["bias"] is p["bias"]  # row-parallel: whole, added once after the all-reduce
            assert inp["format"].group == (cols if group == k else group)


@pytest.mark.parametrize("bits, asym", [(4, True), (8, False)])
def test_an_act_order_shard_pads_its_groups_with_zero_inputs_and_adds_up_to_the_whole(bits, asym):
    """Act-order groups are scattered over the inputs: a rank's part of each becomes whole blocks of 32 whose pads
    read a zero input, so the shard dequantizes to the slice exactly and the ranks' products add up to the whole."""
    n, k, group = 40, 256, 64
    p = random_linear(n, k, bits, group, asym, act_order=True)
    w = formats.dequantize(p)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    parts = []
    for r in range(2):
        s = shard.split_inputs(p, r, 2)
        f = s["format"]
        assert f.group == 32 and f.in_features % 32 == 0 and f.in_features >= k // 2
        assert torch.equal(formats.dequantize(s), w[:, r * 128:(r + 1) * 128])
        y = Ops().linear(x[:, r * 128:(r + 1) * 128], s, bias=False)
        # the pads add nothing: the same shard with its pads' values changed gives the same bits
        q, scales, offsets = quant.unpack(s["qweight"], s["scales"], s.get("offsets"), f)
        q[:, s["perm"] == f.in_features] ^= 0x5
        moved = {**s, "qweight": quant.pack(q, scales, offsets, bits)[0]}
        assert torch.equal(Ops().linear(x[:, r * 128:(r + 1) * 128], moved, bias=False), y)
        parts.append(y)
    want = x @ w.t()  # [3, N]: the float product; the kernel's int8 activations cost about 1% of it
    torch.testing.assert_close(parts[0] + parts[1], want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_gate_and_up_hand_an_act_order_down_proj_its_stored_block():
    """Gate/up split in down_proj's stored order give each rank whole groups of down_proj's inputs, in the order
    one rank's product reads them: the rank's down_proj reads x as it comes (no perm)."""
    h, i = 64, 256
    mlp = {"gate_proj": random_linear(i, h, 4, 32, True, seed=1), "up_proj": random_linear(i, h, 4, 32, False, seed=2),
           "down_proj": random_linear(h, i, 4, 64, True, act_order=True, seed=3)}
    perm = mlp["down_proj"]["perm"]
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(4))
    act = {m: Ops().linear(x, mlp[m]) for m in ("gate_proj", "up_proj")}  # [3, I] each, one rank's
    w = formats.dequantize(mlp["down_proj"])[:, perm]  # [H, I] in stored order
    for r in range(2):
        got = shard_layer({"mlp": mlp}, TPGroup(2, r, "g"))["mlp"]
        block = slice(r * i // 2, (r + 1) * i // 2)
        for m in ("gate_proj", "up_proj"):
            assert torch.equal(Ops().linear(x, got[m]), act[m][:, perm[block]])
        down = got["down_proj"]
        assert "perm" not in down and down["format"].group == 64
        assert torch.equal(formats.dequantize(down), w[:, block])


def test_a_split_that_cuts_a_group_is_refused_naming_the_sizes():
    p = random_linear(32, 256, 4, 128, False)
    with pytest.raises(ValueError, match=r"a shard of 64 inputs \(256 / 4\) is not a multiple of its quantization "
                                         r"group of 128 \(test\): each rank must hold whole groups"):
        shard.split_inputs(p, 0, 4)
    with pytest.raises(ValueError, match=r"a shard of 48 inputs \(96 / 2\) is not a multiple of 32"):
        shard.split_inputs(random_linear(32, 96, 8, 96, False), 0, 2)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """What the engines run: a Llama with every bias (quantized on load), a Qwen2 (q/k/v biases) as GPTQ with zero
    points, a Llama as GGUF Q4_0; and the Qwen2 as GPTQ with act-order (``act_order``, run by hand)."""
    root = tmp_path_factory.mktemp("tp_quant")
    make_hf_model(root / "float", attention_bias=True, mlp_bias=True, **SHAPE)
    make_hf_model(root / "qwen2", arch="qwen2", seed=1, **SHAPE)
    make_hf_model(root / "llama", seed=2, **SHAPE)
    return {"int8": (str(root / "float"), "int8"), "int4": (str(root / "float"), "int4"),
            "gptq": (str(qw.write_gptq(root / "qwen2", root / "gptq", group=32, sym=False)), None),
            "gguf": (str(gguf_write.write(root / "llama", root / "q4_0.gguf", "q4_0")), None),
            "act_order": (str(qw.write_gptq(root / "qwen2", root / "act_order", group=32, desc_act=True)), None)}


def test_a_tensor_parallel_size_that_cuts_a_group_is_refused_before_any_rank_starts(tmp_path):
    make_hf_model(tmp_path, num_hidden_layers=1, hidden_size=64, intermediate_size=384)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split model\.layers\.0\.mlp\.down_proj: a "
                                         r"shard of 192 inputs \(384 / 2\) is not a multiple of its quantization "
                                         r"group of 128 \(int4-g128\)"):
        Engine(str(tmp_path), quantization="int4-g128", tensor_parallel_size=2, enforce_eager=True)
    assert not dist.is_initialized()


def _tokens(eng) -> list:
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]


def _logits(model) -> torch.Tensor:
    """The last position's logits [V] of PROMPTS[1] by ``model`` (a rank's shard, or whole) on its kernels."""
    ops = resolve("cpu")
    cfg = dataclasses.replace(model.cfg, ops=ops)
    z = torch.zeros(1, dtype=torch.int64)
    kv = init_kv_cache(cfg, 1, len(PROMPTS[1]))
    return forward(cfg, prepare_params(model.params, ops), kv, torch.tensor(PROMPTS[1:]), z, z)[0][0, -1]


def _rank(rank: int, port: int, targets: dict, out: str) -> None:
    """One torchrun-style rank: a TP=2 engine per format, its tokens and its fused layers' sizes; the act-order
    checkpoint's logits and its shard's layout."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for name, (path, scheme) in targets.items():
        if name == "act_order":
            model = shard_model(load_model(path), TPGroup(2, rank, dist.group.WORLD.group_name))
            layer = model.params["model"]["layers"][0]
            res[name] = {"logits": _logits(model).tolist(), "o_proj": len(layer["self_attn"]["o_proj"]["perm"]),
                         "down_proj": "perm" in layer["mlp"]["down_proj"]}
            continue
        eng = Engine(path, quantization=scheme, tensor_parallel_size=2, **ENGINE)
        layer = eng.params["target"]["model"]["layers"][0]
        attn, mlp = layer["self_attn"], layer["mlp"]
        res[name] = {"tokens": _tokens(eng), "fused": ["qkv_proj" in attn, "gate_up_proj" in mlp],
                     "inputs": [attn["o_proj"]["format"].in_features, mlp["down_proj"]["format"].in_features],
                     "kv_heads": eng.state.kv.k.shape[2]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_emits_tp1_greedy_tokens_for_every_quantized_format(targets, tmp_path):
    """int8 (per channel) and int4 quantized on load, GPTQ with zero points, GGUF Q4_0: each rank holds half of
    every sharded layer, fused per rank, and both ranks emit one rank's greedy tokens. GPTQ with act-order: logits
    close to one rank's (its o_proj's activations are blocked per rank)."""
    ref = {name: _tokens(Engine(path, quantization=scheme, **ENGINE)) for name, (path, scheme) in targets.items()
           if name != "act_order"}
    logits = _logits(load_model(targets["act_order"][0]))
    ranks = run_ranks(_rank, (targets,), tmp_path, 300)
    for r in range(2):  # o_proj's groups padded to blocks of its own (more than its 32 inputs); down_proj: no perm
        got = ranks[r]["act_order"]
        assert got["o_proj"] > 32 and not got["down_proj"]
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, atol=0.05 * logits.abs().max().item(),
                                   rtol=0)
    for name in ref:
        assert ref[name][0] != ref[name][1] and len(ref[name][0]) == 10
        for r in range(2):
            got = ranks[r][name]
            assert got["tokens"] == ref[name], (name, r)
            assert got["kv_heads"] == 1, name
            assert got["fused"] == [True, True] and got["inputs"] == [32, 64], name  # fused per rank, halves
