"""Graph capture per bucket: captured == eager, padding invariance, no recompiles, many buckets, NPU/CUDA refusals."""

import functools

import pytest
import torch

from funcspec import Engine, SamplingParams, kernels
from funcspec.capture import BucketPlan, capture, fresh_code_copy
from funcspec.capture.backends import TrustedAfterChecks
from funcspec.pytree import tree_signature

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 33], list(range(10, 25)), [44, 9, 71, 8], [3] * 7, [90, 12]]


@pytest.fixture(scope="module")
def inductor_engine(tiny_llama):
    """Lazy capture: each test that uses it compiles its buckets under ``traced_codegen`` (Dynamo's graph in
    place of inductor's codegen). NOTE: padded rows on real inductor are checked by the logprobs matrix
    (tests/engine/test_logprobs.py: the row left when the other finishes runs padded in its graph), and a
    symbolic-batch AR step compiles for real in tests/engine/test_store.py."""
    return Engine(tiny_llama, backend="inductor", max_num_seqs=8, max_model_len=64,
                  compilation_config={"capture": "lazy"})


@pytest.fixture(scope="module")
def eager_engine(tiny_llama):
    return Engine(tiny_llama, backend="eager", max_num_seqs=8, max_model_len=64)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_inductor_equals_eager_on_padded_buckets(inductor_engine, eager_engine, n, traced_codegen):
    """1, 3 and 5 prompts (buckets 1, 3 and 5 of the inductor engine where its batch is symbolic, else 1, 4
    and 8, as the eager one's): greedy and seeded sampling are identical."""
    params = [GREEDY if i % 2 == 0 else SAMPLED for i in range(n)]
    assert _ids(inductor_engine.generate(PROMPTS[:n], params)) == _ids(eager_engine.generate(PROMPTS[:n], params))
    plan = inductor_engine.plan.bucket_plan
    b = n if plan.symbolic_batch else plan.batch_bucket(n)  # a symbolic batch: every size is a bucket
    assert f"B{b}_K0" in inductor_engine.stats()["buckets_used"]


def test_second_generate_never_recompiles(inductor_engine, traced_codegen):
    """The same workloads a second time compile nothing: every (B, K, T, mode) bucket is warm."""
    def workloads():
        inductor_engine.generate(PROMPTS[:3], GREEDY)
        inductor_engine.generate(PROMPTS, SAMPLED)

    workloads()
    with torch.compiler.set_stance("fail_on_recompile"):
        workloads()
    st = inductor_engine.stats()
    assert st["recompiles"] == 0 and st["graph_breaks"] == 0
    for g in st["graphs"].values():
        assert g["capture_seconds"] > 0 and g["replay_ms_median"] > 0 and g["recompiles"] == 0


def test_padding_rows_never_change_real_rows(eager_engine):
    """A row's tokens are the same alone (bucket 1) and beside padding rows (bucket 8)."""
    alone = [_ids(eager_engine.generate([p], SAMPLED))[0] for p in PROMPTS]
    together = _ids(eager_engine.generate(PROMPTS, SAMPLED))
    assert alone == together


def test_padding_rows_write_only_the_scratch_slot(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=4, max_model_len=32, enforce_eager=True)
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    k_real = eng.state.kv.k[:, :4].clone()
    lens, hist = eng.state.kv.lens.clone(), eng.state.history[:4].clone()
    bucket = eng.bucket(4, 0)  # live=0: four padding rows
    before = tree_signature(eng.state)
    _, new = bucket.fn(*bucket.args)
    assert tree_signature(new) == before
    assert torch.equal(new.kv.k[:, :4], k_real) and torch.equal(new.history[:4], hist)
    assert torch.equal(new.kv.lens, lens) and int(new.kv.lens[4]) == 0


def test_ten_batch_sizes_share_two_graphs_and_never_recompile(tiny_llama, traced_codegen, rows_free_ops):
    """Batches 1..10 run in buckets 1..10 (no padding) on two graphs per mode: B = 1, and one with a symbolic
    batch for the rest; both are captured while the engine starts, and nothing compiles afterwards.

    Inductor's code generation is swapped for the traced graph itself to keep this test fast (Dynamo still
    traces, guards and counts compiles); the tests above and test_runtime.py run real inductor code.
    """
    eng = Engine(tiny_llama, backend="inductor", max_num_seqs=10, max_model_len=24, ops=rows_free_ops)
    assert eng.plan.bucket_plan.batch_buckets == tuple(range(1, 11)) and eng.plan.bucket_plan.symbolic_batch
    assert sorted(eng.runner.compiled) == [(0, 0, 25, "filtered"), (0, 0, 25, "greedy"),
                                           (1, 0, 25, "filtered"), (1, 0, 25, "greedy")]
    assert all(g.stats.compiles == 1 for g in eng.runner.compiled.values())
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in range(1, 11):
            eng.generate([[1, 2, 3]] * n, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert eng.stats()["recompiles"] == 0 and set(eng.stats()["buckets_used"]) == {f"B{b}_K0" for b in range(1, 11)}
    assert len(eng.runner.compiled) == 4 and eng.graphs[(7, 0, 25, "greedy")] is eng.graphs[(2, 0, 25, "greedy")]


def test_where_products_count_rows_each_batch_bucket_has_its_graph(tiny_llama, traced_codegen):
    """The plain products (AVX2 CPUs; ``kernels.REFERENCE`` here on any CPU) pick their path by the row count, so
    the plan keeps a static graph per batch bucket (1, 2, 4, 8, 10), every one captured while the engine starts;
    batches 1..10 pad into them and nothing compiles afterwards."""
    eng = Engine(tiny_llama, backend="inductor", max_num_seqs=10, max_model_len=24, ops=kernels.REFERENCE)
    assert not eng.plan.bucket_plan.symbolic_batch and eng.plan.bucket_plan.batch_buckets == (1, 2, 4, 8, 10)
    assert sorted(eng.runner.compiled) == [(b, 0, 25, m) for b in (1, 2, 4, 8, 10) for m in ("filtered", "greedy")]
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in range(1, 11):
            eng.generate([[1, 2, 3]] * n, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert eng.stats()["recompiles"] == 0 and set(eng.stats()["buckets_used"]) == {f"B{b}_K0" for b in (1, 2, 4, 8, 10)}
    assert len(eng.runner.compiled) == 10


def test_shared_code_object_would_hit_the_recompile_limit():
    """The trap the per-bucket code copies avoid: one code object, many static shapes."""
    def f(x):
        return x * 2 + 1

    shared = torch.compile(f, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(Exception, match="recompile|Hard failure due to fullgraph"):
        for n in range(1, 12):
            shared(torch.ones(n))
    for n in range(1, 12):
        cap = capture(f, (torch.ones(n),), "inductor", name=f"f_{n}")
        assert torch.equal(cap(torch.ones(n)), torch.full((n,), 3.0)) and cap.stats.recompiles == 0


def test_an_inductor_bucket_skips_its_guards_only_once_it_proved_static():
    def f(x):
        return x * 2 + 1

    cap = capture(f, (torch.ones(4),), "inductor", name="trusted_f")
    for n in range(TrustedAfterChecks.CHECKED_CALLS):
        assert not cap.trusted and torch.equal(cap(torch.full((4,), float(n))), torch.full((4,), 2.0 * n + 1))
    assert cap.trusted and torch.equal(cap(torch.full((4,), 5.0)), torch.full((4,), 11.0))
    with torch.compiler.set_stance("fail_on_recompile"):  # the caller's stance is kept around the call
        assert torch.equal(cap(torch.ones(4)), torch.full((4,), 3.0))
    moved = capture(f, (torch.ones(4),), "inductor", name="moved_f")
    assert torch.equal(moved(torch.ones(5)), torch.full((5,), 3.0)) and moved.stats.recompiles == 1
    moved(torch.ones(4))
    assert not moved.trusted  # a bucket that recompiled keeps its guards: the other shape still gets its graph
    assert torch.equal(moved(torch.ones(5)), torch.full((5,), 3.0)) and moved.stats.recompiles == 1


def test_fresh_code_copy_keeps_behaviour():
    def sub(a, b):
        return a - b

    g = fresh_code_copy(functools.partial(sub, 10), "renamed")
    h = fresh_code_copy(functools.partial(sub, 10), "other")
    assert g(3) == 7 and g.__code__.co_name == "renamed" and g.__code__ is not h.__code__


# ----------------------------------------------------------------- plans
def test_bucket_plan_defaults_and_validation():
    plan = BucketPlan.for_engine(max_batch_size=8, max_k=3)
    assert plan.batch_buckets == (1, 2, 4, 8) and plan.ks == (0, 1, 2, 3)
    assert [plan.batch_bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert plan.capture_sizes()[3] == [4, 8, 16, 32]
    assert BucketPlan.for_engine(6, 0).batch_buckets == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="batch_buckets must not be empty"):
        BucketPlan(())
    with pytest.raises(ValueError, match="batch_buckets must be sorted"):
        BucketPlan((4, 2))
    with pytest.raises(ValueError, match="ks must be >= 0"):
        BucketPlan((1,), (-1, 0))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        plan.batch_bucket(9)


# ----------------------------------------------------------------- device backends without devices
def test_aclgraph_refuses_without_torch_npu_and_checks_k(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 3}
    with pytest.raises(RuntimeError, match=r"Ascend NPU host.*torch-npu==2.13.0"):
        Engine(tiny_llama, speculative_config=spec, backend="aclgraph")
    spec16 = dict(spec, num_speculative_tokens=16)
    with pytest.raises(ValueError, match="num_speculative_tokens.*npu_fused_infer_attention_score"):
        Engine(tiny_llama, speculative_config=spec16, backend="aclgraph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")
def test_cudagraph_equals_eager(tiny_llama):
    cuda = Engine(tiny_llama, backend="cudagraph", max_num_seqs=8, max_model_len=64, device="cuda")
    eager = Engine(tiny_llama, backend="eager", max_num_seqs=8, max_model_len=64, device="cuda")
    assert _ids(cuda.generate(PROMPTS, GREEDY)) == _ids(eager.generate(PROMPTS, GREEDY))
    assert cuda.stats()["recompiles"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal applies only where CUDA is missing")
def test_cudagraph_refuses_without_cuda(tiny_llama):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        Engine(tiny_llama, backend="cudagraph")


def test_unknown_backend(tiny_llama):
    with pytest.raises(ValueError, match="backend must be one of"):
        Engine(tiny_llama, backend="tpu")


def test_auto_is_a_rule_on_the_device(monkeypatch):
    """auto reads no benchmark files, so an installed package picks as a checkout does."""
    from pathlib import Path

    from funcspec.capture.backends import auto_backend, resolve_backend

    def no_files(*args, **kwargs):
        raise AssertionError("resolving auto read a file")

    monkeypatch.setattr(Path, "glob", no_files)
    monkeypatch.setattr(Path, "read_text", no_files)
    assert resolve_backend("auto", "cpu") == "inductor"  # every committed CPU capture run measured it faster
    assert auto_backend("cuda:0") == "cudagraph" and auto_backend(torch.device("meta")) == "inductor"
