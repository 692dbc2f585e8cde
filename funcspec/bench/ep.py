"""``funcspec bench ep-comm``: which collective brings decode-sized tokens to their experts, on gloo.

Expert parallelism splits a MoE layer's experts over the ranks. With
tensor-parallel attention every rank already holds every token of the step
(attention's all-reduce replicates the residual stream), so two exchanges can
finish the layer:

- **all-reduce of partial outputs**: each rank runs its own experts on the
  tokens routed to them and the ranks sum their ``[T, H]`` partials (the
  row-parallel pattern of a dense ``down_proj``);
- **all-to-all dispatch and combine**: each rank sends every other rank the
  rows routed to that rank's experts and gets their results back. With static
  shapes the send buffer holds the worst case, ``T·top_k`` rows per peer.

Two ranks (spawned, gloo on loopback, one thread each) time both for T
tokens of H features, alternating the two in every round so that the machine's
load falls on both alike. Results go to ``graphs/results/cpu/ep-comm-<time>.json``
and ``.md``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from funcspec.bench.capture import write_result
from funcspec.bench.scale.machine import machine_info


def _all_reduce(x: torch.Tensor, top_k: int, size: int) -> None:
    """Sum the [T, H] partial outputs over the ranks."""
    dist.all_reduce(x)


def _all_to_all(x: torch.Tensor, top_k: int, size: int) -> None:
    """Dispatch T·top_k rows to every peer (static worst case) and combine their results back."""
    rows = x.shape[0] * top_k
    send = x.new_empty(size * rows, x.shape[1])  # [N·T·k, H]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # dispatch
    dist.all_to_all_single(send, recv)  # combine


PATTERNS = {"all_reduce": _all_reduce, "all_to_all": _all_to_all}


def _rank(rank: int, size: int, port: int, cases: list, rounds: int, out) -> None:
    """One rank: time every (T, H, dtype) case's patterns, alternated, ``rounds`` times each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        rows = []
        for t, h, top_k, dtype in cases:
            x = torch.randn(t, h).to(getattr(torch, dtype))
            times: dict[str, list[float]] = {name: [] for name in PATTERNS}
            for i in range(rounds + 3):  # the first 3 rounds warm the connections
                order = list(PATTERNS) if i % 2 == 0 else list(PATTERNS)[::-1]
                for name in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    PATTERNS[name](x, top_k, size)
                    if i >= 3:
                        times[name].append((time.perf_counter() - t0) * 1e6)
            rows.append({"tokens": t, "hidden": h, "top_k": top_k, "dtype": dtype,
                         **{f"{n}_us": statistics.median(v) for n, v in times.items()}})
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def measure(tokens, hidden: int, top_k: int, dtypes, rounds: int, size: int = 2) -> list[dict]:
    """Median microseconds of each pattern per case, on ``size`` spawned gloo ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [(t, hidden, top_k, d) for d in dtypes for t in tokens]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, port, cases, rounds, out)) for r in range(size)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    return rows


def run(args) -> None:
    """``funcspec bench ep-comm``: both patterns at decode sizes; writes JSON and markdown."""
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = measure(tokens, args.hidden, args.top_k, args.dtypes.split(","), args.rounds)
    for r in rows:
        r["all_to_all_over_all_reduce"] = r["all_to_all_us"] / r["all_reduce_us"]
    result = {"bench": "ep-comm", "time": time.strftime("%Y%m%d-%H%M%S"), "ranks": 2, "backend": "gloo",
              "rounds": args.rounds, "machine": machine_info(), "rows": rows}
    path = write_result(result, args.out, markdown)
    print(markdown(result))
    print(f"wrote {path} and its .md")


def markdown(r: dict) -> str:
    """The result as a markdown table, with the machine."""
    m = r["machine"]
    lines = ["# funcspec bench ep-comm: all-reduce of partial outputs against all-to-all dispatch and combine\n",
             f"{r['ranks']} ranks on {r['backend']} (loopback, one thread each), medians of {r['rounds']} "
             "alternated rounds. all-to-all sends the static worst case, T·top_k rows per peer, both ways.\n",
             "| T | H | top_k | dtype | all-reduce us | all-to-all us | all-to-all / all-reduce |",
             "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']} | {x['hidden']} | {x['top_k']} | {x['dtype']} | {x['all_reduce_us']:.0f} | "
                     f"{x['all_to_all_us']:.0f} | {x['all_to_all_over_all_reduce']:.2f} |")
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    lines += ["", "## Machine\n", f"- CPU: {m['cpu']} ({m['cores']} logical cores)", f"- ISA: {flags}",
              f"- torch {m['torch']}, CPU capability {m['cpu_capability']}", ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    """Register ``funcspec bench ep-comm`` and its options."""
    p = kinds.add_parser("ep-comm", help="expert parallelism: all-reduce vs all-to-all at decode sizes (gloo)")
    p.add_argument("--tokens", default="1,2,4,5,9,16,40", help="tokens per step, comma-separated")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="dtypes, comma-separated")
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per case (default %(default)s)")
    p.add_argument("--out", default=None, help="results directory (default graphs/results/cpu)")
    p.set_defaults(func=run)
