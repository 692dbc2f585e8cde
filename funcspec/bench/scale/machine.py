"""What ``bench scale`` records about the machine: the CPU, its ISA flags and caches, and the memory bandwidth
that bounds a decode step (weights streamed once per token)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_info() -> dict:
    """CPU model, threads, ISA flags (avx2 ... amx_tile), torch version, ATen's CPU capability, and the load
    average (1, 5, 15 minutes) when the run starts: other work on the cores slows every timing."""
    model, flags = "unknown", set[str]()
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
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average": list(os.getloadavg()),
            "kernels": kernel_choice()}


def kernel_choice() -> dict:
    """The CPU's kind, the kernel build ``Ops`` takes here and why, and the paths :func:`funcspec.kernels.resolve`
    chose (``ops``): machines differ, and a result is read against what ran."""
    import dataclasses

    from funcspec.kernels import build, resolve

    return {**build.explain(), "ops": dataclasses.asdict(resolve("cpu"))}


def kernel_line(m: dict) -> str:
    """A report's markdown line for :func:`kernel_choice` (empty for a result recorded before it existed)."""
    k = m.get("kernels")
    if not k:
        return ""
    paths = ", ".join(name for name, on in k["ops"].items() if on is True) or "none"
    streaming = k.get("streaming_build")  # absent from results recorded before it existed
    stream = f"; streaming products: {streaming} ({k['streaming_why']})" if streaming not in (None, k["build"]) else ""
    return (f"- Kernels: CPU kind {k['cpu_kind']}; build {k['build'] or 'none'} ({k['why']}){stream}; "
            f"paths: {paths}; routed experts: {k['ops']['routed_experts']}")


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
