"""What this CPU can do, and memory laid out for streaming: the facts :func:`funcspec.kernels.resolve` reads.

Each question is asked of torch once and cached; nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import functools
import math
import platform
import sys

import torch

HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page: 2 MiB."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice that asks for transparent huge pages."""


@functools.cache
def is_x86() -> bool:
    """An x86-64 CPU (the one kind the ISA-specific kernel builds serve)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def x86_flags() -> frozenset[str]:
    """The x86 features this CPU and OS offer, by ``/proc/cpuinfo``'s names (Linux lists only what the kernel
    enabled, so AVX-512 state the OS does not save is absent); elsewhere what torch reports (``fma`` and ``f16c``
    with AVX2: every AVX2 CPU has them); empty off x86."""
    if not is_x86():
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = set()
    if torch.cpu._is_avx2_supported():
        have |= {"avx2", "fma", "f16c"}
    if torch.cpu._is_avx512_supported():
        have |= {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}
    if avx512_bf16():
        have.add("avx512_bf16")
    if vnni():
        have.add("avx512_vnni")
    return frozenset(have)


@functools.cache
def avx512_bf16() -> bool:
    """x86 with AVX-512 (F, BW, VL) and AVX512-BF16: what the streaming and decode attention kernels need."""
    return torch.cpu._is_avx512_bf16_supported()


@functools.cache
def amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later)."""
    return torch.cpu._is_amx_tile_supported()


@functools.cache
def vnni() -> bool:
    """VNNI (``vpdpbusd``: u8 x s8 dot products into int32)."""
    return torch.cpu._is_vnni_supported()


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 here (bf16 instructions, and a oneDNN build that has the kernels)."""
    return ((avx512_bf16() or amx()) and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _madvise():
    """libc's ``madvise``, or ``None`` off Linux."""
    if sys.platform != "linux":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the CPU, backed by transparent huge pages where Linux grants them (on any
    other ``device``: plain ``torch.empty``).

    NOTE: decode streams the packed weights (and reads the KV cache) once per
    step; with 4 KiB pages that is a TLB miss every 4 KiB. Many kernels only
    grant huge pages to memory that asks (``madvise``), as this VM's does, so
    the tensor is a 2 MiB-aligned view into a buffer one page larger, advised
    before anything touches it. The unaligned ends are never touched, so they
    take no memory (huge pages stream faster: graphs/results/notes/kernels.md).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if torch.device(device).type != "cpu" or madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # [bytes + one page]
    off = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + off, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # best effort: no check
    return raw[off:off + nbytes].view(dtype).view(shape)
