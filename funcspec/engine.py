"""The host loop (DESIGN §6): slots, buckets, padding, stop rules, stats.

Each iteration of :meth:`Engine.generate`:

    admit waiting requests into the lowest free slots (prefill)
    rows = slots 0..B-1 (running requests fill slots 0..n-1), B = smallest batch bucket >= n
    K = k_for_batch_size(active);  T = smallest context bucket >= longest row + K + 1
    mode = greedy | random | filtered: the cheapest sampling that serves every row
    drafts = host proposer (suffix only)
    out, state = graph[B, K, T, mode](params, state, inputs)
    read (tokens, num_emitted) once            # SYNC
    apply stop rules; retire finished requests
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Optional, Sequence

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec import rng, sampling
from funcspec.capture import BucketPlan, capture, resolve_backend
from funcspec.nn.llama import KVRead
from funcspec.checkpoints import Model, load_model
from funcspec.config import SamplingParams, SpecConfig
from funcspec.nn import forward, init_kv_cache
from funcspec.outputs import CompletionOutput, RequestOutput
from funcspec.step import EngineState, StepConfig, StepInputs, move_slot, row_keys, spec_step
from funcspec.tree import replace
from funcspec.types import PLACEHOLDER, Sampling
from funcspec.verifiers import synthetic, verify_config

MIN_PREFILL_BUCKET = 16


@dataclasses.dataclass
class Request:
    """Host-side bookkeeping of one request."""

    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    text: Optional[str] = None
    steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def total_len(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)


def readback(out) -> tuple[list, list, list, Optional[torch.Tensor]]:
    """Copy a StepOutput to the host in ONE transfer: tokens, num_emitted, num_drafts, confidence.

    NOTE: everything is packed into one float64 tensor (token ids are exact
    below 2^53), so a step costs exactly one device-to-host sync.
    """
    parts = [out.tokens.double(), out.num_emitted.double().unsqueeze(1), out.num_drafts.double().unsqueeze(1)]
    if out.confidence is not None:
        parts.append(out.confidence.double())
    host = torch.cat(parts, 1).cpu()
    k1 = out.tokens.shape[1]
    ints = host[:, : k1 + 2].long()
    conf = host[:, k1 + 2:].float() if out.confidence is not None else None
    return ints[:, :k1].tolist(), ints[:, k1].tolist(), ints[:, k1 + 1].tolist(), conf


def graph_name(key: tuple[int, int, int, str]) -> str:
    """``B{b}_K{k}_T{t}_{mode}``: the stats name of the captured step of bucket ``key``."""
    b, k, t, mode = key
    return f"B{b}_K{k}_T{t}_{mode}"


def _next_pow2(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


class Engine:
    """Speculative (or autoregressive) generation with one captured graph per (B, K) bucket.

    Args:
        model: a checkpoint path or a loaded :class:`~funcspec.checkpoints.Model`.
        speculative_config: a vLLM ``speculative_config`` dict (or a parsed
            :class:`SpecConfig`); ``None`` decodes autoregressively.
        backend: eager | inductor | cudagraph | aclgraph | auto.
        max_batch_size: number of KV slots (continuous batching).
        max_model_len: prompt + output limit; defaults to min(max_position_embeddings, 2048).
        additional_config: vLLM-Ascend ``additional_config`` (rejection sampler,
            draft window, dynamic spec).
        batch_buckets: batch bucket sizes (default: powers of two).
        eager_capture: capture every bucket at construction (else lazily).
        seed: engine seed for requests without ``SamplingParams.seed``.
        device, dtype: where and in what precision to run.
        context_buckets: KV lengths that a step's attention reads (default:
            powers of two from 256, then the whole cache). A step reads the
            smallest that holds its longest row, so it costs the live KV.
    """

    def __init__(self, model, speculative_config=None, backend: str = "eager", max_batch_size: int = 8,
                 max_model_len: Optional[int] = None, additional_config: Optional[dict] = None,
                 batch_buckets: Optional[Sequence[int]] = None, eager_capture: bool = False, seed: int = 0,
                 device="cpu", dtype=torch.float32, kv_transfer_config: Optional[dict] = None,
                 context_buckets: Optional[Sequence[int]] = None):
        self.model = model if isinstance(model, Model) else load_model(model, dtype=dtype, device=device)
        cfg = self.model.cfg
        if isinstance(speculative_config, SpecConfig) or speculative_config is None:
            self.spec = speculative_config
        else:
            self.spec = SpecConfig.from_vllm(speculative_config, additional_config)
        self.dump = None
        if self.spec is not None and self.spec.method == "extract_hidden_states":
            from funcspec import extract

            self.dump = extract.build(self.spec, cfg.num_layers, kv_transfer_config)
            self.spec = None  # it does not speculate: decode is plain autoregressive
        elif kv_transfer_config is not None:
            raise ValueError("kv_transfer_config is only supported with method 'extract_hidden_states'")
        max_k = self.spec.num_speculative_tokens if self.spec else 0
        if self.spec is not None:
            self.spec.validate_for_backend(backend)  # before importing torch_npu: report K+1 <= 16 first
        self.backend = resolve_backend(backend, device)
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 2048)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_model_len, self.device, self.seed = max_model_len, torch.device(device), seed
        # NOTE: room for a full K+1 block past max_model_len, so writes never go out of bounds.
        self.t_max = max_model_len + max_k + 1
        self.plan = BucketPlan.for_engine(max_batch_size, max_k, batch_buckets, eager_capture, self.t_max,
                                          context_buckets)
        self.num_slots = max_batch_size
        from funcspec.proposers import BuildContext, build_proposer

        ctx = BuildContext(self.max_model_len, self.device)
        self.proposer = build_proposer(self.spec, self.model, ctx) if self.spec else None
        self.params = {"target": self.model.params, "draft": self.proposer.params if self.proposer else None}
        self.dyn = None
        if self.spec is not None and self.spec.dynamic_spec is not None:
            from funcspec.dynamic import ConfidenceScheduler

            self.dyn = ConfidenceScheduler(self.spec.dynamic_spec, max_k)
            self._dyn_k = self.dyn.budget_k
        self.synthetic_rates = self.spec.synthetic_acceptance_rates if self.spec else None
        self.state = self._init_state(dtype)
        self.graphs: dict[tuple[int, int, int, str], Any] = {}  # (B, K, T, mode name) -> captured step
        self.free_slots = list(range(self.num_slots))
        self.running: dict[int, Request] = {}
        self._counter = 0
        self._stats = collections.Counter()
        self._accepted_per_pos = [0] * max_k
        self._buckets_used: collections.Counter = collections.Counter()
        if eager_capture:
            # NOTE: up front, only the general mode, which serves any request;
            # _pick_graph then never captures at run time.
            todo = [(b, k, t) for b, k in self.plan.buckets for t in self.plan.context_buckets]
            for b, k, t in tqdm(todo, desc="capturing buckets"):
                self._graph(b, k, t, sampling.FILTERED)

    # ----------------------------------------------------------------- state
    def _init_state(self, dtype) -> EngineState:
        s, dev = self.num_slots, self.device
        return EngineState(
            kv=init_kv_cache(self.model.cfg, s, self.t_max, dtype, dev),
            history=torch.zeros(s + 1, self.t_max + 1, dtype=torch.int64, device=dev),
            keys=torch.zeros(s + 1, dtype=torch.int64, device=dev),
            sampling=Sampling.full(s + 1, 1.0, 0, 1.0, dev),
            proposer=self.proposer.init_state(self.num_slots, self.t_max) if self.proposer else None,
        )

    # ---------------------------------------------------------------- graphs
    def _step_config(self, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED) -> StepConfig:
        """The static config of bucket (·, k, t, mode): ``t`` cache positions read, rows are slots."""
        p = self.proposer
        verify = dataclasses.replace(verify_config(self.spec, k), filters=mode.filters) if p else None
        return StepConfig(self.model.cfg, k, p.bound if p else None, verify,
                          p.hidden_layers if p else (), self.dyn.min_k if self.dyn else None,
                          KVRead(t if t is not None else self.t_max, aligned=True), mode)

    def _inputs(self, slots: list[int], b: int, k: int, drafts=None) -> StepInputs:
        """Graph inputs for the running ``slots`` 0..n-1 (row i is slot i); rows n..b-1 pad (scratch slot)."""
        if list(slots) != list(range(len(slots))) or len(slots) > b:
            raise ValueError(f"slots must be 0..n-1 with n <= {b} (attention reads slot i in row i), got {slots}")
        pad = list(slots) + [self.num_slots] * (b - len(slots))
        budget = self.dyn.budget_tensor(self.device) if self.dyn else None
        cond = None
        if self.synthetic_rates is not None and k > 0:
            cond = synthetic.conditional_tensor(self.synthetic_rates[:k], self.device)  # [K]
        return StepInputs(torch.tensor(pad, dtype=torch.int64, device=self.device),
                          drafts if drafts is not None else self._host_drafts_placeholder(b, k), budget, cond)

    def set_synthetic_acceptance_rates(self, rates: Sequence[float]) -> None:
        """New per-position rates [K_max] for ``rejection_sample_method="synthetic"``, without recapture.

        The rates reach the graphs as a tensor input, so a sweep over acceptance
        rates reuses every captured bucket. Raises ``ValueError`` naming the field.
        """
        if self.synthetic_rates is None:
            raise ValueError("synthetic_acceptance_rates: this engine's rejection_sample_method is not 'synthetic'")
        self.synthetic_rates = synthetic.check_rates(rates, len(self.synthetic_rates))

    def _host_drafts_placeholder(self, b: int, k: int):
        if self.proposer is None or not self.proposer.runs_on_host:
            return None
        return torch.full((b, k), PLACEHOLDER, dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def _graph(self, b: int, k: int, t: Optional[int] = None, mode: sampling.Mode = sampling.FILTERED):
        """The captured step for bucket (b, k, t, mode), capturing it on first use (always under no_grad,
        which Dynamo guards on)."""
        t = self.t_max if t is None else t
        key = (b, k, t, mode.name)
        if key not in self.graphs:
            import functools

            fn = functools.partial(spec_step, self._step_config(k, t, mode))
            # NOTE: every example row points at the scratch slot, so warm-up
            # and capture never touch a real request's KV or history.
            example = (self.params, self.state, self._inputs([], b, k))
            self.graphs[key] = capture(fn, example, self.backend, name=f"spec_step_b{b}_k{k}_t{t}_{mode.name}")
        return self.graphs[key]

    def _pick_graph(self, b: int, k: int, t: int, mode: sampling.Mode):
        """The exact bucket's graph; with ``eager_capture``, the general mode's graph that is already there."""
        if self.plan.eager_capture and (b, k, t, mode.name) not in self.graphs:
            mode = sampling.FILTERED
        return self._graph(b, k, t, mode)

    # ------------------------------------------------------------- requests
    def _make_request(self, prompt, params: SamplingParams) -> Request:
        tok = self.model.tokenizer
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            text, ids = None, [int(t) for t in prompt]
        if ids is None:
            if tok is None:
                raise ValueError("prompt: text prompts need a tokenizer; this checkpoint has none")
            ids = tok(text)["input_ids"]
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.model.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                "(it needs room for at least one output token)"
            )
        self._counter += 1
        return Request(str(self._counter - 1), text, ids, params)

    def _admit(self, reqs: list[Request]) -> None:
        """Prefill ``reqs`` into free slots together and emit each one's first token."""
        st = self.state
        for req in reqs:
            req.slot, req.t_start = self.free_slots.pop(0), time.perf_counter()
            p, slot, n = req.params, req.slot, len(req.prompt_ids)
            seed = p.seed if p.seed is not None else (self.seed << 32) + int(req.request_id)
            st.keys[slot] = rng.key(seed, self.device)
            st.sampling.temperature[slot] = p.temperature
            st.sampling.top_k[slot] = p.top_k
            st.sampling.top_p[slot] = p.top_p
            st.history[slot, :n] = torch.tensor(req.prompt_ids, dtype=torch.int64, device=self.device)
        firsts = self._prefill(reqs)
        for req, first in zip(reqs, firsts):
            n = len(req.prompt_ids)
            st.kv.lens[req.slot] = n
            st.history[req.slot, n] = first
            self.running[req.slot] = req
            req.t_first = time.perf_counter()
            self._append(req, [first])
            if self.dump is not None and not req.finish_reason:
                req.finish_reason = "length"  # extract_hidden_states emits one token per request

    @torch.no_grad()
    def _prefill(self, reqs: list[Request]) -> list[int]:
        """Eager batched prefill, padded to a power-of-two length bucket; returns the first tokens.

        NOTE: prefill runs eagerly, like vLLM's FULL_DECODE_ONLY graph mode: its
        shapes vary with prompt lengths, and the decode graphs are what repeats.
        """
        lens = [len(r.prompt_ids) for r in reqs]
        t = min(_next_pow2(max(lens), MIN_PREFILL_BUCKET), self.t_max)
        tokens = torch.zeros(len(reqs), t, dtype=torch.int64, device=self.device)
        for i, r in enumerate(reqs):
            tokens[i, : lens[i]] = torch.tensor(r.prompt_ids, dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        zero = torch.zeros_like(slots)
        layers = self.proposer.hidden_layers if self.proposer else self.dump.layers if self.dump else ()
        logits, hiddens, _ = forward(self.model.cfg, self.model.params, self.state.kv, tokens, slots, zero, layers,
                                     KVRead(t))  # the prompts' positions are all below t
        if self.dump is not None:
            for i, r in enumerate(reqs):
                path = self.dump.save(r.request_id, tokens[i, :lens[i]], tuple(h[i, :lens[i]] for h in hiddens))
                r.extra["kv_transfer_params"] = {"hidden_states_path": path}
        if self.proposer is not None:
            for i, r in enumerate(reqs):
                pstate = self.proposer.prefill(self.params["draft"], self.state.proposer, tokens[i:i + 1], r.slot,
                                               lens[i], tuple(h[i:i + 1] for h in hiddens))
                self.state = replace(self.state, proposer=pstate)
        last = torch.tensor(lens, device=self.device) - 1  # [P]
        key = row_keys(self.state, slots, last)
        s = self.state.sampling
        first = sampling.sample(key, logits[torch.arange(len(reqs)), last], s.temperature[slots], s.top_k[slots],
                                s.top_p[slots], sampling.mode_for(r.params for r in reqs))
        return first.tolist()  # SYNC: prefill hands the first tokens to the host

    # ----------------------------------------------------------- stop rules
    def _append(self, req: Request, new: list[int]) -> None:
        """Append emitted tokens one by one, stopping at the first stop rule that fires."""
        p = req.params
        eos = () if p.ignore_eos else self.model.eos_token_ids
        for t in new:
            req.output_ids.append(t)
            n_out = len(req.output_ids)
            if n_out > p.min_tokens and (t in eos or t in (p.stop_token_ids or ())):
                req.finish_reason, req.stop_reason = "stop", (None if t in eos else t)
            elif p.stop and n_out > p.min_tokens and self._hit_stop_string(req):
                req.finish_reason = "stop"
            elif p.max_tokens is not None and n_out >= p.max_tokens:
                req.finish_reason = "length"
            elif req.total_len >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason:
                return

    def _hit_stop_string(self, req: Request) -> bool:
        text = self.model.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        for s in req.params.stop:
            i = text.find(s)
            if i >= 0:
                req.text, req.stop_reason = text[:i], s
                return True
        return False

    def _retire(self, req: Request) -> None:
        """Free ``req``'s slot, then move the highest running request into it (compaction)."""
        del self.running[req.slot]
        free = req.slot
        last = max(self.running, default=-1)
        if last > free:
            # NOTE: running requests always fill slots 0..n-1, so a batch of n rows is
            # a view of the first n slots and buckets follow the number of requests.
            moved = self.running.pop(last)
            move_slot(self.state, last, free)
            moved.slot, self.running[free] = free, moved
            free = last
        self.free_slots.append(free)
        self.free_slots.sort()
        req.t_end = time.perf_counter()
        if self.proposer is not None:
            self.proposer.on_finish(req)

    # ------------------------------------------------------------ the loop
    def _choose_k(self, active: int) -> int:
        """K for this step: the K table (or ``num_speculative_tokens``), or the confidence budget."""
        if self.dyn is not None:
            return self._dyn_k
        return self.spec.k_for_batch_size(active) if self.spec else 0

    def _observe_confidence(self, rows: int, conf: torch.Tensor, drafts: list[int], k: int) -> None:
        """Confidence-based verify length on the host: update the budget, then the next K bucket.

        NOTE: graphs have static K, so the bucket is the width rows may verify: the
        largest verify length used this step, one more when a row hit the cap, and
        never below the per-request budget. Rows verify their allocated prefix inside it.
        """
        self.dyn.observe(self._stats["steps"] - 1, conf[:rows])
        used = max(drafts[:rows], default=0)
        self._dyn_k = min(self.dyn.d, max(self.dyn.budget_k, used + (used == k)))

    @torch.no_grad()
    def _step(self) -> None:
        active = len(self.running)
        running = [self.running[slot] for slot in range(active)]  # they fill slots 0..n-1: row i is slot i
        b, k = self.plan.batch_bucket(active), self._choose_k(active)
        t = self.plan.context_bucket(max(r.total_len for r in running) + k + 1)
        drafts = self.proposer.host_drafts(running, b, k) if self.proposer and self.proposer.runs_on_host else None
        inputs = self._inputs(list(range(active)), b, k, drafts)
        graph = self._pick_graph(b, k, t, sampling.mode_for(r.params for r in running))
        t0 = time.perf_counter()
        out, self.state = graph(self.params, self.state, inputs)
        tokens, n, drafts, conf = readback(out)  # SYNC: the step's one device-to-host copy
        graph.stats.replay_ms.append((time.perf_counter() - t0) * 1e3)
        self._record(running, tokens, n, drafts, k, b)
        if self.dyn is not None and k > 0:
            self._observe_confidence(active, conf, drafts, k)

    def _record(self, rows: list[Request], tokens, n, drafts, k: int, b: int) -> None:
        self._stats["steps"] += 1
        self._buckets_used[f"B{b}_K{k}"] += 1
        for i, req in enumerate(rows):
            req.steps += 1
            self._stats["row_steps"] += 1
            self._stats["emitted"] += n[i]
            if k > 0:
                req.num_draft_tokens += drafts[i]
                req.num_accepted_tokens += n[i] - 1
                self._stats["spec_row_steps"] += 1
                for j in range(n[i] - 1):
                    self._accepted_per_pos[j] += 1
            before = len(req.output_ids)
            self._append(req, tokens[i][:n[i]])
            self._stats["tokens_generated"] += len(req.output_ids) - before
            if req.finish_reason:
                self._retire(req)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns vLLM-shaped outputs in prompt order.

        ``prompts``: a string, a list of strings, token-id lists or
        ``{"prompt_token_ids": [...]}`` dicts. ``sampling_params``: one
        :class:`SamplingParams` for all, or a list, one per prompt.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        # Validate everything before any request touches the engine's state.
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        waiting = collections.deque(requests)
        bar = tqdm(total=len(requests), disable=not use_tqdm, desc="requests")
        while waiting or self.running:
            admitted = [waiting.popleft() for _ in range(min(len(waiting), len(self.free_slots)))]
            if admitted:
                self._admit(admitted)
                for req in admitted:
                    if req.finish_reason:
                        self._retire(req)
            if self.running:
                self._step()
            bar.n = sum(r.finish_reason is not None for r in requests)
            bar.refresh()
        bar.close()
        return [self._output(r) for r in requests]

    def _output(self, req: Request) -> RequestOutput:
        tok = self.model.tokenizer
        text = req.text
        if text is None:
            text = tok.decode(req.output_ids, skip_special_tokens=True) if tok is not None else ""
        steps = max(req.steps, 1)
        metrics = {
            "num_draft_tokens": req.num_draft_tokens,
            "num_accepted_tokens": req.num_accepted_tokens,
            "acceptance_length": (req.num_accepted_tokens + req.steps) / steps,
            "steps": req.steps,
            "time_to_first_token_s": req.t_first - req.t_start,
            "e2e_s": req.t_end - req.t_start,
        }
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids,
                             [CompletionOutput(0, text, list(req.output_ids), req.finish_reason, req.stop_reason)],
                             metrics=metrics, kv_transfer_params=req.extra.get("kv_transfer_params"))

    # ----------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        """Zero the step, token and acceptance counters (e.g. after a warm-up); graphs are kept."""
        self._stats = collections.Counter()
        self._accepted_per_pos = [0] * len(self._accepted_per_pos)
        self._buckets_used = collections.Counter()

    @property
    def stats(self) -> dict:
        """Engine counters: steps, tokens, recompiles, per-bucket graph stats, acceptance.

        ``mean_acceptance_length`` (τ) is tokens emitted per row-step;
        ``per_position_acceptance[i]`` is the fraction of speculative row-steps
        whose first i+1 drafts were all accepted (unconditional, so it never rises with i).
        """
        s = self._stats
        graphs = {graph_name(key): g.stats.summary() for key, g in sorted(self.graphs.items())}
        spec_rows = s["spec_row_steps"]
        return {
            "backend": self.backend,
            "steps": s["steps"],
            "tokens_generated": s["tokens_generated"],
            "recompiles": sum(g["recompiles"] for g in graphs.values()),
            "graph_breaks": sum(g["graph_breaks"] for g in graphs.values()),
            "graphs": graphs,
            "capture_seconds": sum(g["capture_seconds"] for g in graphs.values()),
            "buckets_used": dict(self._buckets_used),
            "mean_acceptance_length": s["emitted"] / s["row_steps"] if s["row_steps"] else 0.0,
            "per_position_acceptance": [a / spec_rows if spec_rows else 0.0 for a in self._accepted_per_pos],
            "capture_sizes": self.plan.capture_sizes(),
        }
