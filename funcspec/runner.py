"""Running, on the device: the state, the params, one captured graph per bucket, prefill and a step.

The runner knows nothing of requests' lifetimes (``scheduler.py`` does). It is
told which rows run and with which bucket, and it owns everything that lives on
the device: the :class:`~funcspec.step.EngineState` pytree, the params and the
captured graphs. :meth:`Runner.bucket` is the public handle on one bucket's
pure step function, for people who capture or export it themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from funcspec import logprobs, rng, sampling
from funcspec.capture import capture
from funcspec.capture.backends import filed, graph_pool
from funcspec.capture.window import Window
from funcspec.nn import forward, init_kv_cache
from funcspec.nn.llama import KVRead
from funcspec.step import EngineState, StepConfig, StepInputs, row_keys, spec_step
from funcspec.plan import EnginePlan
from funcspec.token_tree import Chain, static_parents
from funcspec.pytree import move_slot, replace
from funcspec.types import PLACEHOLDER, Sampling
from funcspec.verifiers import synthetic

MIN_PREFILL_BUCKET = 16
BucketKey = tuple[int, int, int, str]  # (B, K, T, mode name)


def graph_name(key: BucketKey) -> str:
    """``B{b}_K{k}_T{t}_{mode}``: the stats name of the captured step of bucket ``key``
    (``Bn``: the graph with a symbolic batch, ``b = 0``)."""
    b, k, t, mode = key
    return f"B{b or 'n'}_K{k}_T{t}_{mode}"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One (B, K, T, mode) bucket: its pure step function and arguments to call it with.

    ``fn(params, state, inputs) -> (StepOutput, new_state)`` is exactly what the
    engine captures: pass it with ``args`` to :func:`funcspec.capture.capture`,
    ``torch.compile``, ``torch.export`` or ``torch._dynamo.explain``. ``fn``
    donates the state (the KV cache and history are updated in place).

    Attributes:
        key: ``(B, K, T, mode name)``.
        fn: the step of this bucket, a pure function of its three arguments.
        args: ``(params, state, inputs)``; rows below ``live`` are the running
            requests, the others point at the scratch slot and change nothing.
        live: how many rows of ``args`` are running requests.
    """

    key: BucketKey
    fn: Callable
    args: tuple
    live: int = 0

    @property
    def name(self) -> str:
        return graph_name(self.key)


def readback(tree):
    """Every tensor of the pytree ``tree`` read to the host; returns ``tree`` with each tensor a Python list of its
    values (``Tensor.tolist``, in its own dtype).

    NOTE: off the CPU the tensors cross in ONE copy (:func:`host_copy`), so a step, or a prefill, costs exactly
    one device-to-host sync. The step's ``StepOutput`` and the prefill's first tokens and logprobs travel through
    it alike. Tensors already on the host (a CPU engine) are read as they lie: packing them costs more.
    """
    leaves, spec = pytree.tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return tree
    if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in leaves):
        leaves = host_copy(leaves)
    out = []
    for x in leaves:  # NOTE: a loop, not a comprehension: every host read happens in this frame
        out.append(x.tolist() if isinstance(x, torch.Tensor) else x)
    return pytree.tree_unflatten(out, spec)


def host_copy(leaves: list) -> list:
    """``leaves`` with each tensor replaced by its host copy (same dtype and shape), all made by ONE transfer:
    every tensor is packed into one float64 tensor (token ids are exact below 2^53, float32 logprobs exactly)."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    host = torch.cat([x.double().reshape(-1) for x in tensors]).cpu()  # SYNC: the one copy
    parts = iter(host.split([x.numel() for x in tensors]))
    return [next(parts).view(x.shape).to(x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves]


def step_lists(out) -> tuple[list, list, list, Optional[list], Optional[list]]:
    """A step's :class:`~funcspec.step.StepOutput` after :func:`readback`, as the host loop reads it: tokens
    [B][K+1], num_emitted [B], num_drafts [B], confidence [B][K] (or ``None``), and per row its
    ``logprobs.HostRow`` (or ``None`` where the bucket computed none)."""
    lps = None if out.logprobs is None else logprobs.rows(out.logprobs)
    return out.tokens, out.num_emitted, out.num_drafts, out.confidence, lps


def batch_dims(inputs: StepInputs) -> list[tuple[torch.Tensor, int]]:
    """The (tensor, dim) of a step's inputs whose size is the batch B: the rows' slots and host drafts."""
    return [(x, 0) for x in (inputs.slots, inputs.drafts, inputs.draft_parents) if x is not None]


def example_drafts(shape, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Host drafts [B, K] of no proposal and their parents [B, K], for a bucket of ``shape``'s example inputs:
    a chain's i - 1, a tree's nodes all under the root (a dynamic tree's parents arrive per step)."""
    tokens = torch.full((b, shape.size), PLACEHOLDER, dtype=torch.int64, device=device)
    # NOTE: contiguous, as the host's are: a graph's guards (and an ahead-of-time graph's) check strides
    parents = static_parents(shape, b, device).contiguous() if isinstance(shape, Chain) else torch.full_like(tokens, -1)
    return tokens, parents


def _next_pow2(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


class Runner:
    """The device side of an engine.

    Args (keyword-only):
        plan: the engine's :class:`~funcspec.plan.EnginePlan`: slots, cache length,
            backend, buckets, and per bucket K its verify rule and token tree.
        model: the loaded target (:class:`~funcspec.checkpoints.Model`).
        proposer: the built proposer (:class:`~funcspec.proposers.BoundProposer`, which holds the draft
            params), or ``None`` (autoregressive).
        device, dtype: where and in what the state lives.
        dyn: the confidence scheduler (dynamic verify length; host state that
            changes every step, so not part of the plan), or ``None``.
        prefill_hooks: callables ``hook(reqs, tokens [P, T], lens, hiddens)``
            with a ``layers`` attribute: they see each prefill's hidden states
            of those layers (``extract_hidden_states`` is one).
    """

    def __init__(self, *, plan: EnginePlan, model, proposer, device, dtype, dyn=None,
                 prefill_hooks: Sequence[Any] = ()):
        self.plan, self.model, self.proposer, self.device, self.dyn = plan, model, proposer, torch.device(device), dyn
        self.backend, self.num_slots, self.t_max = plan.backend, plan.num_slots, plan.t_max
        self.synthetic_rates = plan.synthetic_rates  # NOTE: a tensor input: set_synthetic_acceptance_rates changes it
        self.prefill_hooks = tuple(prefill_hooks)
        self.state = self._init_state(dtype)
        self.graphs: dict[BucketKey, Any] = {}  # (B, K, T, mode name) -> the captured step that runs it
        self.compiled: dict[BucketKey, Any] = {}  # (plan.graph_batch(B), K, T, mode name) -> captured step
        self.pool = graph_pool(self.backend)  # device graphs: one memory pool for this runner's buckets
        self.replay_ms: dict[BucketKey, Window] = collections.defaultdict(Window)  # per bucket: recent step wall ms

    @property
    def params(self) -> dict:
        """``{"target": ..., "draft": ...}``: the params pytree every bucket takes, read from where they are
        held (the target's ``model.params`` and the proposer's ``params``)."""
        return {"target": self.model.params, "draft": self.proposer.params if self.proposer else None}

    def _init_state(self, dtype) -> EngineState:
        s, dev = self.num_slots, self.device
        return EngineState(
            kv=init_kv_cache(self.model.cfg, s, self.t_max, dtype, dev),
            history=torch.zeros(s + 1, self.t_max + 1, dtype=torch.int64, device=dev),
            keys=torch.zeros(s + 1, dtype=torch.int64, device=dev),
            sampling=Sampling.full(s + 1, 1.0, 0, 1.0, dev),
            proposer=self.proposer.init_state(self.num_slots, self.t_max) if self.proposer else None,
        )

    # ---------------------------------------------------------------- buckets
    def step_config(self, k: int, t: int, mode: sampling.Mode) -> StepConfig:
        """The static config of bucket (·, k, t, mode): ``t`` cache positions read, row i is slot i; its shape
        and verify rule are the plan's (``EnginePlan.bucket_tree``, ``EnginePlan.verify``)."""
        p = self.proposer
        return StepConfig(self.model.cfg, k, p, self.plan.verify(k, mode), p.hidden_layers if p else (),
                          self.dyn.min_k if self.dyn else None, KVRead(t, aligned=True), mode,
                          self.plan.bucket_tree(k))

    def inputs(self, live: int, b: int, k: int, drafts=None) -> StepInputs:
        """Graph inputs for ``live`` running rows (slots 0..live-1); rows live..b-1 pad (scratch slot).

        ``drafts``: a host proposer's (tokens, parents), [B, K] each.
        """
        if not 0 <= live <= b:
            raise ValueError(f"live rows must be in [0, {b}], got {live}")
        slots = list(range(live)) + [self.num_slots] * (b - live)
        budget = self.dyn.budget_tensor(self.device) if self.dyn else None
        cond = None
        if self.synthetic_rates is not None and k > 0:
            cond = synthetic.conditional_tensor(self.synthetic_rates[:k], self.device)  # [K]
        host = self.proposer is not None and self.proposer.runs_on_host
        if drafts is None and host:  # example inputs: PLACEHOLDER drafts (of a tree: under the root)
            drafts = example_drafts(self.plan.bucket_tree(k), b, self.device)
        tokens, parents = drafts if host else (None, None)
        return StepInputs(torch.tensor(slots, dtype=torch.int64, device=self.device), tokens, parents, budget, cond)

    def bucket(self, b: int, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED,
               live: int = 0) -> Bucket:
        """Bucket (b, k, t, mode) with arguments whose first ``live`` rows are the running requests."""
        t = self.t_max if t is None else t
        fn = functools.partial(spec_step, self.step_config(k, t, mode))
        return Bucket((b, k, t, mode.name), fn, (self.params, self.state, self.inputs(live, b, k)), live)

    def graph_key(self, b: int, k: int, t: int, mode: sampling.Mode) -> BucketKey:
        """The key of the graph that runs bucket (b, k, t, mode), from the plan's tables: buckets above B = 1
        share one graph when the batch is symbolic (``BucketPlan.graph_batch``), and a mode runs in the
        graph of ``EnginePlan.graph_modes`` (after a start-up capture, the general mode's for most)."""
        return self.plan.bucket_plan.graph_batch(b), k, t, self.plan.graph_modes[mode.name].name

    @torch.no_grad()
    def graph(self, b: int, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED):
        """The captured step that runs bucket (b, k, t, mode) (:meth:`graph_key`), captured on first use
        (under no_grad, which Dynamo guards on)."""
        key = (b, k, self.t_max if t is None else t, mode.name)
        if key not in self.graphs:
            gkey = self.graph_key(b, *key[1:3], mode)
            if gkey not in self.compiled:
                # NOTE: built only on a miss: a bucket's config and example inputs are not per-step work.
                fn, args, name, symbolic = self._example(b, k, t, mode)
                self.compiled[gkey] = capture(fn, args, self.backend, name=name, symbolic=symbolic,
                                              donated=(1,), pool=self.pool)  # donated: the state, updated in place
            self.graphs[key] = self.compiled[gkey]
        return self.graphs[key]

    @torch.no_grad()  # NOTE: as graph(): the store's key names the grad mode
    def filed(self, b: int, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED) -> bool:
        """Whether the graph of bucket (b, k, t, mode) needs no compile: captured here already, or (inductor) in
        the compiled-step store, where :meth:`graph` will load it from."""
        gkey = self.graph_key(b, k, self.t_max if t is None else t, mode)
        if gkey in self.compiled:
            return True
        return self.backend == "inductor" and filed(*self._example(b, k, t, mode))

    def _example(self, b: int, k: int, t: Optional[int], mode: sampling.Mode):
        """(function, example arguments, name, symbolic sizes) that bucket (b, k, t, mode)'s graph is captured
        from: its graph's mode, its rows on the scratch slot, the batch symbolic in a shared graph."""
        gkey = self.graph_key(b, k, self.t_max if t is None else t, mode)
        bucket = self.bucket(b, k, t, self.plan.graph_modes[mode.name])
        symbolic = batch_dims(bucket.args[2]) if gkey[0] == 0 else ()
        return bucket.fn, bucket.args, f"spec_step_{graph_name(gkey)}", symbolic

    def set_synthetic_acceptance_rates(self, rates: Sequence[float]) -> None:
        """See :meth:`funcspec.Engine.set_synthetic_acceptance_rates`."""
        if self.synthetic_rates is None:
            raise ValueError("synthetic_acceptance_rates: this engine's rejection_sample_method is not 'synthetic'")
        self.synthetic_rates = synthetic.check_rates(rates, len(self.synthetic_rates))

    # ---------------------------------------------------------------- running
    @torch.no_grad()
    def step(self, live: int, b: int, k: int, t: int, mode: sampling.Mode, drafts=None):
        """One decode step of rows 0..live-1 in bucket (b, k, t, mode); returns :func:`step_lists`."""
        graph = self.graph(b, k, t, mode)
        inputs = self.inputs(live, b, k, drafts)
        t0 = time.perf_counter()
        out, self.state = graph(self.params, self.state, inputs)
        result = step_lists(readback(out))  # SYNC: the step's one device-to-host copy
        ms = (time.perf_counter() - t0) * 1e3
        graph.stats.replay_ms.append(ms)  # per graph (shared by the buckets of a symbolic batch)
        self.replay_ms[(b, k, t, mode.name)].append(ms)  # per bucket
        return result

    def move_slot(self, src: int, dst: int) -> None:
        """Move a request's state from slot ``src`` to ``dst`` (the scheduler's compaction)."""
        move_slot(self.state, src, dst)

    @torch.no_grad()
    def prefill(self, reqs, seeds: Sequence[int], mode: sampling.Mode):
        """Write each sequence's slot (key, sampling, prompt), prefill the prompts together, sample first tokens
        in ``mode`` (the engine's ``sampling.mode_for`` of ``reqs``).

        ``reqs`` are sequences (``scheduler.Request``); the completions of an
        ``n`` > 1 request arrive together, and only completion 0's prompt runs:
        its KV and drafter state are then copied into its siblings' slots, and
        every completion draws its first token from the same logits with its
        own key. Returns ``(first tokens, first logprobs, prompt logprobs)``,
        one entry per sequence; the logprob entries are ``None`` where the
        request did not ask (else its ``logprobs.HostRow``: E = 1 for the first
        token, one position per prompt token after the first for the prompt).

        NOTE: prefill runs eagerly, padded to a power-of-two length, like
        vLLM's FULL_DECODE_ONLY graph mode: its shapes vary with prompt
        lengths, and the decode graphs are what repeats.
        """
        st, dev = self.state, self.device
        leads = [r for r in reqs if r.index == 0]
        row = {id(r): i for i, r in enumerate(leads)}  # completion 0 -> its row in the prefill batch
        lens = [len(r.prompt_ids) for r in leads]
        t = min(_next_pow2(max(lens), MIN_PREFILL_BUCKET), self.t_max)
        tokens = torch.zeros(len(leads), t, dtype=torch.int64, device=dev)
        for i, req in enumerate(leads):
            p, slot, n = req.params, req.slot, lens[i]
            prompt = torch.tensor(req.prompt_ids, dtype=torch.int64, device=dev)
            st.sampling.temperature[slot], st.sampling.top_k[slot], st.sampling.top_p[slot] = \
                p.temperature, p.top_k, p.top_p
            st.history[slot, :n] = prompt
            tokens[i, :n] = prompt
        slots = torch.tensor([r.slot for r in leads], device=dev)
        own = self.proposer.hidden_layers if self.proposer else ()
        layers = tuple(dict.fromkeys(own + tuple(x for h in self.prefill_hooks for x in h.layers)))
        logits, hiddens, _ = forward(self.model.cfg, self.model.params, st.kv, tokens, slots, torch.zeros_like(slots),
                                     layers, KVRead(t))  # the prompts' positions are all below t
        by_layer = dict(zip(layers, hiddens))
        for hook in self.prefill_hooks:
            hook(leads, tokens, lens, tuple(by_layer[x] for x in hook.layers))
        if self.proposer is not None:
            for i, r in enumerate(leads):
                pstate = self.proposer.prefill(self.state.proposer, tokens[i:i + 1], r.slot, lens[i],
                                               tuple(by_layer[x][i:i + 1] for x in own))
                self.state = replace(self.state, proposer=pstate)
        for req in reqs:
            if req.index > 0:  # a sibling: the prompt's KV, history, sampling and drafter state, copied
                move_slot(self.state, req.group[0].slot, req.slot)
        for req, seed in zip(reqs, seeds):
            self.state.keys[req.slot] = rng.key(seed, dev)
        rows = torch.tensor([row[id(r.group[0] if r.index else r)] for r in reqs], device=dev)  # [R]
        all_slots = torch.tensor([r.slot for r in reqs], device=dev)  # [R]
        last = torch.tensor(lens, device=dev)[rows] - 1  # [R]
        first_logits = logits[rows, last]  # [R, V]
        s = self.state.sampling
        first = sampling.sample(row_keys(self.state, all_slots, last), first_logits,
                                s.temperature[all_slots], s.top_k[all_slots], s.top_p[all_slots], mode)  # [R]
        wants = [r.params.logprobs is not None for r in reqs]
        first_lp = logprobs.token_logprobs(first_logits.unsqueeze(1), first.unsqueeze(1)) if any(wants) else None
        prompt_lp = [logprobs.token_logprobs(logits[i:i + 1, : lens[i] - 1], tokens[i:i + 1, 1:lens[i]])
                     if r.params.prompt_logprobs is not None and lens[i] > 1 else None for i, r in enumerate(leads)]
        # SYNC: prefill hands its first tokens (and logprobs) to the host, in the one copy a step makes
        firsts, first_lp, prompt_lp = readback((first, first_lp, prompt_lp))
        first_rows = logprobs.rows(first_lp) if first_lp is not None else [None] * len(reqs)  # [R] of E = 1
        prompt_rows = [None if lp is None else logprobs.rows(lp)[0] for lp in prompt_lp]
        for r, f in zip(reqs, firsts):
            self.state.kv.lens[r.slot] = len(r.prompt_ids)
            self.state.history[r.slot, len(r.prompt_ids)] = f
        return (firsts, [x if w else None for x, w in zip(first_rows, wants)],
                [prompt_rows[row[id(r)]] if r.index == 0 else None for r in reqs])
