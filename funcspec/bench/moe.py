"""``funcspec bench moe``: the routed-expert kernel against the bytes it must stream, and against the reference.

One MoE layer's routed experts (default: Qwen3-30B-A3B's, H = 2048, E = 128,
top-8, I = 768, bf16; ``--quantization int8|int4``: its experts quantized on load,
through the quantized kernel) at each T of ``--tokens``: every call draws a fresh
random routing (each token k distinct experts, uniform), so the experts it
selects are not in the caches. Per T the result records

- the union of the selected experts (mean size, against its expectation
  ``E·(1 - (1 - k/E)^T)``) and its bytes, which a call must stream at least;
- the kernel's wall time per call (``Ops.experts`` on prepared params) and the
  union bytes over it (GB/s);
- the bound (:func:`dense_bound`): as many experts' packed blocks (a random run) as
  the union holds, streamed as two dense one-row products through the same
  tiles (:func:`funcspec.kernels.stream.stream_op`), right after each kernel
  call; the kernel's GB/s over the bound's is the fraction it reaches;
- the torch reference (every expert on every token) and its time over the
  kernel's;
- the share of the CPUs that other processes used meanwhile (a shared machine).

Results go to ``graphs/results/<device>/moe-<time>.json`` and ``.md``, with
the CPU and its ISA flags.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from funcspec.bench.capture import write_result
from funcspec.bench.runtime import _cpu_seconds, _others_share
from funcspec.bench.scale import machine_info
from funcspec.kernels import moe

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def expected_union(e: int, k: int, t: int) -> float:
    """The mean number of distinct experts T tokens select, each k distinct of E uniformly."""
    return e * (1 - (1 - k / e) ** t)


def union_bytes(ids: torch.Tensor, p: dict) -> int:
    """The bytes of the experts ids [T, k] select: what a call streams at least."""
    return int(torch.unique(ids).numel()) * moe.expert_bytes(p)


def random_routing(t: int, k: int, e: int, g: torch.Generator) -> tuple:
    """ids [T, k] (k distinct experts a token) and softmax-like weights [T, k] that sum to 1."""
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def layer(o) -> tuple:
    """(raw params, prepared params, Ops) of one random layer of the options' shape."""
    from funcspec import kernels
    from funcspec.quant import prepare_params

    ops = kernels.resolve("cpu")
    if ops.routed_experts != "cpu_kernel":
        raise SystemExit("funcspec bench moe: the routed-expert CPU kernel is not available here "
                         "(it needs a C++ compiler, an x86 or ARM CPU, and FUNCSPEC_CPU_KERNELS not 0)")
    g, dtype = torch.Generator().manual_seed(o.seed), DTYPES[o.dtype]
    raw = {"gate_up_proj": {"weight": (torch.randn(o.experts, 2 * o.intermediate, o.hidden, generator=g)
                                       * 0.02).to(dtype)},
           "down_proj": {"weight": (torch.randn(o.experts, o.hidden, o.intermediate, generator=g) * 0.02).to(dtype)}}
    quantization = getattr(o, "quantization", None)
    p = prepare_params({"experts": raw}, ops, quantization=quantization)["experts"]
    if quantization and "qweight" not in p["gate_up_proj"]:
        raise SystemExit(f"funcspec bench moe: --quantization {quantization} does not take this shape (I must be a "
                         f"multiple of 32 and of the group)")
    return raw, p, ops


def dense_bound(p: dict, u: int, start: int) -> float:
    """Seconds to stream experts ``start .. start + u - 1``'s packed gate_up and down blocks (the bytes of a union
    of u experts, contiguous) as two dense one-row products through the same tiles: the rate a union of u
    experts could be streamed at if it were one weight."""
    from funcspec.kernels import quant, stream

    t0 = time.perf_counter()
    if "qweight" in p["gate_up_proj"]:  # the same union of quantized blocks as one quantized weight
        for w in (p["gate_up_proj"], p["down_proj"]):
            f = w["format"]
            n = w["qweight"].shape[1] * quant.QB * u  # every block of u experts, as the rows of one weight
            one = {k: w[k][start:start + u].reshape(-1, *w[k].shape[2:]) for k in ("qweight", "scales", "offsets")
                   if k in w}
            fmt = quant.QuantFormat(f.bits, f.group, n, f.in_features, f.asym, f.name)
            quant.qlinear(torch.ones(1, f.in_features, dtype=torch.bfloat16), {**one, "format": fmt})
        return time.perf_counter() - t0
    for packed in (p["gate_up_proj"]["packed"], p["down_proj"]["packed"]):
        w = packed[start:start + u].reshape(-1, *packed.shape[2:])  # [u·blocks, K/P, 64, P]: a view
        x = torch.ones(1, w.shape[1] * w.shape[3], dtype=w.dtype)
        stream.stream_op(x, w, None, w.shape[0] * stream.BLOCK)
    return time.perf_counter() - t0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(o, t: int, raw: dict, p: dict, ops) -> dict:
    """One T: ``--reps`` kernel calls, each with a fresh routing and followed by :func:`dense_bound` over as many
    experts as it selected, then ``--reference-reps`` reference calls."""
    from funcspec.kernels import REFERENCE

    g = torch.Generator().manual_seed(o.seed + 100 + t)
    dtype = DTYPES[o.dtype]
    for _ in range(2):  # warm-up
        ids, w = random_routing(t, o.top_k, o.experts, g)
        ops.experts(torch.randn(t, o.hidden, generator=g).to(dtype), ids, w, p)
        dense_bound(p, o.top_k, 0)
    calls, before = [], _cpu_seconds()
    for _ in range(o.reps):
        ids, w = random_routing(t, o.top_k, o.experts, g)
        x = torch.randn(t, o.hidden, generator=g).to(dtype)
        s = timed(lambda: ops.experts(x, ids, w, p))  # noqa: B023 (called at once, in this iteration)
        u, nbytes = int(torch.unique(ids).numel()), union_bytes(ids, p)
        start = int(torch.randint(0, o.experts - u + 1, (), generator=g))
        calls.append({"union": u, "bytes": nbytes, "s": s, "bound_gbps": nbytes / dense_bound(p, u, start) / 1e9})
    others = _others_share(before, _cpu_seconds())
    ref = []
    for _ in range(o.reference_reps):
        ids, w = random_routing(t, o.top_k, o.experts, g)
        x = torch.randn(t, o.hidden, generator=g).to(dtype)
        q = p if "qweight" in p["gate_up_proj"] else raw
        ref.append(timed(lambda: REFERENCE.experts(x, ids, w, q)))  # noqa: B023 (called at once, in this iteration)
    ms = statistics.median(c["s"] for c in calls) * 1e3
    gbps = [c["bytes"] / c["s"] / 1e9 for c in calls]
    return {"tokens": t, "mean_union": statistics.mean(c["union"] for c in calls),
            "expected_union": expected_union(o.experts, o.top_k, t),
            "union_mib": statistics.mean(c["bytes"] for c in calls) / 2**20, "kernel_ms": ms,
            "gb_per_s": statistics.median(gbps), "bound_gb_per_s": statistics.median(c["bound_gbps"] for c in calls),
            "of_bound": statistics.median(x / c["bound_gbps"] for x, c in zip(gbps, calls)),
            "reference_ms": statistics.median(ref) * 1e3, "reference_over_kernel": statistics.median(ref) * 1e3 / ms,
            "others_cpu_share": others, "calls": calls}


def run(o) -> dict:
    """``funcspec bench moe``: :func:`measure` at each T; writes JSON and markdown."""
    torch.set_num_threads(o.threads)
    raw, p, ops = layer(o)
    rows = [measure(o, t, raw, p, ops) for t in (int(x) for x in o.tokens.split(","))]
    machine = machine_info()
    result = {"bench": "moe", "time": time.strftime("%Y%m%d-%H%M%S"), "machine": machine,
              "shape": {"hidden": o.hidden, "experts": o.experts, "top_k": o.top_k, "intermediate": o.intermediate,
                        "dtype": o.dtype, "quantization": getattr(o, "quantization", None),
                        "expert_bytes": moe.expert_bytes(p)},
              "threads": o.threads, "reps": o.reps, "reference_reps": o.reference_reps,
              "load_average": os.getloadavg(), "rows": rows}
    path = write_result(result, o.out, markdown)
    print(markdown(result))
    print(f"wrote {path} and .md")
    return result


def markdown(r: dict) -> str:
    s, m = r["shape"], r["machine"]
    per_expert = s.get("expert_bytes", 3 * s["hidden"] * s["intermediate"] * DTYPES[s["dtype"]].itemsize)
    weights = f"experts {s['quantization']} (quantized on load), activations {s['dtype']}" \
        if s.get("quantization") else s["dtype"]
    lines = [f"# funcspec bench moe: routed experts, H={s['hidden']}, E={s['experts']}, top-{s['top_k']}, "
             f"I={s['intermediate']}, {weights}", "",
             f"One MoE layer's routed experts through the CPU kernel (`Ops.experts` on prepared params), "
             f"{r['threads']} threads. Every call draws a fresh random routing (each token {s['top_k']} distinct "
             f"experts, uniform); medians over {r['reps']} calls per T. The union is the experts a call selects, "
             f"{per_expert / 2**20:.2f} MiB each: what it must stream. The bound streams as many experts' "
             f"packed blocks as two dense one-row products through the same tiles (the union's bytes as if they "
             f"were one weight), right after each kernel call; 'of bound' is the median of the kernel's GB/s over "
             f"the bound's, call by call. The reference runs every "
             f"expert on every token ({r['reference_reps']} calls per T).", "",
             "A verify block of T tokens costs its union: 'vs T=1' is the kernel's time over one token's, to set "
             "beside the mean union over k. 'of bound' near 1 says the kernel streams the union as fast as one "
             "dense weight of its bytes (the bound also pays a second call's fixed cost).", "",
             "| T | mean union (expected) | union MiB | kernel ms | vs T=1 | GB/s | bound GB/s | of bound | "
             "reference ms | reference / kernel | others' CPU share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    one = r["rows"][0]["kernel_ms"]
    for x in r["rows"]:
        lines.append(f"| {x['tokens']} | {x['mean_union']:.1f} ({x['expected_union']:.1f}) | {x['union_mib']:.0f} | "
                     f"{x['kernel_ms']:.2f} | {x['kernel_ms'] / one:.2f} | {x['gb_per_s']:.1f} | "
                     f"{x['bound_gb_per_s']:.1f} | "
                     f"{x['of_bound']:.2f} | {x['reference_ms']:.1f} | {x['reference_over_kernel']:.1f}x | "
                     f"{x['others_cpu_share']:.0%} |")
    lines += ["", "## Machine", "", f"- CPU: {m['cpu']} ({m['cores']} logical cores)",
              "- ISA: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items()),
              f"- torch {m['torch']}, CPU capability {m['cpu_capability']}",
              f"- load average at the end: {', '.join(f'{x:.2f}' for x in r['load_average'])}", ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    """Register ``funcspec bench moe``."""
    p = kinds.add_parser("moe", help="the routed-expert CPU kernel: GB/s of the selected experts, vs the reference")
    p.add_argument("--tokens", default="1,2,3,5,9", help="token counts T (default %(default)s)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--quantization", choices=("int8", "int8-g32", "int4", "int4-g128"), default=None,
                   help="quantize the experts on load (the quantized kernel); default: float")
    p.add_argument("--reps", type=int, default=40, help="kernel calls per T")
    p.add_argument("--reference-reps", type=int, default=3, help="reference calls per T")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory (default graphs/results/<device>)")
    p.set_defaults(func=run)
