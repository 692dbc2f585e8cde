"""Shared fixtures: tiny random HF checkpoints saved to disk, loaded by funcspec."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# NOTE: one intra-op thread. Tiny models gain nothing from two, and on a busy
# 2-core machine (inductor's compile workers, CI neighbours) OpenMP's barrier
# made a 4-row eager step take 300 ms instead of 3 ms.
torch.set_num_threads(1)

# NOTE: one inductor cache (and so one compiled-step store) for the whole run, shared by the xdist workers
# (they inherit the environment) and removed at its end: the suite never reads or writes a user's own cache.
# Torch's precompiled header is the exception: it goes to torch's default directory whatever
# TORCHINDUCTOR_CACHE_DIR says (one per venv path and compiler flags), and later runs reuse it.
_OWN_INDUCTOR_DIR = "FUNCSPEC_TEST_INDUCTOR_DIR" not in os.environ  # this process made it (not a worker)
if _OWN_INDUCTOR_DIR:
    import tempfile

    os.environ["FUNCSPEC_TEST_INDUCTOR_DIR"] = tempfile.mkdtemp(prefix="funcspec-tests-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["FUNCSPEC_TEST_INDUCTOR_DIR"]
# NOTE: no start-up helper processes unless a test asks for them: xdist already runs one worker per core, and
# a helper per engine would only queue behind them (test_runtime's first test starts one).
os.environ.setdefault("FUNCSPEC_COMPILE_HELPERS", "0")


def pytest_sessionstart(session):
    """Tests that call torch.compile directly get the same -fwrapv kernels as capture()."""
    from funcspec.capture.backends import wrap_int64_overflow

    wrap_int64_overflow()


def make_hf_model(path, arch: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random transformers model of ``arch`` to ``path``; return the HF model."""
    import transformers

    torch.manual_seed(seed)
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    base.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM)}[arch]
    model = cls[1](cls[0](**base)).eval()
    # NOTE: random init gives near-uniform logits; a larger embedding scale
    # makes argmax margins wide enough that batch shape never flips a greedy token.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
    model.save_pretrained(str(path))
    return model


def reference_attention(q, keys, vals, visible, dtype=torch.float64):
    """Masked softmax attention computed in ``dtype``, GQA by repeating the KV heads: q [B, T, H, D], keys and
    vals [B, H_kv, T_read, D], visible [B, T, T_read] -> [B, T, H·D]; a row that sees nothing gets zeros."""
    b, t, h, d = q.shape
    rep = h // keys.shape[1]
    k, v = keys.to(dtype).repeat_interleave(rep, 1), vals.to(dtype).repeat_interleave(rep, 1)
    s = torch.einsum("bthd,bhjd->bhtj", q.to(dtype), k) / d ** 0.5
    s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.einsum("bhtj,bhjd->bthd", torch.softmax(s, -1), v).nan_to_num(0.0).reshape(b, t, h * d)


@pytest.fixture(scope="session")
def check_slot_declarations():
    """``check(engine)``: every tensor of the engine's state declares its slot axis, sized slots + scratch."""
    from funcspec.pytree import slot_leaves, tree_leaves

    def check(eng):
        declared = list(slot_leaves(eng.state))
        assert len(declared) == len([x for x in tree_leaves(eng.state) if isinstance(x, torch.Tensor)])
        assert all(x.shape[axis] == eng.num_slots + 1 for x, axis in declared)

    return check


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """The neural-head zoo (``tests/heads_cases.py``): a 3-layer target, a random head per method, AR outputs."""
    from heads_cases import build_zoo

    return build_zoo(tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="session")
def zoo_target():
    """The trained zoo's target (``models/target``), loaded once."""
    from funcspec import load_model, zoo

    return load_model(zoo.model_path("target"))


@pytest.fixture(scope="session")
def zoo_prompts(zoo_target):
    """Two code prompts for the zoo target, as token ids."""
    tok = zoo_target.tokenizer
    return [tok("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")["input_ids"],
            tok("import os\nimport sys\n\n")["input_ids"]]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a 2-layer GQA Llama (vocab 96), untied embeddings."""
    path = tmp_path_factory.mktemp("tiny_llama")
    make_hf_model(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """A 1-layer Llama with the same vocab, a different seed: a (poor) draft model."""
    path = tmp_path_factory.mktemp("tiny_draft")
    make_hf_model(path, seed=1, num_hidden_layers=1)
    return str(path)


@pytest.fixture
def traced_codegen(monkeypatch):
    """Inductor's C++ codegen swapped for the Dynamo graph itself, for tests about what Dynamo captures (one
    fullgraph, no recompiles) that cannot afford a cold compile each. The graph store is off: no store key
    can see the swap, and a real compiled graph must not stand in for the traced one.

    NOTE: the ahead-of-time compile is skipped too, for the plain ``torch.compile`` it falls back to: it cannot
    serialize the Dynamo graph, so each graph was traced, refused (with a warning), and traced again by that
    same fallback (test_capture's four-graph test: 69 s before, 12 s after, on a busy 2-core machine)."""
    import torch._inductor.compile_fx as cfx

    from funcspec.capture import backends

    monkeypatch.setattr(cfx, "compile_fx", lambda gm, example_inputs, **options: gm.forward)
    monkeypatch.setenv("FUNCSPEC_GRAPH_STORE", "0")
    monkeypatch.setattr(backends, "_ahead_of_time", lambda fn, name, stats, args, at: None)


@pytest.fixture(scope="session")
def rows_free_ops():
    """This CPU's kernels with every fp32 product on a path that never compares the row count (the streaming
    kernel where it runs, else ``F.linear``): an inductor engine then plans one symbolic-batch graph on any
    CPU, AVX2 ones included, whose own kernels keep a graph per batch bucket (``Ops.rows_free``)."""
    import dataclasses

    from funcspec import kernels

    ops = kernels.resolve("cpu")
    return ops if ops.rows_free(torch.float32) else dataclasses.replace(ops, blas_skinny=True)


@pytest.fixture(scope="session")
def default_model():
    """The default zoo model (built on first use, as `make run` does)."""
    from funcspec import zoo

    return str(zoo.build_default())


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_unconfigure(config):
    """The run's inductor cache goes with the run (in the process that made it, once every worker finished)."""
    if _OWN_INDUCTOR_DIR:
        import shutil

        shutil.rmtree(os.environ["FUNCSPEC_TEST_INDUCTOR_DIR"], ignore_errors=True)


def run_ranks(rank_fn, args: tuple, out, timeout: float, nprocs: int = 2) -> list:
    """Spawn ``rank_fn(rank, port, *args, out)`` on ``nprocs`` torchrun-style ranks, each writing
    ``out/rank<r>.json``; the ranks' JSON once all finished (killed, and the test failed, past ``timeout`` s)."""
    import json
    import time
    from pathlib import Path

    from funcspec.distributed import _free_port

    ctx = torch.multiprocessing.spawn(rank_fn, (_free_port(), *args, str(out)), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs} ranks did not finish in {timeout:.0f} s")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.fixture
def two_threads():
    """torch on 2 threads (the suite runs on 1), so a kernel's threaded paths run; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)



class OpLog(TorchDispatchMode):
    """``with OpLog() as log``: every aten / funcspec op run, as ``ops`` (name, output shapes), ``calls`` (name,
    arguments, the largest output's elements) and ``names`` (the set of names)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        self.records.append((func.overloadpacket.__name__, args, outs))
        return out

    @property
    def ops(self) -> list:
        return [(name, [tuple(o.shape) for o in outs]) for name, _, outs in self.records]

    @property
    def calls(self) -> list:
        return [(name, args, max((o.numel() for o in outs), default=0)) for name, args, outs in self.records]

    @property
    def names(self) -> set:
        return {name for name, _, _ in self.records}
