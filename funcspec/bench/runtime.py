"""``funcspec bench runtime``: start-up, compile stalls and the fixed cost of a step, in one run.

For each model (the zoo target with the zoo's EAGLE-3 head, and a random
~300 MB Llama of ``bench scale``'s ``llama-600m`` shape, autoregressive), a
child process is started twice on one fresh inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``): the first is a cold start (empty caches), the
second a warm one. Each child

1. builds ``LLM(model, speculative_config)`` with the default start-up
   capture and records how long that took, which graphs it compiled, and how
   many of them its start-up helper processes compiled;
2. runs a fixed mixed workload twice (4 greedy prompts, one sampled request
   with top-p, two with plain temperature, 3 long prompts), recording each
   run's wall time and the compiles it caused: a compile stall shows as a first
   run much slower than the second;
3. drives ``Engine.step`` by hand at batch 1 and 8 (greedy) and splits each
   decode step's wall time into the graph (``Runner.step``: replay plus the one
   read-back) and the host loop around it (admission, bucket choice, stop rules);
4. (AR only) times the batch-1 captured step against the weight-streaming bound
   (weight bytes over measured copy bandwidth) and HF ``generate`` on the same
   prompt (same tokens required), each the median of :data:`AR_REPS` runs.

``--replicas N`` also starts N children cold at the same moment on one
empty cache (start-up only), as replicas or notebook kernels do: one compiles
each graph, the others wait for its lock and load it (``loaded_graphs``).

``--contention`` then measures ``make run``'s decode (the zoo target with its
EAGLE-3 head, K = 4, its three prompts, greedy) on a quiet machine and beside
``--busy`` processes that spin on the cores, for each OpenMP setting of
:data:`CONTENTION_SETTINGS` (``--contention all``) or funcspec's default
against libgomp's (``--contention defaults``): ``--rounds`` child processes per
setting (OpenMP reads its settings when torch loads it), the settings
alternated, each timing ``--rate-pairs`` quiet and busy runs in turn, with the
share of the CPUs that other work used during each run, since a shared
machine adds noise.

Results go to ``graphs/results/<device>/runtime-<time>.json`` and ``.md``,
with the CPU and its ISA flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from funcspec.bench.capture import write_result
from funcspec.bench.timing import new_replays
from funcspec.bench.scale.machine import kernel_line

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
    walls, graphs = [], []
    while engine.has_unfinished_requests():
        before = engine.stats()
        t0 = time.perf_counter()
        engine.step()
        wall = (time.perf_counter() - t0) * 1e3
        ran = [times[-1] for times in new_replays(before, engine.stats()).values()]  # the bucket this step ran
        if not before["waiting"] and len(ran) == 1:  # a pure decode step (no prefill in it)
            walls.append(wall)
            graphs.append(ran[0])
    step, graph = statistics.median(walls), statistics.median(graphs)
    host = statistics.median(w - g for w, g in zip(walls, graphs))
    return {"batch": batch, "steps": len(walls), "step_ms": step, "graph_ms": graph, "host_ms": host,
            "host_fraction": host / step}


def child(model: str, spec: str | None, dtype: str, max_tokens: int, threads: int, startup_only: bool = False) -> dict:
    """One process's measurements (see the module docstring); run by :func:`run` in a subprocess.
    ``startup_only``: step 1 alone (a replica of ``--replicas``)."""
    import torch

    from funcspec import LLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model=model, speculative_config=json.loads(spec) if spec else None, dtype=dtype)
    graphs = llm.engine.stats()["graphs"]
    out: dict = {"startup_s": time.perf_counter() - t0, "capture_s": llm.engine.startup_seconds,
                 "graphs": {k: round(g["capture_seconds"], 2) for k, g in graphs.items()},
                 "helper_graphs": sum(g["helper"] is not None for g in graphs.values()),
                 "loaded_graphs": sum(g["loaded"] and g["helper"] is None for g in graphs.values())}
    if startup_only:
        return out
    runs = []
    for _ in range(2):
        compiled, t0 = llm.engine.stats()["graphs"], time.perf_counter()
        workload(llm, max_tokens)
        st = llm.engine.stats()
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


AR_REPS = 5
"""Runs of funcspec's and HF's AR decode behind each median: one short run follows a shared VM's moment."""


def ar_vs_bounds(eng, model: str, dtype: str, ids: list[int], batch1: dict, n: int = 64) -> dict:
    """The batch-1 AR step against the weight-streaming bound, and funcspec AR against HF ``generate`` (medians
    of :data:`AR_REPS` runs each)."""
    from funcspec import SamplingParams
    from funcspec.bench import scale

    bw = scale.copy_bandwidth()
    _, streamed = scale.weight_bytes(Path(model), dtype)
    bound_ms = streamed / (bw["gb_per_s"] * 1e9) * 1e3
    hf = scale.hf_greedy(Path(model), dtype, ids, n, reps=AR_REPS)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    runs = [eng.generate([ids], sp)[0] for _ in range(AR_REPS)]
    ours = runs[0]
    decode_ms = statistics.median((r.metrics["e2e_s"] - r.metrics["time_to_first_token_s"]) / (n - 1) * 1e3
                                  for r in runs)
    return {"copy_gb_per_s": bw["gb_per_s"], "streamed_bytes": streamed, "bound_ms": bound_ms,
            "graph_over_bound": batch1["graph_ms"] / bound_ms, "hf_ms_per_token": hf["ms_per_token"],
            "ms_per_token": decode_ms, "vs_hf": hf["ms_per_token"] / decode_ms,
            "same_tokens_as_hf": hf["tokens"] == list(ours.outputs[0].token_ids)}


OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
"""The OpenMP settings a contention child runs with (each measured setting names its own, the rest unset)."""

CONTENTION_SETTINGS = {
    "funcspec": {},  # nothing set: funcspec's own default, GOMP_SPINCOUNT=30000 (funcspec/__init__.py)
    "libgomp": {"GOMP_SPINCOUNT": "300000"},  # libgomp's default: spin ~3 ms at a barrier, then sleep
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-100k": {"GOMP_SPINCOUNT": "100000"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "spin-1k": {"GOMP_SPINCOUNT": "1000"},
    "1-thread": {"OMP_NUM_THREADS": "1"},
}
"""The OpenMP settings ``--contention all`` compares: name -> the variables a child starts with."""


def decode_rate(max_tokens: int, pairs: int, busy: int) -> dict:
    """``make run``'s decode in this process, timed ``pairs`` times quiet and beside ``busy`` spinning processes
    (after one warm-up run; the order alternates pair by pair): tokens/s of each run and the load average."""
    import torch

    from funcspec import Engine, SamplingParams, zoo

    eng = Engine(str(zoo.model_path("target")), speculative_config=zoo.speculative_config("eagle3", 4),
                 backend="auto", max_num_seqs=len(zoo.RUN_PROMPTS))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.generate(zoo.RUN_PROMPTS, sp)
    runs: dict[str, list] = {"quiet": [], "busy": [], "others": []}

    def rate(spinning: int) -> None:
        before = _cpu_seconds()
        with busy_processes(spinning):
            t0 = time.perf_counter()
            outs = eng.generate(zoo.RUN_PROMPTS, sp)
            wall = time.perf_counter() - t0
        runs["busy" if spinning else "quiet"].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        runs["others"].append(_others_share(before, _cpu_seconds()))

    for i in range(pairs):
        for spinning in ((0, busy) if i % 2 == 0 else (busy, 0)):
            rate(spinning)
    return {**runs, "threads": torch.get_num_threads(), "omp": {k: os.environ.get(k) for k in OMP_VARS}}


def _cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, the machine's busy CPU seconds, this process's and its reaped children's CPU seconds)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system


def _others_share(before: tuple, after: tuple) -> float:
    """The share of the machine's CPUs that other work (not this process nor its spinners) used in between: the
    noise a shared machine adds to a measurement."""
    wall, busy, ours = (a - b for a, b in zip(after, before))
    return max(busy - ours, 0.0) / (wall * os.cpu_count())


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes that spin on the CPU (other work sharing the cores) while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2 if n else 0)  # NOTE: started, not still importing
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def contention(settings: dict, busy: int, rounds: int, max_tokens: int, pairs: int) -> list[dict]:
    """Each setting's decode rate quiet and beside ``busy`` spinning processes: ``rounds`` child processes per
    setting, the settings alternated, each timing ``pairs`` quiet/busy pairs."""
    runs: dict = {name: [] for name in settings}
    for r in range(rounds):
        for name, env in settings.items():
            # NOTE: a graph compiled for 2 threads is filed under the same key as one for 1 thread, and a loaded
            # one refuses the other count: a thread setting keeps its own compile cache
            cache = str(Path(tempfile.gettempdir()) / f"funcspec-bench-{name}") if "OMP_NUM_THREADS" in env else None
            child = _spawn(["--rate", str(max_tokens), "--pairs", str(pairs), "--busy", str(busy)], cache, None, env)
            runs[name].append(child)
            print(f"round {r + 1}/{rounds} {name}: quiet {statistics.median(child['quiet']):.0f} tokens/s, busy "
                  f"{statistics.median(child['busy']):.0f}", flush=True)
    return [_contention_row(name, settings[name], runs[name]) for name in settings]


def _contention_row(name: str, env: dict, children: list[dict]) -> dict:
    """Medians over every run of a setting: quiet and busy tokens/s, and the slowdown of each quiet/busy pair."""
    quiet = [q for c in children for q in c["quiet"]]
    busy = [b for c in children for b in c["busy"]]
    slow = [q / b for q, b in zip(quiet, busy)]
    return {"setting": name, "env": env, "quiet_tokens_per_s": statistics.median(quiet),
            "busy_tokens_per_s": statistics.median(busy), "slowdown": statistics.median(slow),
            "slowdown_range": [min(slow), max(slow)], "quiet_range": [min(quiet), max(quiet)],
            "busy_range": [min(busy), max(busy)],
            "others_median": statistics.median(o for c in children for o in c["others"]), "children": children}


def _spawn(args: list[str], cache: str | None, threads: int | None, omp: dict | None = None) -> dict:
    """Run this module's child with ``args``; ``omp``: the OpenMP variables it starts with (others unset)."""
    return _spawn_all([args], cache, threads, omp)[0]


CHILD_TIMEOUT_S = 3600.0
"""A child still running after this long is stopped, and the bench fails saying which: a hung start-up (a lock
never released, a compile that never ends) must not hang the run."""


def _spawn_all(many: list[list[str]], cache: str | None, threads: int | None, omp: dict | None = None,
               timeout: float = CHILD_TIMEOUT_S) -> list[dict]:
    """Run one child per argument list of ``many``, all at once (as :func:`_spawn` each); their results in order."""
    env = dict(os.environ)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if omp is not None:
        env = {k: v for k, v in env.items() if k not in OMP_VARS} | omp
    procs = [subprocess.Popen([sys.executable, "-m", "funcspec.bench.runtime", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in many]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p, args in zip(procs, many):
            try:
                outs.append(p.communicate(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"bench runtime child {' '.join(args)} still running after {timeout:.0f} s; "
                                   "stopped") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"bench runtime child failed ({p.returncode}):\n{err[-4000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


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

    rows: list[dict] = []
    for name, path, spec, dtype in models([m for m in args.models.split(",") if m], args.cache_dir):
        cache = tempfile.mkdtemp(prefix="funcspec-inductor-")
        child_args = ["--child", path, "--dtype", dtype, "--max-tokens", str(args.max_tokens),
                      "--threads", str(args.threads)] + (["--spec", spec] if spec else [])
        cold = _spawn(child_args, cache, args.threads)
        warm = _spawn(child_args, cache, args.threads)
        rows.append({"model": name, "path": path, "speculative_config": spec, "dtype": dtype,
                     "cold": cold, "warm": warm})
        print(f"{name}: cold start {cold['startup_s']:.1f}s, warm {warm['startup_s']:.1f}s; workload first/second "
              f"{warm['first_over_second']:.2f}x", flush=True)
        if args.replicas > 1:  # N processes start cold at once on one empty store
            replicas = _spawn_all([child_args + ["--startup-only"]] * args.replicas,
                                  tempfile.mkdtemp(prefix="funcspec-inductor-"), args.threads)
            rows[-1]["replicas"] = replicas
            ready = ", ".join(f"{r['startup_s']:.1f}" for r in replicas)
            print(f"{name}: {args.replicas} cold starts at once: ready in {ready} s", flush=True)
    machine = machine_info()
    print(kernel_line(machine)[2:], flush=True)  # what ran, before any figure
    result = {"bench": "runtime", "time": time.strftime("%Y%m%d-%H%M%S"), "machine": machine,
              "threads": args.threads, "max_tokens": args.max_tokens, "rows": rows}
    if args.contention != "none":
        names = list(CONTENTION_SETTINGS) if args.contention == "all" else ["funcspec", "libgomp"]
        busy = args.busy if args.busy is not None else (os.cpu_count() or 1)
        result["contention"] = {"busy": busy, "rounds": args.rounds, "max_tokens": args.rate_tokens,
                                "pairs": args.rate_pairs,
                                "rows": contention({n: CONTENTION_SETTINGS[n] for n in names}, busy, args.rounds,
                                                   args.rate_tokens, args.rate_pairs)}
    written = write_result(result, args.out, markdown)
    print(f"wrote {written} and .md")
    return written


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# funcspec bench runtime"]
    if result["rows"]:
        lines += ["", f"Threads {result['threads']}; workload: 4 greedy prompts x {result['max_tokens']} tokens, one "
                  f"top-p request, two plain-temperature ones, 3 prompts of {len(LONG_PROMPT)} characters. Cold: an "
                  f"empty inductor cache; warm: the same cache again, in a new process.", "",
                  "| model | start-up cold s (graphs) | start-up warm s | workload 1st / 2nd run s (cold) | "
                  "compiles after start-up | host ms/step b1 (of step) | host ms/step b8 (of step) |",
                  "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, w = r["cold"], r["warm"]
        h1, h8 = w["host"][0], w["host"][-1]
        helped = f", {c['helper_graphs']} by helper processes" if c.get("helper_graphs") else ""
        lines.append(f"| {r['model']} | {c['startup_s']:.1f} ({len(c['graphs'])}{helped}) | {w['startup_s']:.1f} | "
                     f"{c['workload'][0]['seconds']:.2f} / {c['workload'][1]['seconds']:.2f} "
                     f"({c['first_over_second']:.2f}x) | {c['compiles_after_startup']} | "
                     f"{h1['host_ms']:.3f} of {h1['step_ms']:.2f} ({h1['host_fraction']:.0%}) | "
                     f"{h8['host_ms']:.3f} of {h8['step_ms']:.2f} ({h8['host_fraction']:.0%}) |")
    replicas = [r for r in result["rows"] if "replicas" in r]
    if replicas:
        lines += ["", f"{len(replicas[0]['replicas'])} processes started cold at the same moment on one empty "
                      f"inductor cache (replicas, notebook kernels): each one's start-up, and how many of its graphs "
                      f"it loaded from the store, filed by another process while it waited for that graph's lock.",
                  "", "| model | one cold start s | each of the processes s (graphs loaded of graphs) |",
                  "|---|---|---|"]
        for r in replicas:
            each = "; ".join(f"{c['startup_s']:.1f} ({c['loaded_graphs']} of {len(c['graphs'])})"
                             for c in r["replicas"])
            lines.append(f"| {r['model']} | {r['cold']['startup_s']:.1f} | {each} |")
    ar = [r for r in result["rows"] if "ar" in r["warm"]]
    if ar:
        lines += ["", f"AR ms/token: medians of {AR_REPS} decodes of 64 tokens each, funcspec's and HF's.", "",
                  "| model (AR, batch 1) | graph ms/step | bound ms (copy GB/s) | graph / bound | "
                      "funcspec ms/token | HF ms/token | vs HF | same tokens |", "|---|---|---|---|---|---|---|---|"]
        for r in ar:
            a, h = r["warm"]["ar"], r["warm"]["host"][0]
            lines.append(f"| {r['model']} | {h['graph_ms']:.2f} | {a['bound_ms']:.2f} ({a['copy_gb_per_s']:.1f}) | "
                         f"{a['graph_over_bound']:.2f}x | {a['ms_per_token']:.2f} | {a['hf_ms_per_token']:.2f} | "
                         f"{a['vs_hf']:.2f}x | {a['same_tokens_as_hf']} |")
    if "contention" in result:
        c = result["contention"]
        lines += ["", f"## Contention: `make run`'s decode (zoo target, EAGLE-3 K=4, 3 prompts x {c['max_tokens']} "
                      f"tokens, greedy), quiet and beside {c['busy']} spinning processes", "",
                  f"Medians over {c['rounds']} processes per setting (settings alternated), each timing "
                  f"{c['pairs']} quiet/busy pairs of one generate, after a warm-up; the slowdown is each pair's "
                  f"quiet over busy. The machine is shared: the share of its CPUs that other work used during each "
                  f"run is in the JSON (`others`), its median in the last column.", "",
                  "| setting | environment | quiet tokens/s (range) | busy tokens/s (range) | slowdown (range) | "
                  "others' CPU share |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            env = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "(funcspec's defaults)"
            lines.append(f"| {r['setting']} | {env} | {r['quiet_tokens_per_s']:.0f} ({r['quiet_range'][0]:.0f}-"
                         f"{r['quiet_range'][1]:.0f}) | {r['busy_tokens_per_s']:.0f} ({r['busy_range'][0]:.0f}-"
                         f"{r['busy_range'][1]:.0f}) | {r['slowdown']:.1f}x "
                         f"({r['slowdown_range'][0]:.1f}-{r['slowdown_range'][1]:.1f}) | {r['others_median']:.0%} |")
    isa = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    lines += ["", "## Machine", "", f"- CPU: {m['cpu']} ({m['cores']} logical cores)", "- ISA: " + isa,
              f"- torch {m['torch']}, CPU capability {m['cpu_capability']}",
              *[line for line in (kernel_line(m),) if line], ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    p = kinds.add_parser("runtime", help="start-up (cold, warm), compile stalls and host cost per step")
    p.add_argument("--models", default="zoo,llama-600m", help="comma-separated: zoo and/or bench scale shapes")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens per greedy request of the workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=None, help="where bench scale's random checkpoints are built")
    p.add_argument("--contention", choices=("none", "defaults", "all"), default="defaults",
                   help="make run's decode quiet and beside --busy spinning processes: funcspec's OpenMP defaults "
                        "against libgomp's, every setting of CONTENTION_SETTINGS, or none")
    p.add_argument("--busy", type=int, default=None, help="spinning processes (default: one per core)")
    p.add_argument("--rounds", type=int, default=3, help="contention processes per setting (settings alternated)")
    p.add_argument("--rate-tokens", type=int, default=128, help="tokens per prompt of a contention run")
    p.add_argument("--rate-pairs", type=int, default=3, help="quiet/busy pairs each contention process times")
    p.add_argument("--replicas", type=int, default=1,
                   help="also start this many processes cold at once on one empty inductor cache (1: none)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":  # the child process of run()
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--rate", type=int, default=None, help="decode_rate's max_tokens")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--spec", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--startup-only", action="store_true")
    a = ap.parse_args()
    out = decode_rate(a.rate, a.pairs, a.busy) if a.rate is not None else child(a.child, a.spec, a.dtype,
                                                                                a.max_tokens, a.threads,
                                                                                a.startup_only)
    print(json.dumps(out))
