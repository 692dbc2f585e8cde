"""What the benchmarks share: timed greedy runs of a warm engine, alternating pairs that cancel a drifting
machine, llama.cpp sessions, and deterministic random prompts."""

from __future__ import annotations

import collections
import contextlib
import functools
from pathlib import Path
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def random_prompts(ids: tuple[int, int], num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` deterministic pseudo-random prompts of ``length`` ids in ``[ids[0], ids[1])``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(ids[0], ids[1], (num, length), generator=g).tolist()


def bucket_name(key) -> str:
    """``B{b}_K{k}`` of a bucket or graph key: ``(B, K)`` or ``(B, K, T, mode)`` (context / sampling-mode
    buckets); ``Bn``: a graph whose batch is symbolic."""
    return f"B{key[0] or 'n'}_K{key[1]}"


def new_replays(before: dict, after: dict) -> dict:
    """Per bucket, the step wall ms it appended between two ``Engine.stats()`` snapshots, as far as its
    bounded window still holds them (keyed like ``bucket_timings``; buckets that ran no step are left out)."""
    out = {}
    for name, t in after["bucket_timings"].items():
        new = t["calls"] - before["bucket_timings"].get(name, {"calls": 0})["calls"]
        if new:
            out[name] = list(t["replay_ms"][max(len(t["replay_ms"]) - new, 0):])
    return out


def timed_generate(eng, prompts: list[list[int]], n: int, reps: int = 1, warm: bool = True) -> dict:
    """Warm up with the same run (captures every bucket it uses; ``warm=False`` skips it where an
    earlier run did), then time ``reps`` greedy ``generate`` runs.

    Returns decode ms/token (``(e2e - ttft) / (tokens - 1)``, median over
    requests, then over reps; and pooled over every request of every rep, the
    figure to pair with τ), prefill seconds, per-(B, K) replay medians of the
    timed runs (over their context buckets), cold capture seconds per (B, K) and
    per graph, τ over the timed runs and the tokens of the first request. A
    timed run that still captured a graph is discarded and rerun (at most twice),
    so compile time never counts as decode time.
    """
    from funcspec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    if warm:
        eng.generate(prompts, sp)
    eng.reset_stats()
    marks = eng.stats()  # per bucket: the replays before the timed runs (buckets of a symbolic batch share a graph)
    ms: list[float] = []
    prefill: list[float] = []
    retries, decode_s, decode_tokens = 0, 0.0, 0
    while len(ms) < reps:
        before = set(eng.stats()["graphs"])
        outs = eng.generate(prompts, sp)
        if set(eng.stats()["graphs"]) != before and retries < 2:
            retries += 1
            continue
        tokens = len(outs[0].outputs[0].token_ids)
        decode_s += sum(o.metrics["e2e_s"] - o.metrics["time_to_first_token_s"] for o in outs)
        decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        ms.append(statistics.median(o.metrics["e2e_s"] - o.metrics["time_to_first_token_s"] for o in outs)
                  / max(tokens - 1, 1) * 1e3)
        prefill.append(statistics.median(o.metrics["time_to_first_token_s"] for o in outs))
    st = eng.stats()
    replay: dict[str, list] = collections.defaultdict(list)
    capture: dict[str, float] = collections.defaultdict(float)
    for name, times in new_replays(marks, st).items():
        replay[bucket_name(st["bucket_timings"][name]["key"])] += times
    for g in st["graphs"].values():
        capture[bucket_name(g["key"])] += g["capture_seconds"]
    return {"ms_per_token": statistics.median(ms), "ms_per_token_reps": ms,
            "ms_per_token_pooled": decode_s / max(decode_tokens, 1) * 1e3, "prefill_s": statistics.median(prefill),
            "tokens_per_request": tokens, "replay_ms": {k: statistics.median(v) for k, v in replay.items() if v},
            "capture_s": dict(capture), "capture_s_graphs": {k: g["capture_seconds"] for k, g in st["graphs"].items()},
            "timing_retries": retries, "recompiles": st["recompiles"], "tau": st["mean_acceptance_length"],
            "steps": st["steps"], "tokens": outs[0].outputs[0].token_ids}


def step_ms(row: dict, b: int, k: int) -> float | None:
    return row["replay_ms"].get(f"B{b}_K{k}")


_REPACK_PROBE = ("import sys, llama_cpp\n"
                 "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)\n"
                 "tokens = llm.generate([1, 2, 3, 4], top_k=1, temp=0.0)\n"
                 "next(tokens), next(tokens)\n")


@functools.cache
def llamacpp_repacks(gguf_path: str) -> bool:
    """Whether llama.cpp may decode ``gguf_path`` on its repacked weight buffers (its default, the layout its
    fastest CPU products read): false where a child process trying it is killed by a signal or hangs. On an
    Intel AMX Xeon VM here that decode ended the process with a segmentation fault, where the plain buffers
    ran. Any other failure of the child (no binding, a bad file) is left to the real load to report."""
    try:
        return subprocess.run([sys.executable, "-c", _REPACK_PROBE, gguf_path], capture_output=True,
                              timeout=600).returncode >= 0
    except subprocess.TimeoutExpired:
        return False


@contextlib.contextmanager
def _llamacpp_buffers(repack: bool):
    """llama.cpp's repacked weight buffers (``use_extra_bufts``) on or off for the ``Llama`` loaded inside:
    llama-cpp-python's constructor does not take the flag, so its default parameters are wrapped meanwhile
    (a binding without them keeps its own)."""
    import llama_cpp

    low = getattr(llama_cpp, "llama_cpp", None)  # the low-level module that Llama reads its defaults from
    if low is None or not hasattr(low, "llama_model_default_params"):
        yield
        return
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = repack
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def llamacpp_session(gguf_path: Path, prompt: list[int], n: int, threads: int, f32_kv: bool = True):
    """A loaded llama.cpp model and its greedy run (temp 0, top_k 1, no penalties) on ``prompt``, on its
    repacked weight buffers where :func:`llamacpp_repacks` says they run (the run's ``repacked`` says which).

    The run returns ``(tokens, prefill_s, decode ms/token after the first token)``.
    ``f32_kv``: an f32 KV cache (llama.cpp defaults to f16), so f32 weights can match HF's tokens.
    """
    import llama_cpp

    kv: dict[str, Any] = {"type_k": 0, "type_v": 0} if f32_kv else {}  # 0 = GGML_TYPE_F32
    repack = llamacpp_repacks(str(gguf_path))
    with _llamacpp_buffers(repack):
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                              n_ctx=len(prompt) + n + 16, logits_all=False, verbose=False, **kv)

    def gen():
        llm.reset()
        toks: list[int] = []
        t0, t_first = time.perf_counter(), 0.0
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            t_first = t_first or time.perf_counter()
            toks.append(int(tok))
            if len(toks) == n:
                break
        return toks, t_first - t0, (time.perf_counter() - t_first) / max(n - 1, 1) * 1e3

    gen.repacked = repack  # type: ignore[attr-defined]  # read by the reports
    return gen


def llamacpp_greedy(gen, reps: int = 1) -> dict:
    """A llama.cpp session's (:func:`llamacpp_session`) tokens, prefill seconds and decode ms/token after
    its first token: medians of ``reps`` runs after a warm-up."""
    gen()  # warm-up
    runs = [gen() for _ in range(reps)]
    return {"tokens": runs[0][0], "prefill_s": statistics.median(r[1] for r in runs),
            "ms_per_token": statistics.median(r[2] for r in runs)}


def decode_ms(eng, prompts: list[list[int]], n: int):
    """One timed run of a warm engine as a callable for :func:`paired_ratios`: its decode ms/token."""
    return lambda: timed_generate(eng, prompts, n, warm=False)["ms_per_token"]


def paired_ratios(ours, theirs, rounds: int) -> dict:
    """``rounds`` alternating runs of two decoders (each returns ms/token): the median of the per-pair
    ratios ours / theirs. This VM's speed drifts by tens of percent within minutes; drift hits
    both runs of a pair alike, so the pairs' ratio holds where two separate medians do not."""
    pairs = []
    for _ in range(rounds):
        a, b = ours(), theirs()
        pairs.append((a, b))
    return {"rounds": rounds, "ours_ms": [a for a, _ in pairs], "theirs_ms": [b for _, b in pairs],
            "ratio": statistics.median(a / b for a, b in pairs)}
