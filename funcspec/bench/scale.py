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
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm  # NOTE: not tqdm.auto: no ipywidgets warning in notebooks

from funcspec.bench.capture import RESULTS, device_name
from funcspec.bench.timing import (bucket_name, step_ms, decode_ms, llamacpp_greedy, llamacpp_session, paired_ratios,
                                   random_prompts, timed_generate)

PHASES = ("bandwidth", "hf", "ar", "sweep", "context", "batch", "profile", "llamacpp", "quant")
DEFAULT_PHASES = PHASES[:-1]
"""Every phase but ``quant`` (its formats, heads and pairings take as long as the rest together)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EMBED_SCALE = 3.0
"""Random init (std 0.02) gives near-uniform logits, so bf16 rounding flips greedy
near-ties between HF and funcspec; the embedding / lm_head are scaled by this
(top-2 logit gap about 7x wider) so both pick the same argmax."""
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
LLAMACPP_SKIPPED = "skipped: llama-cpp-python not installed"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model family's shape: the HF config class kwargs and the non-special prompt-id range."""

    arch: str  # "llama" | "qwen2"
    config: dict
    prompt_ids: tuple[int, int]  # [lo, hi): ids sampled for prompts, no special tokens


_LLAMA_32K = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  max_position_embeddings=8192)
SHAPES = {
    "tiny": Shape("llama", dict(_LLAMA_32K, vocab_size=512, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), (3, 512)),
    # 153M params: 12 x 8.65M layers + 2 x 24.6M (untied embedding and lm_head).
    "llama-150m": Shape("llama", dict(_LLAMA_32K, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=4), (3, 32000)),
    # 156M params, 594 MiB in fp32 (untied).
    "llama-600m": Shape("llama", dict(_LLAMA_32K, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4), (3, 32000)),
    "qwen2.5-0.5b": Shape("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        max_position_embeddings=32768, bos_token_id=151643,
                                        eos_token_id=151643), (0, 151643)),
    "llama-3.2-1b": Shape("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192},
                                        max_position_embeddings=131072, bos_token_id=128000,
                                        eos_token_id=128001), (0, 128000)),
}

DEFAULTS = dict(shape="llama-600m", dtype="float32", cache_dir=None, out=None, backends="eager,inductor",
                sweep_backend="inductor", alphas="0.6,0.7,0.8,0.9", ks="1,2,4,8", contexts="128,512,1024,2048,4096",
                batches="1,4,8", phases=",".join(DEFAULT_PHASES), new_tokens=64, prompt_tokens=128, threads=None,
                allow_mismatch=False, copy_mb=None, profile_steps=4, seed=0, reps=3,
                quantization="int8,int4,q8_0,q4_0,q4_k_m", quant_k=4, quant_alpha=0.8, quant_parts="heads,batch")


# --------------------------------------------------------------- checkpoint
def checkpoint_dir(shape: str, dtype: str, cache_dir=None, seed: int = 0) -> Path:
    """Where the random checkpoint lives: ``<cache_dir>/<shape>-<dtype>`` (``-seed<n>`` appended for seed != 0)."""
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "funcspec" / "scale"
    return root / (f"{shape}-{dtype}" + (f"-seed{seed}" if seed else ""))


def build_checkpoint(shape: str, dtype: str = "float32", cache_dir=None, seed: int = 0) -> Path:
    """The random-weight HF checkpoint (safetensors) of ``shape``, built on first use, then reused.

    Weights: transformers' default init (normal, std 0.02) with the embedding and
    lm_head scaled by :data:`EMBED_SCALE`, saved in ``dtype``.
    """
    import transformers

    path = checkpoint_dir(shape, dtype, cache_dir, seed)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    spec = SHAPES[shape]
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[spec.arch]
    torch.manual_seed(seed)
    model = classes[1](classes[0](**spec.config)).eval()
    with torch.no_grad():
        emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        emb.mul_(EMBED_SCALE)
        if out is not emb:  # untied: scale lm_head too (tied: it is the same tensor)
            out.mul_(EMBED_SCALE)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    model.to(DTYPES[dtype]).save_pretrained(str(tmp))  # safetensors
    tmp.replace(path)  # NOTE: atomic: a killed build never leaves a half checkpoint that looks complete
    return path


def weight_bytes(path: Path, dtype: str) -> tuple[int, int]:
    """(parameters, bytes) a decode step streams: every funcspec param once (a tied lm_head is the embedding)."""
    from funcspec.checkpoints import expected_shapes, model_config, read_config

    cfg = model_config(read_config(path)[1])
    n = sum(math.prod(s) for s in expected_shapes(cfg).values())
    return n, n * torch.empty(0, dtype=DTYPES[dtype]).element_size()


def make_prompts(shape: str, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` deterministic pseudo-random prompts of ``length`` ids from the shape's non-special range."""
    return random_prompts(SHAPES[shape].prompt_ids, num, length, seed)


# ------------------------------------------------------------------ machine
def machine_info() -> dict:
    """CPU model, threads, ISA flags (avx2 ... amx_tile), torch version and ATen's CPU capability."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "threads": torch.get_num_threads(), "cores": os.cpu_count(), "llc_mib": llc_mib(),
            "flags": {f: f in flags for f in ISA_FLAGS}, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def llc_mib() -> int:
    """The last-level cache of CPU 0 in MiB, from sysfs (0 when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], 1 / 2**20)
        sizes.append(float(text.rstrip("KMG")) * scale)
    return int(max(sizes, default=0))


def default_copy_mb() -> int:
    """Bandwidth tensor size: 256 MiB, or 4x the last-level cache when that is larger.

    NOTE: a Xeon with a 300 MiB L3 copied a 256 MiB tensor partly from cache; the
    bound must be DRAM's, as the weights of a real model do not fit.
    """
    return max(256, 4 * llc_mib())


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(mb: int = 256, reps: int = 7) -> dict:
    """Median ``dst.copy_(src)`` bandwidth of an ``mb`` MiB fp32 tensor, counting read + write bytes,
    and the read-only bandwidth of ``src.sum()`` (closer to what streaming weights needs)."""
    n = mb * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # warm-up: page both buffers in
    s = _median_s(lambda: dst.copy_(src), reps)
    read = _median_s(lambda: src.sum(), reps)
    return {"copy_mb": mb, "reps": reps, "median_s": s, "gb_per_s": 2 * n * 4 / s / 1e9,
            "read_gb_per_s": n * 4 / read / 1e9}


# ------------------------------------------------------------------------ HF
class _Clock:
    """A ``generate`` streamer that only timestamps each ``put``: the prompt, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        """Called with the prompt, then with each new token: record when."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Called once generation is done."""


def hf_greedy(path: Path, dtype: str, prompt: list[int], n: int, reps: int = 1) -> dict:
    """HF ``generate`` greedy, batch 1: the n new tokens, prefill seconds and decode ms/token.

    Decode time runs from the first new token to the last (timestamped by a
    streamer), as funcspec's ``e2e - ttft``; the median over ``reps`` runs.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as funcspec's ignore_eos
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])  # [1, P]

    def gen(k):
        clock = _Clock()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                             streamer=clock)
        new = clock.times[1:]  # one stamp per new token
        return out[0, len(prompt):].tolist(), new[0] - t0, (new[-1] - new[0]) / max(len(new) - 1, 1)

    with torch.no_grad():
        gen(2)  # warm-up
        runs = [gen(n) for _ in range(reps)]
    del model
    gc.collect()
    tokens = runs[0][0]
    return {"tokens": tokens, "prefill_s": statistics.median(r[1] for r in runs),
            "ms_per_token": statistics.median(r[2] for r in runs) * 1e3, "distinct_tokens": len(set(tokens))}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), ``None`` when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------ funcspec
def _engine(model, dtype: str, backend: str, max_batch: int, max_len: int, spec: dict | None = None):
    from funcspec import Engine

    return Engine(model, speculative_config=spec, backend=backend, max_batch_size=max_batch,
                  max_model_len=max_len, dtype=DTYPES[dtype], capture="lazy")  # greedy only


def ar_row(ctx: dict, backend: str) -> dict:
    """funcspec AR (K = 0, batch 1) on ``backend`` for the main prompt, measured once per backend."""
    if backend not in ctx["ar_cache"]:
        eng = _engine(ctx["model"], ctx["dtype"], backend, 1, ctx["max_len"])
        row = timed_generate(eng, [ctx["prompt"]], ctx["n"], ctx["reps"])
        ctx["ar_cache"][backend] = {"backend": eng.backend, **row, "step_ms": step_ms(row, 1, 0),
                                    "capture_s_cold": row["capture_s"].get("B1_K0")}
        ctx["ar_engines"][backend] = eng  # warm: the llama.cpp phase times it again, paired
    return ctx["ar_cache"][backend]


def sweep_rows(ctx: dict, backend: str, k: int, alphas: list[float], base: dict) -> list[dict]:
    """Synthetic acceptance at K for each alpha on ONE engine: τ, step cost ratio, achieved vs ideal speedup.

    The rates reach the captured graphs as a tensor (``Engine.set_synthetic_acceptance_rates``),
    so each K compiles once and every alpha reuses its graphs.
    """
    def rates(alpha):  # unconditional: P(first i+1 drafts accepted)
        return [alpha ** (i + 1) for i in range(k)]

    spec = {"method": "echo", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates(alphas[0])}
    eng = _engine(ctx["model"], ctx["dtype"], backend, 1, ctx["max_len"], spec)
    out = []
    for alpha in alphas:
        eng.set_synthetic_acceptance_rates(rates(alpha))
        row = timed_generate(eng, [ctx["prompt"]], ctx["n"], ctx["reps"])
        step_k = step_ms(row, 1, k)
        cost = step_k / base["step_ms"] if step_k and base["step_ms"] else None  # step cost K / step cost 0
        # NOTE: τ varies from run to run (the draws are random), so ms/token
        # and τ are both pooled over the same timed runs: a median run would
        # pair one run's speed with every run's τ.
        achieved = base["ms_per_token"] / row["ms_per_token_pooled"]
        ideal = row["tau"] / cost if cost else None
        out.append({"alpha": alpha, "k": k, "rates": rates(alpha), "tau": row["tau"],
                    "expected_tau": 1 + sum(rates(alpha)), "ms_per_token": row["ms_per_token_pooled"], "step_ms": step_k,
                    "step_cost_ratio": cost, "achieved_speedup": achieved, "ideal_speedup": ideal,
                    "achieved_over_ideal": achieved / ideal if ideal else None, "steps": row["steps"],
                    "capture_s_cold": row["capture_s"].get(f"B1_K{k}")})
    return out


def context_rows(ctx: dict, backend: str, contexts: list[int]) -> dict:
    """AR ms/token per prompt length on ONE engine sized for the largest (constant capacity).

    Two passes, ascending (with warm-up) then descending (graphs already
    captured): a machine whose speed drifts over the sweep biases the two in
    opposite directions, so their mean is what each row reports, with its
    ratio to the shortest prompt's.
    """
    max_len = max(contexts) + ctx["n"] + 64
    eng = _engine(ctx["model"], ctx["dtype"], backend, 1, max_len)
    passes = collections.defaultdict(list)  # context -> one timed_generate result per pass
    order = [(c, True) for c in contexts] + [(c, False) for c in reversed(contexts)]
    for c, warm in tqdm(order, desc="context", leave=False):
        passes[c].append(timed_generate(eng, make_prompts(ctx["shape"], 1, c, ctx["seed"] + c), ctx["n"],
                                        ctx["reps"], warm=warm))
    rows = []
    for c in contexts:
        ms = [r["ms_per_token"] for r in passes[c]]
        steps = [s for s in (step_ms(r, 1, 0) for r in passes[c]) if s is not None]
        rows.append({"context": c, "ms_per_token": statistics.fmean(ms), "ms_per_token_passes": ms,
                     "prefill_s": statistics.fmean(r["prefill_s"] for r in passes[c]),
                     "step_ms": statistics.fmean(steps) if steps else None})
    for row in rows:
        row["vs_shortest"] = row["ms_per_token"] / rows[0]["ms_per_token"]
    r = passes[contexts[-1]][-1]
    cfg = eng.model.cfg
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * eng.t_max * cfg.head_dim * DTYPES[ctx["dtype"]].itemsize
    return {"backend": eng.backend, "max_model_len": max_len, "kv_bytes_per_slot": kv, "rows": rows,
            "graphs_capture_s": r["capture_s_graphs"]}  # every graph the engine captured, by name


def batch_rows(ctx: dict, backend: str, batches: list[int]) -> dict:
    """AR tokens/s per batch size: B same-length prompts on one engine with max(batches) slots.

    With batch 1 and a larger one, also the largest batch's tokens/s over batch 1's from
    :func:`paired_ratios` (alternating runs on the warm engine), the ratio this VM's drift leaves alone.
    """
    eng = _engine(ctx["model"], ctx["dtype"], backend, max(batches), ctx["max_len"])
    rows, prompts = [], {}
    for b in tqdm(batches, desc="batch", leave=False):
        prompts[b] = make_prompts(ctx["shape"], b, ctx["p"], ctx["seed"] + 1000 + b)  # B prompts of P tokens
        r = timed_generate(eng, prompts[b], ctx["n"], ctx["reps"])
        step = r["replay_ms"].get(f"B{eng.plan.batch_bucket(b)}_K0")
        rows.append({"batch": b, "tokens_per_s": b * 1e3 / r["ms_per_token"],
                     "ms_per_token": r["ms_per_token"], "step_ms": step})
    out = {"backend": eng.backend, "rows": rows}
    top = max(batches)
    if 1 in batches and top > 1:
        p = paired_ratios(decode_ms(eng, prompts[1], ctx["n"]), decode_ms(eng, prompts[top], ctx["n"]),
                          max(ctx["reps"], 3))
        out["paired"] = {**p, "batch": top, "tokens_per_s_ratio": top * p["ratio"]}  # B x (ms at 1 / ms at B)
    return out


def profile_step(ctx: dict, steps: int, top: int = 12) -> dict:
    """Top ``top`` ops by self CPU time of ``steps`` eager AR decode steps (batch 1), per step.

    NOTE: drives the engine's ``add_request`` / ``step`` loop, and admits the
    request before profiling, so the profile holds decode steps only, no prefill.
    """
    from torch.profiler import ProfilerActivity, profile

    from funcspec import SamplingParams

    eng = _engine(ctx["model"], ctx["dtype"], "eager", 1, ctx["max_len"])
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    eng.generate([ctx["prompt"]], sp)  # warm-up
    eng.add_request(ctx["prompt"], sp)
    eng.step()  # admission (prefill) and the first decode step
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    wall = (time.perf_counter() - t0) / steps
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0  # us
    rows = [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": e.self_cpu_time_total / steps / 1e3,
             "pct": 100 * e.self_cpu_time_total / total} for e in ops[:top]]
    return {"steps": steps, "wall_ms_per_step_profiled": wall * 1e3, "self_cpu_ms_per_step": total / steps / 1e3,
            "ops": rows}


# ----------------------------------------------------------------- llama.cpp
def write_gguf(ckpt: Path, kind: str) -> Path:
    """The checkpoint as ``model-<kind>.gguf`` beside it (:func:`funcspec.checkpoints.gguf_write.write`), built once."""
    from funcspec.checkpoints import gguf_write

    return gguf_write.write(ckpt, ckpt / f"model-{kind}.gguf", kind)


def llamacpp_phase(ctx: dict) -> dict:
    """llama.cpp on the same weights, or a ``skipped`` note when llama-cpp-python / gguf are missing."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"status": "skipped", "note": LLAMACPP_SKIPPED}
    try:
        import gguf  # noqa: F401
    except ImportError:
        return {"status": "skipped", "note": "skipped: gguf not installed"}
    if SHAPES[ctx["shape"]].arch != "llama":
        return {"status": "skipped", "note": "skipped: the GGUF export here is for llama-arch shapes only"}
    gguf_path, threads = write_gguf(ctx["path"], ctx["dtype"]), torch.get_num_threads()
    session = llamacpp_session(gguf_path, ctx["prompt"], ctx["n"], threads, f32_kv=ctx["dtype"] == "float32")
    r = {**llamacpp_greedy(session, ctx["reps"]), "threads": threads, "gguf": str(gguf_path)}
    ref = ctx["hf"]["tokens"] if ctx.get("hf") else None
    r["status"] = "ran"
    r["tokens_equal_hf"] = None if ref is None else r["tokens"] == ref
    r["first_mismatch_hf"] = None if ref is None else first_mismatch(r["tokens"], ref)
    if ctx["ar_cache"]:
        best = min(a["ms_per_token"] for a in ctx["ar_cache"].values())
        r["funcspec_over_llamacpp"] = best / r["ms_per_token"]  # > 1: funcspec slower
    r["paired"] = {backend: paired_ratios(decode_ms(eng, [ctx["prompt"]], ctx["n"]), lambda: session()[2],
                                          max(ctx["reps"], 3))
                   for backend, eng in ctx["ar_engines"].items()}
    return r


# ----------------------------------------------------------------------- run
def _list(value, cast) -> list:
    if isinstance(value, str):
        return [cast(x) for x in value.split(",") if x.strip()]
    return [cast(x) for x in value]


def _options(args, kwargs) -> dict:
    """DEFAULTS, overridden by an argparse namespace and then by keyword arguments; lists parsed."""
    o = dict(DEFAULTS)
    if args is not None:
        o.update({k: v for k, v in vars(args).items() if k in DEFAULTS})
    o.update(kwargs)
    unknown = set(kwargs) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"bench scale: unknown options {sorted(unknown)}")
    for key, cast in (("backends", str), ("alphas", float), ("ks", int), ("contexts", int), ("batches", int),
                      ("phases", str), ("quantization", str), ("quant_parts", str)):
        o[key] = _list(o[key], cast)
    o["sweep_backend"] = _list(o["sweep_backend"], str)[0]
    if o["shape"] not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {o['shape']!r}")
    if o["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {o['dtype']!r}")
    bad = [p for p in o["phases"] if p not in PHASES]
    if bad:
        raise ValueError(f"phases {bad} unknown; choose from {list(PHASES)}")
    from funcspec.bench.quant import FORMATS

    bad = [f for f in o["quantization"] if f not in FORMATS]
    if bad:
        raise ValueError(f"quantization formats {bad} unknown; choose from {list(FORMATS)}")
    if o["new_tokens"] < 2:
        raise ValueError("new_tokens must be >= 2 (decode time excludes the first token)")
    return o


def run(args=None, **kwargs) -> dict:
    """Run the chosen phases on one random checkpoint; writes JSON, markdown and PNG and returns the result.

    ``args`` is an argparse namespace (the CLI's) or ``None``; keyword arguments
    (the :data:`DEFAULTS` keys) override it. List options take a comma string or
    a sequence. Raises ``RuntimeError`` after writing the results when funcspec AR
    greedy differs from HF greedy, unless ``allow_mismatch``. Compiles go to a
    fresh inductor cache, so capture seconds are cold (as in ``bench capture``).
    """
    o = _options(args, kwargs)
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
    path = build_checkpoint(o["shape"], o["dtype"], o["cache_dir"], o["seed"])
    params, nbytes = weight_bytes(path, o["dtype"])
    ctx = {"shape": o["shape"], "dtype": o["dtype"], "path": path, "n": o["new_tokens"], "p": o["prompt_tokens"],
           "prompt_ids": SHAPES[o["shape"]].prompt_ids,
           "seed": o["seed"], "reps": o["reps"],
           "prompt": make_prompts(o["shape"], 1, o["prompt_tokens"], o["seed"])[0],  # [P] ids
           "max_len": o["prompt_tokens"] + o["new_tokens"] + 8, "ar_cache": {}, "ar_engines": {},
           "model": None, "hf": None}
    result = {"shape": o["shape"], "dtype": o["dtype"], "arch": SHAPES[o["shape"]].arch,
              "config": SHAPES[o["shape"]].config, "checkpoint": str(path), "params": params, "weight_bytes": nbytes,
              "prompt_tokens": o["prompt_tokens"], "new_tokens": o["new_tokens"], "phases": o["phases"],
              "reps": o["reps"], "device": device_name("cpu"), "machine": machine_info(), "embed_scale": EMBED_SCALE}
    bar = tqdm(o["phases"], desc="bench scale")
    for phase in bar:
        bar.set_postfix_str(phase)
        if phase not in ("bandwidth", "hf") and ctx["model"] is None:
            from funcspec.checkpoints import load_model

            ctx["model"] = load_model(path, dtype=DTYPES[o["dtype"]])
        _PHASE_FNS[phase](ctx, o, result)
    bar.close()
    _compare(result, ctx)
    stem = _write(result, Path(o["out"]) if o["out"] else RESULTS / device_name("cpu"))
    bad = [r for r in result.get("ar", []) if r.get("tokens_equal_hf") is False]
    if bad and not o["allow_mismatch"]:
        r = bad[0]
        raise RuntimeError(f"funcspec AR ({r['backend']}) greedy differs from HF greedy at token "
                           f"{r['first_mismatch_hf']} (results in {stem}.json); pass --allow-mismatch to accept "
                           "near-tie flips (bf16)")
    return result


def _phase_bandwidth(ctx, o, result):
    bw = copy_bandwidth(o["copy_mb"] or default_copy_mb())
    bw["bound_ms_per_token"] = result["weight_bytes"] / (bw["gb_per_s"] * 1e9) * 1e3
    # NOTE: a copy also pays write-allocate traffic the count above ignores, so a decode
    # step can beat this bound; the read-only (sum) bound is the tighter one.
    bw["read_bound_ms_per_token"] = result["weight_bytes"] / (bw["read_gb_per_s"] * 1e9) * 1e3
    result["bandwidth"] = bw


def _phase_hf(ctx, o, result):
    ctx["hf"] = hf_greedy(ctx["path"], o["dtype"], ctx["prompt"], ctx["n"], o["reps"])
    result["hf"] = ctx["hf"]


def _phase_ar(ctx, o, result):
    result["ar"] = [dict(ar_row(ctx, b)) for b in tqdm(o["backends"], desc="ar", leave=False)]


def _phase_sweep(ctx, o, result):
    backend = o["sweep_backend"]
    base = ar_row(ctx, backend)
    rows = [r for k in tqdm(o["ks"], desc="sweep", leave=False)
            for r in sweep_rows(ctx, backend, k, o["alphas"], base)]
    rows.sort(key=lambda r: (r["alpha"], r["k"]))
    result["sweep"] = {"backend": base["backend"], "ar_ms_per_token": base["ms_per_token"],
                       "ar_step_ms": base["step_ms"], "rows": rows}


def _phase_context(ctx, o, result):
    result["context"] = context_rows(ctx, o["sweep_backend"], o["contexts"])


def _phase_batch(ctx, o, result):
    result["batch"] = batch_rows(ctx, o["sweep_backend"], o["batches"])


def _phase_profile(ctx, o, result):
    result["profile"] = profile_step(ctx, o["profile_steps"])


def _phase_llamacpp(ctx, o, result):
    result["llamacpp"] = llamacpp_phase(ctx)


def _phase_quant(ctx, o, result):
    from funcspec.bench import quant

    quant.phase(ctx, o, result)


_PHASE_FNS = {"bandwidth": _phase_bandwidth, "hf": _phase_hf, "ar": _phase_ar, "sweep": _phase_sweep,
              "context": _phase_context, "batch": _phase_batch, "profile": _phase_profile,
              "llamacpp": _phase_llamacpp, "quant": _phase_quant}


def _compare(result: dict, ctx: dict) -> None:
    """Per AR row: tokens equal HF's, first mismatch, % of the bandwidth bound, speedup over HF."""
    hf, bound = result.get("hf"), result.get("bandwidth", {}).get("bound_ms_per_token")
    for r in result.get("ar", []):
        r["tokens_equal_hf"] = None if hf is None else r["tokens"] == hf["tokens"]
        r["first_mismatch_hf"] = None if hf is None else first_mismatch(r["tokens"], hf["tokens"])
        r["pct_of_bound"] = 100 * bound / r["ms_per_token"] if bound else None
        r["speedup_vs_hf"] = hf["ms_per_token"] / r["ms_per_token"] if hf else None
    if "ar" in result and hf is not None:
        result["hf_match"] = all(r["tokens_equal_hf"] for r in result["ar"])


# ------------------------------------------------------------------- outputs
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
             f"{c['kv_bytes_per_slot'] / 2**20:.0f} MiB KV per slot)\n")
    first = c["rows"][0]["context"]
    rows = [[str(x["context"]), f"{x['ms_per_token']:.2f}",
             " / ".join(f"{v:.2f}" for v in x.get("ms_per_token_passes", [])) or "-",
             f"{_f(x.get('vs_shortest'))}x", _f(x["step_ms"]), f"{x['prefill_s']:.3f}"] for x in c["rows"]]
    return _md_table(title, ["prompt tokens", "ms/token (mean of passes)", "ascending / descending pass",
                             f"vs {first}", "step ms", "prefill s"], rows)


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
            f"- ISA: {flags}", f"- torch {m['torch']}, CPU capability {m['cpu_capability']}", ""]


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


def _write(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"scale-{result['shape']}-{result['dtype']}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    Path(f"{stem}.md").write_text(markdown(result))
    plot(result, Path(f"{stem}.png"))
    print(markdown(result))
    print(f"wrote {stem}.json, .md and .png")
    return stem


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
