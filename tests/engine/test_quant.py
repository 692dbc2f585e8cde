"""Quantized weights: the int8 / int4 kernel against its reference and the dequantized product, rows that ignore
their neighbours, round-to-nearest quantization on load, prepare_params, and speculation that stays lossless on
the quantized weights (eager and inductor, kernel and reference paths)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model
from funcspec import Engine, SamplingParams
from funcspec.kernels import Ops, build, quant
from funcspec.quant import formats, prepare_params

needs_kernel = pytest.mark.skipif(not build.available(), reason="no build of the CPU kernels runs on this CPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FORMATS = [(8, 64, False), (8, 32, False), (8, 32, True), (8, 16, False), (6, 16, False), (6, 64, False),
           (4, 32, False), (4, 128, True), (4, 64, False)]


def random_format(n, k, bits, group, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    o = torch.rand(n, k // group, generator=g) * 0.1 if asym else None
    qweight, scales, offsets = quant.pack(q, s, o, bits)
    p = {"qweight": qweight, "scales": scales, "format": quant.QuantFormat(bits, group, n, k, asym)}
    if asym:
        p["offsets"] = offsets
    return q, s, o, p


@pytest.mark.parametrize("bits, group, asym", FORMATS)
def test_pack_round_trips_and_dequantizes_to_the_formula(bits, group, asym):
    n, k = 70, 128  # N off the 32-output blocks
    q, s, o, p = random_format(n, k, bits, group, asym)
    q2, s2, o2 = quant.unpack(p["qweight"], p["scales"], p.get("offsets"), p["format"])
    assert torch.equal(q2, q) and torch.equal(s2, s.half()) and (o is None or torch.equal(o2, o.half()))
    w = quant.dequantize(p["qweight"], p["scales"], p.get("offsets"), p["format"])
    sf = s.half().float().repeat_interleave(group, 1)
    want = sf * q.float() - o.half().float().repeat_interleave(group, 1) if asym else \
        sf * (q.float() - {8: 128, 6: 32, 4: 8}[bits])
    torch.testing.assert_close(w, want, atol=0, rtol=0)


@pytest.mark.parametrize("bits, group, asym", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_dequantized_product_up_to_int8_activations_and_rows_are_independent(bits, group, asym,
                                                                                              dtype):
    """The reference quantizes the activations to int8 per 32 k (llama.cpp's Q8): within 1% of x @ W.T; a row's
    bits do not depend on the rows beside it."""
    n, k = 96, 256
    _, _, _, p = random_format(n, k, bits, group, asym, seed=1)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = quant.reference(x, p)
    w = quant.dequantize(p["qweight"], p["scales"], p.get("offsets"), p["format"])
    exact = x.float() @ w.T
    assert ((y.float() - exact).abs().max() / exact.abs().max()) < 0.02
    for lo, hi in ((0, 1), (3, 8), (8, 9)):
        assert torch.equal(quant.reference(x[lo:hi], p), y[lo:hi])


@needs_kernel
@pytest.mark.parametrize("bits, group, asym", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_reference_and_a_row_ignores_its_neighbours(bits, group, asym, dtype):
    """Any row count (passes of up to 6 rows, 4 for 4-bit asymmetric), N off the blocks, a bias: the kernel gives
    the reference's value (its fp32 sum over blocks in another order), and each row the same bits alone or among
    others, so AR equals verification."""
    n, k = 100, 512
    _, _, _, p = random_format(n, k, bits, group, asym, seed=3)
    p["bias"] = torch.randn(n).to(dtype)
    x = torch.randn(27, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    y = quant.qlinear(x, p)
    assert y.shape == (27, n) and y.dtype == dtype
    ref = quant.reference(x, p)
    # bf16: the two round their own fp32 sums, one bf16 step of the outputs' scale apart at most
    atol = 1e-4 if dtype == torch.float32 else ref.float().abs().max().item() * 2 ** -7
    torch.testing.assert_close(y.float(), ref.float(), atol=atol, rtol=1e-4 if dtype == torch.float32 else 0.02)
    for lo, hi in ((0, 1), (0, 5), (4, 5), (0, 6), (0, 7), (7, 19), (12, 25), (26, 27)):
        assert torch.equal(quant.qlinear(x[lo:hi], p), y[lo:hi])
    assert torch.equal(quant.qlinear(x[:5].view(1, 5, k), p), y[:5].view(1, 5, n))


@needs_kernel
def test_kernel_rejects_what_it_cannot_read():
    _, _, _, p = random_format(64, 64, 4, 32, False)
    with pytest.raises(ValueError, match="x must be bfloat16 or float32"):
        quant.qlinear(torch.randn(2, 64).half(), p)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        quant.qlinear(torch.randn(2, 64), {**p, "qweight": p["qweight"][:, :4]})
    with pytest.raises(ValueError, match="offsets is missing"):
        quant.qlinear(torch.randn(2, 64), {**p, "format": quant.QuantFormat(4, 32, 64, 64, True)})
    with pytest.raises(ValueError, match="in_features must be a multiple of 32"):
        quant.check_shape(64, 48, 4, 32)
    with pytest.raises(ValueError, match="or 16 at 8 and 6 bits"):
        quant.check_shape(64, 64, 4, 16)
    with pytest.raises(ValueError, match="8, 6 or 4 bits, got 5"):
        quant.check_shape(64, 64, 5, 32)
    with pytest.raises(ValueError, match="6-bit weights are symmetric"):
        quant.check_shape(64, 64, 6, 16, asym=True)
    _, _, _, six = random_format(64, 64, 6, 16, False)
    with pytest.raises(ValueError, match="6-bit weights are symmetric, got offsets"):
        torch.ops.funcspec.qlinear(torch.randn(2, 64), six["qweight"], six["scales"], six["scales"], None, 64, 64, 6,
                                   16)


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int4", "int4-g128"])
def test_round_to_nearest_quantization_is_as_close_as_the_format_allows(name):
    """Every weight dequantizes within half a step of itself, but int4's +8 (clamped to +7: llama.cpp's Q4_0 rule
    puts the group's largest magnitude at -8), within a step; int4 puts that largest magnitude exactly at -8."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 256, generator=g)
    p = formats.quantize({"weight": w, "bias": torch.zeros(40)}, name)
    f = p["format"]
    bits, group = formats.SCHEMES[name]
    assert (f.bits, f.group, f.out_features, f.in_features, f.name) == (bits, group or 256, 40, 256, name)
    deq = quant.dequantize(p["qweight"], p["scales"], None, f)
    _, s, _ = quant.unpack(p["qweight"], p["scales"], None, f)
    step = s.float().abs().repeat_interleave(f.group, 1)
    err = (deq - w).abs()
    assert (err <= step + 1e-6).all() and (err <= step / 2 + 1e-6).float().mean() >= (0.99 if bits == 4 else 1.0)
    if bits == 4:
        q, _, _ = quant.unpack(p["qweight"], p["scales"], None, f)
        biggest = w.view(40, -1, f.group).abs().argmax(-1)  # [N, K/G]
        assert (torch.gather(q.view(40, -1, f.group), -1, biggest.unsqueeze(-1)) == 0).all()  # q - 8 = -8
    with pytest.raises(ValueError, match="quantization scheme must be one of"):
        formats.check_scheme("int3")


def test_prepare_params_quantizes_linears_only_and_fuses_them():
    """Linears become quantized (their float weights dropped), embeddings stay, q/k/v and gate/up are one
    quantized product each (members are views into it), a tied LM head quantizes, the input is untouched."""
    g = torch.Generator().manual_seed(6)
    lin = {name: {"weight": torch.randn(n, 64, generator=g)} for name, n in
           (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64))}
    mlp = {name: {"weight": torch.randn(n, k, generator=g)} for name, n, k in
           (("gate_proj", 128, 64), ("up_proj", 128, 64), ("down_proj", 64, 128))}
    embed = torch.randn(96, 64, generator=g)
    params = {"model": {"embed_tokens": {"weight": embed}, "layers": [{"self_attn": lin, "mlp": mlp}]}}
    out = prepare_params(params, Ops(), quantization="int4")
    layer = out["model"]["layers"][0]
    qkv = layer["self_attn"]["qkv_proj"]
    assert qkv["format"].out_features == 128 and "qweight" in layer["self_attn"]["o_proj"] and \
        "weight" not in layer["mlp"]["down_proj"]
    k_proj = layer["self_attn"]["k_proj"]  # a view of its column blocks in the fused copy
    assert k_proj["qweight"].data_ptr() == qkv["qweight"][2].data_ptr() and k_proj["format"].out_features == 32
    assert out["model"]["embed_tokens"]["weight"] is embed and "qweight" in out["lm_head"]
    assert "lm_head" not in params and "weight" in params["model"]["layers"][0]["self_attn"]["q_proj"]
    x = torch.randn(3, 64, generator=g)
    q, k, v = Ops().linears(x, [layer["self_attn"][m] for m in ("q_proj", "k_proj", "v_proj")],
                            layer["self_attn"]["qkv_proj"])
    for got, m in zip((q, k, v), ("q_proj", "k_proj", "v_proj")):
        alone = formats.quantize(lin[m], "int4")
        assert torch.equal(got, quant.reference(x, alone))  # a member's bits are its own product's
        assert torch.equal(Ops().linear(x, layer["self_attn"][m]), got)  # and so is the member's view alone


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qtarget")
    make_hf_model(path, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    return str(path)


PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 9, 8, 9, 9]]


def _run(target, spec=None, **kw):
    eng = Engine(target, spec, max_num_seqs=4, **kw, enforce_eager=True)
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)], eng


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("ops", ["kernel", "reference"])
def test_speculation_on_quantized_weights_equals_ar_on_the_same_weights(target, name, ops):
    """Greedy ngram and draft-model speculation, and a quantized draft model, equal greedy AR of the same
    quantized target, on the kernel and on the reference path."""
    if ops == "kernel" and not build.available():
        pytest.skip("no build of the CPU kernels runs on this CPU (the reference case runs everywhere)")
    chosen = {} if ops == "kernel" else {"ops": Ops()}
    for dtype in (torch.float32, torch.bfloat16):
        ar, eng = _run(target, quantization=name, dtype=dtype, **chosen)
        assert "qweight" in eng.params["target"]["lm_head"] and eng.params["target"]["model"]["layers"][0]["mlp"][
            "gate_up_proj"]["format"].bits == formats.SCHEMES[name][0]
        ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
        assert _run(target, ngram, quantization=name, dtype=dtype, **chosen)[0] == ar
        draft = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "quantization": name}
        out, eng = _run(target, draft, quantization=name, dtype=dtype, **chosen)
        assert out == ar and eng.stats()["mean_acceptance_length"] == 4.0  # the same quantized weights draft


@needs_kernel
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_buckets_compile_once_and_stay_lossless_on_inductor(target, name, request):
    """NOTE: the products are one custom op whatever the format, and a quantized dense step compiles by real
    inductor in tests/engine/test_published_quant.py (GPTQ, W8A8), so both run Dynamo's graph in place of
    inductor's codegen here (``traced_codegen``: the fullgraph, its guards, no recompile)."""
    if name in ("int8", "int4"):
        request.getfixturevalue("traced_codegen")
    ar, _ = _run(target, quantization=name)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    out, eng = _run(target, spec, quantization=name, backend="inductor",
                    compilation_config={"batch_sizes": [4], "capture": "lazy"})
    assert out == ar
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _run_again(eng) == ar
    assert all(g.stats.compiles == 1 and g.stats.graph_breaks == 0 for g in eng.graphs.values())


def _run_again(eng):
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]


def test_quantization_names_are_checked(target):
    """funcspec's schemes quantize; vLLM's stored formats quantize nothing; anything else names the field."""
    with pytest.raises(ValueError, match="quantization must be one of .*got 'int3'"):
        Engine(target, quantization="int3", enforce_eager=True)
    with pytest.raises(ValueError, match="speculative_config.quantization must be one of .*got 'int3'"):
        Engine(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 2, "quantization": "int3"},
               enforce_eager=True)
    assert formats.on_load("gguf") is None and formats.on_load("ascend") is None and formats.on_load("int4") == "int4"


ZOO_METHODS = ["ngram", "suffix", "draft_model", "medusa", "mtp", "eagle3", "dflash", "dspark"]


@pytest.fixture(scope="module")
def zoo_int4_ar():
    from funcspec import zoo

    prompts = [[5, 17, 300, 41, 5, 17, 300], [9, 100, 2000, 31]]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng = Engine(str(zoo.model_path("target")), max_num_seqs=2, quantization="int4", enforce_eager=True)
    return prompts, sp, [o.outputs[0].token_ids for o in eng.generate(prompts, sp)]


@pytest.mark.parametrize("method, head", [(m, None) for m in ZOO_METHODS] +
                         [(m, "int8") for m in ZOO_METHODS if m not in ("ngram", "suffix")])
def test_every_zoo_method_on_an_int4_target_equals_its_ar(zoo_int4_ar, method, head):
    """The trained zoo target quantized to int4 on load, each method's trained head as stored or itself quantized
    (int8): greedy speculation equals greedy AR of the same int4 target, token for token."""
    from funcspec import zoo

    prompts, sp, ar = zoo_int4_ar
    extra = {"quantization": head} if head else {}
    eng = Engine(str(zoo.model_path("target")), zoo.speculative_config(method, 3, **extra), max_num_seqs=2,
                 quantization="int4", enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, sp)] == ar
    assert eng.stats()["mean_acceptance_length"] > 1.0  # the trained heads still draft tokens the int4 target keeps


@pytest.mark.parametrize("method", ["eagle3", "medusa", "mtp", "dflash"])
def test_a_quantized_head_keeps_its_state_in_the_activation_dtype(method):
    """Quantized linears hold fp16 scales; the drafter's caches and staged features still take the dtype the model
    runs in (bf16 here), not the first float tensor found."""
    from funcspec import zoo
    from funcspec.pytree import tree_leaves

    eng = Engine(str(zoo.model_path("target")), zoo.speculative_config(method, 2, quantization="int8"),
                 max_num_seqs=1, quantization="int8", dtype=torch.bfloat16, enforce_eager=True)
    floats = {x.dtype for x in tree_leaves(eng.runner.state.proposer) if x.is_floating_point()}
    assert floats == {torch.bfloat16}
