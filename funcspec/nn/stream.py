"""Weight-streaming linear layers for CPU decode (x86 with AVX-512 and AVX512-BF16).

Decode multiplies a few rows (B·(K+1)) by weights far beyond the caches, so a
step costs what reading the weights once costs. oneDNN's bf16 GEMM and MKL's
fp32 products do not reach that here: on a 2-core Zen 4 EPYC, the 113 linears
of a Llama-3.2-1B shape (2.47 GB in bf16) streamed 27-30 GB/s through oneDNN's
pre-packed GEMM (:mod:`funcspec.nn.packed`) and 6-16 GB/s through MKL in fp32,
where llama.cpp streams about 35 GB/s over the same cores.

:file:`stream.cpp` packs W once (:func:`pack_weight`) into column blocks of 64
outputs, each one contiguous stream, and multiplies each block by up to 6
broadcast rows of x per pass (``vdpbf16ps`` for bf16, ``vfmadd`` for fp32, fp32
accumulators that are outputs: no horizontal sums). Interleaved with oneDNN on
the same weights it streamed 33.5 GB/s at 1 and 5 rows against oneDNN's 27 and
30; dropping its software prefetch later took it to 40 and 31 GB/s.

Every output element sums over k in one fixed order whatever the row count, so
a row's result does not depend on the rows beside it: AR (1 row) and
verification (K+1 rows, B·(K+1) in a batch) agree bit for bit, and greedy
speculation equals greedy AR.

The packed copy lives in :mod:`funcspec.nn.packed`'s side table (keyed by the
weight's address and version, so params stay plain tensors): like oneDNN's, it
doubles the model's memory. The kernel is compiled on first use with ``$CXX``
(default ``g++``, which inductor needs on the CPU anyway; about 2 s), cached
under ``~/.cache/funcspec/kernels`` keyed by the source, compiler and flags, and
called through ``ctypes``; OpenMP links to torch's own ``libgomp``, so it runs
on torch's threads (``torch.set_num_threads``). Where it cannot be built (no
compiler, another ISA), :func:`available` is false and
:func:`~funcspec.nn.llama.project` keeps its other paths. :func:`stream_linear`
is a custom op, opaque to ``torch.compile``.
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
import torch.nn.functional as F

from funcspec.nn.packed import cached_pack, linear_meta

SOURCE = Path(__file__).with_name("stream.cpp")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
         "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
CACHE = Path.home() / ".cache" / "funcspec" / "kernels"
SERIAL_MACS = 1 << 18
"""Products of fewer multiply-adds run on one thread: waking the pool costs more."""


def supported() -> bool:
    """Whether this CPU runs the kernel: x86 with AVX-512 (F, BW, VL) and AVX512-BF16."""
    return torch.cpu._is_avx512_bf16_supported()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(cache: Path = CACHE) -> Path:
    """Compile :file:`stream.cpp` into ``cache`` (once per source, flags and compiler); return the library."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: set CXX or install g++ (looked for {os.environ.get('CXX', 'g++')!r})")
    torch_lib = Path(torch.__file__).parent / "lib"
    flags = [*FLAGS, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, *flags]).encode()).hexdigest()[:16]
    lib = cache / f"stream-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # NOTE: built under a temporary name and renamed, so a concurrent process
    # never loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{e.stderr}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if not supported():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"funcspec: the weight-streaming CPU kernel is unavailable, linears fall back to "
                      f"oneDNN/MKL: {e}", RuntimeWarning, stacklevel=3)
        return None
    args = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    for fn in (lib.funcspec_linear_bf16, lib.funcspec_linear_f32):
        fn.argtypes, fn.restype = args, None
    return lib


# NOTE: project() asks at trace time; compiled code takes the answer as a constant
# instead of tracing into the build.
@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether :func:`stream_linear` runs here (built on first call; a failed build warns once)."""
    return _lib() is not None


DTYPES = (torch.bfloat16, torch.float32)
BLOCK = 64
"""Outputs per column block of the packed layout (stream.cpp's ``BLOCK``)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the kernel's layout: column blocks of 64 outputs, each one contiguous stream.

    bf16 [ceil(N/64), K/2, 64, 2] (k pairs, what ``vdpbf16ps`` multiplies), fp32
    [ceil(N/64), K, 64]. N is zero-padded to a whole block and bf16's K to even.
    """
    n, k = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    w = F.pad(weight.detach(), (0, -k % pair, 0, -n % BLOCK))  # [N', K']
    w = w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1] // pair, pair)  # [N'/64, 64, K'/P, P]
    return w.permute(0, 2, 1, 3).contiguous()  # [N'/64, K'/P, 64, P]


def _check(x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """The kernel reads raw memory: a wrong dtype or shape must fail here, not read out of bounds."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"stream_linear: x and weight must both be bfloat16 or float32, "
                         f"got x {x.dtype} and weight {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"stream_linear: weight must be [out, {x.shape[-1]}] for x [..., {x.shape[-1]}], "
                         f"got weight {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"stream_linear: bias must be [{weight.shape[0]}], got {list(bias.shape)}")


def _stream_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    _check(x, weight, bias)
    rows, n = x.numel() // x.shape[-1], weight.shape[0]
    x2 = x.reshape(rows, x.shape[-1])  # [rows, K]
    if x.dtype == torch.bfloat16 and x2.shape[1] % 2:
        x2 = F.pad(x2, (0, 1))  # [rows, K + 1]: the kernel reads bf16 in k pairs
    x2 = x2.contiguous()
    packed = cached_pack(weight, pack_weight)  # [N'/64, K'/P, 64, P]
    b = None if bias is None else bias.to(x.dtype).contiguous()  # [N]
    out = x.new_empty((rows, n))  # [rows, N]
    lib = _lib()
    fn = lib.funcspec_linear_bf16 if x.dtype == torch.bfloat16 else lib.funcspec_linear_f32
    threads = 1 if rows * n * x2.shape[1] < SERIAL_MACS else torch.get_num_threads()
    fn(x2.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
       rows, n, x2.shape[1], threads)
    return out.view(*x.shape[:-1], n)


# NOTE: a raw Library op, as funcspec::packed_linear (torch.library.custom_op's
# Python wrapper costs ~25 us a call, ~3 ms on a 113-linear decode step).
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("stream_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("stream_linear", _stream_linear, "CPU")
_LIB.impl("stream_linear", linear_meta, "Meta")


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for x [..., in] and W [out, in] of one dtype (bf16 or fp32) on the CPU.

    Needs :func:`available`; a row's result is bitwise the same whatever rows come with it.
    """
    return torch.ops.funcspec.stream_linear(x, weight, bias)
