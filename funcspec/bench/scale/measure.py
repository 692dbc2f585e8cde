"""``bench scale``'s funcspec measurements, each on engines of its own: AR decode, the synthetic-acceptance
sweep, the context and batch sweeps, and the eager step's op profile."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec.bench.scale.checkpoint import DTYPES, cache_bytes, make_prompts
from funcspec.bench.scale.context import ScaleContext
from funcspec.bench.timing import decode_ms, paired_ratios, step_ms, timed_generate


def engine(ctx: ScaleContext, backend: str, max_batch: int, max_len: int, spec: dict | None = None):
    """A greedy engine over the context's model, capturing each bucket on first use."""
    from funcspec import Engine

    return Engine(ctx.model, speculative_config=spec, backend=backend, max_num_seqs=max_batch,
                  max_model_len=max_len, dtype=DTYPES[ctx.dtype], compilation_config={"capture": "lazy"})


def ar_row(ctx: ScaleContext, backend: str) -> dict:
    """funcspec AR (K = 0, batch 1) on ``backend`` for the main prompt, measured once per backend."""
    if backend not in ctx.ar_rows:
        eng = engine(ctx, backend, 1, ctx.max_len)
        row = timed_generate(eng, [ctx.prompt], ctx.new_tokens, ctx.reps)
        ctx.ar_rows[backend] = {"backend": eng.backend, **row, "step_ms": step_ms(row, 1, 0),
                                "capture_s_cold": row["capture_s"].get("B1_K0")}
        ctx.ar_engines[backend] = eng  # warm: the llama.cpp phase times it again, paired
    return ctx.ar_rows[backend]


def sweep_rows(ctx: ScaleContext, backend: str, k: int, alphas: list[float], base: dict) -> list[dict]:
    """Synthetic acceptance at K for each alpha on ONE engine: τ, step cost ratio, achieved vs ideal speedup.

    The rates reach the captured graphs as a tensor (``Engine.set_synthetic_acceptance_rates``),
    so each K compiles once and every alpha reuses its graphs.
    """
    def rates(alpha):  # unconditional: P(first i+1 drafts accepted)
        return [alpha ** (i + 1) for i in range(k)]

    spec = {"method": "echo", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates(alphas[0])}
    eng = engine(ctx, backend, 1, ctx.max_len, spec)
    out = []
    for alpha in alphas:
        eng.set_synthetic_acceptance_rates(rates(alpha))
        row = timed_generate(eng, [ctx.prompt], ctx.new_tokens, ctx.reps)
        step_k = step_ms(row, 1, k)
        cost = step_k / base["step_ms"] if step_k and base["step_ms"] else None  # step cost K / step cost 0
        # NOTE: τ varies from run to run (the draws are random), so ms/token
        # and τ are both pooled over the same timed runs: a median run would
        # pair one run's speed with every run's τ.
        achieved = base["ms_per_token"] / row["ms_per_token_pooled"]
        ideal = row["tau"] / cost if cost else None
        out.append({"alpha": alpha, "k": k, "rates": rates(alpha), "tau": row["tau"],
                    "expected_tau": 1 + sum(rates(alpha)), "ms_per_token": row["ms_per_token_pooled"],
                    "step_ms": step_k, "step_cost_ratio": cost, "achieved_speedup": achieved, "ideal_speedup": ideal,
                    "achieved_over_ideal": achieved / ideal if ideal else None, "steps": row["steps"],
                    "capture_s_cold": row["capture_s"].get(f"B1_K{k}")})
    return out


def context_rows(ctx: ScaleContext, backend: str, contexts: list[int]) -> dict:
    """AR ms/token per prompt length on ONE engine sized for the largest (constant capacity).

    Two passes, ascending (with warm-up) then descending (graphs already
    captured): a machine whose speed drifts over the sweep biases the two in
    opposite directions, so their mean is what each row reports, with its
    ratio to the shortest prompt's. With two lengths or more, the longest and
    the shortest also run alternately (:func:`paired_ratios`): the median of
    the pairs' ratio is the one that holds when the machine is shared.
    """
    n = ctx.new_tokens
    max_len = max(contexts) + n + 64
    eng = engine(ctx, backend, 1, max_len)
    passes = collections.defaultdict(list)  # context -> one timed_generate result per pass
    order = [(c, True) for c in contexts] + [(c, False) for c in reversed(contexts)]
    prompts = {c: make_prompts(ctx.shape, 1, c, ctx.seed + c) for c in contexts}  # one prompt each
    for c, warm in tqdm(order, desc="context", leave=False):
        passes[c].append(timed_generate(eng, prompts[c], n, ctx.reps, warm=warm))
    rows: list[dict[str, Any]] = []
    for c in contexts:
        ms = [r["ms_per_token"] for r in passes[c]]
        steps = [s for s in (step_ms(r, 1, 0) for r in passes[c]) if s is not None]
        rows.append({"context": c, "ms_per_token": statistics.fmean(ms), "ms_per_token_passes": ms,
                     "prefill_s": statistics.fmean(r["prefill_s"] for r in passes[c]),
                     "step_ms": statistics.fmean(steps) if steps else None})
    for row in rows:
        row["vs_shortest"] = row["ms_per_token"] / rows[0]["ms_per_token"]
    r = passes[contexts[-1]][-1]
    per_token = cache_bytes_per_token(eng)
    out = {"backend": eng.backend, "max_model_len": max_len, "kv_bytes_per_slot": per_token * eng.t_max,
           "cache_bytes_per_token": per_token, "cache_bytes_from_config": cache_bytes(ctx.path, ctx.dtype),
           "rows": rows, "graphs_capture_s": r["capture_s_graphs"]}  # every graph the engine captured, by name
    short, long_ = min(contexts), max(contexts)
    if long_ > short:
        p = paired_ratios(decode_ms(eng, prompts[long_], n), decode_ms(eng, prompts[short], n), max(ctx.reps, 3))
        out["paired"] = {**p, "context": long_, "shortest": short}  # ratio: ms/token at long_ over at short
    return out


def cache_bytes_per_token(eng) -> int:
    """Bytes the engine's target cache holds per position of one slot, measured on its state: every declared
    per-slot tensor of the cache ([..., slots, ..., T, ...]), whatever the model keeps there (K and V, or a
    latent), over its slots and ``t_max`` positions; the per-slot lengths left out."""
    from funcspec.pytree import slot_leaves

    leaves = [(x, axis) for x, axis in slot_leaves(eng.state.kv) if x.dim() > 1]
    return sum(x.numel() * x.element_size() // x.shape[axis] for x, axis in leaves) // eng.t_max


def batch_rows(ctx: ScaleContext, backend: str, batches: list[int]) -> dict:
    """AR tokens/s per batch size: B same-length prompts on one engine with max(batches) slots.

    With batch 1 and a larger one, also the largest batch's tokens/s over batch 1's from
    :func:`paired_ratios` (alternating runs on the warm engine), the ratio this VM's drift leaves alone.
    """
    n = ctx.new_tokens
    eng = engine(ctx, backend, max(batches), ctx.max_len)
    rows, prompts = [], {}
    for b in tqdm(batches, desc="batch", leave=False):
        prompts[b] = make_prompts(ctx.shape, b, ctx.prompt_tokens, ctx.seed + 1000 + b)  # B prompts of P tokens
        r = timed_generate(eng, prompts[b], n, ctx.reps)
        step = r["replay_ms"].get(f"B{eng.plan.bucket_plan.batch_bucket(b)}_K0")
        rows.append({"batch": b, "tokens_per_s": b * 1e3 / r["ms_per_token"],
                     "ms_per_token": r["ms_per_token"], "step_ms": step})
    out = {"backend": eng.backend, "rows": rows}
    top = max(batches)
    if 1 in batches and top > 1:
        p = paired_ratios(decode_ms(eng, prompts[1], n), decode_ms(eng, prompts[top], n), max(ctx.reps, 3))
        out["paired"] = {**p, "batch": top, "tokens_per_s_ratio": top * p["ratio"]}  # B x (ms at 1 / ms at B)
    return out


def profile_step(ctx: ScaleContext, steps: int, top: int = 12) -> dict:
    """Top ``top`` ops by self CPU time of ``steps`` eager AR decode steps (batch 1), per step.

    NOTE: drives the engine's ``add_request`` / ``step`` loop, and admits the
    request before profiling, so the profile holds decode steps only, no prefill.
    """
    from torch.profiler import ProfilerActivity, profile

    from funcspec import SamplingParams

    eng = engine(ctx, "eager", 1, ctx.max_len)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    eng.generate([ctx.prompt], sp)  # warm-up
    eng.add_request(ctx.prompt, sp)
    eng.step()  # admission (prefill) and the first decode step
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    wall = (time.perf_counter() - t0) / steps
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0  # us
    rows = [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": e.self_cpu_time_total / steps / 1e3,
             "pct": 100 * e.self_cpu_time_total / total} for e in ops[:top]]
    return {"steps": steps, "wall_ms_per_step_profiled": wall * 1e3, "self_cpu_ms_per_step": total / steps / 1e3,
            "ops": rows}
