"""``bench scale``'s phases: each ``phase(ctx, o, result)`` measures one thing and writes it under its name in
``result`` (``o``: the run's options, :data:`funcspec.bench.scale.options.DEFAULTS` keys); :func:`compare` then
sets every AR row against HF and the bandwidth bound."""

from __future__ import annotations

from tqdm import tqdm

from funcspec.bench.scale import hf, llamacpp, machine, measure
from funcspec.bench.scale.context import ScaleContext

ENGINELESS = ("bandwidth", "hf")
"""The phases that never build a funcspec engine (the model is loaded before any other)."""


def bandwidth_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    """The copy and read bandwidths, and the ms/token each bounds a decode step to (weights read once)."""
    bw = machine.copy_bandwidth(o["copy_mb"] or machine.default_copy_mb())
    bw["bound_ms_per_token"] = result["weight_bytes"] / (bw["gb_per_s"] * 1e9) * 1e3
    # NOTE: a copy also pays write-allocate traffic the count above ignores, so a decode
    # step can beat this bound; the read-only (sum) bound is the tighter one.
    bw["read_bound_ms_per_token"] = result["weight_bytes"] / (bw["read_gb_per_s"] * 1e9) * 1e3
    result["bandwidth"] = bw


def hf_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    """HF greedy on the main prompt: the tokens every later engine must reproduce."""
    ctx.hf = hf.hf_greedy(ctx.path, ctx.dtype, ctx.prompt, ctx.new_tokens, ctx.reps)
    result["hf"] = ctx.hf


def ar_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    """One AR row per backend (copies: :func:`compare` adds to them)."""
    result["ar"] = [dict(measure.ar_row(ctx, b)) for b in tqdm(o["backends"], desc="ar", leave=False)]


def sweep_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    """Synthetic acceptance for every (alpha, K) against the sweep backend's AR row, sorted by (alpha, K)."""
    backend = o["sweep_backend"]
    base = measure.ar_row(ctx, backend)
    rows = [r for k in tqdm(o["ks"], desc="sweep", leave=False)
            for r in measure.sweep_rows(ctx, backend, k, o["alphas"], base)]
    rows.sort(key=lambda r: (r["alpha"], r["k"]))
    result["sweep"] = {"backend": base["backend"], "ar_ms_per_token": base["ms_per_token"],
                       "ar_step_ms": base["step_ms"], "rows": rows}


def context_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    result["context"] = measure.context_rows(ctx, o["sweep_backend"], o["contexts"])


def batch_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    result["batch"] = measure.batch_rows(ctx, o["sweep_backend"], o["batches"])


def profile_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    result["profile"] = measure.profile_step(ctx, o["profile_steps"])


def llamacpp_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    result["llamacpp"] = llamacpp.llamacpp_phase(ctx)


def quant_phase(ctx: ScaleContext, o: dict, result: dict) -> None:
    from funcspec.bench import quant

    quant.phase(ctx.quant_keys(), o, result)  # NOTE: bench.quant still reads the context as a dict


PHASE_FNS = {"bandwidth": bandwidth_phase, "hf": hf_phase, "ar": ar_phase, "sweep": sweep_phase,
             "context": context_phase, "batch": batch_phase, "profile": profile_phase, "llamacpp": llamacpp_phase,
             "quant": quant_phase}
"""Every phase, in the order of ``--phases``' help; ``quant`` is not in the default phases."""


def compare(result: dict) -> None:
    """Per AR row: tokens equal HF's, first mismatch, % of the bandwidth bound, speedup over HF."""
    ref, bound = result.get("hf"), result.get("bandwidth", {}).get("bound_ms_per_token")
    for r in result.get("ar", []):
        r.update(hf.compare_tokens(r["tokens"], ref))
        r["pct_of_bound"] = 100 * bound / r["ms_per_token"] if bound else None
        r["speedup_vs_hf"] = ref["ms_per_token"] / r["ms_per_token"] if ref else None
    if "ar" in result and ref is not None:
        result["hf_match"] = all(r["tokens_equal_hf"] for r in result["ar"])
