"""``funcspec bench scale``: funcspec at real model sizes, with random weights.

One process builds (once, cached outside git) a random-weight HF checkpoint of a
real family shape (``--shape``: Llama 150M / 600M, Qwen2.5-0.5B, Llama-3.2-1B,
or a tiny one for tests) and measures, in ``--phases`` order:

- ``bandwidth``: the copy bandwidth of a large ``copy_`` (read + write bytes)
  and the weight-streaming bound = weight bytes / bandwidth (ms per token),
  plus the tighter bound from the read-only bandwidth of a ``sum``;
- ``hf``: HF ``generate`` greedy decode ms/token (batch 1), whose tokens the
  ``ar`` rows must reproduce (a mismatch raises unless ``--allow-mismatch``);
- ``ar``: funcspec autoregressive decode ms/token on each of ``--backends``,
  with the captured step's replay median and its cold capture seconds;
- ``sweep``: synthetic acceptance (the ``echo`` proposer drafts for free, the
  ``synthetic`` verifier accepts position i with probability alpha**(i+1)) for
  each alpha x K, one engine per (alpha, K): measured τ, step cost at K over
  step cost at K = 0, achieved speedup over AR and the ideal τ / (cost K / cost 0);
- ``context``: AR ms/token as the prompt grows, on ONE engine (one capacity),
  in two passes (ascending, then descending: drift on a shared machine
  cancels in their mean), and each length's ratio to the shortest;
- ``batch``: AR tokens/s at each batch size, on one engine, and the largest batch over batch 1 from
  alternating runs;
- ``profile``: the top ops (self CPU time) of one eager AR decode step;
- ``llamacpp``: llama.cpp (llama-cpp-python + gguf, optional) on the same weights,
  then each AR engine and llama.cpp in alternating runs: the median of the
  per-pair ratios is the comparison that holds on a machine whose speed drifts;
- ``quant`` (not in the default phases): each ``--quantization`` format
  (:mod:`funcspec.bench.quant`): AR against llama.cpp on the same GGUF file,
  paired; speculation with real heads and synthetic acceptance; batch.

Decode times exclude prefill: a request's ms/token is ``(e2e - ttft) / (tokens - 1)``,
the median of ``--reps`` timed runs after a warm-up run. On a machine shared with
other work, ``--threads 1`` avoids OpenMP barrier stalls that can inflate 2-thread
timings several-fold.
Results go to ``graphs/results/<device>/scale-<shape>-<dtype>-<time>.json``,
``.md`` and ``.png``.

The package, by concern: :mod:`.checkpoint` (shapes, the random checkpoint), :mod:`.machine` (CPU facts,
bandwidth), :mod:`.hf` (the HF baseline), :mod:`.context` (:class:`ScaleContext`, what the phases share),
:mod:`.measure` (funcspec's measurements), :mod:`.llamacpp`, :mod:`.phases` (one function per phase),
:mod:`.options`, :mod:`.report` and :mod:`.plot` (the files); this module runs them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec.bench.capture import RESULTS, device_name
from funcspec.bench.scale.checkpoint import (DTYPES, EMBED_SCALE, SHAPES, Shape, build_checkpoint, checkpoint_dir,
                                             make_prompts, weight_bytes)
from funcspec.bench.scale.context import ScaleContext
from funcspec.bench.scale.hf import first_mismatch, hf_greedy
from funcspec.bench.scale.llamacpp import LLAMACPP_SKIPPED, llamacpp_phase, write_gguf
from funcspec.bench.scale.machine import ISA_FLAGS, copy_bandwidth, default_copy_mb, kernel_line, llc_mib, machine_info
from funcspec.bench.scale.options import DEFAULT_PHASES, DEFAULTS, PHASES, parse_options
from funcspec.bench.scale.phases import ENGINELESS, PHASE_FNS, compare
from funcspec.bench.scale.plot import plot
from funcspec.bench.scale.report import markdown, write

__all__ = ["DEFAULTS", "DEFAULT_PHASES", "DTYPES", "EMBED_SCALE", "ISA_FLAGS", "LLAMACPP_SKIPPED", "PHASES", "SHAPES",
           "ScaleContext", "Shape", "add_parser", "build_checkpoint", "checkpoint_dir", "copy_bandwidth",
           "default_copy_mb", "first_mismatch", "hf_greedy", "llamacpp_phase", "llc_mib", "machine_info",
           "kernel_line", "make_prompts", "markdown", "plot", "run", "weight_bytes", "write_gguf"]


def run(args=None, **kwargs) -> dict:
    """Run the chosen phases on one random checkpoint; writes JSON, markdown and PNG and returns the result.

    ``args`` is an argparse namespace (the CLI's) or ``None``; keyword arguments
    (the :data:`DEFAULTS` keys) override it. List options take a comma string or
    a sequence. Raises ``RuntimeError`` after writing the results when funcspec AR
    greedy differs from HF greedy, unless ``allow_mismatch``. Compiles go to a
    fresh inductor cache, so capture seconds are cold (as in ``bench capture``).
    """
    o = parse_options(args, kwargs)
    old, threads = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), torch.get_num_threads()
    cache_dir = tempfile.mkdtemp(prefix="funcspec-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        if o["threads"]:
            torch.set_num_threads(o["threads"])
        return _run(o)
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        shutil.rmtree(cache_dir, ignore_errors=True)


def _run(o: dict) -> dict:
    """The phases of ``o`` in order on one :class:`ScaleContext`, then the comparison with HF and the files."""
    path = build_checkpoint(o["shape"], o["dtype"], o["cache_dir"], o["seed"])
    params, nbytes = weight_bytes(path, o["dtype"])
    ctx = ScaleContext.create(o["shape"], o["dtype"], path, new_tokens=o["new_tokens"],
                              prompt_tokens=o["prompt_tokens"], seed=o["seed"], reps=o["reps"])
    result = {"shape": o["shape"], "dtype": o["dtype"], "arch": SHAPES[o["shape"]].arch,
              "config": SHAPES[o["shape"]].config, "checkpoint": str(path), "params": params, "weight_bytes": nbytes,
              "prompt_tokens": o["prompt_tokens"], "new_tokens": o["new_tokens"], "phases": o["phases"],
              "reps": o["reps"], "device": device_name("cpu"), "machine": machine_info(), "embed_scale": EMBED_SCALE}
    print(kernel_line(result["machine"])[2:], flush=True)  # what ran, before any figure
    bar = tqdm(o["phases"], desc="bench scale")
    for phase in bar:
        bar.set_postfix_str(phase)
        if phase not in ENGINELESS and ctx.model is None:
            from funcspec.checkpoints import load_model

            ctx.model = load_model(path, dtype=DTYPES[o["dtype"]])
        PHASE_FNS[phase](ctx, o, result)
    bar.close()
    result["machine"]["load_average_end"] = list(os.getloadavg())
    compare(result)
    stem = write(result, Path(o["out"]) if o["out"] else RESULTS / device_name("cpu"))
    bad = [r for r in result.get("ar", []) if r.get("tokens_equal_hf") is False]
    if bad and not o["allow_mismatch"]:
        r = bad[0]
        raise RuntimeError(f"funcspec AR ({r['backend']}) greedy differs from HF greedy at token "
                           f"{r['first_mismatch_hf']} (results in {stem}.json); pass --allow-mismatch to accept "
                           "near-tie flips (bf16)")
    return result


def add_parser(kinds) -> None:
    """Register ``funcspec bench scale`` and its options."""
    d = DEFAULTS
    p = kinds.add_parser("scale", help="funcspec at real model sizes (random weights) vs HF, the bandwidth bound "
                                       "and llama.cpp")
    p.add_argument("--shape", default=d["shape"], choices=sorted(SHAPES), help="model shape (default %(default)s)")
    p.add_argument("--dtype", default=d["dtype"], choices=sorted(DTYPES), help="checkpoint and run dtype")
    p.add_argument("--cache-dir", default=None, help="checkpoints cache (default ~/.cache/funcspec/scale)")
    p.add_argument("--out", default=None, help="results directory (default graphs/results/<device>)")
    p.add_argument("--phases", default=d["phases"], help="comma list, a subset of (default) %(default)s")
    p.add_argument("--backends", default=d["backends"], help="backends of the ar phase (default %(default)s)")
    p.add_argument("--sweep-backend", default=d["sweep_backend"],
                   help="backend of the sweep, context and batch phases (default %(default)s)")
    p.add_argument("--alphas", default=d["alphas"], help="synthetic acceptance bases (default %(default)s)")
    p.add_argument("--ks", default=d["ks"], help="K values of the sweep (default %(default)s)")
    p.add_argument("--contexts", default=d["contexts"], help="prompt lengths, context sweep (default %(default)s)")
    p.add_argument("--batches", default=d["batches"], help="batch sizes, batch sweep (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=d["new_tokens"], help="tokens per request (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"], help="prompt length (default %(default)s)")
    p.add_argument("--copy-mb", type=int, default=d["copy_mb"],
                   help="bandwidth tensor MiB (default: 256, or 4x the last-level cache if larger)")
    p.add_argument("--reps", type=int, default=d["reps"], help="timed runs per measurement (default %(default)s)")
    p.add_argument("--profile-steps", type=int, default=d["profile_steps"], help="decode steps profiled")
    p.add_argument("--seed", type=int, default=d["seed"], help="weights and prompts seed (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--allow-mismatch", action="store_true", help="record, do not raise on, HF != funcspec tokens")
    p.add_argument("--quantization", default=d["quantization"],
                   help="formats of the quant phase (default %(default)s; also int4-g128, and published layouts "
                        "gptq-int4, gptq-int8, awq-int4, ct-w4a16, ct-w8a8, ascend-w8a8)")
    p.add_argument("--quant-k", type=int, default=d["quant_k"], help="K of the quant phase's speculation")
    p.add_argument("--quant-alpha", type=float, default=d["quant_alpha"], help="its synthetic acceptance base")
    p.add_argument("--quant-parts", default=d["quant_parts"],
                   help="what the quant phase adds to AR and echo: heads (EAGLE-3, DFlash), batch")
    p.set_defaults(func=run)
