"""Weight-streaming linear layers for CPU decode (x86 with AVX-512 and AVX512-BF16).

Decode multiplies a few rows (B·(K+1)) by weights far beyond the caches, so a
step costs what reading the weights once costs. oneDNN's bf16 GEMM and MKL's
fp32 products do not reach that here: on a 2-core Zen 4 EPYC, the 113 linears
of a Llama-3.2-1B shape (2.47 GB in bf16) streamed 27-30 GB/s through oneDNN's
pre-packed GEMM (:mod:`funcspec.nn.packed`) and 6-16 GB/s through MKL in fp32,
where llama.cpp streams about 35 GB/s over the same cores.

:file:`stream.cpp` packs W once (:func:`pack_weight`) into column blocks of 64
outputs, each one contiguous stream, and multiplies each block by broadcast
rows of x (``vdpbf16ps`` for bf16, ``vfmadd`` for fp32, fp32 accumulators that
are outputs: no horizontal sums): up to 6 rows per pass over all 64 columns,
7-12 in two halves of 32. Interleaved with oneDNN on the same weights it
streamed 33.5 GB/s at 1 and 5 rows against oneDNN's 27 and 30; dropping its
software prefetch later took it to 40 and 31 GB/s. From 6 rows on the compute
holds the loads back, so those passes prefetch the next chunk (8 rows then
cost 0.52-0.72x what two passes of 4 did). The threads take runs of blocks as
they free up (guided), not equal shares: this VM's cores differ in speed from
moment to moment.

Linears that read the same input (q/k/v, gate/up) can be one call over their
packed weights side by side (:func:`stream_linears`): a Llama decode step then
makes 65 calls instead of 113, and each call's Python costs ~10 us.

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

from funcspec.nn.packed import cached_pack, huge_empty

SOURCES = tuple(Path(__file__).with_name(n) for n in ("stream.cpp", "decode_attention.cpp"))
"""The CPU kernels, built into one library: these linear layers and :mod:`funcspec.nn.decode_attention`."""
HEADERS = (Path(__file__).with_name("bf16.h"),)
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
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int]
    for fn in (lib.funcspec_attend_bf16, lib.funcspec_attend_f32):
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
    w = w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1] // pair, pair).permute(0, 2, 1, 3)  # [N'/64, K'/P, 64, P]
    return huge_empty(w.shape, w.dtype).copy_(w)


def pack_weights(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Weights [N_i, K] of one input packed one after another (:func:`pack_weight` each): one stream
    whose outputs are the weights' outputs side by side, each but the last padded to whole blocks."""
    parts = [pack_weight(w) for w in weights]  # [ceil(N_i/64), K'/P, 64, P] each
    return torch.cat(parts, out=huge_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype))


def _widths(weights) -> list[int]:
    """The columns each weight's outputs take in the group's product: padded to whole blocks, the last one not."""
    return [-(-w.shape[0] // BLOCK) * BLOCK for w in weights[:-1]] + [weights[-1].shape[0]]


def out_features(weights) -> int:
    """Columns of the group's product (:func:`_widths`)."""
    return weights[0].shape[0] if len(weights) == 1 else sum(_widths(weights))


def _check(x: torch.Tensor, weights, biases) -> None:
    """The kernel reads raw memory: a wrong dtype or shape must fail here, not read out of bounds."""
    if not weights or len(biases) != len(weights):
        raise ValueError(f"stream_linear: weights must be one or more, with one bias (or None) each, "
                         f"got {len(weights)} weights and {len(biases)} biases")
    for weight, bias in zip(weights, biases):
        if x.dtype not in DTYPES or weight.dtype != x.dtype:
            raise ValueError(f"stream_linear: x and weight must both be bfloat16 or float32, "
                             f"got x {x.dtype} and weight {weight.dtype}")
        if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
            raise ValueError(f"stream_linear: weight must be [out, {x.shape[-1]}] for x [..., {x.shape[-1]}], "
                             f"got weight {list(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"stream_linear: bias must be [{weight.shape[0]}], got {list(bias.shape)}")


def _group_bias(weights, biases, dtype) -> torch.Tensor | None:
    """The biases side by side as the group's outputs lie (zeros for a weight without one), or ``None``."""
    if all(b is None for b in biases):
        return None
    if len(biases) == 1:
        return biases[0].to(dtype).contiguous()  # [n]
    parts = [torch.zeros(w.shape[0], dtype=dtype) if b is None else b.to(dtype) for w, b in zip(weights, biases)]
    return torch.cat([F.pad(b, (0, n - b.shape[0])) for b, n in zip(parts, _widths(weights))])  # [out_features]


def _stream_linear(x: torch.Tensor, weights: list, biases: list) -> torch.Tensor:
    # NOTE: a decode step makes 65 of these calls, so the body keeps to the few
    # torch calls it needs (each costs 1-3 us from Python): x is passed as it
    # lies when contiguous, and the output is allocated in its final shape.
    _check(x, weights, biases)
    n = out_features(weights)
    if x.dtype == torch.bfloat16 and x.shape[-1] % 2:
        x = F.pad(x, (0, 1))  # [..., K + 1]: the kernel reads bf16 in k pairs
    if not x.is_contiguous():
        x = x.contiguous()
    if len(weights) == 1:
        packed = cached_pack(weights[0], pack_weight)  # [N'/64, K'/P, 64, P]
    else:
        packed = cached_pack(tuple(weights), pack_weights)  # [sum N_i'/64, K'/P, 64, P]
    b = _group_bias(weights, biases, x.dtype)  # [n] or None
    out = x.new_empty((*x.shape[:-1], n))  # [..., n]
    k = x.shape[-1]
    rows = x.numel() // k
    lib = _lib()
    fn = lib.funcspec_linear_bf16 if x.dtype == torch.bfloat16 else lib.funcspec_linear_f32
    threads = 1 if rows * n * k < SERIAL_MACS else torch.get_num_threads()
    fn(x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), rows, n, k, threads)
    return out


def _stream_linear_meta(x: torch.Tensor, weights: list, biases: list) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features(weights)))


# NOTE: a raw Library op, as funcspec::packed_linear (torch.library.custom_op's
# Python wrapper costs ~25 us a call, ~3 ms on a 113-linear decode step).
_LIB = torch.library.Library("funcspec", "FRAGMENT")
_LIB.define("stream_linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIB.impl("stream_linear", _stream_linear, "CPU")
_LIB.impl("stream_linear", _stream_linear_meta, "Meta")


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for x [..., in] and W [out, in] of one dtype (bf16 or fp32) on the CPU.

    Needs :func:`available`; a row's result is bitwise the same whatever rows come with it.
    """
    return torch.ops.funcspec.stream_linear(x, [weight], [bias])


def stream_linears(x: torch.Tensor, weights, biases=None) -> list[torch.Tensor]:
    """``[x @ W_i.T (+ b_i)]`` for weights W_i [out_i, in] of one input x [..., in], in one pass over them all.

    Fusing q/k/v and gate/up streams one packed weight per group instead of one
    per linear: 65 calls instead of 113 on a Llama decode step, each a longer
    stream with one fork and join of the threads. Each output's bits are those
    of :func:`stream_linear` on its own weight (same k order). The results are
    views of one [..., sum out_i] product, each a slice of the last dim.
    """
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    out = torch.ops.funcspec.stream_linear(x, weights, biases)  # [..., out_features]
    parts = out.split(_widths(weights), -1)  # one call for all the views; then drop any block padding
    return [p if p.shape[-1] == w.shape[0] else p[..., :w.shape[0]] for p, w in zip(parts, weights)]
