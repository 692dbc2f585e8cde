"""The CPU kernels' reliability: the same kernel and bits for a row whatever the row count, every pass and
thread path of the kernels against a float64 reference, and a build that can be switched off, cached where
XDG says, driven by a ``CXX`` with arguments, and stopped when the compiler hangs.

Tests that run the kernels take the build this CPU picks (test_kernel_builds.py runs every build it can), and
skip where none can be built; the build's own tests use fake compilers (shell scripts), so they run everywhere
and compile nothing.
"""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from conftest import OpLog, make_hf_model, reference_attention
from funcspec import LLM, Engine, SamplingParams, kernels
from funcspec.kernels import Ops, attention, build, stream
from funcspec.nn.llama import attend
from funcspec.quant import prepare_params

needs_kernels = pytest.mark.skipif(not build.supported(), reason="no kernel build runs on this CPU")
STREAM = Ops(stream=True, half_gemm=True)

# Stated tolerances against float64. fp32: sums over k = 600 in fp32 (relative error ~ sqrt(k)·2^-24 of the
# terms' size, ~25 here). bf16: the fp32 sum rounded once to bf16 (2^-8 relative), inputs exact in float64.
STREAM_TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-3, "rtol": 2 ** -8}}
# Attention: fp32 softmax and sums; bf16 rounds p to bf16 for p·v, and the output to bf16.
ATTEND_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.02, "rtol": 0.02}}


def prepared(ops: Ops, w, b=None) -> dict:
    """A linear's params as prepare_params leaves them for ``ops``."""
    return prepare_params({"proj": {"weight": w} if b is None else {"weight": w, "bias": b}}, ops)["proj"]


# ----------------------------------------------------------------------------- 1. one kernel at every row count


# Every row count a step of max_num_seqs = 16 at K = 4 has (1..80): one pass of 1-6 rows, one half pass of
# 7-12, two half passes of 13-24 (7 + 6, ..., 12 + 12), passes of 5-6 rows above 24 (stream.cpp); and
# prefill-sized counts beyond, up to 200 rows.
ROW_COUNTS = [*range(1, 16 * 5 + 1), 97, 128, 200]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_streams_and_a_row_has_its_bits_alone(dtype, two_threads):
    """Ops.linear takes the streaming kernel at every row count, fp32 beyond 72 rows included: each row has the
    bits it has computed alone (AR = verification at any batch), whatever rows come with it, on the threaded
    path (several rows) as on the serial one (a row alone), and is x @ W.T + b within STREAM_TOL."""
    g = torch.Generator().manual_seed(7)
    n, k = 130, 600  # 3 column blocks, the last partial; 600 k steps (fp32) or 300 pairs (bf16): 2-3 chunks
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(208, k, generator=g).to(dtype)
    p = prepared(STREAM, w, b)
    torch.set_num_threads(1)  # each row alone, on the serial path
    alone = torch.cat([STREAM.linear(x[i:i + 1], p) for i in range(len(x))])  # [208, n], one row a call
    torch.set_num_threads(2)
    want = x.double() @ w.double().T + b.double()
    for r in ROW_COUNTS:
        s = r % 8  # other neighbours for each count
        with OpLog() as log:
            got = STREAM.linear(x[s:s + r], p)
        assert log.names & {"stream_linear"} and not log.names & {"mm", "addmm", "linear"}, (r, log.names)
        assert torch.equal(got, alone[s:s + r]), f"{r} rows"
        torch.testing.assert_close(got.double(), want[s:s + r], **STREAM_TOL[dtype])
    # a verify block of batch 16 at K = 4, as the step lays it out: [B, K+1, in]
    assert torch.equal(STREAM.linear(x[:80].view(16, 5, k), p), alone[:80].view(16, 5, n))
    # q/k/v-style groups streamed as one product keep each row's bits too
    fused = prepare_params({"self_attn": {"q_proj": {"weight": w}, "k_proj": {"weight": w[:70]},
                                          "v_proj": {"weight": w[:70]}}}, STREAM)["self_attn"]
    members = [fused["q_proj"], fused["k_proj"], fused["v_proj"]]
    one = [torch.cat(parts) for parts in zip(*(STREAM.linears(x[i:i + 1], members, fused["qkv_proj"])
                                               for i in range(90)))]
    for got, want_rows in zip(STREAM.linears(x[:90], members, fused["qkv_proj"]), one):
        assert torch.equal(got, want_rows)


@needs_kernels
def test_a_symbolic_batch_graph_keeps_one_kernel_and_no_guard_on_the_row_count():
    """Inductor's symbolic-batch graph serves every B above 1: the product must not compare the row count
    (B·(K+1)), which would be a guard, so a graph traced at B = 2 runs B = 16 (80 rows) without a recompile
    and with each row's bits alone."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 320, generator=g)
    p = prepared(STREAM, w)

    def product(x):
        return STREAM.linear(x, p)

    x2, x16 = torch.randn(2, 5, 320, generator=g), torch.randn(16, 5, 320, generator=g)
    torch._dynamo.mark_dynamic(x2, 0)
    compiled = torch.compile(product, fullgraph=True, dynamic=False, backend="eager")
    compiled(x2)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compiled(x16)
    alone = torch.stack([product(x16[i:i + 1, j:j + 1]) for i in range(16) for j in range(5)])
    assert torch.equal(got, alone.view(16, 5, 96))


@pytest.mark.skipif(not (kernels.resolve("cpu").stream and kernels.resolve("cpu").decode_attention),
                    reason="this CPU's products or attention round a row differently in a larger batch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_equals_ar_bit_for_bit_at_batch_16_and_k_4(tmp_path, dtype):
    """16 requests at K = 4 verify 80 rows per step, AR runs 16: the same tokens and every logprob bit for bit
    (a 512-wide MLP: sums over k >= 256, where MKL's order differed from the kernel's)."""
    make_hf_model(tmp_path, hidden_size=64, intermediate_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (6,), generator=g).tolist() * 3 for _ in range(16)]  # ngram finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    runs = [Engine(str(tmp_path), speculative_config=s, max_num_seqs=16, max_model_len=64, dtype=dtype,
                   enforce_eager=True)
            .generate(prompts, params) for s in (None, spec)]
    ar, sd = ([(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
               for o in run for c in o.outputs] for run in runs)
    assert ar == sd


# ----------------------------------------------------------------------------- 2. turned off


def test_cpu_kernels_turn_off_by_environment_and_by_engine_option(tiny_llama, monkeypatch):
    """FUNCSPEC_CPU_KERNELS=0 and Engine/LLM(cpu_kernels=False) leave the kernels out of the Ops that resolve
    picks, and never build them; Engine takes ops or cpu_kernels, not both."""
    monkeypatch.setenv("FUNCSPEC_CPU_KERNELS", "0")
    monkeypatch.setattr(build, "lib", lambda: pytest.fail("the library was built or loaded"))
    assert not build.available()
    off = kernels.resolve("cpu")
    assert not (off.stream or off.decode_attention or off.quantized)
    monkeypatch.undo()
    assert kernels.resolve("cpu", cpu_kernels=False) == off
    eng = Engine(tiny_llama, max_num_seqs=1, max_model_len=64, cpu_kernels=False, enforce_eager=True)
    assert eng.model.cfg.ops == off
    with OpLog() as log:
        out = eng.generate([[1, 5, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not log.names & {"stream_linear", "decode_attention", "qlinear"}
    llm = LLM(tiny_llama, max_num_seqs=1, max_model_len=64, enforce_eager=True, cpu_kernels=False)
    assert llm.engine.model.cfg.ops == off
    with pytest.raises(ValueError, match="pass ops or cpu_kernels, not both"):
        Engine(tiny_llama, ops=kernels.REFERENCE, cpu_kernels=False, enforce_eager=True)
    with pytest.raises(ValueError, match="cpu_kernels must be True or False, got 0"):
        Engine(tiny_llama, cpu_kernels=0, enforce_eager=True)
    monkeypatch.setenv("FUNCSPEC_CPU_KERNELS", "no")
    with pytest.raises(ValueError, match="FUNCSPEC_CPU_KERNELS must be 0"):
        kernels.resolve("cpu")


@needs_kernels
def test_the_ops_follow_the_build_choice_at_once_and_refuse_once_it_is_off(monkeypatch):
    """A compiled graph calls torch.ops.funcspec.* without asking which build runs: after build.reset() the ops
    run the new choice's kernels at once, and with the kernels turned off they raise instead of running the
    build chosen before."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g)
    packed = stream.pack_weight(w)
    stream.stream_op(x, packed, None, 40)  # bound to this CPU's choice
    try:
        monkeypatch.setenv(build.SWITCH, "0")
        build.reset()
        with pytest.raises(RuntimeError, match="unavailable or turned off"):
            torch.ops.funcspec.stream_linear(x, packed, None, 40)
        monkeypatch.setenv(build.SWITCH, "portable")
        build.reset()
        got = torch.ops.funcspec.stream_linear(x, packed, None, 40)  # no wrapper between: reset pointed it
        want = torch.empty(3, 40)
        build.load("portable").funcspec_linear_f32(x.data_ptr(), packed.data_ptr(), None, want.data_ptr(), 3, 40, 64,
                                                   1)
        assert torch.equal(got, want)
    finally:
        monkeypatch.undo()
        build.reset()
    assert build.available()


@needs_kernels
def test_the_kernels_are_unavailable_where_their_ops_do_not_build(monkeypatch):
    """The ops' C++ side (torch_ops.cpp) is part of the kernels: where it does not build, available() is false
    (warned once, naming the error), so resolve picks the other paths."""
    def fail(*args, **kwargs):
        raise RuntimeError("building torch_ops.cpp failed: no torch headers")

    monkeypatch.setattr(build, "build_torch_ops", fail)
    build.torch_ops.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="ops are unavailable.*no torch headers"):
            build.reset()
            assert not build.available()
        assert not kernels.resolve("cpu").stream
    finally:
        monkeypatch.undo()
        build.torch_ops.cache_clear()
        build.reset()
    assert build.available()


# ----------------------------------------------------------------------------- 3-5. the build


def fake_compiler(tmp_path, body: str = "") -> str:
    """A shell script that stands in for a compiler: it logs its arguments (one a line) to ``<script>.args``,
    runs ``body``, and writes 'fake' to the file after ``-o``."""
    script = tmp_path / "fakecxx"
    script.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > "{script}.args"
{body}
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo fake > "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_the_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    """$XDG_CACHE_HOME/funcspec/kernels, else ~/.cache/funcspec/kernels (an empty or relative XDG_CACHE_HOME
    is ignored); build() with no directory builds there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert build.cache_dir() == tmp_path / "home" / ".cache" / "funcspec" / "kernels"
    for ignored in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert build.cache_dir() == tmp_path / "home" / ".cache" / "funcspec" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "funcspec" / "kernels"
    monkeypatch.setenv("CXX", fake_compiler(tmp_path))
    lib = build.build()
    assert lib.parent == tmp_path / "xdg" / "funcspec" / "kernels" and lib.read_text() == "fake\n"
    assert not (tmp_path / "home").exists()


def test_cxx_may_carry_arguments_and_only_a_missing_first_word_is_no_compiler(tmp_path, monkeypatch):
    """CXX="ccache g++" runs the launcher with the compiler and its words first; the words are part of the
    cache key; 'no C++ compiler' names the first word when it is not found."""
    launcher = fake_compiler(tmp_path)
    monkeypatch.setenv("CXX", f"{launcher} g++ -DFUNCSPEC_TEST='a b'")
    lib = build.build(tmp_path / "cache")
    args = (tmp_path / "fakecxx.args").read_text().splitlines()
    assert args[:2] == ["g++", "-DFUNCSPEC_TEST=a b"] and args[-2] == "-o" and lib.read_text() == "fake\n"
    assert args[2:2 + len(build.FLAGS)] == list(build.FLAGS)
    monkeypatch.setenv("CXX", f"{launcher} g++")
    assert build.build(tmp_path / "cache") != lib  # another command, another library
    monkeypatch.setenv("CXX", "no-such-launcher-xyz g++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler.*'no-such-launcher-xyz', the first word of CXX"):
        build.build(tmp_path / "other")
    monkeypatch.setenv("CXX", "ccache 'g++")
    with pytest.raises(RuntimeError, match="is not a command line"):
        build.build(tmp_path / "other")


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see that the compiler's child is stopped")
def test_a_hung_compiler_is_stopped_and_the_kernels_are_reported_unavailable(tmp_path, monkeypatch):
    """A compiler that never finishes is stopped after FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT seconds with every
    process it started; lib() then warns and returns None (the kernels unavailable), leaving no temporary."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, f"sleep 120 & echo $! > {tmp_path}/child; wait"))
    monkeypatch.setenv("FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT", "2")
    with pytest.warns(RuntimeWarning, match="unavailable.*did not finish in 2 s and was stopped"):
        assert build.load.__wrapped__("portable") is None  # uncached: the real library stays loaded for other tests
    child = int((tmp_path / "child").read_text())
    for _ in range(500):  # SIGKILL is delivered asynchronously: wait up to 5 s for the sleep to end
        if _gone(child):
            break
        time.sleep(0.01)
    assert _gone(child), "the compiler's child outlived the timeout"
    assert [p.suffix for p in (tmp_path / "xdg" / "funcspec" / "kernels").iterdir()] == [".lock"]  # no library
    for bad in ("abc", "0", "-1", "inf"):
        monkeypatch.setenv("FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT must be a positive number"):
            build.build(tmp_path / "other")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        build.build(tmp_path / "other", timeout=0)


def test_a_failing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "echo 'error: no such flag' >&2; exit 1"))
    with pytest.raises(RuntimeError, match="failed:\nerror: no such flag"):
        build.build(tmp_path / "cache")
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]  # no library, no temporary


# ----------------------------------------------------------------------------- 6. impossible sizes


def test_impossible_head_sizes_are_a_value_error_naming_them():
    """A head size of 0 (or no KV heads) is a ValueError naming it, not a ZeroDivisionError (d ** -0.5,
    h % H_kv) or a kernel reading out of bounds; attends() declines it; a model's head_dim must be >= 1."""
    vis = torch.ones(1, 2, 10, dtype=torch.bool)
    q0, k0 = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 10, 0)
    assert not attention.supports(q0, k0, k0)
    if build.available():
        with pytest.raises(ValueError, match="head size D in 1..256, got \\[1, 2, 4, 0\\]"):
            attention.decode_attention(q0, k0, k0, vis)
        k_none = torch.randn(1, 0, 10, 8)
        with pytest.raises(ValueError, match="keys and vals must be \\[1, H_kv, T_read, 8\\] with H_kv dividing 4"):
            attention.decode_attention(torch.randn(1, 2, 4, 8), k_none, k_none, vis)
    for head_dim in (0, -64, 64.0):
        with pytest.raises(ValueError, match="head_dim must be a positive int"):
            Ops(decode_attention=True).reads_live_only(torch.float32, head_dim, "cpu")


@pytest.mark.parametrize("ops", [Ops(), STREAM], ids=["plain", "stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_of_no_inputs_is_its_bias(ops, dtype):
    """in_features = 0 is the empty sum (F.linear's answer), not a ZeroDivisionError from numel() // in."""
    if ops.stream and not build.supported():
        pytest.skip("no kernel build runs on this CPU")
    b = torch.randn(24).to(dtype)
    got = ops.linear(torch.randn(3, 0).to(dtype), prepared(ops, torch.randn(24, 0).to(dtype), b))
    assert torch.equal(got, b.expand(3, 24))


# ----------------------------------------------------------------------------- 7. attention's paths




@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_decode_attention_has_the_serial_bits(dtype, two_threads):
    """An attention this large runs on torch's threads (threads take (b, KV head) pairs): the same bits as on
    one thread and as each token alone, within ATTEND_TOL of float64; the cache read as a view of the slots."""
    g = torch.Generator().manual_seed(5)
    b, t, h, hkv, d, tr = 2, 5, 8, 2, 64, 1100
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    cache = torch.randn(2, b + 1, hkv, tr + 20, d, generator=g).to(dtype)  # [2, S+1, H_kv, T_max, D]
    keys, vals = cache[0, :b, :, :tr], cache[1, :b, :, :tr]
    pos = torch.tensor([700, 1090]).view(b, 1) + torch.arange(t) - 4  # causal over a verify block
    visible = torch.arange(tr).view(1, 1, -1) <= pos.unsqueeze(-1)  # [B, T, T_read]
    threaded = attention.decode_attention(q, keys, vals, visible)
    torch.set_num_threads(1)
    serial = attention.decode_attention(q, keys, vals, visible)
    torch.set_num_threads(2)
    assert torch.equal(threaded, serial)
    for i in range(t):
        assert torch.equal(attention.decode_attention(q[:, i:i + 1], keys, vals, visible[:, i:i + 1]),
                           threaded[:, i:i + 1])
    torch.testing.assert_close(threaded.double(), reference_attention(q, keys, vals, visible), **ATTEND_TOL[dtype])


# Head sizes: odd ones and every chunk count the kernel instantiates (16 lanes a chunk, 1..16 chunks),
# above 128 up to its limit of 256.
HEAD_SIZES = [1, 3, 17, 33, 65, 96, 127, 129, 136, 160, 191, 200, 224, 255, 256]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_takes_every_head_size_up_to_256_and_attend_falls_back_above(dtype):
    """Odd head sizes and those above 128 are masked softmax attention within ATTEND_TOL, each token with its
    bits alone; above MAX_HEAD_DIM, supports() declines and attend() takes its own path (no kernel call)."""
    g = torch.Generator().manual_seed(11)
    ops = Ops(decode_attention=True)
    for d in HEAD_SIZES:
        q = torch.randn(1, 3, 6, d, generator=g).to(dtype)
        keys, vals = torch.randn(1, 2, 40, d, generator=g).to(dtype), torch.randn(1, 2, 40, d, generator=g).to(dtype)
        visible = torch.arange(40).view(1, 1, -1) <= 36 + torch.arange(3).view(1, 3, 1)
        assert attention.supports(q, keys, vals)
        with OpLog() as log:
            got = attend(ops, q, keys, vals, visible)
        assert "decode_attention" in log.names, d
        torch.testing.assert_close(got.double(), reference_attention(q, keys, vals, visible), **ATTEND_TOL[dtype],
                                   msg=lambda m: f"head size {d}: {m}")
        for i in range(3):
            assert torch.equal(attend(ops, q[:, i:i + 1], keys, vals, visible[:, i:i + 1]), got[:, i:i + 1]), d
    for d in (attention.MAX_HEAD_DIM + 1, 320):
        q = torch.randn(1, 2, 4, d, generator=g).to(dtype)
        keys = torch.randn(1, 2, 40, d, generator=g).to(dtype)
        visible = torch.ones(1, 2, 40, dtype=torch.bool)
        assert not attention.supports(q, keys, keys)
        with OpLog() as log:
            got = attend(ops, q, keys, keys, visible)
        assert "decode_attention" not in log.names
        torch.testing.assert_close(got.double(), reference_attention(q, keys, keys, visible), **ATTEND_TOL[dtype])


def test_two_processes_wanting_one_build_at_once_compile_it_once(tmp_path, monkeypatch):
    """Two callers (two test workers, two notebooks) that need the same library at the same moment: one runs the
    compiler, the other waits for it and gets the same library."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("CXX", fake_compiler(tmp_path, f"echo run >> {tmp_path}/runs; sleep 1"))
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda _: build.build(tmp_path / "cache", name="portable"), range(2)))
    assert libs[0] == libs[1] and libs[0].read_text() == "fake\n"
    assert (tmp_path / "runs").read_text() == "run\n"
