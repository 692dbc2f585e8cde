"""Every kernel build this CPU runs (``build.builds()``: avx512bf16, avx512, avxvnni, avx2, portable), each kernel
against a float64 reference at row counts 1..80, and a row's bits alone equal to its bits among others; the build picked
per CPU and forced by ``FUNCSPEC_CPU_KERNELS``; greedy speculation equal to AR on each build.

Nothing here asks which CPU this is: the tests run on the builds it supports (``portable`` runs everywhere), and
the choice of build is checked on CPUs described by their feature flags.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OpLog, make_hf_model, reference_attention

from funcspec import Engine, SamplingParams, kernels
from funcspec.kernels import Ops, QuantFormat, attention, build, cpu, moe, quant, stream
from funcspec.quant import prepare_params

BUILDS = build.builds()
ROWS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 80]
"""Row counts of a step of up to 16 sequences at K = 4 (1..80), past every pass size of every build."""
HEADS = [1, 8, 32, 64, 80, 128, 256]
"""Head sizes up to attention.MAX_HEAD_DIM."""

# Stated tolerances against float64. Products: sums over k = 600 in fp32 (~sqrt(k)·2^-24 of the terms' size);
# bf16 adds the output's rounding (2^-8 relative). Attention: fp32 softmax and sums; bf16 inputs exact in
# float64, the output (and on avx512bf16 the probabilities) rounded to bf16.
STREAM_TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-3, "rtol": 2 ** -8}}
ATTEND_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.02, "rtol": 0.02}}


@pytest.fixture(params=BUILDS)
def kernel_build(request, monkeypatch):
    """The kernels forced to one build by FUNCSPEC_CPU_KERNELS (the build picked afresh), restored after."""
    monkeypatch.setenv(build.SWITCH, request.param)
    build.reset()
    assert build.selected() == request.param and f"funcspec-{request.param}-" in build.lib()._name
    yield request.param
    monkeypatch.undo()
    build.reset()


def test_portable_runs_everywhere_and_x86_runs_what_its_flags_allow():
    assert BUILDS[-1] == "portable" and BUILDS == [n for n in build.ORDER if n in BUILDS]
    if cpu.is_x86():
        assert "avx2" in BUILDS or not {"avx2", "fma", "f16c"} <= cpu.x86_flags()
        assert "avxvnni" in BUILDS or not {"avx2", "fma", "f16c", "avx_vnni"} <= cpu.x86_flags()


# ----------------------------------------------------------------------------- 1. picking the build


ALL_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize("flags, runs", [
    (ALL_FLAGS, ["avx512bf16", "avx512", "avx2", "portable"]),  # Zen 4, Cooper Lake
    (ALL_FLAGS | {"avx_vnni"}, ["avx512bf16", "avx512", "avxvnni", "avx2", "portable"]),  # Sapphire Rapids, Zen 5
    (ALL_FLAGS - {"avx512_bf16", "avx512_vnni"}, ["avx512", "avx2", "portable"]),  # Skylake-SP
    (ALL_FLAGS - {"avx512_bf16"}, ["avx512", "avx2", "portable"]),  # Ice Lake: VNNI without BF16
    ({"avx2", "fma", "f16c", "avx_vnni"}, ["avxvnni", "avx2", "portable"]),  # Alder Lake .. Arrow Lake laptops
    ({"avx2", "fma", "f16c"}, ["avx2", "portable"]),  # Haswell .. Zen 3
    ({"avx", "sse4_2"}, ["portable"]),
], ids=["avx512bf16", "avx512bf16-avxvnni", "avx512", "avx512-vnni", "avxvnni", "avx2", "sse"])
def test_the_best_build_a_cpu_runs_is_its_default(flags, runs, monkeypatch):
    monkeypatch.setattr(cpu, "is_x86", lambda: True)
    monkeypatch.setattr(cpu, "x86_flags", lambda: frozenset(flags))
    for value in (None, "", "1", " 1 "):
        if value is None:
            monkeypatch.delenv(build.SWITCH, raising=False)
        else:
            monkeypatch.setenv(build.SWITCH, value)
        assert build.builds() == runs and build.choice() == runs[0] and build.enabled()
    for name in build.ORDER:
        monkeypatch.setenv(build.SWITCH, name)
        if name in runs:
            assert build.choice() == name
        else:
            lacks = ", ".join(f for f in build.BUILDS[name].needs if f not in flags)
            with pytest.raises(ValueError, match=f"FUNCSPEC_CPU_KERNELS={name}: this CPU cannot run the {name} "
                                                 f"kernels, it lacks {lacks} \\(it runs {', '.join(runs)}\\)"):
                build.choice()
    monkeypatch.setenv(build.SWITCH, "0")
    assert build.choice() is None and not build.enabled()


@pytest.mark.parametrize("kind_flags, streams", [({"amx_tile"}, "avx512"), (set(), "avx512bf16")],
                         ids=["amx", "avx512bf16"])
def test_amx_cpus_stream_weights_on_the_avx512_build(kind_flags, streams, monkeypatch):
    """On an AMX CPU the bf16/fp32 streaming products take the avx512 build and every other kernel avx512bf16's
    (VNNI); a build FUNCSPEC_CPU_KERNELS names runs everything, and a streaming build that does not build leaves
    the streaming products on the default one."""
    monkeypatch.setattr(cpu, "is_x86", lambda: True)
    monkeypatch.setattr(cpu, "x86_flags", lambda: frozenset(ALL_FLAGS | kind_flags))
    monkeypatch.setattr(build, "load", lambda name: object())  # every build builds (none is run here)
    monkeypatch.setattr(build, "bind", lambda: True)  # nor are the ops pointed at them
    monkeypatch.delenv(build.SWITCH, raising=False)
    build.reset()
    try:
        assert (build.selected(), build.streaming()) == ("avx512bf16", streams)
        explained = build.explain()
        assert (explained["build"], explained["streaming_build"]) == ("avx512bf16", streams)
        assert explained["streaming_why"] == ("on x86 AMX CPUs avx512's streaming products outrun avx512bf16's"
                                              if kind_flags else "the build the kernels take")
        for forced in ("avx512bf16", "avx2"):
            monkeypatch.setenv(build.SWITCH, forced)
            build.reset()
            assert build.selected() == build.streaming() == forced
        monkeypatch.delenv(build.SWITCH)
        monkeypatch.setattr(build, "load", lambda name: None if name == "avx512" else object())
        build.reset()
        assert build.streaming() == "avx512bf16"
    finally:
        build.reset()


def test_the_streaming_op_runs_the_streaming_build():
    """stream_op's bits by default are those of the build :func:`build.streaming` names, forced."""
    if not build.available():
        pytest.skip("reason: no kernel build runs on this machine")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(70, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    packed = stream.pack_weight(w)
    name = build.streaming()
    assert f"funcspec-{name}-" in build.loaded(streamed=True)._name
    default = stream.stream_op(x, packed, None, 70)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(build.SWITCH, name)
        build.reset()
        assert torch.equal(stream.stream_op(x, packed, None, 70), default)
    build.reset()


def test_other_cpus_run_the_portable_build_and_a_bad_value_is_a_value_error(monkeypatch):
    monkeypatch.setattr(cpu, "is_x86", lambda: False)
    monkeypatch.setattr(cpu, "x86_flags", lambda: frozenset())
    monkeypatch.delenv(build.SWITCH, raising=False)
    assert build.builds() == ["portable"] and build.choice() == "portable"
    monkeypatch.setenv(build.SWITCH, "avx2")
    with pytest.raises(ValueError, match="FUNCSPEC_CPU_KERNELS=avx2: this CPU cannot run the avx2 kernels, it "
                                         "lacks x86-64"):
        build.choice()
    for bad in ("avx3", "AVX2", "2", "off"):
        monkeypatch.setenv(build.SWITCH, bad)
        with pytest.raises(ValueError, match=f"FUNCSPEC_CPU_KERNELS must be 0 .* one of avx512bf16, avx512, avxvnni, "
                                             f"avx2, portable; got '{bad}'"):
            kernels.resolve("cpu")
    with pytest.raises(ValueError, match="no kernel build 'avx3'"):
        build.flags("avx3")


def test_each_build_has_its_own_flags_define_and_library(tmp_path, monkeypatch):
    """The same sources, each build's flags and -DFUNCSPEC_ISA_<NAME> (portable: no -m flag), one library each."""
    script = tmp_path / "fakecxx"
    script.write_text('#!/bin/sh\nout=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; '
                      'done\nprintf \'%s\\n\' "$@" > "$out"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    libs = {name: build.build(tmp_path / "cache", name=name) for name in build.ORDER}
    assert len(set(libs.values())) == len(build.ORDER)
    for name, lib in libs.items():
        args = lib.read_text().splitlines()
        assert f"-DFUNCSPEC_ISA_{name.upper()}" in args and lib.name.startswith(f"funcspec-{name}-")
        assert [a for a in args if a.startswith("-m")] == list(build.BUILDS[name].flags)
        assert [a for a in args if a.endswith(".cpp")] == [str(p) for p in build.SOURCES]


def test_every_build_keeps_rows_free_and_one_context_bucket(kernel_build):
    """resolve() on any build: the streaming products, decode attention, quantized products and routed experts,
    so the plan keeps a symbolic batch (rows_free) and one context bucket (reads_live_only)."""
    ops = kernels.resolve("cpu")
    assert ops.stream and ops.decode_attention and ops.quantized and ops.routed_experts == "cpu_kernel"
    assert not ops.onednn_bf16
    for dtype in (torch.float32, torch.bfloat16):
        assert ops.rows_free(dtype)
        for d in (64, 128, 256):
            assert ops.reads_live_only(dtype, d, "cpu")
    assert kernels.resolve("cpu", cpu_kernels=False) == kernels.resolve("cpu", cpu_kernels=False)
    assert not kernels.resolve("cpu", cpu_kernels=False).stream


# ----------------------------------------------------------------------------- 2. every kernel, every build


def alone_and_counts(fn, n: int):
    """fn(i, j) on rows [i, j): every row alone, and each of ROWS starting at a few offsets."""
    alone = torch.cat([fn(i, i + 1) for i in range(n)])
    return alone, [(r, r % 5, fn(r % 5, r % 5 + r)) for r in ROWS if r % 5 + r <= n]


@pytest.mark.parametrize("dtype, k", [(torch.float32, 600), (torch.bfloat16, 600), (torch.bfloat16, 201)])
def test_streaming_products(kernel_build, dtype, k, two_threads):
    """x @ W.T + b within STREAM_TOL of float64 at 1..80 rows (3 column blocks, the last partial; bf16 k odd:
    padded to pairs), each row with the bits it has alone."""
    g = torch.Generator().manual_seed(7)
    n = 130
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(90, k, generator=g).to(dtype)
    packed = stream.pack_weight(w)
    want = x.double() @ w.double().T + b.double()
    alone, counts = alone_and_counts(lambda i, j: stream.stream_op(x[i:j], packed, b, n), len(x))
    torch.testing.assert_close(alone.double(), want, **STREAM_TOL[dtype])
    for r, s, got in counts:
        assert torch.equal(got, alone[s:s + r]), f"{r} rows"


# Every weight the quantized kernel holds: 8 and 4 bits, symmetric and asymmetric, groups of 32, 128 and K (per
# channel), 16 at 8 bits, and 6 bits (symmetric) in groups of 16 (GGUF's Q6_K), 32 and K.
QFORMATS = [(8, 32, False), (8, 32, True), (8, 128, False), (8, 256, False), (8, 16, False), (8, 16, True),
            (6, 16, False), (6, 32, False), (6, 256, False),
            (4, 32, False), (4, 32, True), (4, 128, True), (4, 256, False)]


def quantized_linear(bits: int, group: int, asym: bool, n: int, k: int, g) -> dict:
    """A random quantized linear's params (packed as prepare_params leaves them), with a bias."""
    q = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).half()
    offsets = (torch.rand(n, k // group, generator=g) * 0.1).half() if asym else None
    qweight, s, o = quant.pack(q, scales, offsets, bits)
    p = {"qweight": qweight, "scales": s, "bias": torch.randn(n, generator=g),
         "format": QuantFormat(bits, group, n, k, asym)}
    return p if o is None else {**p, "offsets": o}


def quant_reference64(x: torch.Tensor, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized product's math (quant.reference's: int8 activations per 32 k, integer sums per unit of
    min(G, 32) k, scaled) in float64; and each output's sum of |terms|, the scale of fp32's rounding."""
    f = p["format"]
    q, s, o = quant.unpack(p["qweight"], p["scales"], p.get("offsets"), f)
    xq, d, _ = quant.quantize_activations(x.reshape(-1, f.in_features))  # the kernel's fp32 quantization
    unit = min(f.group, quant.AB)
    xq = xq.view(xq.shape[0], -1, unit).double()  # [R, U, unit]
    dots = torch.einsum("ruk,nuk->rnu", xq, q.view(f.out_features, -1, unit).double())  # [R, N, U]
    sums = xq.sum(-1).unsqueeze(1)  # [R, 1, U]
    s = s.double().repeat_interleave(f.group // unit, 1)  # [N, U]
    if f.asym:
        units = dots * s - o.double().repeat_interleave(f.group // unit, 1) * sums
    else:
        units = (dots - f.zero * sums) * s
    terms = units * d.double().repeat_interleave(quant.AB // unit, 1).unsqueeze(1)  # [R, N, U]
    bias = p["bias"].to(x.dtype).double()  # the kernel adds the bias in x's dtype
    return terms.sum(-1) + bias, terms.abs().sum(-1) + bias.abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", QFORMATS, ids=[f"{b}bit-g{g}{'-asym' if a else ''}" for b, g, a in QFORMATS])
def test_quantized_products(kernel_build, fmt, dtype, two_threads):
    """Each format within fp32's rounding of the float64 math (plus bf16's output rounding) at 1..80 rows (2.5
    column blocks), each row with the bits it has alone."""
    g = torch.Generator().manual_seed(sum(fmt[:2]))
    n, k = 80, 256
    p = quantized_linear(*fmt, n, k, g)
    x = torch.randn(85, k, generator=g).to(dtype)
    want, scale = quant_reference64(x, p)
    alone, counts = alone_and_counts(lambda i, j: quant.qlinear(x[i:j], p), len(x))
    err = (alone.double() - want).abs()
    bound = 64 * 2 ** -24 * scale + (2 ** -8 * want.abs() if dtype == torch.bfloat16 else 0)
    assert (err <= bound).all(), f"{(err - bound).max()} beyond"
    for r, s, got in counts:
        assert torch.equal(got, alone[s:s + r]), f"{r} rows"




@pytest.mark.skipif("avxvnni" not in BUILDS, reason="this CPU has no AVX-VNNI, so no avxvnni build to compare")
@pytest.mark.parametrize("fmt", [(4, 32, False), (6, 16, False), (8, 32, True)], ids=["q4_0", "q6_k", "8bit-asym"])
def test_prefetching_quantized_weights_changes_no_bits(kernel_build, fmt, two_threads):
    """The distance the quantized tiles prefetch at (set per CPU kind on load, build.QUANT_PREFETCH; the portable
    tiles ignore it) changes no output bit, at 1 and 5 rows."""
    g = torch.Generator().manual_seed(11)
    p = quantized_linear(*fmt, 96, 512, g)
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    set_ahead = build.lib().funcspec_set_quant_prefetch
    try:
        outs = []
        for ahead in (0, 64, 3072, 1 << 16):
            set_ahead(ahead)
            outs.append((quant.qlinear(x[:1], p), quant.qlinear(x, p)))
    finally:
        set_ahead(build.QUANT_PREFETCH.get(build.cpu_kind(), 0))
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


def test_avxvnni_and_avx2_builds_give_the_same_bits(monkeypatch, two_threads):
    """The two ways of summing the integer products (AVX-VNNI's vpdpbusd; AVX2's byte products with the 8-bit
    weights shifted by 128) give the same integers, so every format's outputs are bitwise the same."""
    g = torch.Generator().manual_seed(7)
    cases = [(quantized_linear(*fmt, 80, 256, g), torch.randn(13, 256, generator=g).to(dtype))
             for fmt in QFORMATS for dtype in (torch.float32, torch.bfloat16)]
    outs = {}
    try:
        for name in ("avx2", "avxvnni"):
            monkeypatch.setenv(build.SWITCH, name)
            build.reset()
            outs[name] = [quant.qlinear(x, p) for p, x in cases]
    finally:
        build.reset()
    for (p, _), a, b in zip(cases, outs["avx2"], outs["avxvnni"]):
        assert torch.equal(a, b), p["format"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(kernel_build, dtype, two_threads):
    """Head sizes 1..256 (6 query heads over 2 KV heads: groups of 3), 1..80 query tokens over a cache read as
    a view of its slots: within ATTEND_TOL of float64, each token with the bits it has alone, and q read in place
    as a view of a fused q/k/v product."""
    g = torch.Generator().manual_seed(5)
    t, tr = 85, 120
    pos = 30 + torch.arange(t)  # causal over a verify block: token i sees 31 + i positions
    visible = (torch.arange(tr).view(1, 1, -1) <= pos.view(1, -1, 1))  # [1, T, T_read]
    for d in HEADS:
        q = torch.randn(1, t, 6, d, generator=g).to(dtype)
        cache = torch.randn(2, 2, 2, tr + 8, d, generator=g).to(dtype)  # [K/V, slots, H_kv, T_max, D]
        keys, vals = cache[0, :1, :, :tr], cache[1, :1, :, :tr]
        def rows(i, j, q=q, keys=keys, vals=vals):
            return attention.decode_attention(q[:, i:j], keys, vals, visible[:, i:j]).transpose(0, 1)

        alone, counts = alone_and_counts(rows, t)
        alone = alone.transpose(0, 1)  # [1, T, H·D]
        torch.testing.assert_close(alone.double(), reference_attention(q, keys, vals, visible), **ATTEND_TOL[dtype],
                                   msg=lambda m, d=d: f"head size {d}: {m}")
        for r, s, got in counts:
            assert torch.equal(got.transpose(0, 1), alone[:, s:s + r]), f"head size {d}, {r} tokens"
        # q as the fused q/k/v product's view, read in place: the bits of its contiguous copy
        fused = torch.cat([q, torch.randn(1, t, 4, d, generator=g).to(dtype)], dim=2)  # [1, T, 6 + 2 + 2, D]
        view = fused[:, :, :6]
        assert not view.is_contiguous()
        assert torch.equal(attention.decode_attention(view, keys, vals, visible), alone), f"head size {d}"


def expert_layer(e: int, h: int, i: int, dtype, g) -> dict:
    return {"gate_up_proj": {"weight": (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)},
            "down_proj": {"weight": (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)}}


# The torch reference in the same dtype rounds where the kernel rounds (moe.py): fp32 sums in another order;
# bf16 a near-tie one bf16 ulp apart, carried on by the down product (test_moe_kernel.py's TOL and QTOL).
MOE_TOL = {torch.float32: {"atol": 5e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2 ** -7}}
QMOE_TOL = {torch.float32: {"atol": 2e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 4e-2, "rtol": 2 ** -7}}


@pytest.mark.parametrize("scheme", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts(kernel_build, dtype, scheme, two_threads):
    """16 experts of 72 units (padded to 96) over H = 130, top 4 from a pool of 6 (experts shared by up to 80
    tokens): the reference within tolerance (fp32 float experts: float64), each token with its bits alone."""
    g = torch.Generator().manual_seed(3)
    e, h, i, k, t = 16, 130 if scheme is None else 128, 72 if scheme is None else 64, 4, 85
    ops = Ops(routed_experts="cpu_kernel", quantized=True)
    layer = expert_layer(e, h, i, dtype, g)
    p = prepare_params({"experts": layer}, ops, quantization=scheme)["experts"]
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(t)]) + 5  # [T, k]
    w = torch.rand(t, k, generator=g)
    with OpLog() as log:
        ops.experts(x[:2], ids[:2], w[:2], p)
    assert log.names & {"routed_experts", "routed_qexperts"}
    alone, counts = alone_and_counts(lambda a, b: ops.experts(x[a:b], ids[a:b], w[a:b], p), t)
    if scheme is not None:
        want = moe.quantized_reference(x, ids, w, p["gate_up_proj"], p["down_proj"])
        torch.testing.assert_close(alone, want, **QMOE_TOL[dtype])
    else:
        gu, dn = layer["gate_up_proj"]["weight"], layer["down_proj"]["weight"]
        torch.testing.assert_close(alone, moe.reference(x, ids, w, gu, dn), **MOE_TOL[dtype])
        if dtype == torch.float32:
            want = moe.reference(x.double(), ids, w.double(), gu.double(), dn.double())
            torch.testing.assert_close(alone.double(), want, **MOE_TOL[dtype])
    for r, s, got in counts:
        assert torch.equal(got, alone[s:s + r]), f"{r} tokens"


# ----------------------------------------------------------------------------- 3. the engine on every build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_equals_ar_on_every_build(kernel_build, tmp_path, dtype):
    """8 requests at K = 4 (40 verified rows a step, 8 in AR) with the kernels forced to the build: the same
    tokens and logprobs bit for bit (a 512-wide MLP: sums over k >= 256), through the build's kernels."""
    make_hf_model(tmp_path, hidden_size=64, intermediate_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (6,), generator=g).tolist() * 3 for _ in range(8)]  # ngram finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    runs = []
    for s in (None, spec):
        eng = Engine(str(tmp_path), speculative_config=s, max_num_seqs=8, max_model_len=64, dtype=dtype,
                     enforce_eager=True)
        assert eng.model.cfg.ops.stream and eng.model.cfg.ops.decode_attention
        with OpLog() as log:
            runs.append(eng.generate(prompts, params))
        assert {"stream_linear", "decode_attention"} <= log.names
    ar, sd = ([(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
               for o in run for c in o.outputs] for run in runs)
    assert ar == sd
