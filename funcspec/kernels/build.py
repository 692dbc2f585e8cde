"""The CPU kernels' library: one build per ISA, compiled from :data:`SOURCES` on first use, loaded through ``ctypes``.

Every build (:data:`BUILDS`) compiles the same sources with its own flags and
``-DFUNCSPEC_ISA_<NAME>``: ``avx512bf16`` (AVX-512 intrinsics, ``vdpbf16ps``
and VNNI), ``avx512``, ``avxvnni``, ``avx2`` and ``portable`` (the same kernels
written with GCC/Clang vector extensions, which the compiler lowers to the ISA
of its flags; ``portable`` has none, so it is SSE2 on x86-64 and NEON on
AArch64; the avxvnni build sums the quantized products' integer dots with
AVX-VNNI, the avx512 and avx2 builds with AVX2's byte products, as llama.cpp's
AVX2 kernels do). Each has
the C ABI of :data:`_SIGNATURES`, and in each a row's result does not depend on
the rows beside it. The build is picked at first use (:func:`selected`): the
best this CPU runs (:data:`ORDER`), or the one :data:`SWITCH` names; the
streaming products may take another where it streams faster on this CPU's kind
(:func:`streaming`).

The kernels are compiled with ``$CXX`` (default ``g++``, which inductor needs
on the CPU anyway; seconds, longer on a busy machine; ``CXX`` may carry
arguments, as in ``CXX="ccache g++"``), cached under
``$XDG_CACHE_HOME/funcspec/kernels`` (else ``~/.cache/funcspec/kernels``) keyed
by the sources, compiler command and flags, and called through ``ctypes``;
OpenMP links to torch's own ``libgomp``, so they run on torch's threads
(``torch.set_num_threads``). Where they cannot be built (no compiler, a
compile that outlasts :data:`BUILD_TIMEOUT_S`), :func:`available` is false
(warned once) and :func:`funcspec.kernels.resolve` picks other paths; so it is,
with no build and no warning, where ``FUNCSPEC_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from funcspec.kernels import cpu, locks

SOURCES = tuple(Path(__file__).with_name(n) for n in ("stream.cpp", "attention.cpp", "quant.cpp", "moe.cpp"))
"""The CPU kernels, built into one library: the streaming products, the decode attention, the quantized products,
the routed experts."""
HEADERS = tuple(Path(__file__).with_name(n) for n in ("bf16.h", "simd.h", "stream.h", "quant.h"))
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-Wno-psabi")
"""The flags of every build; each adds its own (:data:`BUILDS`)."""
TORCH_OPS = Path(__file__).with_name("torch_ops.cpp")
"""The kernel ops' CPU side (``funcspec::stream_linear``, ``::qlinear``, ``::decode_attention``): checks, output
and the call into the kernels, in C++, so a call costs no Python. Built once per torch (it includes torch's
headers and links its libraries), not per ISA, and pointed at the chosen builds' kernels by :func:`bind`."""
TORCH_OPS_FLAGS = ("-O2", "-std=c++20", "-shared", "-fPIC", "-Wno-psabi")


@dataclasses.dataclass(frozen=True)
class Build:
    """One build of the kernels: its compiler flags and the x86 feature flags (``/proc/cpuinfo``'s names) a CPU
    needs to run it."""

    flags: tuple[str, ...]
    needs: tuple[str, ...]
    x86: bool = True


BUILDS = {
    "avx512bf16": Build(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"),
                        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")),
    "avx512": Build(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"),
                    ("avx512f", "avx512bw", "avx512vl", "fma", "f16c")),
    "avxvnni": Build(("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": Build(("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "portable": Build((), (), x86=False),
}
"""The builds, by name; ``avx512bf16`` is written with AVX-512 intrinsics, the others with simd.h's vectors (and
for the quantized integer dots, quant.h's unit_dots: AVX-VNNI's ``vpdpbusd`` on ``avxvnni``, the AVX2 CPUs of
Intel since Alder Lake; AVX2's byte products on ``avx512`` and ``avx2``)."""
ORDER = ("avx512bf16", "avx512", "avxvnni", "avx2", "portable")
"""The builds from best to last: the first one a CPU runs is its default."""
SWITCH = "FUNCSPEC_CPU_KERNELS"
"""The environment variable that picks the kernels: ``0`` off; unset, empty or ``1``: the best build this CPU
runs; or a build's name (:data:`BUILDS`) to force it."""
TIMEOUT = "FUNCSPEC_CPU_KERNELS_BUILD_TIMEOUT"
"""The environment variable that sets the compile's time limit in seconds (default :data:`BUILD_TIMEOUT_S`)."""
BUILD_TIMEOUT_S = 300.0
"""A compile that runs longer is stopped (with every process it started) and the kernels are unavailable:
a hung compiler must not hang the engine that asked for them."""

# (C function, ctypes argument types) of every kernel in the library.
_SIGNATURES = {
    "funcspec_linear_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_linear_f32": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    "funcspec_attend_bf16": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 15 + [ctypes.c_float, ctypes.c_int],
    "funcspec_attend_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 15 + [ctypes.c_float, ctypes.c_int],
    "funcspec_qlinear_bf16": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
    "funcspec_qlinear_f32": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2,
    "funcspec_experts_bf16": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    "funcspec_experts_f32": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    "funcspec_qexperts_bf16": [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9 + [ctypes.c_int],
    "funcspec_qexperts_f32": [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 9 + [ctypes.c_int],
    "funcspec_set_quant_prefetch": [ctypes.c_int64],
}


def missing(name: str) -> list[str]:
    """The CPU features this CPU lacks to run build ``name`` (empty: it runs it)."""
    b = BUILDS[name]
    if b.x86 and not cpu.is_x86():
        return ["x86-64"]
    have = cpu.x86_flags()
    return [f for f in b.needs if f not in have]


def supported(name: str | None = None) -> bool:
    """Whether this CPU runs build ``name`` (default: any; ``portable`` runs on every CPU)."""
    return not missing(name) if name is not None else any(not missing(n) for n in ORDER)


def builds() -> list[str]:
    """The builds this CPU runs, best first."""
    return [n for n in ORDER if not missing(n)]


def choice() -> str | None:
    """The build :data:`SWITCH` asks for as the environment has it now: ``None`` (``0``: off), this CPU's best
    (unset, empty or ``1``), or the build it names; ``ValueError`` for any other value, and for a build this
    CPU cannot run (naming the features it lacks)."""
    value = os.environ.get(SWITCH, "").strip()
    if value == "0":
        return None
    if value in ("", "1"):
        return builds()[0]
    if value not in BUILDS:
        raise ValueError(f"{SWITCH} must be 0 (the CPU kernels off), 1 (on: the best build for this CPU) or a "
                         f"build's name, one of {', '.join(ORDER)}; got {value!r}")
    lacks = missing(value)
    if lacks:
        raise ValueError(f"{SWITCH}={value}: this CPU cannot run the {value} kernels, it lacks "
                         f"{', '.join(lacks)} (it runs {', '.join(builds())})")
    return value


def enabled() -> bool:
    """Whether the kernels may be used: :data:`SWITCH` (``FUNCSPEC_CPU_KERNELS``) is not ``0`` (checked now)."""
    return choice() is not None


@functools.cache
def selected() -> str | None:
    """The build the kernels take, fixed at first use: :func:`choice` then (``None``: off). :func:`reset` forgets it."""
    return choice()


def reset() -> None:
    """Forget the builds :func:`selected` and :func:`streaming` fixed, so the next use reads :data:`SWITCH`
    again (tests, benchmarks). Ops already bound are pointed at the new choice now: a graph compiled before
    calls them without asking (where the new choice has no kernels, they raise)."""
    selected.cache_clear()
    streaming.cache_clear()
    ops = torch_ops() if torch_ops.cache_info().currsize else None  # the ops' library, if ever loaded
    _BOUND.clear()
    if ops is not None and not bind():
        ops.funcspec_ops_bind(*[None] * 6)


STREAMING_OVERRIDE = {"x86 AMX": ("avx512bf16", "avx512")}
"""CPU kind -> (default build, the build its bf16/fp32 streaming products take instead). On Intel's AMX cores
``vdpbf16ps`` streams bf16 weights slower than the avx512 build's widening FMAs, at 1 row and at 16 (on Zen 4 it
is the other way round), while VNNI keeps the quantized products best on avx512bf16:
graphs/results/cpu/kernel-builds-20261205-005240.md. AMX tiles did not beat VNNI's quantized products at 1-16
rows (graphs/results/cpu/kernel-builds-20261205-064844.md), so no build uses them."""


QUANT_PREFETCH = {"x86 AMX": 3072}
"""CPU kind -> how many bytes ahead the quantized products (the avx512bf16 build's tile) prefetch their weights;
other kinds leave it to the hardware prefetcher. On the Intel AMX Xeon the prefetch made every quantized product
of a llama-600m shape faster, at 1 and 5 rows (graphs/results/cpu/quant-prefetch-20261205-183800.md); on Zen 4,
software prefetches slowed the streaming products at a few rows (graphs/results/notes/kernels.md), and the
quantized ones were not measured there. Prefetches change no bits."""


def _streaming_choice(base: str | None) -> tuple[str | None, str]:
    """(the build the streaming products take, why) where the kernels take build ``base``
    (:data:`STREAMING_OVERRIDE`)."""
    value = os.environ.get(SWITCH, "").strip()
    if base is None or value not in ("", "1"):
        return base, "the build the kernels take"
    default, other = STREAMING_OVERRIDE.get(cpu_kind(), (None, None))
    if base != default or other is None or load(other) is None:
        return base, "the build the kernels take"
    return other, f"on {cpu_kind()} CPUs {other}'s streaming products outrun {default}'s"


@functools.cache
def streaming() -> str | None:
    """The build of the bf16/fp32 streaming products, dense and routed experts: :func:`selected`, except where
    :data:`STREAMING_OVERRIDE` names a faster one for this CPU's kind and :data:`SWITCH` forces none (a forced
    build runs every kernel). A row's result stays independent of its neighbours either way."""
    return _streaming_choice(selected())[0]


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


def _compile(cmd: list[str], timeout: float, what: str) -> None:
    """Run ``cmd`` (which builds ``what``) in a process group of its own, stopped whole after ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError(f"building {what} did not finish in {timeout:g} s "
                           f"and was stopped (set {TIMEOUT} to allow more): {shlex.join(cmd[:1])}") from None
    except BaseException:  # NOTE: an interrupt must not leave the compiler running
        _stop(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{err}")


def flags(name: str) -> list[str]:
    """The compiler flags of build ``name``: :data:`FLAGS`, its own, and its ``-DFUNCSPEC_ISA_<NAME>``."""
    if name not in BUILDS:
        raise ValueError(f"no kernel build {name!r}: the builds are {', '.join(ORDER)}")
    return [*FLAGS, *BUILDS[name].flags, f"-DFUNCSPEC_ISA_{name.upper()}"]


def build(cache: Path | None = None, timeout: float | None = None, name: str = "avx512bf16") -> Path:
    """Compile :data:`SOURCES` with build ``name``'s flags into one library in ``cache`` (default
    :func:`cache_dir`), once per sources, flags and compiler command, within ``timeout`` seconds (default
    :func:`build_timeout`); return it."""
    torch_lib = Path(torch.__file__).parent / "lib"
    return _cached(f"funcspec-{name}", SOURCES, HEADERS, [*flags(name), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"],
                   [], cache, timeout)


def build_torch_ops(cache: Path | None = None, timeout: float | None = None) -> Path:
    """Compile :data:`TORCH_OPS` against this torch (its headers and libraries) into a library in ``cache``, as
    :func:`build` does; return it."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    args = [*TORCH_OPS_FLAGS, f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DFUNCSPEC_TORCH={torch.__version__}"]
    libs = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_cpu", "-lc10"]
    return _cached("funcspec-torch-ops", (TORCH_OPS,), (), args, libs, cache, timeout)


def _cached(stem: str, sources, headers, args: list[str], libs: list[str], cache: Path | None,
            timeout: float | None) -> Path:
    """The library ``cache``/``stem``-<key>.so compiled from ``sources`` with ``args`` (and ``libs`` after the
    sources), keyed by the sources, ``headers``, arguments and compiler command: made by one process (another
    waits and takes it) within ``timeout`` seconds."""
    cache = cache_dir() if cache is None else Path(cache)
    cmd = compiler()
    timeout = build_timeout() if timeout is None else timeout
    if not 0 < timeout < math.inf:
        raise ValueError(f"build: timeout must be a positive number of seconds, got {timeout!r}")
    texts = [p.read_text() for p in (*sources, *headers)]
    key = hashlib.sha256("\0".join([*texts, *cmd, *args, *libs]).encode()).hexdigest()[:16]
    lib = cache / f"{stem}-{key}.so"

    def make() -> None:  # NOTE: built under a temporary name and renamed: nothing loads a half-written library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            _compile([*cmd, *args, *map(str, sources), *libs, "-o", tmp], timeout,
                     " and ".join(p.name for p in sources))
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    locks.once(lib, lib.with_suffix(".lock"), make)  # one process builds it, another waits and loads it
    return lib


def lib(name: str | None = None) -> ctypes.CDLL | None:
    """Build ``name``'s library (default :func:`selected`), built on first call, or ``None`` where the kernels
    are off or it cannot be built (warned once)."""
    name = selected() if name is None else name
    return None if name is None else load(name)


UNAVAILABLE = "funcspec: a CPU kernel was called where the kernels are unavailable or turned off"


def loaded(streamed: bool = False) -> ctypes.CDLL:
    """:func:`lib` (``streamed``: :func:`streaming`'s build), for a kernel op: the ops run only where
    :func:`available` said yes, so a missing library is a caller's error, raised here rather than as an
    attribute error on ``None``."""
    handle = lib(streaming() if streamed else None)
    if handle is None:
        raise RuntimeError(UNAVAILABLE)
    return handle


@functools.cache
def torch_ops() -> ctypes.CDLL | None:
    """:data:`TORCH_OPS`' library, built on first call and loaded into torch (its ops' CPU kernels registered),
    or ``None`` where it cannot be built (warned once)."""
    try:
        path = build_torch_ops()
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"funcspec: the CPU kernels' ops are unavailable, products and attention fall back to "
                      f"oneDNN/MKL/SDPA: {e}", RuntimeWarning, stacklevel=3)
        return None
    handle = ctypes.CDLL(str(path))
    handle.funcspec_ops_bind.argtypes, handle.funcspec_ops_bind.restype = [ctypes.c_void_p] * 6, None
    return handle


_BOUND: list = []
"""The (selected, streaming) builds the ops point at now, once :func:`bind` has pointed them."""


# NOTE: asked at trace time too (the ops' wrappers call it); compiled code takes the answer as a constant.
@torch.compiler.assume_constant_result
def bind() -> bool:
    """Point the kernel ops at the builds the kernels take now: :func:`streaming`'s streaming products,
    :func:`selected`'s quantized products and attention (built first). False where they are off or cannot be
    built, and then the ops raise when called."""
    key = (selected(), streaming())
    if _BOUND == [key]:
        return True
    ops, base, streams = torch_ops(), lib(key[0]), lib(key[1])
    if ops is None or base is None or streams is None:
        return False

    def addr(handle, fn: str):
        return ctypes.cast(getattr(handle, fn), ctypes.c_void_p).value

    ops.funcspec_ops_bind(addr(streams, "funcspec_linear_bf16"), addr(streams, "funcspec_linear_f32"),
                          addr(base, "funcspec_qlinear_bf16"), addr(base, "funcspec_qlinear_f32"),
                          addr(base, "funcspec_attend_bf16"), addr(base, "funcspec_attend_f32"))
    _BOUND[:] = [key]
    return True


def ready() -> None:
    """:func:`bind`, for a kernel op's wrapper: ``RuntimeError`` where the kernels are unavailable or off."""
    if not bind():
        raise RuntimeError(UNAVAILABLE)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """Build ``name``'s library, built on first call, or ``None`` where this CPU cannot run it or it cannot be
    built (warned once)."""
    if not supported(name):
        return None
    try:
        handle = ctypes.CDLL(str(build(name=name)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"funcspec: the CPU kernels ({name}) are unavailable, products and attention fall back to "
                      f"oneDNN/MKL/SDPA: {e}", RuntimeWarning, stacklevel=3)
        return None
    for fn_name, args in _SIGNATURES.items():
        fn = getattr(handle, fn_name)
        fn.argtypes, fn.restype = args, None
    handle.funcspec_set_quant_prefetch(QUANT_PREFETCH.get(cpu_kind(), 0))
    return handle


# NOTE: asked at trace time; compiled code takes the answer as a constant instead of tracing into the build.
@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernels run here and are not turned off (:func:`enabled`): built on first call, their ops
    bound (:func:`bind`); a failed build warns once. Turned off, nothing is built."""
    return enabled() and lib() is not None and bind()


def cpu_kind() -> str:
    """This CPU's kind as the kernels see it: ``x86 AMX``, ``x86 AVX-512 BF16``, ``x86 AVX-512``, ``x86 AVX2``,
    ``x86`` (none of those) or the machine name off x86 (``aarch64``, ...)."""
    if not cpu.is_x86():
        return platform.machine() or "unknown"
    have = cpu.x86_flags()
    for flag, kind in (("amx_tile", "x86 AMX"), ("avx512_bf16", "x86 AVX-512 BF16"), ("avx512f", "x86 AVX-512"),
                       ("avx2", "x86 AVX2")):
        if flag in have:
            return kind
    return "x86"


def explain() -> dict[str, object]:
    """Which build the kernels take here and why, for benchmark reports: ``{"cpu_kind", "runs" (the builds this
    CPU runs, best first), "build" (``None``: off or unavailable), "why", "streaming_build" and "streaming_why"
    (:func:`streaming`'s)}``. Reads :data:`SWITCH` as it is now, so a bad value is its ``ValueError``."""
    runs, value = builds(), os.environ.get(SWITCH, "").strip()
    if value == "0":
        build, why = None, f"{SWITCH}=0 turns the kernels off"
    else:
        build = choice()
        why = (f"{SWITCH}={value} names it" if value not in ("", "1")
               else f"the best of the builds this CPU runs ({', '.join(runs)})")
        if not available():
            why = f"{build} was chosen ({why}) but did not build here (no compiler, or the compile failed)"
            build = None
    stream_build, stream_why = _streaming_choice(build) if build is not None else (None, why)
    return {"cpu_kind": cpu_kind(), "runs": runs, "build": build, "why": why, "streaming_build": stream_build,
            "streaming_why": stream_why}
