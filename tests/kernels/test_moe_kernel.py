"""The routed-expert products behind ``Ops.experts``: the CPU kernel against the torch reference over many
routings, a token's bits alone equal to its bits in a batch, the op under ``torch.compile`` (same bits, no
recompile when the routing changes), packing once at load, and the CUDA and Ascend paths' index math run on the
CPU with stand-ins for their grouped GEMMs and torch_npu's MoE ops.

Tests that run the kernel take the build this CPU picks (test_kernel_builds.py runs every build it can).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import OpLog
from funcspec import kernels
from funcspec.kernels import Ops, build, moe
from funcspec.quant import prepare_params

needs_kernels = pytest.mark.skipif(not build.supported(), reason="no kernel build runs on this CPU")
KERNEL = Ops(routed_experts="cpu_kernel")

# Stated tolerances against the reference. fp32: sums over H and I in another order (and the slot sum in slot
# order, the reference's in expert order): a few ulps of the terms' size. bf16: the same roundings as the
# reference (gate, up, silu, the product, each expert's output), so a difference needs a near-tie where the
# fp32 sums, in another order, round to neighbouring bf16 values: about one bf16 ulp of the output.
TOL = {torch.float32: {"atol": 5e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2 ** -7}}


def layer(e: int, h: int, i: int, dtype, seed: int = 0) -> dict:
    """A MoE layer's stacked experts, weights scaled so that activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": {"weight": (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)},
            "down_proj": {"weight": (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)}}


def routing(kind: str, t: int, k: int, e: int, seed: int = 0) -> tuple:
    """ids [T, k] int64 and weights [T, k] fp32: ``random`` (k distinct experts a token), ``repeated`` (tokens
    draw from a pool of k + 2 experts, so experts repeat across tokens), ``one`` (every token on the same k
    experts: one expert at k = 1)."""
    g = torch.Generator().manual_seed(seed)
    pool = {"random": e, "repeated": min(e, k + 2), "one": k}[kind]
    offset = torch.randint(0, e - pool + 1, (), generator=g)
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) + offset  # [T, k]
    if kind == "one":
        ids = ids.sort(-1).values  # the same k experts, in one order
    return ids, torch.rand(t, k, generator=g)


def reference(x, ids, w, p):
    return moe.reference(x, ids, w, p["gate_up_proj"]["weight"], p["down_proj"]["weight"])


def prepared(p: dict, ops: Ops = KERNEL) -> dict:
    return prepare_params({"experts": p}, ops)["experts"]


# ----------------------------------------------------------------------------- 1. the kernel against the reference


# (E, H, I, T, k, routing): T = 1 and 65, top_k = 1 and 8, E = 128 with I not a multiple of the 64-output block
# (nor of 32: padded units), H not a multiple of 64 (a partial down block) and odd (bf16 pads k to pairs).
CASES = [(8, 64, 64, 1, 1, "random"), (8, 64, 64, 1, 8, "random"), (16, 130, 72, 9, 4, "repeated"),
         (128, 96, 100, 65, 8, "random"), (128, 64, 72, 65, 1, "one"), (32, 63, 40, 40, 8, "one"),
         (128, 128, 80, 3, 8, "repeated")]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_kernel_is_the_reference_within_tolerance(case, dtype, two_threads):
    """Ops.experts takes the kernel on prepared params and equals the reference within TOL over routings with
    experts repeated across tokens, all tokens on one expert, T = 1 and 65, top_k = 1 and 8."""
    e, h, i, t, k, kind = case
    p = layer(e, h, i, dtype, seed=e + h)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
    ids, w = routing(kind, t, k, e, seed=k)
    with OpLog() as log:
        got = KERNEL.experts(x, ids, w, prepared(p))
    assert "routed_experts" in log.names and got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float(), reference(x, ids, w, p).float(), **TOL[dtype])


@needs_kernels
def test_ids_outside_the_experts_add_nothing():
    """A slot whose id is not an expert (-1, E) adds nothing, as in the reference (which never matches it)."""
    p = layer(8, 64, 32, torch.float32)
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, -1], [8, 3], [2, 2]])
    w = torch.rand(3, 2)
    got = KERNEL.experts(x, ids, w, prepared(p))
    torch.testing.assert_close(got, reference(x, ids, w, p), **TOL[torch.float32])
    assert torch.equal(got[0], KERNEL.experts(x[:1], ids[:1, :1], w[:1, :1], prepared(p))[0])


# ----------------------------------------------------------------------------- 2. a token's bits, alone or batched


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "repeated"])
def test_a_token_has_its_bits_alone_in_a_batch_of_9_and_40(dtype, kind):
    """Each token computed alone (one thread) equals its row of a T = 9 and a T = 40 call (two threads), bit for
    bit: experts shared by up to 40 tokens take other passes (1-6 rows, 7-12 in halves, more in passes of 6)
    and other threads, never another order of a token's sums."""
    p = prepared(layer(64, 128, 96, dtype, seed=1))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, w = routing(kind, 40, 8, 64, seed=3)
    alone = torch.cat([KERNEL.experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], p) for r in range(40)])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for t in (9, 40):
            assert torch.equal(KERNEL.experts(x[:t], ids[:t], w[:t], p), alone[:t]), f"T = {t}"
        assert torch.equal(KERNEL.experts(x[31:], ids[31:], w[31:], p), alone[31:])  # other neighbours
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- 3. under torch.compile


@needs_kernels
def test_compiled_layer_has_eager_bits_and_no_recompile_when_the_routing_changes():
    """The routed experts behind a top-k over router probabilities, compiled with fullgraph=True: the kernel
    runs inside the graph with the eager bits, and new routings (data, not shapes) run without a recompile."""
    e, h, k = 32, 64, 4
    p = prepared(layer(e, h, 48, torch.bfloat16, seed=4))

    def moe_layer(x, probs):  # x [T, H], probs [T, E]
        weights, ids = probs.topk(k, -1)  # [T, k] each
        return KERNEL.experts(x, ids, weights, p)

    g = torch.Generator().manual_seed(5)
    inputs = [(torch.randn(5, h, generator=g).to(torch.bfloat16), torch.rand(5, e, generator=g)) for _ in range(3)]
    graphs = []

    def inductor(gm, example_inputs):  # inductor, keeping the graph it compiles
        from torch._inductor.compile_fx import compile_fx

        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(moe_layer, fullgraph=True, dynamic=False, backend=inductor)
    assert torch.equal(compiled(*inputs[0]), moe_layer(*inputs[0]))
    assert len(graphs) == 1 and "funcspec.routed_experts" in graphs[0]
    with torch.compiler.set_stance("fail_on_recompile"):
        for x, probs in inputs[1:]:
            assert torch.equal(compiled(x, probs), moe_layer(x, probs))


@needs_kernels
def test_a_symbolic_batch_graph_serves_every_token_count_with_each_tokens_bits():
    """Inductor's graphs of a symbolic batch serve every B above 1: the experts compare no token count, so a
    graph traced at B = 2 runs B = 16 verify blocks ([B, K+1, H], K = 4) without a recompile, each token with its
    bits alone."""
    p = prepared(layer(16, 64, 48, torch.float32, seed=10))
    g = torch.Generator().manual_seed(11)

    def experts(x, ids, w):  # x [B, K+1, H], ids and w [B, K+1, k]
        return KERNEL.experts(x, ids, w, p)

    def inputs(b):
        ids, w = routing("random", b * 5, 4, 16, seed=b)
        return torch.randn(b, 5, 64, generator=g), ids.view(b, 5, 4), w.view(b, 5, 4)

    small, big = inputs(2), inputs(16)
    for t in small:
        torch._dynamo.mark_dynamic(t, 0)
    compiled = torch.compile(experts, fullgraph=True, dynamic=False, backend="eager")
    compiled(*small)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compiled(*big)
    x, ids, w = (t.flatten(0, 1) for t in big)
    alone = torch.cat([KERNEL.experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], p) for r in range(80)])
    assert torch.equal(got, alone.view(16, 5, 64))


# ----------------------------------------------------------------------------- 4. packed once, at load


@needs_kernels
def test_experts_are_packed_once_at_load_and_read_in_place():
    """prepare_params packs the stacked experts once (a shared memo: once for two params trees), keeps their
    weights, and every call hands the kernel those packed tensors as they lie: no op of a call makes a tensor
    as large as one expert, and the packed copies' storage never moves."""
    raw = layer(16, 128, 96, torch.bfloat16, seed=6)
    memo = {}
    p, again = (prepare_params({"experts": raw}, KERNEL, memo)["experts"] for _ in range(2))
    packed = (p["gate_up_proj"]["packed"], p["down_proj"]["packed"])
    assert again["gate_up_proj"]["packed"] is packed[0] and again["down_proj"]["packed"] is packed[1]
    assert p["gate_up_proj"]["weight"] is raw["gate_up_proj"]["weight"]  # kept for the other paths
    ptrs = [t.data_ptr() for t in packed]
    one_expert = raw["down_proj"]["weight"][0].numel()
    for seed in range(3):
        ids, w = routing("random", 4, 4, 16, seed=seed)
        with OpLog() as log:
            KERNEL.experts(torch.randn(4, 128).to(torch.bfloat16), ids, w, p)
        (call,) = [args for name, args, _ in log.calls if name == "routed_experts"]
        assert call[3] is packed[0] and call[4] is packed[1]
        assert max(n for _, _, n in log.calls) < one_expert, log.calls
    assert [t.data_ptr() for t in packed] == ptrs


# ----------------------------------------------------------------------------- 5. the device paths' index math


def grouped_mm_loop(a, b, offs):
    """torch._grouped_mm's meaning, one group at a time: a [S, K] rows offs[g-1]:offs[g] times b[g] [K, N]."""
    out = a.new_zeros(a.shape[0], b.shape[2])  # [S, N]
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


class FakeNPU:
    """torch_npu's MoE ops as their documentation defines them, in torch, keyword for keyword as vLLM-Ascend
    calls them: a stand-in that runs :func:`moe.npu_experts`' routing, offsets and un-permutation on the CPU."""

    @staticmethod
    def npu_moe_init_routing(x, *, row_idx, expert_idx, active_num):
        """Rows sorted by expert (then by row index): ``(expanded_x, expanded_row_idx, expanded_expert_idx)``,
        where expanded_row_idx[r] is where the row of index r (row_idx's values) landed."""
        assert row_idx.dtype == expert_idx.dtype == torch.int32 and active_num == x.shape[0]
        r, e = row_idx.reshape(-1).long(), expert_idx.reshape(-1).long()
        order = torch.argsort(e * r.numel() + r)  # [T·k]
        dst = torch.empty_like(r).index_copy_(0, r[order], torch.arange(r.numel()))
        return x[r[order] % x.shape[0]], dst.int(), e[order].int()

    @staticmethod
    def npu_moe_compute_expert_tokens(sorted_expert_idx, num_experts):
        """Each expert's group end in the sorted rows (cumulative counts)."""
        return (sorted_expert_idx.long()[None, :] <= torch.arange(num_experts)[:, None]).sum(1).int()

    @staticmethod
    def npu_grouped_matmul(*, x, weight, split_item, group_list_type, group_type, group_list):
        assert split_item == 2 and group_list_type == 0 and group_type == 0 and group_list.dtype == torch.int64
        return [grouped_mm_loop(x[0], weight[0], group_list)]

    @staticmethod
    def npu_swiglu(h):
        gate, up = h.chunk(2, -1)
        return F.silu(gate) * up

    @staticmethod
    def npu_moe_finalize_routing(rows, *, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                                 export_for_source_row):
        """out[t] = sum_j scales[t, j] · rows[expanded_src_to_dst_row[j·T + t]]."""
        assert skip1 is None and skip2 is None and bias is None and scales.dtype == rows.dtype
        t, k = scales.shape
        y = rows[expanded_src_to_dst_row.long()].view(k, t, -1).transpose(0, 1)  # [T, k, H]
        return moe.slot_sum(y, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_and_npu_paths_index_math_is_the_reference(dtype):
    """The grouped path (the slots sorted by expert, group ends from fixed-size counts, back in slot order) with
    a per-group loop and with torch._grouped_mm where it runs on the CPU, and the NPU path on FakeNPU, equal
    the reference within TOL, ids outside the experts included for the grouped path."""
    p = layer(16, 64, 48, dtype, seed=7)
    gu, dn = p["gate_up_proj"]["weight"], p["down_proj"]["weight"]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    for kind, k in (("random", 4), ("repeated", 8), ("one", 1)):
        ids, w = routing(kind, 9, k, 16, seed=k)
        want = moe.reference(x, ids, w, gu, dn).float()
        torch.testing.assert_close(moe.grouped(x, ids, w, gu, dn, mm=grouped_mm_loop).float(), want, **TOL[dtype])
        torch.testing.assert_close(moe.grouped(x, ids, w, gu, dn).float(), want, **TOL[dtype])  # torch's
        torch.testing.assert_close(moe.npu_experts(x, ids, w, gu, dn, npu=FakeNPU).float(), want, **TOL[dtype])
    ids, w = routing("random", 9, 4, 16, seed=9)
    ids[2, 1], ids[5, 0] = -1, 16
    torch.testing.assert_close(moe.grouped(x, ids, w, gu, dn, mm=grouped_mm_loop).float(),
                               moe.reference(x, ids, w, gu, dn).float(), **TOL[dtype])


def test_the_sort_by_expert_has_static_shapes_and_no_host_sync():
    """sort_by_expert compiles with fullgraph=True (no host read) and serves a new routing without a recompile;
    its groups are the slots of each expert in slot order."""
    compiled = torch.compile(moe.sort_by_expert, fullgraph=True, dynamic=False, backend="eager")
    ids = torch.tensor([[3, 1], [1, 0], [5, 3]])
    order, ends, valid = compiled(ids, 6)
    assert order.tolist() == [3, 1, 2, 0, 5, 4] and ends.tolist() == [1, 3, 3, 5, 5, 6] and bool(valid.all())
    with torch.compiler.set_stance("fail_on_recompile"):
        order, ends, valid = compiled(torch.tensor([[2, 9], [2, -1], [0, 2]]), 6)
    assert order.tolist()[:4] == [4, 0, 2, 5] and ends.tolist() == [1, 1, 4, 4, 4, 4]
    assert valid.tolist() == [True, False, True, False, True, True]


# ----------------------------------------------------------------------------- 6. the choice, and turned off


def test_the_path_is_chosen_once_per_device_and_cpu_kernels_off_is_the_reference(monkeypatch):
    """resolve picks the kernel on a CPU that builds it, grouped GEMMs on CUDA; FUNCSPEC_CPU_KERNELS=0 or
    cpu_kernels=False leaves the kernel out (no packing, the reference runs); autograd takes the reference; an
    unknown path is a ValueError naming the field."""
    assert kernels.resolve("cuda").routed_experts == ("grouped_mm" if moe.has_grouped_mm() else "reference")
    assert kernels.resolve("cpu").routed_experts == ("cpu_kernel" if build.available() else "reference")
    monkeypatch.setenv("FUNCSPEC_CPU_KERNELS", "0")
    off = kernels.resolve("cpu")
    monkeypatch.undo()
    assert off.routed_experts == "reference" and kernels.resolve("cpu", cpu_kernels=False) == off
    raw = layer(4, 64, 32, torch.float32)
    p = prepared(raw, off)
    assert "packed" not in p["gate_up_proj"] and "packed" not in p["down_proj"]
    x, (ids, w) = torch.randn(2, 64), routing("random", 2, 2, 4)
    with OpLog() as log:
        out = off.experts(x, ids, w, p)
    assert "routed_experts" not in log.names and torch.equal(out, reference(x, ids, w, raw))
    if build.available():
        with OpLog() as log:
            KERNEL.experts(x.requires_grad_(), ids, w, prepared(raw))
        assert "routed_experts" not in log.names  # the op has no gradient: autograd takes the reference
    with pytest.raises(ValueError, match="Ops.routed_experts must be one of"):
        Ops(routed_experts="triton")


@needs_kernels
def test_wrong_packed_shapes_are_a_value_error_naming_them():
    """The kernel reads raw memory: experts packed for another H, or gate_up and down of different layers, fail
    in the op, naming the operand."""
    p = prepared(layer(4, 64, 32, torch.float32))
    ids, w = routing("random", 2, 2, 4)
    with pytest.raises(ValueError, match="gate_up must be packed"):
        moe.experts_op(torch.randn(2, 32), ids, w, p["gate_up_proj"]["packed"], p["down_proj"]["packed"])
    other = prepared(layer(4, 64, 96, torch.float32))
    with pytest.raises(ValueError, match="down must be packed"):
        moe.experts_op(torch.randn(2, 64), ids, w, p["gate_up_proj"]["packed"], other["down_proj"]["packed"])
    with pytest.raises(ValueError, match="ids must be int64"):
        moe.experts_op(torch.randn(2, 64), ids.int(), w, p["gate_up_proj"]["packed"], p["down_proj"]["packed"])


def test_routing_weights_that_need_a_gradient_get_one():
    """Training a router through Ops.experts: the kernel passes no gradient, so such weights take the reference,
    whose gradient is the expert outputs."""
    ops = kernels.resolve("cpu")
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 16, 8, generator=gen), torch.randn(4, 8, 8, generator=gen)
    p = prepare_params({"experts": {"gate_up_proj": {"weight": gate_up}, "down_proj": {"weight": down}}},
                       ops)["experts"]
    x, ids = torch.randn(3, 8, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2, generator=gen).requires_grad_()
    ops.experts(x, ids, w, p).sum().backward()
    # the expert outputs' sums, in float64: the reference's fp32 sums of terms up to ~10 take another order, so
    # a sum near 0 is off by about 1e-5 in absolute terms, not relative ones
    want = torch.stack([torch.stack([F.linear(F.silu(g) * u, down[e].double()).sum() for e in row
                                     for g, u in [F.linear(x[t].double(), gate_up[e].double()).chunk(2)]])
                        for t, row in enumerate(ids.tolist())])
    assert w.grad is not None and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad.double(), want, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- quantized experts

QKERNEL = Ops(routed_experts="cpu_kernel", quantized=True)
QTOL = {torch.float32: {"atol": 2e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 4e-2, "rtol": 2 ** -7}}
"""Against the quantized reference: the same int8 activations and integer block sums, fp32 sums over blocks in
another order (fp32: a few ulps; bf16: a near-tie rounds gate, up or an expert's output one bf16 ulp apart, which
the down product carries on)."""


def quantized(p: dict, scheme: str) -> dict:
    return prepare_params({"experts": p}, QKERNEL, quantization=scheme)["experts"]


def qreference(x, ids, w, q):
    return moe.quantized_reference(x, ids, w, q["gate_up_proj"], q["down_proj"])


# (scheme, E, H, I, T, k, routing): per-channel and grouped, 8 and 4 bits; T = 1 and 33; H not a multiple of
# 32 output columns of down (a partial block: 96 = 3 blocks, 80 = 2.5).
QCASES = [("int8", 8, 64, 64, 1, 2, "random"), ("int8-g32", 16, 96, 32, 9, 4, "repeated"),
          ("int4", 32, 64, 96, 33, 8, "random"), ("int4-g128", 8, 128, 128, 5, 8, "one"),
          ("int4", 16, 160, 64, 7, 1, "one")]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", QCASES, ids=["-".join(map(str, c)) for c in QCASES])
def test_the_quantized_kernel_is_the_quantized_reference(case, dtype, two_threads):
    """Experts quantized on load take the kernel (one call, no float weight left) and equal the quantized
    reference within QTOL; a token's result has its bits alone in the batch."""
    scheme, e, h, i, t, k, kind = case
    q = quantized(layer(e, h, i, dtype, seed=e + i), scheme)
    assert "weight" not in q["gate_up_proj"] and q["down_proj"]["format"].name == scheme
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
    ids, w = routing(kind, t, k, e, seed=k)
    ids[0, 0] = -1  # another rank's slot: adds nothing
    with OpLog() as log:
        got = QKERNEL.experts(x, ids, w, q)
    assert [n for n in log.names if "expert" in n] == ["routed_qexperts"]
    torch.testing.assert_close(got, qreference(x, ids, w, q), **QTOL[dtype])
    alone = torch.cat([QKERNEL.experts(x[j:j + 1], ids[j:j + 1], w[j:j + 1], q) for j in range(t)])
    assert torch.equal(got, alone)


@needs_kernels
def test_quantized_experts_stay_close_to_the_float_experts():
    """The relative error (Frobenius) of the layer's output: int8 per channel within 2%, int4 in groups of 32
    within 20% (round-to-nearest 4 bits: about 10% per product, through three products)."""
    p = layer(16, 128, 64, torch.float32, seed=3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    ids, w = routing("random", 6, 4, 16, seed=2)
    want = reference(x, ids, w, p)
    for scheme, bound in (("int8", 0.02), ("int4", 0.2)):
        err = (QKERNEL.experts(x, ids, w, quantized(p, scheme)) - want).norm() / want.norm()
        assert err < bound, (scheme, err)


@needs_kernels
def test_compiled_quantized_experts_have_eager_bits_and_no_recompile():
    q = quantized(layer(16, 64, 32, torch.bfloat16, seed=4), "int4")

    def moe_layer(x, probs):  # x [T, H], probs [T, E]
        weights, ids = probs.topk(2, -1)  # [T, 2] each
        return QKERNEL.experts(x, ids, weights, q)

    g = torch.Generator().manual_seed(5)
    inputs = [(torch.randn(5, 64, generator=g).to(torch.bfloat16), torch.rand(5, 16, generator=g)) for _ in range(3)]
    compiled = torch.compile(moe_layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(*inputs[0]), moe_layer(*inputs[0]))
    with torch.compiler.set_stance("fail_on_recompile"):
        for x, probs in inputs[1:]:
            assert torch.equal(compiled(x, probs), moe_layer(x, probs))


def test_stacking_quantized_experts_checks_their_formats():
    from funcspec.quant import formats

    def lin(n, k, scheme="int8"):
        return formats.quantize({"weight": torch.randn(n, k)}, scheme)

    with pytest.raises(ValueError, match="share one format"):
        moe.stack_quantized([lin(32, 64)], [lin(32, 64, "int4")], [lin(64, 32)])
    with pytest.raises(ValueError, match=r"intermediate size \(48\) must be a multiple of 32"):
        moe.stack_quantized([lin(48, 64)], [lin(48, 64)], [lin(64, 64)])
    with pytest.raises(ValueError, match=r"act-order or a bias"):
        moe.stack_quantized([{**lin(32, 64), "bias": torch.zeros(32)}], [lin(32, 64)], [lin(64, 32)])
    q = moe.stack_quantized([lin(32, 64)] * 2, [lin(32, 64)] * 2, [lin(64, 32)] * 2)
    with pytest.raises(ValueError, match=r"qexperts: down qweight must be contiguous torch.uint8 \[2, 2, 8, 32, 4\]"):
        moe.qexperts_op(torch.randn(1, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1),
                        q["gate_up_proj"], {**q["down_proj"], "qweight": q["down_proj"]["qweight"][:, :1]})


def test_i_not_a_multiple_of_32_keeps_the_experts_float():
    """An intermediate size the kernel cannot block (I = 48) stays float, packed, under on-load quantization."""
    q = quantized(layer(4, 64, 48, torch.float32), "int8")
    assert "weight" in q["gate_up_proj"] and "qweight" not in q["gate_up_proj"]
