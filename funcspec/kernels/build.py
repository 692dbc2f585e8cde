"""The CPU kernels' library: compiled from :data:`SOURCES` on first use, loaded through ``ctypes``.

The kernels are compiled with ``$CXX`` (default ``g++``, which inductor needs
on the CPU anyway; about 2 s, 20 s on a busy 2-core machine; ``CXX`` may carry
arguments, as in ``CXX="ccache g++"``), cached under
``$XDG_CACHE_HOME/funcspec/kernels`` (else ``~/.cache/funcspec/kernels``) keyed
by the sources, compiler command and flags, and called through ``ctypes``;
OpenMP links to torch's own ``libgomp``, so they run on torch's threads
(``torch.set_num_threads``). Where they cannot be built (no compiler, another
ISA, a compile that outlasts :data:`BUILD_TIMEOUT_S`), :func:`available` is
false (warned once) and :func:`funcspec.kernels.resolve` picks other paths; so
it is, with no build and no warning, where ``FUNCSPEC_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from funcspec.kernels import cpu

SOURCES = tuple(Path(__file__).with_name(n) for n in ("stream.cpp", "attention.cpp", "quant.cpp", "moe.cpp"))
"""The CPU kernels, built into one library: the streaming products, the decode attention, the quantized products,
the routed experts."""
HEADERS = tuple(Path(__file__).with_name(n) for n in ("bf16.h", "stream.h", "quant.h"))
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
         "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
SWITCH = "FUNCSPEC_CPU_KERNELS"
"""The environment variable that turns the kernels off: ``0`` (unset, empty or ``1``: on)."""
TIMEOUT = "FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT"
"""The environment variable that sets the compile's time limit in seconds (default :data:`BUILD_TIMEOUT_S`)."""
BUILD_TIMEOUT_S = 300.0
"""A compile that runs longer is stopped (with every process it started) and the kernels are unavailable:
a hung compiler must not hang the engine that asked for them."""

# (C function, ctypes argument types) of every kernel in the library.
_SIGNATURES = {
    "funcspec_linear_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_linear_f32": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_attend_bf16": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int],
    "funcspec_attend_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int],
    "funcspec_qlinear_bf16": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
    "funcspec_qlinear_f32": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
    "funcspec_experts_bf16": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    "funcspec_experts_f32": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    "funcspec_qexperts_bf16": [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9 + [ctypes.c_int],
    "funcspec_qexperts_f32": [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9 + [ctypes.c_int],
}


def supported() -> bool:
    """Whether this CPU runs the kernels: x86 with AVX-512 (F, BW, VL), AVX512-BF16 and VNNI (every AVX512-BF16
    CPU so far: Cooper Lake, Sapphire Rapids, Zen 4)."""
    return cpu.avx512_bf16() and cpu.vnni()


def enabled() -> bool:
    """Whether the kernels may be used: :data:`SWITCH` (``FUNCSPEC_CPU_KERNELS``) is unset, empty or ``1``."""
    value = os.environ.get(SWITCH, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SWITCH} must be 0 (the CPU kernels off) or 1 (on), got {value!r}")
    return value != "0"


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/funcspec/kernels``, else ``~/.cache/funcspec/kernels``
    (an empty or relative ``XDG_CACHE_HOME`` is ignored, as the XDG base directory spec asks)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "funcspec" / "kernels"


def compiler() -> list[str]:
    """The compiler command: ``$CXX`` split as a shell splits it (a launcher and its compiler, ``ccache g++``,
    or a compiler and its own flags), default ``g++``, its first word resolved on ``PATH``."""
    cxx = os.environ.get("CXX", "")
    try:
        words = shlex.split(cxx) or ["g++"]
    except ValueError as e:  # NOTE: an unclosed quote; RuntimeError, as for a missing compiler: lib() warns
        raise RuntimeError(f"CXX={cxx!r} is not a command line: {e}") from None
    exe = shutil.which(words[0])
    if exe is None:
        where = f", the first word of CXX={cxx!r}" if cxx.strip() and cxx.strip() != words[0] else ""
        raise RuntimeError(f"no C++ compiler: set CXX or install g++ (looked for {words[0]!r}{where})")
    return [exe, *words[1:]]


def build_timeout() -> float:
    """The compile's time limit in seconds: :data:`TIMEOUT` (``FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT``), else
    :data:`BUILD_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT, "").strip()
    if not raw:
        return BUILD_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{TIMEOUT} must be a positive number of seconds, got {raw!r}")
    return seconds


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything it started (its own process group: g++'s cc1plus and as, a launcher's
    compiler), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, PermissionError):  # no process groups here, or already gone
        proc.kill()
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # NOTE: something outside the group still holds the pipes: stop reading
        proc.kill()
        proc.wait()


def _compile(cmd: list[str], timeout: float) -> None:
    """Run ``cmd`` in a process group of its own, stopped whole after ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError(f"building {' and '.join(p.name for p in SOURCES)} did not finish in {timeout:g} s "
                           f"and was stopped (set {TIMEOUT} to allow more): {shlex.join(cmd[:1])}") from None
    except BaseException:  # NOTE: an interrupt must not leave the compiler running
        _stop(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"building {' and '.join(p.name for p in SOURCES)} failed:\n{err}")


def build(cache: Path | None = None, timeout: float | None = None) -> Path:
    """Compile :data:`SOURCES` into one library in ``cache`` (default :func:`cache_dir`), once per sources, flags
    and compiler command, within ``timeout`` seconds (default :func:`build_timeout`); return it."""
    cache = cache_dir() if cache is None else Path(cache)
    cmd = compiler()
    timeout = build_timeout() if timeout is None else timeout
    if not 0 < timeout < math.inf:
        raise ValueError(f"build: timeout must be a positive number of seconds, got {timeout!r}")
    torch_lib = Path(torch.__file__).parent / "lib"
    flags = [*FLAGS, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *cmd, *flags]).encode()).hexdigest()[:16]
    lib = cache / f"stream-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # NOTE: built under a temporary name and renamed, so a concurrent process
    # never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        _compile([*cmd, *flags, *map(str, SOURCES), "-o", tmp], timeout)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The kernels' library (built on first call), or ``None`` where it cannot run or be built (warned once)."""
    if not supported():
        return None
    try:
        handle = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"funcspec: the CPU kernels are unavailable, products and attention fall back to "
                      f"oneDNN/MKL/SDPA: {e}", RuntimeWarning, stacklevel=3)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, None
    return handle


# NOTE: asked at trace time; compiled code takes the answer as a constant instead of tracing into the build.
@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernels run here and are not turned off (:func:`enabled`): built on first call; a failed
    build warns once. Turned off, nothing is built."""
    return enabled() and lib() is not None
