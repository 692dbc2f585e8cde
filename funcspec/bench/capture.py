"""``funcspec bench capture``: capture seconds, replay vs eager latency and recompiles per (B, K) bucket.

With a token tree (``tree``: its ``speculative_config`` keys) the buckets are
(B, N): K is the node count N the step drafts, the tree cut to N nodes, as an
engine with a per-batch-size N table runs it. ``funcspec tune-k --tree`` reads them.

Eager and captured steps run side by side in one process on the same state:
every timed call first resets the rows' lengths, so each repetition decodes
the same positions. Results go to ``graphs/results/<device>/capture-<time>.json``
with a PNG plot beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import shutil
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[2] / "graphs" / "results"


def write_result(result: dict, out, render) -> Path:
    """File ``result`` as ``<bench>-<time>.json`` and its ``render(result)`` markdown beside it, under ``out``
    (default: ``graphs/results/cpu``); returns the JSON path."""
    out_dir = Path(out) if out else RESULTS / device_name("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['bench']}-{result['time']}.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(render(result))
    return path


def device_name(device: str) -> str:
    """A directory name for the device: ``cpu``, or the GPU / NPU model."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev).lower().replace(" ", "-")
    return dev.type


def best_cpu_backend() -> str:
    """inductor or eager, whichever the newest committed CPU capture benchmark found faster.

    A report for people and tests: ``backend="auto"`` does not read it (see
    :data:`funcspec.capture.backends.AUTO_BACKENDS`), so it works installed.
    """
    files = sorted((RESULTS / "cpu").glob("capture-*.json"))
    if not files:
        return "inductor"
    rows = json.loads(files[-1].read_text())["buckets"]
    speedup = statistics.median(r["eager_ms"] / r["replay_ms"] for r in rows)
    return "inductor" if speedup > 1.0 else "eager"


def _time_calls(fn, args, reset, reps: int) -> float:
    """Median wall ms of ``fn(*args)`` over ``reps`` calls, each after ``reset()``."""
    times = []
    for _ in range(reps):
        reset()
        t0 = time.perf_counter()
        out, _ = fn(*args)
        out.num_emitted.cpu()  # the step's one sync, as the engine does
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tree_size(method: str, tree: dict) -> int:
    """N, the node count of the token tree that ``tree`` (speculative_config keys) describes."""
    from funcspec.config import SpecConfig

    spec = SpecConfig.from_vllm({"method": method, "model": "-", **tree}, check_paths=False)
    return spec.num_speculative_tokens  # type: ignore[union-attr]  # a method given: a config


def _engine(model: str, batches, ks, method: str, device: str, prompt_len: int, head: str | None = None,
            tree: dict | None = None):
    from funcspec import Engine, SamplingParams
    from funcspec.zoo import speculative_config

    # NOTE: a tree's num_speculative_tokens is its whole node count; each bucket cuts it to its K = N.
    k = tree_size(method, tree) if tree else max(ks)
    spec = None if max(ks) == 0 else speculative_config(method, k, head, **(tree or {}))
    eng = Engine(model, speculative_config=spec, backend="eager", max_num_seqs=max(batches),
                 max_model_len=prompt_len + 64, device=device)
    g = torch.Generator().manual_seed(0)
    vocab = eng.model.cfg.vocab_size
    for _ in range(max(batches)):
        eng.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=None))  # up to the context: never done here
    eng.step()  # admits (prefills) every request, then decodes one token
    return eng


def run(model: str, batches=(1, 2, 4, 8), ks=(0, 1, 3, 5), backend: str = "inductor", method: str = "ngram",
        device: str = "cpu", reps: int = 20, prompt_len: int = 64, warm: bool = True, out_dir=None,
        head: str | None = None, tree: dict | None = None) -> dict:
    """Benchmark every (B, K) bucket; returns (and writes) the result dict.

    K > 0 buckets draft with ``method`` (``head``: its checkpoint, for neural
    methods); with ``tree`` (token-tree keys, e.g. ``{"speculative_token_tree":
    "[(0,), (1,)]"}``) K is a node count N <= the tree's size. Compiles go to a
    fresh inductor cache, so "cold" means cold; the caller's
    ``TORCHINDUCTOR_CACHE_DIR`` is restored afterwards.
    """
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cache_dir = tempfile.mkdtemp(prefix="funcspec-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        return _run(model, batches, ks, backend, method, device, reps, prompt_len, warm, out_dir, head, tree)
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        shutil.rmtree(cache_dir, ignore_errors=True)


def _run(model, batches, ks, backend, method, device, reps, prompt_len, warm, out_dir, head, tree) -> dict:
    from funcspec.capture import capture

    eng = _engine(model, batches, ks, method, device, prompt_len, head, tree)
    saved = eng.state.kv.lens.clone()

    def reset():
        eng.state.kv.lens.copy_(saved)

    rows = []
    for b in batches:
        for k in ks:
            live = eng.bucket(b, k, live=b)  # b running rows
            fn, args = live.fn, live.args
            eager_ms = _time_calls(fn, args, reset, reps)
            example = eng.bucket(b, k).args  # scratch rows only: capture touches no request
            cap = capture(fn, example, backend, name=f"bench_b{b}_k{k}")
            row = {"B": b, "K": k, "tokens": b * (k + 1), "capture_s_cold": cap.stats.capture_seconds}
            replay_ms = _time_calls(cap, args, reset, reps)
            if warm and backend != "eager":
                torch._dynamo.reset()
                row["capture_s_warm"] = capture(fn, example, backend, name=f"bench_b{b}_k{k}").stats.capture_seconds
            row.update(eager_ms=eager_ms, replay_ms=replay_ms, replay_over_eager=replay_ms / eager_ms,
                       recompiles=cap.stats.recompiles, graph_breaks=cap.stats.graph_breaks,
                       graph_memory_bytes=cap.stats.graph_memory_bytes)
            rows.append(row)
            warm_s = f" / {row['capture_s_warm']:.2f}s warm" if "capture_s_warm" in row else ""
            print(f"B={b} K={k}: capture {row['capture_s_cold']:.2f}s cold{warm_s}, "
                  f"eager {eager_ms:.2f} ms, replay {replay_ms:.2f} ms ({eager_ms / replay_ms:.2f}x)")
    result = {"model": str(model), "backend": backend, "method": method, "head": head, "tree": tree or None,
              "device": device_name(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": reps,
              "prompt_len": prompt_len, "buckets": rows}
    _write(result, Path(out_dir) if out_dir else RESULTS / device_name(device))
    return result


def _write(result: dict, out_dir: Path) -> None:
    from matplotlib.figure import Figure  # NOTE: not pyplot: leaves a notebook's backend alone

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"capture-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    rows = result["buckets"]
    labels = [f"B{r['B']}K{r['K']}" for r in rows]
    x = range(len(rows))
    fig = Figure(figsize=(12, 4))
    a1, a2 = fig.subplots(1, 2)
    a1.bar(x, [r["capture_s_cold"] for r in rows], label="cold")
    if all("capture_s_warm" in r for r in rows):
        a1.bar(x, [r["capture_s_warm"] for r in rows], label="warm cache", alpha=0.7)
    a1.set(title=f"capture seconds ({result['backend']})", xticks=list(x))
    a1.set_xticklabels(labels, rotation=90)
    a1.legend()
    a2.plot(x, [r["eager_ms"] for r in rows], "o-", label="eager")
    a2.plot(x, [r["replay_ms"] for r in rows], "s-", label=result["backend"])
    a2.set(title="step latency (ms, median)", xticks=list(x))
    a2.set_xticklabels(labels, rotation=90)
    a2.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    print(f"wrote {stem}.json and {stem}.png")


def add_parser(kinds) -> None:
    """Register ``funcspec bench capture`` and its options."""
    p = kinds.add_parser("capture", help="per-bucket capture cost and replay vs eager")
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--k", default="0,1,3,5")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--method", default="ngram", help="proposer used for K > 0 buckets")
    p.add_argument("--head", default=None, help="checkpoint of a neural --method")
    p.add_argument("--tree", default=None, metavar="JSON",
                   help="token-tree keys of --method, e.g. '{\"speculative_token_tree\": \"[(0,), (1,), (0, 0)]\"}'; "
                        "--k are then node counts N")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--no-warm", action="store_true", help="skip the warm-cache recapture")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")

    def go(a):
        if a.threads:
            torch.set_num_threads(a.threads)
        run(a.model, [int(x) for x in a.batch.split(",")], [int(x) for x in a.k.split(",")], a.backend,
            a.method, a.device, a.reps, a.prompt_len, not a.no_warm, a.out_dir, a.head,
            json.loads(a.tree) if a.tree else None)

    p.set_defaults(func=go)
