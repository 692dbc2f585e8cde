"""GB/s of each CPU kernel build this machine runs (funcspec/kernels/build.py's BUILDS): bf16 and fp32
streaming products and 8-, 6- and 4-bit quantized products, at 1, 5 and 16 rows, on weights beyond the caches.

    python -m funcspec.bench.kernel_builds [--out graphs/results/cpu] [--reps 15]

The builds are interleaved rep by rep (each call timed alone, the median kept), so a busy moment of a shared
machine falls on every build alike. Writes ``kernel-builds-<time>.json`` and ``.md`` with the CPU model and
its flags as /proc/cpuinfo gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from funcspec.bench.scale.machine import machine_info
from funcspec.kernels import QuantFormat, build, quant, stream

ROWS = (1, 5, 16)
"""Row counts timed: a decode step, a K = 4 verify block, 16 rows."""


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cases(g: torch.Generator) -> dict:
    """name -> (bytes streamed, fn(x rows) -> out, x [16, K]): weights of 128 MB (bf16, fp32: 256 MB) and
    64 MB (q8, q4 with their fp16 scales)."""
    out: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {}
    for name, dtype, n, k in (("bf16", torch.bfloat16, 8192, 8192), ("fp32", torch.float32, 8192, 8192)):
        w = torch.randn(n, k, generator=g).to(dtype)
        packed = stream.pack_weight(w)
        del w
        out[name] = (packed.numel() * packed.element_size(), partial(stream.stream_op, packed=packed, bias=None, n=n),
                     torch.randn(16, k, generator=g).to(dtype))
    for name, bits, group, n, k in (("q8_0", 8, 32, 8192, 8192), ("q6_k", 6, 16, 8192, 8192),
                                    ("q4_0", 4, 32, 16384, 8192)):
        q = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
        qw, s, _ = quant.pack(q, (torch.rand(n, k // group, generator=g) * 0.01).half(), None, bits)
        del q
        fmt = QuantFormat(bits, group, n, k, False, name)
        p = {"qweight": qw, "scales": s, "format": fmt}
        out[name] = (fmt.bytes, partial(quant.qlinear, p=p), torch.randn(16, k, generator=g).to(torch.bfloat16))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="graphs/results/cpu")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    builds = build.builds()
    before = os.environ.get(build.SWITCH)
    work = cases(torch.Generator().manual_seed(0))
    times: dict[tuple[str, str, int], list[float]] = {(b, c, r): [] for b in builds for c in work for r in ROWS}
    try:
        for b in builds:  # built and loaded before any timing
            os.environ[build.SWITCH] = b
            build.reset()
            if build.lib() is None:
                raise RuntimeError(f"the {b} kernels could not be built")
        for _ in range(args.reps + 1):  # the first round warms up, untimed
            for b in builds:
                os.environ[build.SWITCH] = b
                build.reset()
                for c, (_, fn, x) in work.items():
                    for r in ROWS:
                        t0 = time.perf_counter()
                        fn(x[:r])
                        times[(b, c, r)].append(time.perf_counter() - t0)
    finally:
        if before is None:
            os.environ.pop(build.SWITCH, None)
        else:
            os.environ[build.SWITCH] = before
        build.reset()
    results = [{"build": b, "case": c, "rows": r, "bytes": work[c][0],
                "median_ms": 1e3 * statistics.median(times[(b, c, r)][1:]),
                "gb_s": work[c][0] / statistics.median(times[(b, c, r)][1:]) / 1e9}
               for b in builds for c in work for r in ROWS]
    report = {"machine": {**machine_info(), "cpuinfo_flags": cpu_flags()}, "builds": builds,
              "reps": args.reps, "results": results}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-builds-{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    lines = [f"# CPU kernel builds: GB/s streamed ({stamp} UTC)", "",
             (f"CPU: {m['cpu']}, {m['cores']} cores, torch threads {m['threads']}, load average at start "
              f"{', '.join(f'{a:.2f}' for a in m['load_average'])}."), "",
             f"/proc/cpuinfo flags: `{m['cpuinfo_flags']}`", "",
             (f"Median of {args.reps} calls per cell, the builds interleaved call by call. Weights: bf16 and fp32 "
              "8192x8192 (packed for the streaming products), q8_0 8192x8192 and q4_0 16384x8192 in groups of 32, "
              "q6_k 8192x8192 in groups of 16 (values and fp16 scales), bf16 activations for the quantized ones."), "",
             "| build | " + " | ".join(f"{c} {r} row{'s' if r > 1 else ''}" for c in work for r in ROWS) + " |",
             "|---|" + "---:|" * (len(work) * len(ROWS))]
    for b in builds:
        cells = [next(x for x in results if x["build"] == b and x["case"] == c and x["rows"] == r)["gb_s"]
                 for c in work for r in ROWS]
        lines.append(f"| {b} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    (out / f"kernel-builds-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
