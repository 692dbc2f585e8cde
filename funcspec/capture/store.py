"""A store of compiled step functions, so that a warm start traces nothing.

A warm inductor cache still leaves Dynamo to trace every graph again at each
start (about 5 s a graph for the zoo target on 2 cores): inductor's caches
hold compiled kernels, not the traced program. ``torch.compile(...).aot_compile``
keeps the traced program as well, and ``torch.compiler.load_compiled_function``
brings it back without tracing (about 1 s a graph). This module files those
functions under a key that names everything the graph bakes in:

- the step's static configuration (the closure of the bucket's function:
  dataclasses, tuples, numbers, modules, functions and tensors, walked by
  :func:`fingerprint`; an object it cannot name makes the graph uncacheable),
- the example arguments' tree structure and tensor metadata (dtype, shape,
  strides, device) and which sizes are symbolic,
- the source of the funcspec package, the torch and Python versions and the
  CPU's instruction sets.

NOTE: the functions are saved with Dynamo's portable guards only (tensor
metadata and global context such as ``no_grad``): the key stands in for the
guards on the closure and on globals, which cannot be serialized.

A global that tracing reads and a caller monkeypatches is invisible to the key:
``FUNCSPEC_GRAPH_STORE=0`` turns the store off.

The files live in ``funcspec-graphs/`` under inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``), so an empty inductor cache is an empty store too.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import platform
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

_PACKAGE = Path(__file__).resolve().parents[1]


class Unnameable(Exception):
    """An object in a step's closure that :func:`fingerprint` cannot name by value."""


def enabled() -> bool:
    """Whether compiled functions are filed and reused (``FUNCSPEC_GRAPH_STORE=0`` turns it off, e.g. while
    monkeypatching a module global that tracing reads, which no key can see)."""
    return os.environ.get("FUNCSPEC_GRAPH_STORE", "1") != "0"


def directory() -> Path:
    """Where compiled functions are filed: ``funcspec-graphs/`` in inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "funcspec-graphs"


@functools.cache
def _environment() -> str:
    """The package source, torch, Python and the CPU's flags: what every key shares (hashed once a process)."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
    h.update(f"{torch.__version__}|{platform.python_version()}|{platform.machine()}|{_cpu_flags()}".encode())
    return h.hexdigest()


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which decide inductor's vector ISA and funcspec's kernels."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def fingerprint(obj: Any, h: "hashlib._Hash", values: bool = True) -> None:
    """Feed a stable description of ``obj`` into ``h``. Tensors are described by metadata, and by their
    bytes when ``values`` (a closure's constants; a step's arguments are inputs, so metadata only).
    Raises :class:`Unnameable` for an object whose identity is all it has (its repr names an address)."""
    if isinstance(obj, torch.Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}{obj.stride()}{obj.device.type}".encode())
        if values:
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, functools.partial):
        h.update(b"P")
        for part in (obj.func, obj.args, obj.keywords):
            fingerprint(part, h, values)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(f"D{type(obj).__module__}.{type(obj).__qualname__}".encode())
        for f in dataclasses.fields(obj):
            h.update(f.name.encode())
            fingerprint(getattr(obj, f.name), h, values)
    elif isinstance(obj, (tuple, list)):
        h.update(f"L{type(obj).__name__}{len(obj)}".encode())
        for x in obj:
            fingerprint(x, h, values)
    elif isinstance(obj, dict):
        h.update(f"M{len(obj)}".encode())
        for k, v in obj.items():
            fingerprint(k, h, values)
            fingerprint(v, h, values)
    elif isinstance(obj, types.ModuleType):
        h.update(f"m{obj.__name__}".encode())
    elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        if "<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__:
            raise Unnameable(f"{obj.__qualname__} is a local function")
        h.update(f"f{obj.__module__}.{obj.__qualname__}".encode())
    elif isinstance(obj, (str, bytes, int, float, bool, complex, enum.Enum, torch.dtype, torch.device,
                          type(None), type(Ellipsis))):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        text = repr(obj)
        if " at 0x" in text or " object at " in text:
            raise Unnameable(f"{type(obj).__qualname__} has no value-based repr")
        h.update(f"O{type(obj).__module__}.{type(obj).__qualname__}:{text}".encode())


def key(fn: Callable, example_args: tuple, symbolic: tuple, options: dict) -> Optional[str]:
    """The store key of ``fn`` compiled for ``example_args`` (``None``: the closure cannot be named)."""
    h = hashlib.sha256(_environment().encode())
    try:
        fingerprint(fn, h)
        fingerprint(sorted((k, repr(v)) for k, v in options.items()), h)
    except Unnameable:
        return None
    leaves, spec = pytree.tree_flatten(example_args)
    h.update(str(spec).encode())
    for leaf in leaves:
        fingerprint(leaf, h, values=False)
    ids = {id(t): i for i, t in enumerate(leaves)}
    h.update(str(sorted((ids.get(id(t), -1), d) for t, d in symbolic)).encode())
    return h.hexdigest()[:32]


def path_for(name: str, key_: str) -> Path:
    """The file of graph ``name`` under ``key_``."""
    return directory() / f"{name}-{key_}.bin"


def load(path: Path) -> Optional[Callable]:
    """The compiled function in ``path``, or ``None`` when there is none or it no longer loads
    (another torch, a moved file): the caller then compiles."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
    except Exception:  # a stale or foreign file is a cache miss, never an error
        return None
    return fn


def save(compiled, path: Path) -> bool:
    """File ``compiled`` (an ``aot_compile`` result) at ``path`` (atomically); ``False`` if it cannot be
    serialized (the graph still runs, it just compiles again at the next start)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        compiled.save_compiled_function(str(path))  # torch writes it atomically
    except Exception:  # e.g. a backend whose output cannot be serialized
        return False
    return True
