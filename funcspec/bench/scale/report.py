"""``bench scale``'s report: the result as markdown (decode table, sweeps, op breakdown, machine), and the
JSON, markdown and PNG files of a run."""

from __future__ import annotations

import json
import time
from pathlib import Path

from funcspec.bench.scale.machine import kernel_line


def _f(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def markdown(result: dict) -> str:
    """The result as markdown: decode table, sweep, context, batch, op breakdown, machine."""
    r = result
    out = [f"# funcspec bench scale: {r['shape']} ({r['dtype']})\n",
           f"{r['params'] / 1e6:.1f}M params, {r['weight_bytes'] / 2**20:.0f} MiB of weights; prompt "
           f"{r['prompt_tokens']} tokens, {r['new_tokens']} new tokens, greedy, batch 1; decode only "
           "(prefill excluded). Random weights (checkpoint `{}`).\n".format(r["checkpoint"])]
    from funcspec.bench.quant import markdown as quant_markdown

    out += _md_decode(r) + quant_markdown(r) + _md_sweep(r) + _md_context(r) + _md_batch(r) + _md_profile(r) \
        + _md_machine(r)
    return "\n".join(out) + "\n"


def _md_decode(r: dict) -> list[str]:
    lines = ["## Decode ms/token\n", "| engine | backend | ms/token | tokens/s | % of bound | vs HF | = HF greedy "
             "| step ms (replay) | cold capture s |", "|---|---|---|---|---|---|---|---|---|"]
    bw = r.get("bandwidth")
    if bw:
        lines.append(f"| bound: weights / copy bandwidth ({bw['gb_per_s']:.1f} GB/s, read + write) | - | "
                     f"{bw['bound_ms_per_token']:.2f} | {1e3 / bw['bound_ms_per_token']:.1f} | 100% | - | - | - | - |")
        lines.append(f"| bound: weights / read bandwidth ({bw['read_gb_per_s']:.1f} GB/s, sum) | - | "
                     f"{bw['read_bound_ms_per_token']:.2f} | {1e3 / bw['read_bound_ms_per_token']:.1f} | "
                     f"{100 * bw['bound_ms_per_token'] / bw['read_bound_ms_per_token']:.0f}% | - | - | - | - |")
    if r.get("hf"):
        h = r["hf"]
        lines.append(f"| HF generate | eager | {h['ms_per_token']:.2f} | {1e3 / h['ms_per_token']:.1f} | "
                     f"{_pct(bw, h)} | 1.00x | - | - | - |")
    for a in r.get("ar", []):
        eq = "-" if a["tokens_equal_hf"] is None else ("yes" if a["tokens_equal_hf"] else
                                                       f"no (first at {a['first_mismatch_hf']})")
        lines.append(f"| funcspec AR | {a['backend']} | {a['ms_per_token']:.2f} | {1e3 / a['ms_per_token']:.1f} | "
                     f"{_pct(bw, a)} | {_times(a['speedup_vs_hf'])} | {eq} | {_f(a['step_ms'])} | "
                     f"{_f(a['capture_s_cold'])} |")
    lc = r.get("llamacpp")
    if lc and lc.get("status") == "ran":
        eq = "-" if lc["tokens_equal_hf"] is None else ("yes" if lc["tokens_equal_hf"] else "no")
        vs = r["hf"]["ms_per_token"] / lc["ms_per_token"] if r.get("hf") else None
        lines.append(f"| llama.cpp | {lc['threads']} threads | {lc['ms_per_token']:.2f} | "
                     f"{1e3 / lc['ms_per_token']:.1f} | {_pct(bw, lc)} | {_times(vs)} | {eq} | - | - |")
    if lc:
        ratio = f"funcspec AR (best backend) / llama.cpp ms/token = {_f(lc.get('funcspec_over_llamacpp'))}"
        lines.append(f"\nllama.cpp: {lc.get('note') or ratio}")
        if lc.get("repacked") is False:
            lines.append("\nllama.cpp ran on its plain weight buffers: its repacked ones crashed the process on "
                         "this machine (timing.llamacpp_repacks).")
        for backend, p in lc.get("paired", {}).items():
            lines.append(f"\nPaired ({p['rounds']} alternating runs, median of the pair ratios): funcspec AR "
                         f"{backend} / llama.cpp ms/token = {p['ratio']:.2f} (funcspec "
                         f"{', '.join(f'{x:.1f}' for x in p['ours_ms'])}; llama.cpp "
                         f"{', '.join(f'{x:.1f}' for x in p['theirs_ms'])})")
    return lines + [""]


def _times(x) -> str:
    """A ratio as ``2.10x``, or ``-`` where the run has none (no ``hf`` phase)."""
    return _f(x, none="-") + ("x" if x is not None else "")


def _pct(bw, row) -> str:
    return f"{100 * bw['bound_ms_per_token'] / row['ms_per_token']:.0f}%" if bw else "-"


def _md_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown section: ``title``, then a table of ``rows`` under ``header``."""
    return [title, "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _md_sweep(r: dict) -> list[str]:
    s = r.get("sweep")
    if not s:
        return []
    title = (f"## Synthetic-acceptance sweep ({s['backend']}, echo proposer, one engine per K)\n\n"
             f"AR: {s['ar_ms_per_token']:.2f} ms/token, step {_f(s['ar_step_ms'])} ms. Ideal speedup = "
             "τ / (step cost K / step cost 0).\n")
    header = ["alpha", "K", "τ", "expected τ", "ms/token", "step ms", "cost K/0", "achieved", "ideal",
              "achieved/ideal", "cold capture s"]
    rows = [[str(x["alpha"]), str(x["k"]), f"{x['tau']:.2f}", f"{x['expected_tau']:.2f}", f"{x['ms_per_token']:.2f}",
             _f(x["step_ms"]), _f(x["step_cost_ratio"]), f"{x['achieved_speedup']:.2f}x",
             f"{_f(x['ideal_speedup'])}x", _f(x["achieved_over_ideal"]), _f(x["capture_s_cold"])] for x in s["rows"]]
    return _md_table(title, header, rows)


def _md_context(r: dict) -> list[str]:
    c = r.get("context")
    if not c:
        return []
    title = (f"## Context sweep ({c['backend']}, one engine, max_model_len {c['max_model_len']}: "
             f"{c['kv_bytes_per_slot'] / 2**20:.0f} MiB KV per slot)\n{_md_cache(c)}")
    first = c["rows"][0]["context"]
    rows = [[str(x["context"]), f"{x['ms_per_token']:.2f}",
             " / ".join(f"{v:.2f}" for v in x.get("ms_per_token_passes", [])) or "-",
             f"{_f(x.get('vs_shortest'))}x", _f(x["step_ms"]), f"{x['prefill_s']:.3f}"] for x in c["rows"]]
    out = _md_table(title, ["prompt tokens", "ms/token (mean of passes)", "ascending / descending pass",
                            f"vs {first}", "step ms", "prefill s"], rows)
    if p := c.get("paired"):
        out.append(f"\nPaired ({p['rounds']} alternating runs, median of the pair ratios): decode at {p['context']} "
                   f"tokens of context is **{p['ratio']:.2f}x** decode at {p['shortest']} (ms/token "
                   f"{', '.join(f'{x:.1f}' for x in p['ours_ms'])} against "
                   f"{', '.join(f'{x:.1f}' for x in p['theirs_ms'])}).\n")
    return out


def _md_cache(c: dict) -> str:
    """The cache's bytes per token, measured, and for a latent cache the K/V it stands for."""
    per_token, cfg = c.get("cache_bytes_per_token"), c.get("cache_bytes_from_config") or {}
    if per_token is None:
        return ""
    line = f"\nCache: {per_token} bytes per token of context (measured on the engine's state)"
    if "latent" in cfg:
        line += (f"; the latent is {cfg['latent']} bytes per token, the K/V it expands to {cfg['kv']} "
                 f"({cfg['kv'] / cfg['latent']:.1f}x)")
    return line + ".\n"


def _md_batch(r: dict) -> list[str]:
    b = r.get("batch")
    if not b:
        return []
    rows = [[str(x["batch"]), f"{x['tokens_per_s']:.1f}", f"{x['ms_per_token']:.2f}", _f(x["step_ms"])]
            for x in b["rows"]]
    out = _md_table(f"## Batch sweep ({b['backend']})\n", ["batch", "tokens/s", "ms/token per row", "step ms"], rows)
    if p := b.get("paired"):
        out.append(f"\nPaired ({p['rounds']} alternating runs of batch 1 and batch {p['batch']}, median of the pair "
                   f"ratios): batch {p['batch']} gives **{p['tokens_per_s_ratio']:.2f}x** the tokens/s of batch 1.\n")
    return out


def _md_profile(r: dict) -> list[str]:
    p = r.get("profile") or {"ops": []}
    rows = [[f"`{x['op']}`", f"{x['calls_per_step']:.0f}", f"{x['ms_per_step']:.3f}", f"{x['pct']:.1f}%"]
            for x in p["ops"]]
    if not rows:
        return []
    return _md_table(f"## Eager AR decode step: top ops by self CPU time ({p['steps']} steps profiled, "
                     f"{p['self_cpu_ms_per_step']:.2f} ms self CPU / step, {p['wall_ms_per_step_profiled']:.2f} ms "
                     "wall)\n", ["op", "calls/step", "ms/step", "%"], rows)


def _md_machine(r: dict) -> list[str]:
    m = r["machine"]
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    llc = f", last-level cache {m['llc_mib']} MiB" if m.get("llc_mib") else ""
    return ["## Machine\n", f"- CPU: {m['cpu']} ({m['cores']} logical cores{llc}), torch threads: {m['threads']}",
            f"- ISA: {flags}", f"- torch {m['torch']}, CPU capability {m['cpu_capability']}",
            *[line for line in (kernel_line(m),) if line], *_md_load(m), ""]


def _md_load(m: dict) -> list[str]:
    """The load average at the run's start and end (1 / 5 / 15 minutes), where the run recorded it."""
    if "load_average" not in m:
        return []
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731 (a local one-liner)
    end = f", at its end {fmt(m['load_average_end'])}" if "load_average_end" in m else ""
    return [f"- load average (1 / 5 / 15 min) at the run's start {fmt(m['load_average'])}{end}"]



def write(result: dict, out_dir: Path) -> Path:
    """``scale-<shape>-<dtype>-<time>.json``, ``.md`` and ``.png`` in ``out_dir``; prints the markdown and
    returns the files' common stem."""
    from funcspec.bench.scale.plot import plot

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"scale-{result['shape']}-{result['dtype']}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    Path(f"{stem}.md").write_text(markdown(result))
    plot(result, Path(f"{stem}.png"))
    print(markdown(result))
    print(f"wrote {stem}.json, .md and .png")
    return stem
