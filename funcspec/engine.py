"""The host loop: admit, pick a bucket, run it, apply stop rules.

Each :meth:`Engine.step`:

    admit waiting requests into the lowest free slots (prefill)
    rows = the running requests, in slots 0..n-1; B = smallest batch bucket >= n
    K = k_for_batch_size(n), or the confidence budget
    T = smallest context bucket >= longest row + K + 1
    mode = greedy | random | filtered: the cheapest sampling that serves every row
    drafts = host proposer (suffix only)
    tokens, num_emitted = runner.step(rows, bucket (B, K, T, mode), drafts)   # one SYNC
    apply stop rules; retire finished requests (compacting the slots)

Who owns what: ``scheduler.py`` the requests and slots (host only),
``runner.py`` the device state and the captured graphs; this file wires them
and keeps the counters.
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
import warnings
from typing import Optional, Sequence

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec import build, logprobs, rng, sampling
from funcspec.args import EngineArgs
from funcspec.config import SamplingParams
from funcspec.config.prompts import generate_args, request_args
from funcspec.distributed import mirrored
from funcspec.outputs import CompletionOutput, RequestOutput
from funcspec.plan import EnginePlan
from funcspec.runner import Bucket, graph_name
from funcspec.scheduler import Request

__all__ = ["Engine", "Bucket", "Request", "graph_name"]


class Engine:
    """Speculative (or autoregressive) generation with one captured graph per (B, K, T, mode) bucket.

    Use :meth:`generate` for a batch of prompts, or drive the loop yourself
    with :meth:`add_request` and :meth:`step`, as with vLLM's ``LLMEngine``.
    :meth:`bucket` hands out one bucket's pure step function and arguments.

    Args:
        model: a checkpoint path, a loaded :class:`~funcspec.checkpoints.Model`, or an
            :class:`~funcspec.args.EngineArgs` (then no other argument).
        speculative_config: a vLLM ``speculative_config`` dict (or a parsed
            :class:`SpecConfig`); ``None`` decodes autoregressively.
        **kwargs: the other fields of :class:`~funcspec.args.EngineArgs`, under vLLM's names, with its
            defaults: compiled graphs (``backend="auto"``) unless ``enforce_eager=True``;
            ``Engine(model, **kw)`` is ``Engine(EngineArgs(model=model, **kw))``. The old spellings
            (``max_batch_size``, ``batch_buckets``, ``capture``, ``compile_cache``, ``capture_logprobs``)
            still work for one release, with a ``DeprecationWarning`` naming the new one.

    The engine is built in the named steps of :mod:`funcspec.build`. With ``tensor_parallel_size > 1``,
    from a plain process this engine is rank 0 and spawns the others, which replay its public calls
    (:mod:`funcspec.distributed`); they receive its arguments (``EngineArgs.to_dict()``) and its plan
    (``EnginePlan.to_dict()``), and run that plan. Under ``torchrun`` every rank builds its own engine.
    Call :meth:`close` (or let the interpreter exit) to stop them.

    Attributes:
        args: the :class:`~funcspec.args.EngineArgs` it was built from.
        model, spec, proposer: what the engine runs (``model`` is this rank's shard of the target).
        plan: the :class:`~funcspec.plan.EnginePlan` its arguments resolve to (K, cache length,
            slots, backend, buckets, per-K verify rule and tree); ``backend``, ``max_model_len``,
            ``t_max`` and ``num_slots`` are its values.
        tp: this rank's :class:`~funcspec.parallel.TPGroup`.
        followers: the spawned ranks (:class:`~funcspec.distributed.Followers`), or ``None``.
        scheduler: requests and slots (:class:`~funcspec.scheduler.Scheduler`).
        runner: device state and graphs (:class:`~funcspec.runner.Runner`). Tools (server, benchmarks,
            CLI) read :meth:`stats` and the public methods instead of these two, which may change.
    """

    def __init__(self, model, speculative_config=None, *, _plan: Optional[dict] = None, **kwargs):
        if isinstance(model, EngineArgs) and (speculative_config is not None or kwargs):
            raise ValueError("Engine takes an EngineArgs alone, or a model and keywords: not both")
        self.args = args = model if isinstance(model, EngineArgs) else EngineArgs.from_kwargs(
            {"model": model, "speculative_config": speculative_config, **kwargs}, "Engine")
        self.followers = None
        planned = build.plan(args, _plan)  # a spawned follower runs rank 0's plan (``_plan``), never its own
        prepared = build.prepare(args, planned, build.load(args, planned))
        group = build.distribute(args, planned, prepared, type(self))
        self.followers = group.followers
        self._hold(args, planned.plan, prepared, group, build.capture(args, planned, prepared, group))

    def _hold(self, args: EngineArgs, plan: EnginePlan, prepared: build.Prepared, group: build.Distributed,
              built: build.Captured) -> None:
        """Keep what the build steps made, and zero the counters."""
        self.plan, self.spec, self.model, self.proposer = plan, plan.spec, group.model, group.proposer
        self.backend, self.max_model_len, self.t_max, self.num_slots = (plan.backend, plan.max_model_len,
                                                                         plan.t_max, plan.num_slots)
        self.device, self.seed, self.quantization = torch.device(args.device), args.seed, prepared.quantization
        self.startup_modes = built.startup_modes
        self.dyn, self.tp = prepared.dyn, group.tp
        if self.dyn is not None:
            self._dyn_k = self.dyn.budget_k
        self.scheduler, self.runner = built.scheduler, built.runner
        self.startup_seconds = built.startup_seconds  # spent capturing graphs while the engine was built
        self.compile_cache: Optional[dict] = built.compile_cache  # what a loaded compile cache held, by kind
        self._stats: collections.Counter[str] = collections.Counter()
        # a tree accepts at most one node per depth: its per-position acceptance is per depth
        # (of the whole tree: a tree cut to N nodes may be shallower, its deeper counts stay 0)
        self._accepted_per_pos = [0] * (plan.tree.depth if plan.tree else plan.max_k)
        self._buckets_used: collections.Counter = collections.Counter()

    def startup_graphs(self) -> list[tuple[int, int, int, str]]:
        """The buckets (B, K, T, mode) whose graphs a start-up capture compiles, one per graph: every batch
        size up to ``max_num_seqs`` with the K it runs (the K table, or every K under a confidence budget),
        every context bucket, and the modes of :func:`funcspec.plan.startup_modes` (those of
        :data:`~funcspec.capture.STARTUP_SAMPLING`, and the general mode with logprobs under ``capture_logprobs``)."""
        return build.startup_graphs(self.plan, self.runner, self.dyn, self.startup_modes)

    # ------------------------------------------------------------ the device
    @property
    def params(self) -> dict:
        """``{"target": ..., "draft": ...}``: the params pytree every bucket takes."""
        return self.runner.params

    @property
    def state(self):
        """The :class:`~funcspec.step.EngineState` pytree (KV caches, histories, keys, proposer state)."""
        return self.runner.state

    @property
    def graphs(self) -> dict:
        """Captured steps by bucket key ``(B, K, T, mode name)``."""
        return self.runner.graphs

    @property
    def running(self) -> dict[int, Request]:
        """Running requests by slot (slots 0..n-1)."""
        return self.scheduler.running

    def bucket(self, b: int, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED,
               live: int = 0) -> Bucket:
        """The pure step function of bucket (b, k, t, mode) and example arguments for it.

        ``t`` defaults to the whole cache; ``mode`` is a :class:`funcspec.sampling.Mode`
        (``sampling.GREEDY``, ``RANDOM``, ``FILTERED``, or one of ``sampling.MODES`` by
        name, with logprobs). A token-tree engine takes any node count ``k`` = N up to its
        tree's size (the tree cut to N nodes), planned or not. With ``live=0`` every row points at the scratch slot, so
        calling or capturing ``bucket.fn(*bucket.args)`` changes no request;
        ``live=n`` makes the first n rows the running requests (slots 0..n-1).
        """
        tree = self.plan.tree
        if tree is not None and not (isinstance(k, int) and 0 <= k <= tree.size):
            raise ValueError(f"k must be a node count 0..{tree.size} of this engine's token tree, got {k}")
        if tree is None and k not in self.plan.bucket_plan.ks:
            raise ValueError(f"k must be one of this engine's K values {self.plan.bucket_plan.ks}, got {k}")
        if not isinstance(mode, sampling.Mode):
            raise ValueError(f"mode must be a funcspec.sampling.Mode (sampling.MODES[name] for a name), got {mode!r}")
        return self.runner.bucket(b, k, t, mode, live)

    @mirrored
    def set_synthetic_acceptance_rates(self, rates: Sequence[float]) -> None:
        """New per-position rates [max_k] for ``rejection_sample_method="synthetic"``, without recapture.

        The rates reach the graphs as a tensor input, so a sweep over acceptance
        rates reuses every captured bucket. Raises ``ValueError`` naming the field.
        """
        self.runner.set_synthetic_acceptance_rates(rates)

    def close(self) -> None:
        """Stop this engine's spawned ranks and leave their process group (nothing to do on one rank)."""
        if self.followers is not None:
            self.followers.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        """``with Engine(...) as engine:`` closes the engine (its tensor-parallel ranks) on leaving the block."""
        self.close()

    # -------------------------------------------------------------- the loop
    @mirrored
    def add_request(self, prompt, sampling_params: Optional[SamplingParams] = None) -> str:
        """Validate and queue one request; returns its id. :meth:`step` admits it when a slot is free."""
        req = self.scheduler.make_request(*request_args(prompt, sampling_params))
        self.scheduler.add([req])
        return req.request_id

    @mirrored
    def abort_request(self, request_id) -> None:
        """Abort requests by id (one id, or an iterable of ids), as vLLM's ``LLMEngine.abort_request``.

        A waiting request leaves the queue; a running one frees its slot now
        (finish reason ``"abort"``), so the next :meth:`step` runs without it
        and can admit another request into the slot. Ids that are unknown or
        already finished are ignored: a server's client may disconnect just as
        its request finishes, and that race must not be an error.
        """
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        sched = self.scheduler
        for req in [r for r in sched.waiting if r.request_id in ids]:
            sched.waiting.remove(req)
            req.finish_reason = "abort"
        for req in [r for r in sched.running.values() if r.request_id in ids]:
            req.finish_reason = "abort"
            self._retire(req)  # NOTE: the same compaction as a finished request: slots 0..n-1 stay filled

    def has_unfinished_requests(self) -> bool:
        """Whether any added request still waits for a slot or runs."""
        return self.scheduler.has_unfinished()

    @mirrored
    def step(self) -> list[RequestOutput]:
        """Admit what fits, then run one decode step; returns the outputs of the requests that finished
        (a request with ``n`` completions once all of them have)."""
        done = {id(r.group[0]): r.group[0] for r in self._advance() if all(s.finish_reason for s in r.group)}
        return [self._output(r) for r in done.values()]

    @torch.no_grad()
    def _advance(self) -> list[Request]:
        """One iteration of the host loop (the module docstring); returns the requests that finished."""
        finished = self._admit(self.scheduler.admit())
        rows = self.scheduler.rows()
        if rows:
            b, k = self.plan.bucket_plan.batch_bucket(len(rows)), self._choose_k(len(rows))
            t = self.plan.bucket_plan.context_bucket(max(r.total_len for r in rows) + k + 1)
            mode = sampling.mode_for(r.params for r in rows)
            host = self.proposer is not None and self.proposer.runs_on_host
            drafts = self.proposer.host_drafts(rows, b, k, self.plan.bucket_tree(k)) if host else None
            tokens, n, used, conf, lps = self.runner.step(len(rows), b, k, t, mode, drafts)
            finished += self._record(rows, tokens, n, used, k, b, lps)
            if self.dyn is not None and k > 0:
                self._observe_confidence(len(rows), conf, used, k)
        return finished

    @mirrored
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns vLLM-shaped outputs in prompt order.

        ``prompts``: a string, a list of strings, token-id lists or
        ``{"prompt_token_ids": [...]}`` dicts. ``sampling_params``: one
        :class:`SamplingParams` for all, or a list, one per prompt.
        """
        prompts, params = generate_args(prompts, sampling_params)  # ValueError naming a bad prompt or params
        # Validate everything before any request touches the engine's state.
        counter = self.scheduler.counter
        try:
            requests = [self.scheduler.make_request(p, sp) for p, sp in zip(prompts, params)]
        except ValueError:
            # NOTE: a refused batch takes no request ids: an unseeded request's seed is its id, so the next
            # requests draw what they would have drawn without the refused call.
            self.scheduler.counter = counter
            raise
        self.scheduler.add(requests)
        with tqdm(total=len(requests), disable=not use_tqdm, desc="requests") as bar:
            while self.scheduler.has_unfinished():
                self._advance()
                bar.update(sum(r.finish_reason is not None for r in requests) - bar.n)
        return [self._output(r) for r in requests]

    # ------------------------------------------------------------- requests
    def _admit(self, reqs: list[Request]) -> list[Request]:
        """Prefill newly admitted ``reqs``, one request (with its ``n`` completions) at a time, and emit each
        one's first token; returns those done.

        A request whose prefill raises is finished alone (:meth:`_fail`): a prefill writes only its own slots,
        so the others' state is untouched, and its slots are rewritten by the next request admitted there.

        NOTE: one prompt per prefill, because a batched prefill pads every prompt to the longest one's length
        and runs more rows through the products: its logits differed from a solo prefill's in the last bits, and
        a seeded top-p request (EAGLE-3, zoo) then drew another token at position 121 than when run alone.
        """
        for group in _prompt_groups(reqs):
            seeds = [rng.completion_seed(r.params.seed if r.params.seed is not None
                                         else (self.seed << 32) + int(r.request_id), r.index) for r in group]
            try:
                mode = sampling.mode_for(r.params for r in group)  # as a step's: the engine decides it
                firsts, first_lps, prompt_lps = self.runner.prefill(group, seeds, mode)
                for req, first, lp, plp in zip(group, firsts, first_lps, prompt_lps):
                    req.t_first = time.perf_counter()
                    if plp is not None:
                        k = req.params.prompt_logprobs
                        assert k is not None, "prompt logprobs come back only for rows that asked for them"
                        req.prompt_logprobs = [None, *logprobs.dicts(req.prompt_ids[1:], plp, k, self._decode)]
                    self._append(req, [first], lp)
            except Exception as err:  # noqa: BLE001 (one request's failure is its own)
                self._fail(group, err)
        done = [r for r in reqs if r.finish_reason]
        for req in done:
            self._retire(req)
        return done

    def _append(self, req: Request, new: list[int], lps: Optional[logprobs.HostRow] = None) -> int:
        """Append ``new`` tokens under the stop rules, with their logprobs ``lps`` (the row's, one position per
        token) where the request asked for them; returns how many the stop rules kept."""
        before = len(req.output_ids)
        self.scheduler.append(req, new)
        if req.logprobs is not None:  # NOTE: only the tokens the stop rules kept
            k = req.params.logprobs
            assert lps is not None and k is not None, "a request with logprobs asked for them: its row has them"
            req.logprobs += logprobs.dicts(req.output_ids[before:], lps, k, self._decode)
        return len(req.output_ids) - before

    @staticmethod
    def _fail(seqs: list[Request], err: Exception) -> None:
        """Finish ``seqs`` with ``finish_reason="error"`` and ``err`` as their ``error``, alone: the host work of one
        request (its prefill, stop rules, text, logprobs) that raises fails that request, and the engine goes on
        with the others. A step's graph cannot fail on a request's values (:meth:`Scheduler.make_request` checks
        every value it writes), so what fails there is the engine's own, and :meth:`step` raises it."""
        message = f"{type(err).__name__}: {err}"
        for seq in seqs:
            seq.finish_reason, seq.error = "error", message
        warnings.warn(f"request {seqs[0].request_id} failed and was finished alone: {message}", stacklevel=3)

    def _retire(self, req: Request) -> None:
        """Free ``req``'s slot; the runner applies the scheduler's compaction move."""
        move = self.scheduler.retire(req)
        if move is not None:
            self.runner.move_slot(*move)
        if self.proposer is not None:
            self.proposer.on_finish(req)

    def _choose_k(self, active: int) -> int:
        """K for this step: the K table (or ``num_speculative_tokens``), or the confidence budget."""
        if self.dyn is not None:
            return self._dyn_k
        return self.spec.k_for_batch_size(active) if self.spec else 0

    def _observe_confidence(self, rows: int, conf: list, drafts: list[int], k: int) -> None:
        """Confidence-based verify length on the host: update the budget, then the next K bucket.

        NOTE: graphs have static K, so the bucket is the width rows may verify: the
        largest verify length used this step, one more when a row hit the cap, and
        never below the per-request budget. Rows verify their allocated prefix inside it.
        """
        self.dyn.observe(self._stats["steps"] - 1, conf[:rows])
        used = max(drafts[:rows], default=0)
        self._dyn_k = min(self.dyn.max_k, max(self.dyn.budget_k, used + (used == k)))

    @functools.cached_property
    def _decode(self) -> logprobs.Decoder:
        """Token id -> text for logprobs' ``decoded_token`` (memoised)."""
        return logprobs.Decoder(self.model.tokenizer)

    def _record(self, rows: list[Request], tokens, n, drafts, k: int, b: int, lps=None) -> list[Request]:
        """Count the step, append each row's tokens (and logprobs), retire the finished rows; returns them."""
        self._stats["steps"] += 1
        self._buckets_used[f"B{b}_K{k}"] += 1
        done = []
        for i, req in enumerate(rows):
            req.steps += 1
            self._stats["row_steps"] += 1
            self._stats["emitted"] += n[i]
            if k > 0:
                req.num_draft_tokens += drafts[i]
                req.num_accepted_tokens += n[i] - 1
                self._stats["spec_row_steps"] += 1
                if not req.accepted_per_pos:
                    req.accepted_per_pos = [0] * len(self._accepted_per_pos)
                for j in range(n[i] - 1):
                    self._accepted_per_pos[j] += 1
                    req.accepted_per_pos[j] += 1
            try:
                self._stats["tokens_generated"] += self._append(req, tokens[i][:n[i]], lps and lps[i])
            except Exception as err:  # noqa: BLE001 (one request's failure is its own)
                self._fail([req], err)
            if req.finish_reason:
                done.append(req)
        # NOTE: retire after the loop: a retirement moves a request between
        # slots, and rows[i] must stay slot i while the step's tokens are read.
        for req in done:
            self._retire(req)
        return done

    def _seq_metrics(self, req: Request) -> dict:
        """One sequence's counters: drafts, accepted tokens (in all and per position), τ, steps, timings."""
        steps = max(req.steps, 1)
        return {
            "num_draft_tokens": req.num_draft_tokens,
            "num_accepted_tokens": req.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(req.accepted_per_pos or [0] * len(self._accepted_per_pos)),
            "acceptance_length": (req.num_accepted_tokens + req.steps) / steps,
            "steps": req.steps,
            "time_to_first_token_s": req.t_first - req.t_start,
            "e2e_s": req.t_end - req.t_start,
        }

    def _output(self, req: Request) -> RequestOutput:
        """The RequestOutput of ``req`` (completion 0) and its ``n`` completions."""
        group = req.group or [req]
        outs = []
        for seq in group:
            cum = sum(d[t].logprob for d, t in zip(seq.logprobs, seq.output_ids)) if seq.logprobs is not None \
                else None
            outs.append(CompletionOutput(seq.index, self.scheduler.final_text(seq), list(seq.output_ids),
                                         seq.finish_reason, seq.stop_reason, seq.logprobs, cum,
                                         self._seq_metrics(seq), seq.error))
        each = [o.metrics for o in outs]
        metrics = {key: sum(m[key] for m in each) for key in ("num_draft_tokens", "num_accepted_tokens", "steps")}
        metrics["num_accepted_tokens_per_pos"] = [sum(x) for x in zip(*(m["num_accepted_tokens_per_pos"]
                                                                          for m in each))]
        metrics["acceptance_length"] = (metrics["num_accepted_tokens"] + metrics["steps"]) / max(metrics["steps"], 1)
        metrics["time_to_first_token_s"] = min(m["time_to_first_token_s"] for m in each)
        metrics["e2e_s"] = max(m["e2e_s"] for m in each)
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, metrics=metrics,
                             kv_transfer_params=req.extra.get("kv_transfer_params"),
                             prompt_logprobs=req.prompt_logprobs)

    # ----------------------------------------------------------------- stats
    @mirrored
    def reset_stats(self) -> None:
        """Zero the step, token and acceptance counters (e.g. after a warm-up); graphs are kept."""
        self._stats = collections.Counter()
        self._accepted_per_pos = [0] * len(self._accepted_per_pos)
        self._buckets_used = collections.Counter()

    def stats(self) -> dict:
        """A snapshot of the engine: counters, queues, graphs, step times, acceptance; what tools read instead
        of the engine's parts (a plain dict, taken now: later steps do not change it).

        ``waiting`` and ``running`` count sequences (a request with ``n`` completions counts ``n``): those that
        wait for a slot, and those in one. ``graphs`` maps each captured step's :func:`graph_name` to its
        capture stats (``stored``: its file in the compiled-step store, else ``None``; ``helper``: the start-up
        helper process that compiled it, else ``None``; ``key``: its bucket key, batch 0 where the batch is
        symbolic). ``bucket_timings`` maps each bucket that ran a step to
        ``key``, ``calls`` (every step so far) and ``replay_ms``, the wall ms of its recent steps, oldest
        first (at most :data:`~funcspec.capture.window.WINDOW`), and their median. A read of this rank's
        engine: tensor-parallel followers do not replay it.

        ``mean_acceptance_length`` (τ) is tokens emitted per row-step;
        ``per_position_acceptance[i]`` is the fraction of speculative row-steps
        whose first i+1 drafts were all accepted (unconditional, so it never rises with i);
        with a token tree, whose accepted path reached depth i+1 (per-depth acceptance).
        """
        s = self._stats
        graphs = {graph_name(key): {**g.stats.summary(), "key": key} for key, g in sorted(self.runner.compiled.items())}
        spec_rows = s["spec_row_steps"]
        return {
            "backend": self.backend,
            "steps": s["steps"],
            "tokens_generated": s["tokens_generated"],
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "recompiles": sum(g["recompiles"] for g in graphs.values()),
            "graph_breaks": sum(g["graph_breaks"] for g in graphs.values()),
            "graphs": graphs,
            "bucket_timings": {graph_name(key): _timings(key, w) for key, w in sorted(self.runner.replay_ms.items())},
            "capture_seconds": sum(g["capture_seconds"] for g in graphs.values()),
            "startup_capture_seconds": self.startup_seconds,
            "buckets_used": dict(self._buckets_used),
            "mean_acceptance_length": s["emitted"] / s["row_steps"] if s["row_steps"] else 0.0,
            "per_position_acceptance": [a / spec_rows if spec_rows else 0.0 for a in self._accepted_per_pos],
            "capture_sizes": self.plan.bucket_plan.capture_sizes(),
        }

    def waiting_ids(self) -> set[str]:
        """The ``seq_id`` of every sequence still waiting for a slot (the request id, ``.i`` appended for
        completion i > 0): the ones no step has touched yet (a server keeps them when a step fails)."""
        return {r.seq_id for r in self.scheduler.waiting}


def _timings(key, window) -> dict:
    """One bucket's step times for :meth:`Engine.stats`: a copy of its bounded window, its median, every call."""
    recent = tuple(window)
    return {"key": key, "calls": window.total, "replay_ms": recent,
            "replay_ms_median": round(statistics.median(recent), 4) if recent else None}


def _prompt_groups(reqs: list[Request]) -> list[list[Request]]:
    """``reqs`` in order, cut into runs that share one request (its ``n`` completions admitted together)."""
    groups: list[list[Request]] = []
    for r in reqs:
        if groups and groups[-1][0].request_id == r.request_id:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups

