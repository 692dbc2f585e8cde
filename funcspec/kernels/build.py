"""The CPU kernels' library: compiled from :data:`SOURCES` on first use, loaded through ``ctypes``.

The kernels are compiled with ``$CXX`` (default ``g++``, which inductor needs
on the CPU anyway; about 2 s), cached under ``~/.cache/funcspec/kernels`` keyed
by the sources, compiler and flags, and called through ``ctypes``; OpenMP links
to torch's own ``libgomp``, so they run on torch's threads
(``torch.set_num_threads``). Where they cannot be built (no compiler, another
ISA), :func:`available` is false and :func:`funcspec.kernels.resolve` picks
other paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from funcspec.kernels import cpu

SOURCES = tuple(Path(__file__).with_name(n) for n in ("stream.cpp", "attention.cpp", "quant.cpp"))
"""The CPU kernels, built into one library: the streaming products, the decode attention, the quantized products."""
HEADERS = (Path(__file__).with_name("bf16.h"),)
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
         "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
CACHE = Path.home() / ".cache" / "funcspec" / "kernels"

# (C function, ctypes argument types) of every kernel in the library.
_SIGNATURES = {
    "funcspec_linear_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_linear_f32": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_attend_bf16": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int],
    "funcspec_attend_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int],
    "funcspec_qlinear_bf16": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
    "funcspec_qlinear_f32": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
}


def supported() -> bool:
    """Whether this CPU runs the kernels: x86 with AVX-512 (F, BW, VL), AVX512-BF16 and VNNI (every AVX512-BF16
    CPU so far: Cooper Lake, Sapphire Rapids, Zen 4)."""
    return cpu.avx512_bf16() and cpu.vnni()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(cache: Path = CACHE) -> Path:
    """Compile :data:`SOURCES` into one library in ``cache`` (once per sources, flags and compiler); return it."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: set CXX or install g++ (looked for {os.environ.get('CXX', 'g++')!r})")
    torch_lib = Path(torch.__file__).parent / "lib"
    flags = [*FLAGS, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cxx, *flags]).encode()).hexdigest()[:16]
    lib = cache / f"stream-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # NOTE: built under a temporary name and renamed, so a concurrent process
    # never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {' and '.join(p.name for p in SOURCES)} failed:\n{e.stderr}") from e
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
    """Whether the kernels run here (built on first call; a failed build warns once)."""
    return lib() is not None
