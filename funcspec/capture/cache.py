"""A portable compile cache: torch's compile-cache entries and funcspec's compiled steps in one file.

``funcspec precompile`` builds an engine (which captures every graph at
start-up) and saves, in one zip file,

- what those compiles put in torch's caches (``torch.compiler.save_cache_artifacts``:
  inductor's and AOTAutograd's entries), and
- the compiled step functions of :mod:`funcspec.capture.store` the engine
  compiled or loaded.

An engine given that file (``compilation_config={"compile_cache": ...}``) loads both before it captures
(``torch.compiler.load_cache_artifacts``; the steps are filed in its own
store, signed with its user's key), so a second machine of the same ISA, torch
version and funcspec code starts warm: nothing is traced or compiled.

Such a file is executable code: loading it unpickles and runs what it holds.
It is loaded only when the user names it; load one only from a trusted source.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Sequence

import torch

from funcspec.capture import store

_TORCH = "torch-cache-artifacts.bin"
_STEPS = "funcspec-graphs/"
_STEP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.bin")
"""A step's file name: no directory part, no hidden file."""


def save(path, steps: Sequence[str]) -> dict:
    """Write the cache entries this process created or used, and the compiled step files ``steps`` (of the
    store, checked and unsigned: the reader signs them with its own key), to ``path``; returns what it holds,
    by kind."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None and not steps:
        raise RuntimeError("compile cache: this process compiled nothing to save (were the graphs captured?)")
    data, info = saved if saved is not None else (b"", None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:  # compiled artifacts do not compress much
        z.writestr(_TORCH, data)
        for step in sorted(set(steps)):
            z.writestr(_STEPS + Path(step).name, store.read_payload(Path(step)))
    return {"bytes": path.stat().st_size, "steps": len(set(steps)), **_counts(info)}


def load(path) -> dict:
    """Load a file written by :func:`save` into torch's caches and this machine's step store; returns what it
    held, by kind. The file is code (its entries are unpickled and run): load only one from a trusted source.
    A member that is not one :func:`save` writes is a ``ValueError`` naming it, before anything is loaded."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise ValueError(f"compile_cache: {path} is not a file written by `funcspec precompile`")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        if _TORCH not in names:
            raise ValueError(f"compile_cache: {path} has no member {_TORCH!r}: not a file written by "
                             f"`funcspec precompile`")
        steps = [n for n in names if n.startswith(_STEPS) and n != _STEPS]
        for name in names:
            if name not in (_TORCH, _STEPS) and not (name.startswith(_STEPS)
                                                     and _STEP_NAME.fullmatch(name[len(_STEPS):])):
                raise ValueError(f"compile_cache: {path} has a member {name!r} that `funcspec precompile` "
                                 f"does not write")
        target = store.open_store() if steps else None
        if steps and target is None:
            raise ValueError(f"compile_cache: the compiled-step store ({store.directory()}) is not this user's "
                             f"alone, so {path}'s steps cannot be filed there")
        data = z.read(_TORCH)
        info = torch.compiler.load_cache_artifacts(data) if data else None
        for name in steps:
            store.import_payload(target, name[len(_STEPS):], z.read(name))  # type: ignore[arg-type]  # steps: a target
    return {"bytes": path.stat().st_size, "steps": len(steps), **_counts(info)}


def _counts(info) -> dict:
    """{kind: number of entries} of a ``CacheInfo`` (inductor, aot_autograd, ...)."""
    if info is None:
        return {}
    entries = {k: getattr(info, f"{k}_artifacts", None) for k in ("inductor", "aot_autograd", "autotune", "pgo",
                                                                   "precompile")}
    return {k: len(v) for k, v in entries.items() if v}
