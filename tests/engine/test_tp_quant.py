"""Tensor parallelism of quantized linears (funcspec.quant.shard): shards keep groups whole.

A shard dequantizes to the slice of the whole layer's weight, exactly, in
every layout (8 and 4 bits, groups, per channel, offsets, act-order), and a
split that would cut a group is refused naming the sizes.
"""

from __future__ import annotations

import pytest
import torch

from funcspec.kernels import Ops, quant
from funcspec.quant import formats, shard

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


def test_a_split_that_cuts_a_group_is_refused_naming_the_sizes():
    p = random_linear(32, 256, 4, 128, False)
    with pytest.raises(ValueError, match=r"a shard of 64 inputs \(256 / 4\) is not a multiple of its quantization "
                                         r"group of 128 \(test\): each rank must hold whole groups"):
        shard.split_inputs(p, 0, 4)
    with pytest.raises(ValueError, match=r"a shard of 48 inputs \(96 / 2\) is not a multiple of 32"):
        shard.split_inputs(random_linear(32, 96, 8, 96, False), 0, 2)
