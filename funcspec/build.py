"""An engine, built in named steps: ``plan → load → prepare → distribute → capture``.

Each step is a function of the :class:`~funcspec.args.EngineArgs` and the steps
before it, and returns a small frozen record, so that :class:`~funcspec.Engine`
reads as the order of its steps and a test can stop after any of them:

- :func:`plan`: the target's config (no weights read) and the :class:`~funcspec.plan.EnginePlan`.
- :func:`load`: the target's weights, on this rank's device, with the planned kernels.
- :func:`prepare`: the proposer, the confidence scheduler, the prefill hooks; the last checks.
- :func:`distribute`: the tensor-parallel group, this rank's shard, its weights packed for its kernels.
- :func:`capture`: the scheduler, the runner and the start-up graphs.

Every step that can refuse the arguments runs before :func:`distribute` starts
any process, so a refused engine leaves none behind; from there on, a failure
stops the whole group (``Followers.fail``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec import distributed, kernels, sampling
from funcspec.args import EngineArgs
from funcspec.capture import cache, helpers, store
from funcspec.capture.backends import probe_isa_early
from funcspec.checkpoints import Model, load_model
from funcspec.checkpoints.llama import load_config
from funcspec.checkpoints.tp import check_quantized, check_size, shard_model
from funcspec.config import SpecConfig
from funcspec.nn import ModelConfig
from funcspec.parallel import TPGroup
from funcspec.plan import EnginePlan, plan_engine
from funcspec.plan import startup_modes
from funcspec.quant import prepare_params
from funcspec.quant.formats import on_load
from funcspec.runner import Runner, graph_name
from funcspec.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Planned:
    """What the arguments and the target's config decide: the plan, the config (with its kernels) and the
    device of this rank."""

    plan: EnginePlan
    cfg: ModelConfig
    device: torch.device


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The whole target, its config replaced by the planned one's kernels; ``quantization``: the scheme it is
    quantized to on load (``None`` for a stored format)."""

    model: Model
    quantization: Optional[str]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything the engine runs beside the target, built from the whole target (before any shard)."""

    model: Model
    quantization: Optional[str]
    proposer: Any  # a funcspec.proposers proposer, or None
    dyn: Any  # a funcspec.dynamic.ConfidenceScheduler, or None
    hooks: tuple  # prefill hooks (extract_hidden_states' writer)
    shard_draft: bool  # the drafter is sharded with the target


@dataclasses.dataclass(frozen=True)
class Distributed:
    """This rank's group, its spawned followers (rank 0 of a plain process) and its packed shards."""

    tp: TPGroup
    followers: Optional[distributed.Followers]
    model: Model
    proposer: Any


@dataclasses.dataclass(frozen=True)
class Captured:
    """The host loop's parts, its graphs captured (under ``capture="startup"``)."""

    scheduler: Scheduler
    runner: Runner
    compile_cache: Optional[dict]  # what a loaded compile cache held, by kind
    startup_seconds: float  # spent capturing graphs
    startup_modes: tuple[sampling.Mode, ...]  # the modes a start-up capture compiles


def plan(args: EngineArgs, followed: Optional[dict] = None) -> Planned:
    """The engine's plan, from the arguments and the target's config alone (no weight is read).

    ``followed``: rank 0's plan (its ``to_dict()``), which a spawned follower runs instead of planning: ranks
    that planned apart (another device's kernels, another default) would capture different graphs.
    """
    device = torch.device(args.device)
    if args.tensor_parallel_size != 1:
        device = distributed.rank_device(device, distributed.local_rank())
    # NOTE: the kernels are chosen once, here, from the device: every ModelConfig (the target's, and the
    # drafter's, built from it) carries them into each bucket's static key.
    ops = kernels.resolve(device, args.cpu_kernels) if args.ops is None else args.ops
    cfg = configured(args.model.cfg if isinstance(args.model, Model) else load_config(args.model), ops,
                     args.enable_expert_parallel)
    check_size(cfg, args.tensor_parallel_size)
    if followed is not None:
        return Planned(EnginePlan.from_dict(followed), cfg, device)
    spec = None if args.method == "extract_hidden_states" else args.speculative_config  # decodes as AR
    return Planned(plan_engine(spec, cfg, ops, backend=args.backend_name, device=device, dtype=args.torch_dtype,
                               max_batch_size=args.max_num_seqs, max_model_len=args.max_model_len,
                               batch_buckets=args.batch_buckets, context_buckets=args.context_buckets,
                               capture=args.compilation_config.capture), cfg, device)


def configured(cfg: ModelConfig, ops: kernels.Ops, expert_parallel: bool) -> ModelConfig:
    """``cfg`` with kernels ``ops`` and, for a mixture of experts, vLLM's ``enable_expert_parallel``."""
    cfg = dataclasses.replace(cfg, ops=ops)
    if cfg.moe.num_experts:
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=expert_parallel))
    if expert_parallel:
        warnings.warn("enable_expert_parallel=True has no effect: the target is dense (it has no experts to "
                      "split)", stacklevel=4)
    return cfg


def load(args: EngineArgs, planned: Planned) -> Loaded:
    """The whole target on this rank's device, with the planned kernels; checks that its quantized weights
    split across the ranks."""
    if planned.plan.backend == "inductor" and planned.device.type == "cpu":
        probe_isa_early()  # NOTE: in a thread, while the weights load
    scheme = on_load(args.quantization)
    stored = None if scheme else args.quantization  # a stored format's name: the checkpoint must be in it
    model = args.model if isinstance(args.model, Model) else load_model(
        args.model, dtype=args.torch_dtype, device=planned.device, tokenizer=args.tokenizer, quantization=stored)
    model = dataclasses.replace(model, cfg=configured(model.cfg, planned.cfg.ops, args.enable_expert_parallel))
    check_quantized(model.params, args.tensor_parallel_size, scheme, expert_parallel=model.cfg.moe.expert_parallel)
    return Loaded(model, scheme)


def prepare(args: EngineArgs, planned: Planned, loaded: Loaded) -> Prepared:
    """The proposer (built from the whole target), the confidence scheduler of a dynamic K, and the prefill
    hooks of ``extract_hidden_states``; the last checks that can refuse the arguments."""
    spec, model, max_k = planned.plan.spec, loaded.model, planned.plan.max_k
    hooks: tuple = ()
    if args.method == "extract_hidden_states":
        from funcspec import extract

        writer = args.tensor_parallel_size == 1 or distributed.global_rank() == 0
        hooks = (extract.build(args.speculative_config, model.cfg.num_layers, args.kv_transfer_config, writer),)
    from funcspec.proposers import BuildContext, build_proposer

    proposer = build_proposer(spec, model, BuildContext(planned.plan.max_model_len, planned.device)) if spec else None
    dyn = None
    if spec is not None and spec.dynamic_spec is not None:
        from funcspec.dynamic import ConfidenceScheduler

        dyn = ConfidenceScheduler(spec.dynamic_spec, max_k)
    shard_draft = shards_draft(spec, proposer, args.tensor_parallel_size)
    return Prepared(model, loaded.quantization, proposer, dyn, hooks, shard_draft)


def shards_draft(spec: Optional[SpecConfig], proposer, size: int) -> bool:
    """Whether the drafter is sharded with the target (``draft_tensor_parallel_size`` > 1); checks it first."""
    draft = spec.draft_tensor_parallel_size if spec is not None else None
    if draft in (None, 1):
        return False
    if draft != size:
        raise ValueError(f"speculative_config.draft_tensor_parallel_size={draft} must be 1 or the engine's "
                         f"tensor_parallel_size={size}")
    assert spec is not None  # a draft size was read from it
    proposer.module.check_shard(proposer.cfg, proposer.params, size, spec.quantization)
    return True


def distribute(args: EngineArgs, planned: Planned, prepared: Prepared, engine_cls: type) -> Distributed:
    """Join or start the tensor-parallel group, then shard the target (and a sharded drafter) and pack, fuse
    and quantize the weights for the planned kernels.

    NOTE: the group starts here, once every check that can refuse the arguments has run, so a refused engine
    leaves no processes behind. Spawned followers rebuild the engine from ``args.to_dict()`` on this plan.
    """
    tp, followers = distributed.setup(args.tensor_parallel_size, planned.device, engine_cls, args, planned.plan)
    with failing(followers):
        # NOTE: shard before the scheduler takes the model, so that nothing keeps the whole target alive.
        model, proposer = shard_model(prepared.model, tp, prepared.quantization), prepared.proposer
        if prepared.shard_draft:
            proposer = proposer.shard(tp, _draft_quantization(planned))
        model, proposer = pack(model, proposer, planned, prepared.quantization)
    return Distributed(tp, followers, model, proposer)


def _draft_quantization(planned: Planned) -> Optional[str]:
    """The drafter's on-load scheme (``speculative_config["quantization"]``); ``None`` without a drafter."""
    spec = planned.plan.spec
    return spec.quantization if spec is not None else None


def pack(model: Model, proposer, planned: Planned, quantization: Optional[str]) -> tuple[Model, Any]:
    """The target's and the drafter's weights packed, fused and quantized for the planned kernels, once; a
    tensor they share (a head's copy of the target's LM head) is prepared once, as the target's."""
    memo: dict = {}
    ops = planned.cfg.ops
    model = dataclasses.replace(model, params=prepare_params(model.params, ops, memo, quantization))
    if proposer is not None:
        draft = prepare_params(proposer.params, ops, memo, _draft_quantization(planned))
        proposer = dataclasses.replace(proposer, params=draft)
    return model, proposer


def capture(args: EngineArgs, planned: Planned, prepared: Prepared, dist: Distributed) -> Captured:
    """The scheduler and the runner; a compile cache loaded, then (``capture="startup"``) every graph a
    request can need captured; last, the followers' word that they built the same."""
    plan, cc = planned.plan, args.compilation_config
    with failing(dist.followers):
        scheduler = Scheduler(plan.num_slots, plan.max_model_len, dist.model,
                              max_new_tokens=1 if prepared.hooks else None)
        run = runner(args, planned, prepared, dist)
        loaded = cache.load(cc.compile_cache) if cc.compile_cache is not None else None  # before any capture
        modes = startup_modes(cc.capture_logprobs)
        seconds = 0.0
        if plan.startup:
            todo = startup_graphs(plan, run, prepared.dyn, modes)
            seconds = capture_all(run, todo, start_helpers(args, planned, run, todo, dist))
        if dist.followers is not None:
            dist.followers.wait_ready()  # NOTE: last: followers build (and capture) in step with rank 0
    return Captured(scheduler, run, loaded, seconds, modes)


def runner(args: EngineArgs, planned: Planned, prepared: Prepared, dist: Distributed) -> Runner:
    """This rank's device state and graphs (none captured yet)."""
    return Runner(plan=planned.plan, model=dist.model, proposer=dist.proposer, device=planned.device,
                  dtype=args.torch_dtype, dyn=prepared.dyn, prefill_hooks=prepared.hooks)


def start_helpers(args: EngineArgs, planned: Planned, run: Runner, todo: list[tuple[int, int, int, str]],
                  dist: Distributed) -> Optional[helpers.Helpers]:
    """Helper processes compiling a share of the start-up graphs that the store does not hold yet
    (:mod:`funcspec.capture.helpers`), or ``None``."""
    if run.backend != "inductor" or dist.followers is not None or args.tensor_parallel_size != 1 \
            or not store.enabled() or isinstance(args.model, Model) or store.open_store() is None:
        return None
    count = functools.partial(helpers.count, args.compilation_config.compile_helpers,
                              weight_bytes=helpers.weight_bytes(run.params), auto=planned.device.type == "cpu")
    if count(len(todo)) == 0:  # NOTE: first, so that no helper wanted costs no store key
        return None
    missing = [g for g in todo if not run.filed(*g[:3], sampling.MODES[g[3]])]
    n = count(len(missing))
    if n == 0:
        return None
    return helpers.Helpers.start(HELPER, args.to_dict(), planned.plan.to_dict(), helpers.shares(missing, n)[1:],
                                 torch.get_num_threads())


HELPER = (sys.executable, "-c", "from funcspec.build import helper_main; helper_main()")
"""The command of a start-up helper process (:func:`helper_main`)."""


def helper_main() -> None:
    """A start-up helper (:mod:`funcspec.capture.helpers`): read its job from stdin, build the engine's parts
    (no follower, no start-up capture), compile and file each graph of its share, and report each on stdout."""
    job = json.load(sys.stdin)
    out, sys.stdout = sys.stdout, sys.stderr  # NOTE: anything else printed goes to the log, not the pipe
    torch.set_num_threads(job["threads"])
    args = EngineArgs.from_dict(job["args"])
    planned = plan(args, job["plan"])
    prepared = prepare(args, planned, load(args, planned))
    run = runner(args, planned, prepared, distribute(args, planned, prepared, object))  # one rank: no follower
    for b, k, t, name in job["graphs"]:
        if run.graph(b, k, t, sampling.MODES[name]).stats.stored:
            helpers.report((b, k, t, name), out)


@contextlib.contextmanager
def failing(followers: Optional[distributed.Followers]):
    """Any error inside stops every rank (``followers.fail`` raises, naming a failed follower if there is one)."""
    try:
        yield
    except BaseException as e:
        if followers is not None:
            followers.fail(e)
        raise


def startup_graphs(plan: EnginePlan, runner: Runner, dyn,
                   modes: Sequence[sampling.Mode]) -> list[tuple[int, int, int, str]]:
    """The buckets (B, K, T, mode) whose graphs a start-up capture compiles, one per graph: every batch size up
    to ``max_num_seqs`` with the K it runs (the K table, or every K under a confidence budget), every context
    bucket, and each of ``modes``."""
    spec, bp = plan.spec, plan.bucket_plan
    ks = lambda n: bp.ks if dyn is not None else (spec.k_for_batch_size(n) if spec else 0,)  # noqa: E731
    todo: dict = {}
    for n in range(1, plan.num_slots + 1):
        b = bp.batch_bucket(n)
        for k in ks(n):
            for t in bp.context_buckets or (plan.t_max,):
                for mode in modes:
                    todo.setdefault(runner.graph_key(b, k, t, mode), (b, k, t, mode.name))
    return sorted(todo.values())


def capture_all(runner: Runner, todo: list[tuple[int, int, int, str]],
                helping: Optional[helpers.Helpers] = None) -> float:
    """Capture the graphs of ``todo`` now, with a progress bar naming each; returns the seconds it took. With
    ``helping``, this process compiles the graphs no helper has, then waits for them and loads theirs (or
    compiles what a helper did not file)."""
    t0 = time.perf_counter()
    theirs = [g for share in helping.shares for g in share] if helping else []
    filed: Optional[dict] = None
    try:
        with tqdm([g for g in todo if g not in theirs] + theirs, desc="capturing graphs", unit="graph") as bar:
            for b, k, t, name in bar:
                mode = sampling.MODES[name]
                if helping is not None and filed is None and (b, k, t, name) in theirs:
                    bar.set_postfix_str(f"waiting for {len(helping.shares)} helper process(es)")
                    filed = helping.wait()
                bar.set_postfix_str(graph_name(runner.graph_key(b, k, t, mode)))
                graph = runner.graph(b, k, t, mode)
                if filed and (b, k, t, name) in filed and graph.stats.loaded:
                    graph.stats.helper = filed[b, k, t, name]
    finally:
        if helping is not None:
            helping.stop()
    return time.perf_counter() - t0
