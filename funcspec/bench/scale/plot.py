"""``bench scale``'s figure: four panels (decode, synthetic-acceptance sweep, context, batch)."""

from __future__ import annotations

from pathlib import Path

def plot(result: dict, path: Path) -> None:
    """Four panels: decode ms/token (bound, HF, funcspec, llama.cpp); sweep achieved vs ideal speedup;
    context ms/token; batch tokens/s. Phases not run leave their panel with a note."""
    from matplotlib.figure import Figure  # NOTE: not pyplot: leaves a notebook's backend alone

    fig = Figure(figsize=(13, 9))
    ax = fig.subplots(2, 2)
    _plot_decode(ax[0, 0], result)
    _plot_sweep(ax[0, 1], result.get("sweep"))
    _plot_line(ax[1, 0], result.get("context"), "context", "ms_per_token", "prompt tokens", "decode ms/token")
    _plot_line(ax[1, 1], result.get("batch"), "batch", "tokens_per_s", "batch size", "tokens/s")
    fig.suptitle(f"funcspec bench scale: {result['shape']} ({result['dtype']}), "
                 f"{result['params'] / 1e6:.1f}M params, {result['machine']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_decode(a, r: dict) -> None:
    bars = []  # (name, ms/token)
    if r.get("bandwidth"):
        bars.append(("bound (copy bandwidth)", r["bandwidth"]["bound_ms_per_token"]))
        bars.append(("bound (read bandwidth)", r["bandwidth"]["read_bound_ms_per_token"]))
    if r.get("hf"):
        bars.append(("HF generate", r["hf"]["ms_per_token"]))
    bars += [(f"funcspec {x['backend']}", x["ms_per_token"]) for x in r.get("ar", [])]
    if (r.get("llamacpp") or {}).get("status") == "ran":
        bars.append(("llama.cpp", r["llamacpp"]["ms_per_token"]))
    if not bars:
        a.text(0.5, 0.5, "decode phases not run", ha="center", transform=a.transAxes)
        return
    a.barh([b[0] for b in bars], [b[1] for b in bars])
    a.set(xlabel="decode ms/token (lower is better)", title="batch 1 decode")


def _plot_sweep(a, s: dict | None) -> None:
    if not s:
        a.text(0.5, 0.5, "sweep not run", ha="center", transform=a.transAxes)
        return
    for i, alpha in enumerate(sorted({x["alpha"] for x in s["rows"]})):
        rows = sorted((x for x in s["rows"] if x["alpha"] == alpha), key=lambda x: x["k"])
        ks = [x["k"] for x in rows]
        a.plot(ks, [x["achieved_speedup"] for x in rows], "o-", color=f"C{i}", label=f"α={alpha} achieved")
        a.plot(ks, [x["ideal_speedup"] or float("nan") for x in rows], "x--", color=f"C{i}", label=f"α={alpha} ideal")
    a.axhline(1.0, color="k", lw=0.5)
    a.set(xlabel="K", ylabel="speedup over AR", title=f"synthetic acceptance ({s['backend']})")
    a.legend(fontsize=7, ncol=2)


def _plot_line(a, block: dict | None, xkey: str, ykey: str, xlabel: str, ylabel: str) -> None:
    if not block:
        a.text(0.5, 0.5, f"{xkey} sweep not run", ha="center", transform=a.transAxes)
        return
    rows = block["rows"]
    a.plot([x[xkey] for x in rows], [x[ykey] for x in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xticks([x[xkey] for x in rows], [str(x[xkey]) for x in rows])
    a.set_ylim(bottom=0)
    a.set(xlabel=xlabel, ylabel=ylabel, title=f"{xkey} sweep ({block['backend']})")
