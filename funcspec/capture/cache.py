"""A portable compile cache: inductor's and AOTAutograd's cache entries in one file.

``funcspec precompile`` builds an engine (which captures every graph at
start-up) and saves what those compiles put in torch's caches with
``torch.compiler.save_cache_artifacts``; an engine given that file
(``Engine(compile_cache=...)``, ``compilation_config={"compile_cache": ...}``)
loads it with ``torch.compiler.load_cache_artifacts`` before it captures, so a
second machine of the same ISA and torch version starts warm: Dynamo still
traces each graph (seconds), inductor compiles nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save(path) -> dict:
    """Write the cache entries this process created or used to ``path``; returns what it holds, by kind."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("compile cache: this process compiled nothing to save (were the graphs captured?)")
    data, info = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"bytes": len(data), **_counts(info)}


def load(path) -> dict:
    """Load a file written by :func:`save` into torch's caches; returns what it held, by kind."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"compile_cache: {path} is not a file (write one with `funcspec precompile`)")
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    return {"bytes": path.stat().st_size, **_counts(info)}


def _counts(info) -> dict:
    """{kind: number of entries} of a ``CacheInfo`` (inductor, aot_autograd, ...)."""
    if info is None:
        return {}
    entries = {k: getattr(info, f"{k}_artifacts", None) for k in ("inductor", "aot_autograd", "autotune", "pgo",
                                                                   "precompile")}
    return {k: len(v) for k, v in entries.items() if v}
