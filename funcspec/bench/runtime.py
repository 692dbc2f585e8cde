"""``funcspec bench runtime``: start-up, compile stalls and the fixed cost of a step, in one run.

For each model (the zoo target with the zoo's EAGLE-3 head, and a random
~300 MB Llama of ``bench scale``'s ``llama-600m`` shape, autoregressive), a
child process is started twice on one fresh inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``): the first is a cold start (empty caches), the
second a warm one. Each child

1. builds ``LLM(model, speculative_config)`` with the default start-up
   capture and records how long that took and which graphs it compiled;
2. runs a fixed mixed workload twice (4 greedy prompts, one sampled request
   with top-p, two with plain temperature, 3 long prompts), recording each
   run's wall time and the compiles it caused: a compile stall shows as a first
   run much slower than the second;
3. drives ``Engine.step`` by hand at batch 1 and 8 (greedy) and splits each
   decode step's wall time into the graph (``Runner.step``: replay plus the one
   read-back) and the host loop around it (admission, bucket choice, stop rules);
4. (AR only) times the batch-1 captured step against the weight-streaming bound
   (weight bytes over measured copy bandwidth) and HF ``generate`` on the same
   prompt (same tokens required).

Results go to ``graphs/results/<device>/runtime-<time>.json`` and ``.md``,
with the CPU and its ISA flags.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from funcspec.bench.capture import write_result

WORKLOAD_PROMPTS = ["def parse(x):\n    ", "import os\nclass A:\n", "for i in range(10):\n", "x = [1, 2, 3]\n"]
LONG_PROMPT = "def f(a, b):\n    return a + b\n" * 40


def workload(llm, max_tokens: int) -> None:
    """The mixed workload: batch 4 greedy, one top-p request, two plain-temperature ones, 3 long prompts."""
    from funcspec import SamplingParams

    eng = llm.engine
    short = [{"prompt_token_ids": _ids(eng.model.tokenizer, p, eng.model.cfg.vocab_size)} for p in WORKLOAD_PROMPTS]
    long = {"prompt_token_ids": _ids(eng.model.tokenizer, LONG_PROMPT, eng.model.cfg.vocab_size)}
    g = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(short, g)
    llm.generate(short[:1], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens // 3, seed=1,
                                           ignore_eos=True))
    llm.generate(short[:2], SamplingParams(temperature=0.8, max_tokens=max_tokens // 5, seed=2, ignore_eos=True))
    llm.generate([long] * 3, g)


def _ids(tokenizer, prompt, vocab: int) -> list[int]:
    """Token ids of ``prompt``: the model's tokenizer, or bytes folded into the vocabulary (random models)."""
    if tokenizer is not None:
        return tokenizer.encode(prompt)
    return [3 + b % (vocab - 3) for b in prompt.encode()]


def host_split(engine, prompt_ids: list[int], batch: int, steps: int) -> dict:
    """Median wall ms of a decode step, of its graph (replay + read-back) and of the host work around it."""
    from funcspec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": prompt_ids}, sp)
    walls, graphs, replays = [], [], engine.runner.replay_ms
    while engine.has_unfinished_requests():
        admitting = bool(engine.scheduler.waiting)
        before, t0 = {key: v.total for key, v in replays.items()}, time.perf_counter()
        engine.step()
        wall = (time.perf_counter() - t0) * 1e3
        ran = [v[-1] for key, v in replays.items() if v.total > before.get(key, 0)]  # the bucket this step ran
        if not admitting and len(ran) == 1:  # a pure decode step (no prefill in it)
            walls.append(wall)
            graphs.append(ran[0])
    step, graph = statistics.median(walls), statistics.median(graphs)
    host = statistics.median(w - g for w, g in zip(walls, graphs))
    return {"batch": batch, "steps": len(walls), "step_ms": step, "graph_ms": graph, "host_ms": host,
            "host_fraction": host / step}


def child(model: str, spec: str | None, dtype: str, max_tokens: int, threads: int) -> dict:
    """One process's measurements (see the module docstring); run by :func:`run` in a subprocess."""
    import torch

    from funcspec import LLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model=model, speculative_config=json.loads(spec) if spec else None, dtype=dtype)
    out = {"startup_s": time.perf_counter() - t0, "capture_s": llm.engine.startup_seconds,
           "graphs": {k: round(g["capture_seconds"], 2) for k, g in llm.engine.stats["graphs"].items()}}
    runs = []
    for _ in range(2):
        compiled, t0 = llm.engine.stats["graphs"], time.perf_counter()
        workload(llm, max_tokens)
        st = llm.engine.stats
        runs.append({"seconds": time.perf_counter() - t0, "new_graphs": len(st["graphs"]) - len(compiled),
                     "recompiles": st["recompiles"]})
    out["workload"] = runs
    out["first_over_second"] = runs[0]["seconds"] / runs[1]["seconds"]
    eng = llm.engine
    ids = _ids(eng.model.tokenizer, WORKLOAD_PROMPTS[0], eng.model.cfg.vocab_size)
    out["host"] = [host_split(eng, ids, b, 64) for b in (1, min(8, eng.num_slots))]
    if spec is None:
        out["ar"] = ar_vs_bounds(eng, model, dtype, ids, out["host"][0])
    out["compiles_after_startup"] = sum(r["new_graphs"] for r in runs)
    return out


def ar_vs_bounds(eng, model: str, dtype: str, ids: list[int], batch1: dict, n: int = 64) -> dict:
    """The batch-1 AR step against the weight-streaming bound, and funcspec AR against HF ``generate``."""
    from funcspec import SamplingParams
    from funcspec.bench import scale

    bw = scale.copy_bandwidth()
    _, streamed = scale.weight_bytes(Path(model), dtype)
    bound_ms = streamed / (bw["gb_per_s"] * 1e9) * 1e3
    hf = scale.hf_greedy(Path(model), dtype, ids, n)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ours = eng.generate([ids], sp)[0]
    decode_ms = (ours.metrics["e2e_s"] - ours.metrics["time_to_first_token_s"]) / (n - 1) * 1e3
    return {"copy_gb_per_s": bw["gb_per_s"], "streamed_bytes": streamed, "bound_ms": bound_ms,
            "graph_over_bound": batch1["graph_ms"] / bound_ms, "hf_ms_per_token": hf["ms_per_token"],
            "ms_per_token": decode_ms, "vs_hf": hf["ms_per_token"] / decode_ms,
            "same_tokens_as_hf": hf["tokens"] == list(ours.outputs[0].token_ids)}


def _spawn(args: list[str], cache: str, threads: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "funcspec.bench.runtime", *args], env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench runtime child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def models(names: list[str], cache_dir=None) -> list[tuple[str, str, str | None, str]]:
    """(name, checkpoint, speculative_config JSON or None, dtype) for each of ``names``."""
    from funcspec import zoo
    from funcspec.bench import scale

    out = []
    for name in names:
        if name == "zoo":
            spec = json.dumps(zoo.speculative_config("eagle3", 4))
            out += [("zoo-eagle3", str(zoo.model_path("target")), spec, "float32"),
                    ("zoo-ar", str(zoo.model_path("target")), None, "float32")]
        elif name in scale.SHAPES:
            out.append((f"{name}-ar", str(scale.build_checkpoint(name, "bfloat16", cache_dir)), None, "bfloat16"))
        else:
            raise ValueError(f"--models: {name!r} is neither 'zoo' nor a bench scale shape {sorted(scale.SHAPES)}")
    return out


def run(args) -> Path:
    """``funcspec bench runtime``: cold and warm children per model; writes JSON and markdown."""
    from funcspec.bench.scale import machine_info

    rows = []
    for name, path, spec, dtype in models(args.models.split(","), args.cache_dir):
        cache = tempfile.mkdtemp(prefix="funcspec-inductor-")
        child_args = ["--child", path, "--dtype", dtype, "--max-tokens", str(args.max_tokens),
                      "--threads", str(args.threads)] + (["--spec", spec] if spec else [])
        cold = _spawn(child_args, cache, args.threads)
        warm = _spawn(child_args, cache, args.threads)
        rows.append({"model": name, "path": path, "speculative_config": spec, "dtype": dtype,
                     "cold": cold, "warm": warm})
        print(f"{name}: cold start {cold['startup_s']:.1f}s, warm {warm['startup_s']:.1f}s; workload first/second "
              f"{warm['first_over_second']:.2f}x", flush=True)
    result = {"bench": "runtime", "time": time.strftime("%Y%m%d-%H%M%S"), "machine": machine_info(),
              "threads": args.threads, "max_tokens": args.max_tokens, "rows": rows}
    path = write_result(result, args.out, markdown)
    print(f"wrote {path} and .md")
    return path


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# funcspec bench runtime", "",
             f"Threads {result['threads']}; workload: 4 greedy prompts x {result['max_tokens']} tokens, one top-p "
             f"request, two plain-temperature ones, 3 prompts of {len(LONG_PROMPT)} characters. Cold: an empty "
             f"inductor cache; warm: the same cache again, in a new process.", "",
             "| model | start-up cold s (graphs) | start-up warm s | workload 1st / 2nd run s (cold) | "
             "compiles after start-up | host ms/step b1 (of step) | host ms/step b8 (of step) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, w = r["cold"], r["warm"]
        h1, h8 = w["host"][0], w["host"][-1]
        lines.append(f"| {r['model']} | {c['startup_s']:.1f} ({len(c['graphs'])}) | {w['startup_s']:.1f} | "
                     f"{c['workload'][0]['seconds']:.2f} / {c['workload'][1]['seconds']:.2f} "
                     f"({c['first_over_second']:.2f}x) | {c['compiles_after_startup']} | "
                     f"{h1['host_ms']:.3f} of {h1['step_ms']:.2f} ({h1['host_fraction']:.0%}) | "
                     f"{h8['host_ms']:.3f} of {h8['step_ms']:.2f} ({h8['host_fraction']:.0%}) |")
    ar = [r for r in result["rows"] if "ar" in r["warm"]]
    if ar:
        lines += ["", "| model (AR, batch 1) | graph ms/step | bound ms (copy GB/s) | graph / bound | "
                      "funcspec ms/token | HF ms/token | vs HF | same tokens |", "|---|---|---|---|---|---|---|---|"]
        for r in ar:
            a, h = r["warm"]["ar"], r["warm"]["host"][0]
            lines.append(f"| {r['model']} | {h['graph_ms']:.2f} | {a['bound_ms']:.2f} ({a['copy_gb_per_s']:.1f}) | "
                         f"{a['graph_over_bound']:.2f}x | {a['ms_per_token']:.2f} | {a['hf_ms_per_token']:.2f} | "
                         f"{a['vs_hf']:.2f}x | {a['same_tokens_as_hf']} |")
    lines += ["", "## Machine", "", f"- CPU: {m['cpu']} ({m['cores']} logical cores)", "- ISA: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items()), f"- torch {m['torch']}, CPU capability {m['cpu_capability']}", ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    p = kinds.add_parser("runtime", help="start-up (cold, warm), compile stalls and host cost per step")
    p.add_argument("--models", default="zoo,llama-600m", help="comma-separated: zoo and/or bench scale shapes")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens per greedy request of the workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=None, help="where bench scale's random checkpoints are built")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":  # the child process of run()
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--child", required=True)
    ap.add_argument("--spec", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(json.dumps(child(a.child, a.spec, a.dtype, a.max_tokens, a.threads)))
