"""Tensor parallelism (funcspec.parallel, checkpoints.tp, distributed): 2 ranks on CPU over gloo.

The target has q/k/v, o_proj and MLP biases, so the test also covers the
row-parallel rule that a bias is added once, after the all-reduce.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import funcspec
from funcspec import Engine, SamplingParams, distributed, sampling
from funcspec.checkpoints import init_draft_head, load_model
from funcspec.checkpoints.tp import shard_model
from funcspec.distributed import _free_port
from funcspec.parallel import TPGroup

from conftest import make_hf_model, run_ranks

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8]]
# One greedy and one sampled row in the same batch: one random-mode graph serves both.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7)]
ENGINE = dict(max_num_seqs=2, max_model_len=40, compilation_config={"batch_sizes": [2], "capture": "lazy"})
# NOTE: inductor compiles take most of this file's time (two ranks compile at once on two cores); the sharded
# draft model runs eager only.
# NOTE: compiled under TP: EAGLE-3's step, which holds the target's all-reduces (its verify forward, the same
# layers AR's graph runs) and a replicated drafter's graph beside them; ngram and the draft model add no
# collective of their own, and a cold compile is this test's cost
COMPILED = ("eagle3",)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """A GQA target with every bias (4 heads, 2 KV heads), a draft model and a random EAGLE-3 head."""
    root = tmp_path_factory.mktemp("tp")
    make_hf_model(root / "target", attention_bias=True, mlp_bias=True)
    make_hf_model(root / "draft", seed=1, num_hidden_layers=1)
    init_draft_head("eagle3", str(root / "target"), root / "eagle3")
    return {name: str(root / name) for name in ("target", "draft", "eagle3")}


def specs(paths: dict) -> dict:
    return {
        "ar": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 2},
        "eagle3": {"method": "eagle3", "model": paths["eagle3"], "num_speculative_tokens": 2},
        # draft_tensor_parallel_size on request: the draft model is sharded too (eager only)
        "draft_sharded": {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 2,
                          "draft_tensor_parallel_size": 2},
    }


def tokens(engine_or_llm) -> list:
    return [o.outputs[0].token_ids for o in engine_or_llm.generate(PROMPTS, PARAMS)]


TP_LLM = dict(enforce_eager=True, max_num_seqs=2, max_model_len=40)


def registered(group: str) -> bool:
    """Whether torch still resolves ``group`` (the name a bucket's all-reduces run on) in this process."""
    try:
        torch._C._distributed_c10d._resolve_process_group(group)
    except RuntimeError:
        return False
    return True


def test_shards_tile_the_weights_and_heads_stay_with_their_kv_head(tp_models):
    model = load_model(tp_models["target"])
    shards = [shard_model(model, TPGroup(2, r, "g")) for r in range(2)]
    assert (shards[1].cfg.num_heads, shards[1].cfg.num_kv_heads, shards[1].cfg.intermediate_size) == (2, 1, 32)
    full, parts = model.params["model"]["layers"][1], [s.params["model"]["layers"][1] for s in shards]
    for part, name, dim in (("self_attn", "q_proj", 0), ("self_attn", "k_proj", 0), ("self_attn", "v_proj", 0),
                            ("self_attn", "o_proj", 1), ("mlp", "gate_proj", 0), ("mlp", "up_proj", 0),
                            ("mlp", "down_proj", 1)):
        w = torch.cat([p[part][name]["weight"] for p in parts], dim)
        assert torch.equal(w, full[part][name]["weight"]), name
        assert parts[1][part][name]["weight"].untyped_storage().size() < \
            full[part][name]["weight"].untyped_storage().size(), f"{name}: a view keeps the whole weight alive"
    # Column-parallel biases are split; row-parallel ones are whole on every rank (added after the reduce).
    q_bias = torch.cat([p["self_attn"]["q_proj"]["bias"] for p in parts])
    assert torch.equal(q_bias, full["self_attn"]["q_proj"]["bias"])
    assert all(torch.equal(p["mlp"]["down_proj"]["bias"], full["mlp"]["down_proj"]["bias"]) for p in parts)
    # Rank 1 holds query heads 2, 3: those of its KV head 1 (G = 2).
    d = model.cfg.head_dim
    assert torch.equal(parts[1]["self_attn"]["q_proj"]["weight"], full["self_attn"]["q_proj"]["weight"][2 * d:])
    assert model.cfg.num_heads == 4, "sharding must not touch the input model"


@pytest.mark.parametrize("size, field", [(3, "num_key_value_heads=2"), (4, "num_key_value_heads=2"),
                                         (0, "must be >= 1, got 0")])
def test_bad_tensor_parallel_size_is_refused_before_any_rank_starts(tp_models, size, field):
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{field}"):
        Engine(tp_models["target"], tensor_parallel_size=size, enforce_eager=True)
    assert not dist.is_initialized()


def test_bad_draft_tensor_parallel_size_is_refused_before_any_rank_starts(tp_models, tmp_path):
    spec = {"method": "draft_model", "model": tp_models["draft"], "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 must be 1 or the engine's "
                                         "tensor_parallel_size=1"):
        Engine(tp_models["target"], spec, enforce_eager=True)
    make_hf_model(tmp_path / "mqa", seed=1, num_hidden_layers=1, num_key_value_heads=1)
    with pytest.raises(ValueError, match="speculative_config.draft_tensor_parallel_size=2 must divide the draft "
                                         "model's num_key_value_heads=1"):
        Engine(tp_models["target"], {**spec, "model": str(tmp_path / "mqa")}, tensor_parallel_size=2,
               enforce_eager=True)
    assert not dist.is_initialized()


def test_more_ranks_than_accelerators_is_refused(monkeypatch):
    from funcspec.distributed import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 cuda device"):
        check_devices(2, "cuda")
    check_devices(2, "cpu")  # a CPU takes any number of ranks


def _rank(rank: int, port: int, paths: dict, out: str) -> None:
    """One torchrun-style rank: the group exists before the engines, and every rank makes every call."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for name, spec in specs(paths).items():
        ref_spec = {**spec, "draft_tensor_parallel_size": 1} if name == "draft_sharded" else spec
        res[f"{name}/tp1"] = tokens(Engine(paths["target"], ref_spec, backend="eager", **ENGINE))
        for backend in ("eager", "inductor") if name in COMPILED else ("eager",):
            eng = Engine(paths["target"], spec, backend=backend, tensor_parallel_size=2, **ENGINE)
            res[f"{name}/{backend}"] = tokens(eng)
            if backend == "inductor":
                with torch.compiler.set_stance("fail_on_recompile"):
                    res[f"{name}/again"] = tokens(eng)
                res[f"{name}/stats"] = [eng.stats()["recompiles"], eng.stats()["graph_breaks"]]
            else:
                b = eng.bucket(2, eng.plan.bucket_plan.ks[-1], mode=sampling.RANDOM)
                ex = torch._dynamo.explain(b.fn)(*b.args)
                res[f"{name}/explain"] = [ex.graph_break_count, ex.graph_count, sum(map(_all_reduces, ex.graphs))]
                res[f"{name}/kv_heads"] = eng.state.kv.k.shape[2]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _all_reduces(gm) -> int:
    """All-reduces a graph runs, counting each call of a nested compile region (one per target layer)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "get_attr" or node.op == "placeholder":
            continue
        if node.target is torch.ops.higher_order.invoke_subgraph:
            n += _all_reduces(getattr(gm, node.args[0].target))
        elif "all_reduce" in str(node.target):
            n += 1
    return n


@pytest.mark.slow
def test_tp2_equals_tp1_for_every_method_on_eager_and_inductor(tp_models, tmp_path):
    """Greedy and sampled rows, AR and four drafters on eager, EAGLE-3 on inductor: TP=2 emits TP=1's tokens."""
    ranks = run_ranks(_rank, (tp_models,), tmp_path, 600)
    assert ranks[0] == ranks[1]  # every rank emitted the same tokens, with no broadcast
    res = ranks[0]
    for name in specs(tp_models):
        ref = res[f"{name}/tp1"]
        assert ref[0] != ref[1] and len(ref[0]) == len(ref[1]) == 10
        assert res[f"{name}/eager"] == ref, name
        if name in COMPILED:
            assert res[f"{name}/inductor"] == ref, name
            assert res[f"{name}/again"] == ref, name  # under fail_on_recompile
            assert res[f"{name}/stats"] == [0, 0], name  # no recompile, no graph break
        # One graph, no break; two all-reduces per target layer (2 layers); a replicated drafter adds none,
        # the sharded draft model two per layer (1) and forward (2 at K = 2).
        assert res[f"{name}/explain"] == [0, 1, 8 if name == "draft_sharded" else 4], name
        assert res[f"{name}/kv_heads"] == 1, name  # each rank caches its own KV head only


def test_under_torchrun_every_rank_runs_the_script(tp_models, tmp_path):
    """The real launcher: WORLD_SIZE/RANK in the environment, no group yet; each rank builds its own LLM."""
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        sys.path.insert(0, {os.path.dirname(os.path.dirname(funcspec.__file__))!r})
        import funcspec
        torch.set_num_threads(1)
        llm = funcspec.LLM({tp_models["target"]!r}, enforce_eager=True, max_num_seqs=2, max_model_len=40,
                           tensor_parallel_size=2)
        params = [funcspec.SamplingParams(**p) for p in {[vars_of(p) for p in PARAMS]!r}]
        out = [o.outputs[0].token_ids for o in llm.generate({PROMPTS!r}, params)]
        rank = torch.distributed.get_rank()
        json.dump({{"tokens": out, "kv_heads": llm.engine.state.kv.k.shape[2], "followers": llm.engine.followers}},
                  open(os.path.join({str(tmp_path)!r}, f"out{{rank}}.json"), "w"))
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(script)]
    subprocess.run(cmd, check=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ref = tokens(Engine(tp_models["target"], **ENGINE, enforce_eager=True))
    for rank in range(2):
        got = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert got == {"tokens": ref, "kv_heads": 1, "followers": None}


def vars_of(params: SamplingParams) -> dict:
    """The arguments that rebuild ``params`` (the fields this file sets)."""
    return {k: getattr(params, k) for k in ("temperature", "max_tokens", "ignore_eos", "seed")}


def test_llm_spawns_its_ranks_refuses_bad_input_alike_and_closes_cleanly(tp_models):
    ref = tokens(funcspec.LLM(tp_models["target"], enforce_eager=True, max_num_seqs=2, max_model_len=40))
    llm = funcspec.LLM(tp_models["target"], enforce_eager=True, max_num_seqs=2, max_model_len=40,
                       tensor_parallel_size=2)
    procs, group = llm.engine.followers.procs, llm.engine.tp.group
    assert group.startswith("funcspec-tp") and registered(group) and not dist.is_initialized()  # its own group
    assert tokens(llm) == ref
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]], PARAMS[0])
    assert tokens(llm) == ref  # a refused call leaves the group working
    llm.close()
    assert [p.exitcode for p in procs] == [0] and not registered(group) and not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"this tensor-parallel engine is closed: close\(\) stopped its ranks; "
                                           r"build a new engine"):
        llm.generate(PROMPTS, PARAMS)
    llm.close()  # again: a no-op


class FailsOnRank1(Engine):
    """An engine whose follower fails while it is built (rank 0 must not wait for it forever)."""

    def __init__(self, *args, **kwargs):
        if distributed.global_rank() == 1:
            raise RuntimeError("rank 1 could not build its engine")
        super().__init__(*args, **kwargs)


def test_a_follower_failing_to_start_is_reported_by_rank_0(tp_models):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1 raised.*rank 1 could not build its engine"):
        FailsOnRank1(tp_models["target"], tensor_parallel_size=2, max_model_len=40, enforce_eager=True)
    assert time.monotonic() - t0 < 60 and not dist.is_initialized()


def test_a_dying_rank_stops_the_group_with_an_error_not_a_hang(tp_models):
    llm = funcspec.LLM(tp_models["target"], enforce_eager=True, max_num_seqs=2, max_model_len=40,
                       tensor_parallel_size=2)
    follower, group = llm.engine.followers.procs[0], llm.engine.tp.group
    threading.Timer(1.0, os.kill, (follower.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        while time.monotonic() - t0 < 60:  # generate until the kill lands, mid-call or between calls
            llm.generate(PROMPTS, PARAMS)
    assert time.monotonic() - t0 < 30 and not registered(group)


def test_only_rank_0_writes_extracted_hidden_states(tmp_path):
    """A rank other than 0 names a file but does not write it (ranks would race on one file); rank 0 writes the file
    its outputs name."""
    from types import SimpleNamespace

    from funcspec.extract import HiddenStateDump

    reqs = [SimpleNamespace(request_id="7", extra={})]
    tokens, hiddens = torch.tensor([[3, 4, 0]]), (torch.ones(1, 3, 2),)
    HiddenStateDump((0,), tmp_path, write=False, run="r1")(reqs, tokens, [2], hiddens)
    assert reqs[0].extra == {"kv_transfer_params": {"hidden_states_path": str(tmp_path / "7-r1.safetensors")}}
    assert not list(tmp_path.iterdir())
    HiddenStateDump((0,), tmp_path, run="r1")(reqs, tokens, [2], hiddens)
    assert [p.name for p in tmp_path.iterdir()] == ["7-r1.safetensors"]


class DeadRank:
    """A follower process killed with SIGKILL."""

    exitcode = -9

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass


class BrokenPipe:
    """A dead rank's pipe: it polls ready, then its read raises ``error``."""

    def __init__(self, error: Exception):
        self.error = error

    def poll(self, timeout=0):
        return True

    def recv(self):
        raise self.error

    def close(self):
        pass


def test_a_rank_dying_between_poll_and_recv_is_named_not_an_eoferror():
    """A dead rank's pipe polls ready and then ends: rank 0 reports the rank's exit, not a bare EOFError."""
    from funcspec.distributed import Followers

    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        Followers([DeadRank()], [BrokenPipe(EOFError())])._acks()


# ---------------------------------------------------------------- reliability: groups, dead ranks, closing
@pytest.fixture(scope="module")
def tp1_tokens(tp_models):
    """The single-rank tokens every tensor-parallel engine of these tests must emit."""
    return tokens(funcspec.LLM(tp_models["target"], **TP_LLM))


def test_two_spawned_engines_in_one_process_each_run_their_own_group(tp_models, tp1_tokens):
    """A second TP engine while the first is open used the first one's group and hung in a gloo timeout."""
    a = funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM)
    b = funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM)
    assert tokens(b) == tp1_tokens and tokens(a) == tp1_tokens and tokens(b) == tp1_tokens
    assert a.engine.tp.group != b.engine.tp.group and not dist.is_initialized()
    a.close()
    assert not registered(a.engine.tp.group) and registered(b.engine.tp.group)
    assert tokens(b) == tp1_tokens  # closing one engine leaves the other's group alone
    b.close()
    assert not registered(b.engine.tp.group)


@pytest.mark.parametrize("call", ["generate", "step", "close"])
def test_a_rank_killed_between_calls_is_named_by_the_next_call_and_a_new_engine_works(tp_models, tp1_tokens,
                                                                                         call):
    llm = funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM)
    follower, group = llm.engine.followers.procs[0], llm.engine.tp.group
    dead = r"tensor-parallel rank 1 exited with code -9 \(SIGKILL\)"
    if call == "close":
        os.kill(follower.pid, signal.SIGKILL)
        follower.join()
        with pytest.raises(RuntimeError, match=dead):
            llm.close()
    else:
        if call == "step":
            llm.engine.add_request(PROMPTS[0], PARAMS[0])
        # NOTE: a stopped rank looks alive, so rank 0 sends it the call and then waits in an all-reduce when
        # the kill lands: the unread call resets the pipe (a bare ConnectionResetError before the fix).
        os.kill(follower.pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (follower.pid, signal.SIGKILL)).start()
        with pytest.raises(RuntimeError, match=dead):
            llm.generate(PROMPTS, PARAMS) if call == "generate" else llm.engine.step()
    assert follower.exitcode == -9 and not registered(group)
    with pytest.raises(RuntimeError, match=f"this tensor-parallel engine is closed: {dead}"):
        llm.generate(PROMPTS, PARAMS)
    llm.close()  # closing a stopped engine again is a no-op
    again = funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM)
    assert tokens(again) == tp1_tokens
    again.close()


def test_a_dead_rank_read_off_a_reset_pipe_is_named_not_a_connectionreseterror():
    """A rank killed with a call still unread resets its pipe: its answer reads as ConnectionResetError."""
    from funcspec.distributed import Followers

    pipe = BrokenPipe(ConnectionResetError(104, "Connection reset by peer"))
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code -9 \(SIGKILL\)"):
        Followers([DeadRank()], [pipe]).call("step", (), {}, lambda: None)


def test_a_collected_engine_stops_its_ranks_and_its_group(tp_models, tp1_tokens):
    llm = funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM)
    procs, group = llm.engine.followers.procs, llm.engine.tp.group
    assert tokens(llm) == tp1_tokens
    del llm
    gc.collect()
    assert [p.exitcode for p in procs] == [0] and not registered(group)


def test_a_with_block_closes_the_engine_and_its_ranks(tp_models, tp1_tokens):
    with funcspec.Engine(tp_models["target"], tensor_parallel_size=2, max_num_seqs=2, max_model_len=40,
                         enforce_eager=True) as eng:
        procs, group = eng.followers.procs, eng.tp.group
        out = eng.generate([[3, 4, 5]], funcspec.SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    assert [p.exitcode for p in procs] == [0] and not registered(group)
    with pytest.raises(RuntimeError, match="this tensor-parallel engine is closed"):
        eng.generate([[3, 4, 5]], funcspec.SamplingParams(max_tokens=2))


def test_an_llm_with_block_closes_its_ranks(tp_models, tp1_tokens):
    with funcspec.LLM(tp_models["target"], tensor_parallel_size=2, **TP_LLM) as llm:
        procs, group = llm.engine.followers.procs, llm.engine.tp.group
        assert tokens(llm) == tp1_tokens
    assert [p.exitcode for p in procs] == [0] and not registered(group)


def _no_planning(*args, **kwargs):
    raise AssertionError("a follower called plan_engine: it must run rank 0's plan")


class PlansOtherwiseOnRank1(Engine):
    """An engine whose follower could not plan (``plan_engine`` raises there) and whose own arguments would plan
    another cache length: it must run rank 0's plan, and can report it (a mirrored call every rank runs)."""

    def __init__(self, *args, **kwargs):
        if distributed.global_rank() == 1:  # a follower: built from rank 0's EngineArgs
            import funcspec.build

            funcspec.build.plan_engine = _no_planning  # this follower's process only
            args = (dataclasses.replace(args[0], max_model_len=30),)
        super().__init__(*args, **kwargs)

    @distributed.mirrored
    def dump_plan(self, out: str) -> None:
        with open(os.path.join(out, f"plan{distributed.global_rank()}.json"), "w") as f:
            json.dump({"plan": self.plan.to_dict(), "lengths": [self.max_model_len, self.t_max]}, f)


def test_a_follower_runs_rank_0s_serialised_plan_not_one_of_its_own(tp_models, tp1_tokens, tmp_path):
    with PlansOtherwiseOnRank1(tp_models["target"], tensor_parallel_size=2, max_num_seqs=2,
                               max_model_len=40, enforce_eager=True) as eng:
        eng.dump_plan(str(tmp_path))
        assert tokens(eng) == tp1_tokens
    ranks = [json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(2)]
    assert ranks[1] == ranks[0] == {"plan": eng.plan.to_dict(), "lengths": [40, 41]}


def test_interpreter_exit_stops_the_ranks_of_an_open_engine(tp_models, tmp_path):
    """A script that never closes its TP engine: at exit its followers are asked to stop, and stop cleanly."""
    script = tmp_path / "open_at_exit.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(funcspec.__file__))!r})
        import torch
        import funcspec

        if __name__ == "__main__":
            procs = []
            # registered first, so it runs last: after the engine's own clean-up at exit
            atexit.register(lambda: print("exit codes", [p.exitcode for p in procs], flush=True))
            torch.set_num_threads(1)
            llm = funcspec.LLM({tp_models["target"]!r}, tensor_parallel_size=2, **{TP_LLM!r})
            procs.extend(llm.engine.followers.procs)
            llm.generate([[3, 4, 5]], funcspec.SamplingParams(max_tokens=2))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "exit codes [0]" in out.stdout
