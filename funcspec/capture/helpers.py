"""Start-up capture spread over helper processes.

Compiling a graph is mostly one core's work: Dynamo, AOTAutograd and inductor's code generation are Python,
and only the C++ kernels build in parallel. So a cold start-up of N graphs is bounded by one core, however
many are idle. A helper is a fresh interpreter (``funcspec.build.helper_main``, never the caller's
``__main__``, which a notebook or an unguarded script cannot run again). It builds the engine's parts from
the engine's arguments and plan, as a tensor-parallel follower does, compiles its share of the graphs into the
compiled-step store, and exits. The engine compiles its own share meanwhile, then loads the helpers' graphs as
a warm start does. A graph a helper did not file (it failed, or its store key differs) the engine compiles
itself: a helper can only save time, never change a graph.

How many (:func:`count`): ``compilation_config["compile_helpers"]``, else ``FUNCSPEC_COMPILE_HELPERS``, else,
on a CPU engine, one per idle core (the cores this process may run on, less one), at most the graphs not yet
filed less one, and no more than half the free memory holds: each helper loads its own copy of the weights.
None where the graphs are not inductor's, the store is off, the engine is tensor-parallel, or its model is not
a path a helper can load.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

ENV = "FUNCSPEC_COMPILE_HELPERS"
"""Environment variable: the number of helpers where ``compilation_config`` names none (0: none)."""

_MARK = "funcspec-helper-filed "
"""A helper's stdout line that reports one graph filed (the rest of its output is ignored)."""

Graph = tuple  # (B, K, T, mode name): an entry of funcspec.build.startup_graphs


def count(requested: Optional[int], missing: int, weight_bytes: int, auto: bool = True,
          cores: Optional[int] = None, free: Optional[int] = None) -> int:
    """How many helpers compile ``missing`` graphs: ``requested`` (else :data:`ENV`, else the automatic choice of
    the module docstring where ``auto``), at most ``missing - 1``. ``cores``, ``free``: this machine's usable
    cores and free bytes (read here when ``None``; free memory unknown: no limit)."""
    if requested is None and os.environ.get(ENV, "").strip():
        value = os.environ[ENV].strip()
        if not value.isdigit():
            raise ValueError(f"{ENV} must be a number of helper processes >= 0, got {value!r}")
        requested = int(value)
    if requested is None and not auto:
        return 0
    if requested is None:
        cores = usable_cores() if cores is None else cores
        free = free_memory() if free is None else free
        requested = cores - 1
        if free is not None and weight_bytes > 0:
            requested = min(requested, free // 2 // weight_bytes)
    return max(0, min(requested, missing - 1))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def free_memory() -> Optional[int]:
    """Bytes of memory available to new processes (Linux's ``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def weight_bytes(params: Any) -> int:
    """Bytes of the tensors in pytree ``params`` (what a helper loads again)."""
    return sum(x.nbytes for x in pytree.tree_leaves(params) if isinstance(x, torch.Tensor))


def shares(graphs: Sequence[Graph], n: int) -> list[list[Graph]]:
    """``graphs`` dealt to the engine (share 0) and ``n`` helpers in turn. NOTE: dealt, not cut into runs: a run
    kept one batch bucket's graphs together (they share kernels) but left one process the symbolic batch's
    dearer graphs, and the zoo's cold start took longer."""
    return [list(graphs[i::n + 1]) for i in range(n + 1)]


def report(graph: Graph, out) -> None:
    """A helper's line on ``out`` that it filed ``graph`` (the rest of its output is ignored)."""
    print(_MARK + json.dumps(list(graph)), file=out, flush=True)


class Helpers:
    """Running helper processes, one share of graphs each (:meth:`start`); :meth:`wait` collects what they filed."""

    def __init__(self, procs: list[tuple[subprocess.Popen, Path]], shares: list[list[Graph]]):
        self.procs, self.shares = procs, shares

    @classmethod
    def start(cls, command: Sequence[str], engine_args: dict, plan: dict, shares: list[list[Graph]],
              threads: int) -> "Helpers":
        """Start one helper per share, running ``command``: it reads its job (JSON) from stdin, builds from
        ``engine_args`` (``EngineArgs.to_dict()``) on ``plan`` (``EnginePlan.to_dict()``) with ``threads`` torch
        threads (a store key names the thread count), and prints :func:`report` for each graph it filed."""
        procs = []
        for share in shares:
            fd, name = tempfile.mkstemp(prefix="funcspec-helper-", suffix=".log")
            log = Path(name)
            with os.fdopen(fd, "wb") as err:
                p = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                     text=True)
            assert p.stdin is not None  # stdin=PIPE
            p.stdin.write(json.dumps({"args": engine_args, "plan": plan, "graphs": share, "threads": threads}))
            p.stdin.close()
            procs.append((p, log))
        return cls(procs, shares)

    def wait(self) -> dict[Graph, int]:
        """Wait for every helper; the graphs they filed, each with its helper's number (1, 2, ...). A helper that
        failed is named in one warning, with the end of its output."""
        import warnings

        filed: dict[Graph, int] = {}
        for i, (p, log) in enumerate(self.procs, start=1):
            assert p.stdout is not None  # stdout=PIPE
            for line in p.stdout:
                if line.startswith(_MARK):
                    filed[tuple(json.loads(line[len(_MARK):]))] = i
            if p.wait() != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-8:]
                warnings.warn(f"start-up helper {i} failed (exit status {p.returncode}); this process compiles the "
                              f"graphs it did not file. Its last output:\n" + "\n".join(tail),
                              RuntimeWarning, stacklevel=2)
            log.unlink(missing_ok=True)
        return filed

    def stop(self) -> None:
        """Stop helpers still running (the engine failed) and remove their logs."""
        for p, log in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.unlink(missing_ok=True)
