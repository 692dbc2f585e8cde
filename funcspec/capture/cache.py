"""A portable compile cache: torch's compile-cache entries and funcspec's compiled steps in one file.

``funcspec precompile`` builds an engine (which captures every graph at
start-up) and saves, in one zip file,

- what those compiles put in torch's caches (``torch.compiler.save_cache_artifacts``:
  inductor's and AOTAutograd's entries), and
- the compiled step functions of :mod:`funcspec.capture.store` the engine
  compiled or loaded.

An engine given that file (``Engine(compile_cache=...)``,
``compilation_config={"compile_cache": ...}``) loads both before it captures
(``torch.compiler.load_cache_artifacts``; the steps are copied into its own
store), so a second machine of the same ISA, torch version and funcspec source
starts warm: nothing is traced or compiled.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Sequence

import torch

from funcspec.capture import store

_TORCH = "torch-cache-artifacts.bin"
_STEPS = "funcspec-graphs/"


def save(path, steps: Sequence[str]) -> dict:
    """Write the cache entries this process created or used, and the compiled step files ``steps`` (of the
    store), to ``path``; returns what it holds, by kind."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None and not steps:
        raise RuntimeError("compile cache: this process compiled nothing to save (were the graphs captured?)")
    data, info = saved if saved is not None else (b"", None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:  # compiled artifacts do not compress much
        z.writestr(_TORCH, data)
        for step in sorted(set(steps)):
            z.write(step, _STEPS + Path(step).name)
    return {"bytes": path.stat().st_size, "steps": len(set(steps)), **_counts(info)}


def load(path) -> dict:
    """Load a file written by :func:`save` into torch's caches and this machine's step store; returns what it
    held, by kind."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise ValueError(f"compile_cache: {path} is not a file written by `funcspec precompile`")
    with zipfile.ZipFile(path) as z:
        data = z.read(_TORCH)
        info = torch.compiler.load_cache_artifacts(data) if data else None
        steps = [n for n in z.namelist() if n.startswith(_STEPS) and n != _STEPS]
        target = store.directory()
        target.mkdir(parents=True, exist_ok=True)
        for name in steps:
            (target / Path(name).name).write_bytes(z.read(name))
    return {"bytes": path.stat().st_size, "steps": len(steps), **_counts(info)}


def _counts(info) -> dict:
    """{kind: number of entries} of a ``CacheInfo`` (inductor, aot_autograd, ...)."""
    if info is None:
        return {}
    entries = {k: getattr(info, f"{k}_artifacts", None) for k in ("inductor", "aot_autograd", "autotune", "pgo",
                                                                   "precompile")}
    return {k: len(v) for k, v in entries.items() if v}
