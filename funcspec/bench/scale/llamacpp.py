"""``bench scale``'s ``llamacpp`` phase: llama.cpp (llama-cpp-python, optional) on the same weights, written
as GGUF, then each warm AR engine and llama.cpp in alternating runs."""

from __future__ import annotations

from pathlib import Path

import torch

from funcspec.bench.scale.checkpoint import SHAPES
from funcspec.bench.scale.context import ScaleContext
from funcspec.bench.scale.hf import compare_tokens
from funcspec.bench.timing import decode_ms, llamacpp_greedy, llamacpp_session, paired_ratios

LLAMACPP_SKIPPED = "skipped: llama-cpp-python not installed"


def write_gguf(ckpt: Path, kind: str) -> Path:
    """The checkpoint as ``model-<kind>.gguf`` beside it (:func:`funcspec.checkpoints.gguf_write.write`), built once."""
    from funcspec.checkpoints import gguf_write

    return gguf_write.write(ckpt, ckpt / f"model-{kind}.gguf", kind)


def _skipped(ctx: ScaleContext) -> str | None:
    """Why the phase cannot run here, or ``None``."""
    try:
        import llama_cpp  # noqa: F401 (imported only to see it is installed)
    except ImportError:
        return LLAMACPP_SKIPPED
    try:
        import gguf  # noqa: F401 (imported only to see it is installed)
    except ImportError:
        return "skipped: gguf not installed"
    if SHAPES[ctx.shape].arch not in ("llama", "deepseek_v2"):
        return "skipped: the GGUF export here is for llama and deepseek2 shapes only"
    return None


def llamacpp_phase(ctx: ScaleContext) -> dict:
    """llama.cpp on the same weights, or a ``skipped`` note when llama-cpp-python / gguf are missing.

    Its tokens are checked against HF's (``ctx.hf``), its ms/token set against the best AR row's, and each
    warm AR engine of ``ctx.ar_engines`` is timed again in alternating runs with it (:func:`paired_ratios`).
    """
    if note := _skipped(ctx):
        return {"status": "skipped", "note": note}
    n, gguf_path, threads = ctx.new_tokens, write_gguf(ctx.path, ctx.dtype), torch.get_num_threads()
    session = llamacpp_session(gguf_path, ctx.prompt, n, threads, f32_kv=ctx.dtype == "float32")
    r = {**llamacpp_greedy(session, ctx.reps), "threads": threads, "gguf": str(gguf_path), "status": "ran",
         "repacked": session.repacked}
    r.update(compare_tokens(r["tokens"], ctx.hf))
    if ctx.ar_rows:
        best = min(a["ms_per_token"] for a in ctx.ar_rows.values())
        r["funcspec_over_llamacpp"] = best / r["ms_per_token"]  # > 1: funcspec slower
    r["paired"] = {backend: paired_ratios(decode_ms(eng, [ctx.prompt], n), lambda: session()[2], max(ctx.reps, 3))
                   for backend, eng in ctx.ar_engines.items()}
    return r
