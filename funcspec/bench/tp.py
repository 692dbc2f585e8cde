"""``funcspec bench tp``: what tensor parallelism costs per decode step, TP = 1 against TP = 2, in one run.

For each method (autoregressive, and the zoo's drafter) and each TP size, an
``LLM`` with ``tensor_parallel_size`` generates the same greedy batch twice (a
warm-up, which also captures, then the timed run), and the result records:

- the median step ms of rank 0 (its wall time includes waiting in the
  all-reduces for the other ranks);
- the bytes all-reduced per step: two all-reduces per target layer (after
  ``o_proj`` and ``down_proj``), each of the step's ``[B, K+1, H]`` residual
  stream; a ring all-reduce sends ``2 (n-1)/n`` of that from every rank;
- whether TP = 2 emitted TP = 1's tokens.

NOTE: on a 2-core CPU this shows correctness and cost, not speed: two ranks
share two cores (one thread each), and gloo's all-reduce goes through the
loopback TCP stack. The win that TP exists for (half the weight bytes streamed
per rank, on devices with their own memory bandwidth) cannot show here.
Results go to ``graphs/results/<device>/tp-<time>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from funcspec.bench.capture import RESULTS, device_name
from funcspec.bench.scale import machine_info
from funcspec.bench.timing import new_replays


def allreduce_bytes(cfg, rows: int, itemsize: int, size: int) -> dict:
    """Bytes all-reduced by one target forward over ``rows`` = B·(K+1) tokens at TP ``size``.

    ``payload``: the tensors reduced (2 per layer, ``rows × H`` each);
    ``ring_sent_per_rank``: what each rank sends with a ring all-reduce, ``2 (n-1)/n · payload``.
    """
    if size == 1:
        return {"payload": 0, "ring_sent_per_rank": 0}
    payload = 2 * cfg.num_layers * rows * cfg.hidden_size * itemsize
    return {"payload": payload, "ring_sent_per_rank": int(2 * (size - 1) / size * payload)}


def run_one(model: str, spec, tp: int, backend: str, prompts, max_tokens: int, batch: int) -> dict:
    """One (method, TP) row: warm up, reset the counters, time one greedy batch on rank 0."""
    from funcspec import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, speculative_config=spec, backend=backend, max_num_seqs=batch,
              compilation_config={"capture": "lazy"})  # greedy only: the warm-up captures what it uses
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up: captures every bucket the timed run uses
        llm.engine.reset_stats()
        before = llm.engine.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        st = llm.engine.stats()
        replays = new_replays(before, st)  # per bucket: the timed run's steps
        cfg = llm.engine.model.cfg  # this rank's shard: hidden size and layers are whole
        k = spec["num_speculative_tokens"] if spec else 0
        itemsize = torch.empty(0, dtype=llm.engine.model.params["model"]["norm"]["weight"].dtype).element_size()
        ran_most = max(replays.values(), key=len, default=None)  # the bucket that ran most
        return {
            "method": spec["method"] if spec else "ar", "tp": tp, "k": k, "batch": batch,
            "step_ms_median": statistics.median(ran_most) if ran_most else None, "steps": st["steps"],
            "tokens_per_s": st["tokens_generated"] / wall, "mean_acceptance_length": st["mean_acceptance_length"],
            "recompiles": st["recompiles"], "graph_breaks": st["graph_breaks"],
            "allreduce_bytes_per_step": allreduce_bytes(cfg, batch * (k + 1), itemsize, tp),
            "tokens": [o.outputs[0].token_ids for o in outs],
        }
    finally:
        llm.close()


def run(args) -> Path:
    """``funcspec bench tp``: TP = 1 and 2 for AR and the zoo's drafter; writes JSON and markdown."""
    from funcspec import zoo

    torch.set_num_threads(args.threads)  # NOTE: spawned ranks take the same count
    model = args.model or str(zoo.model_path("target"))
    specs: list[dict | None] = [None]
    if args.method != "none":
        specs.append(zoo.speculative_config(args.method, args.k))
    prompts = [[5 + (7 * i + j) % 200 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    rows = []
    for spec in specs:
        for tp in (1, 2):
            rows.append(run_one(model, spec, tp, args.backend, prompts, args.max_tokens, args.batch))
            print(f"{rows[-1]['method']} tp={tp}: {rows[-1]['step_ms_median']:.2f} ms/step")
    for row in rows:
        ref = next(r for r in rows if r["method"] == row["method"] and r["tp"] == 1)
        row["tokens_match_tp1"] = row["tokens"] == ref["tokens"]
    result = {"bench": "tp", "model": model, "backend": args.backend, "device": "cpu", "threads_per_rank": args.threads,
              "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "machine": machine_info(),
              "note": "2 ranks share this machine's cores: correctness and cost, not speed", "rows": rows}
    out = Path(args.out) if args.out else RESULTS / device_name("cpu")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tp-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    Path(f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json and .md")
    return stem


def markdown(r: dict) -> str:
    """The result as a markdown report: the table, the cost model and the machine."""
    m = r["machine"]
    lines = [f"# funcspec bench tp: {Path(r['model']).name} ({r['backend']})\n",
             "Two ranks share this machine's cores (one thread each) and reduce over gloo on loopback TCP: "
             "this run shows correctness and cost, not speed.\n",
             "| method | TP | K | batch | step ms (median) | tokens/s | τ | all-reduced bytes/step | "
             "sent bytes/rank/step (ring) | recompiles | graph breaks | tokens == TP 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        ar = x["allreduce_bytes_per_step"]
        lines.append(f"| {x['method']} | {x['tp']} | {x['k']} | {x['batch']} | {x['step_ms_median']:.2f} | "
                     f"{x['tokens_per_s']:.1f} | {x['mean_acceptance_length']:.2f} | {ar['payload']} | "
                     f"{ar['ring_sent_per_rank']} | {x['recompiles']} | {x['graph_breaks']} | "
                     f"{'yes' if x['tokens_match_tp1'] else 'NO'} |")
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    lines += ["", "All-reduced bytes per step: 2 all-reduces per target layer of the [B, K+1, H] residual stream "
              "(the drafter is replicated and reduces nothing).", "",
              "## Machine\n",
              f"- CPU: {m['cpu']} ({m['cores']} logical cores), threads per rank: {r['threads_per_rank']}",
              f"- ISA: {flags}", f"- torch {m['torch']}, CPU capability {m['cpu_capability']}", ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    """Register ``funcspec bench tp`` and its options."""
    p = kinds.add_parser("tp", help="tensor parallelism: step ms and all-reduced bytes, TP = 1 vs 2")
    p.add_argument("--model", default=None, help="target checkpoint (default: the zoo target)")
    p.add_argument("--method", default="eagle3", help="zoo drafter besides AR, or 'none' (default %(default)s)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the drafter (default %(default)s)")
    p.add_argument("--backend", default="inductor", help="capture backend (default %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="prompts in the batch (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default %(default)s)")
    p.add_argument("--out", default=None, help="results directory (default graphs/results/<device>)")
    p.set_defaults(func=run)
