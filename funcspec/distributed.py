"""Launching a tensor-parallel engine: the process group, the follower ranks, shutdown and failures.

Every rank runs the same engine on the same requests with the same seeds.
Keys are counter-based (``rng.py``) and every rank sees the same all-reduced
logits, so all ranks sample the same tokens without a broadcast, and their
host loops take the same branches.

Two ways to start N ranks:

- **torchrun** (``WORLD_SIZE``/``RANK`` set, or a process group already
  initialised): every rank runs the user's script, so every rank makes the
  same API calls itself. :func:`setup` joins (or initialises) the group.
- **a plain process** (a script or a notebook): :func:`setup` spawns N-1
  follower processes (``torch.multiprocessing``, spawn start method) and
  rendezvouses with them on a free local port; rank 0 is the caller's process
  and serves the API. Each follower builds the same engine and then replays
  every public call rank 0 makes (:func:`mirrored`), sent over a pipe, and
  acknowledges it.

Failures stop the group, never hang it: a follower that raises reports its
traceback and exits (its sockets close, so rank 0's pending all-reduce fails
at once); rank 0 checks that every follower is alive before each call and
after any error, raises a ``RuntimeError`` naming the rank, and tears the
group down. Collectives run under a process-group timeout as a last resort.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import socket
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

from funcspec.parallel import SINGLE, TPGroup

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""torch.distributed backend of each device type."""

TIMEOUT_S = 120.0
"""Process-group timeout: the longest a collective waits for a rank that neither answers nor dies."""

ACK_POLL_S = 0.5
"""How often rank 0 checks that its followers are alive while it waits for their acknowledgement."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device, rank: int) -> torch.device:
    """The device of ``rank``: accelerator ``rank`` of the machine, or the CPU."""
    device = torch.device(device)
    return device if device.type == "cpu" else torch.device(device.type, rank)


def local_rank() -> int:
    """This process's rank on its machine (its device index): torchrun's, the group's, or 0 (a spawning rank 0)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def global_rank() -> int:
    """This process's rank in its group before the engine joins it: the group's, torchrun's, or 0."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _init_group(device, rank: int, size: int, init_method: Optional[str] = None) -> None:
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"tensor_parallel_size > 1 needs a cpu, cuda or npu device, got {device!r}")
    if kind == "npu":
        from funcspec.capture.backends import _npu_module

        _npu_module()  # registers hccl, or says clearly why it cannot
    if kind != "cpu":
        getattr(torch, kind).set_device(torch.device(device))  # NCCL/HCCL bind a rank to its current device
    dist.init_process_group(BACKENDS[kind], init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _group(size: int) -> TPGroup:
    """The world group as this rank's :class:`TPGroup` (one tensor-parallel group spans the world)."""
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} must equal the torch.distributed world size {world}")
    return TPGroup(size, dist.get_rank(), dist.group.WORLD.group_name)


def check_devices(size: int, device) -> None:
    """Refuse more ranks than the machine has accelerators (a CPU takes any number)."""
    kind = torch.device(device).type
    if kind in ("cuda", "npu"):
        count = getattr(torch, kind).device_count()
        if size > count:
            raise ValueError(f"tensor_parallel_size={size} exceeds the {count} {kind} device(s) of this machine")


def setup(size: int, device, engine_cls, engine_args: dict) -> tuple[TPGroup, Optional["Followers"]]:
    """Join or start a group of ``size`` ranks; returns this rank's group and, on a spawning rank 0, its followers.

    Spawned followers rebuild their engine as ``engine_cls(**engine_args)`` (the
    class is passed in: this module sits below the engine and never imports it).
    """
    if size == 1:
        return SINGLE, None
    check_devices(size, device)
    if dist.is_initialized():
        return _group(size), None
    if "WORLD_SIZE" in os.environ:  # torchrun: every rank runs the script
        _init_group(device, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return _group(size), None
    followers = Followers.spawn(size, device, engine_cls, engine_args)
    return _group(size), followers


def _follow(rank: int, size: int, init_method: str, threads: int, engine_cls, engine_args: dict, conn) -> None:
    """A spawned follower: build the engine as rank ``rank``, then replay rank 0's calls until told to stop."""
    try:
        conn.send(("up", None))  # started: rank 0 may now wait in the rendezvous
        torch.set_num_threads(threads)
        _init_group(rank_device(engine_args["device"], rank), rank, size, init_method)
        engine = engine_cls(**engine_args)
        conn.send(("ok", None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if msg is None:
                break
            name, args, kwargs = msg
            try:
                getattr(engine, name)(*args, **kwargs)
            except ValueError:  # bad input: rank 0 refuses it alike, and the group lives on
                conn.send(("refused", traceback.format_exc()))
                continue
            conn.send(("ok", None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)  # NOTE: no clean-up: closing our sockets is what unblocks rank 0's collectives
    dist.destroy_process_group()


class Followers:
    """Rank 0's handle on its spawned follower processes (ranks 1..N-1)."""

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        self.busy = False  # inside a mirrored call: nested public calls are not sent again
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def spawn(cls, size: int, device, engine_cls, engine_args: dict) -> "Followers":
        """Start ranks 1..size-1, then join the group as rank 0 (the rendezvous waits for all of them)."""
        ctx = torch.multiprocessing.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs, conns = [], []
        for rank in range(1, size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_follow, name=f"funcspec-tp-rank{rank}", daemon=True,
                            args=(rank, size, init, torch.get_num_threads(), engine_cls, engine_args, theirs))
            p.start()
            procs.append(p)
            conns.append(mine)
        followers = cls(procs, conns)
        followers._acks("up")  # NOTE: a follower that dies starting up must not leave rank 0 in the rendezvous
        try:
            _init_group(device, 0, size, init)
        except BaseException as e:
            followers.fail(e)
        return followers

    def wait_ready(self) -> None:
        """Wait until every follower has built its engine (they load and shard in parallel with rank 0)."""
        self._acks()

    def call(self, name: str, args: tuple, kwargs: dict, run):
        """Send call ``name`` to every follower, run it here (``run()``), then collect their acknowledgements."""
        self._check_alive()
        for c in self.conns:
            c.send((name, args, kwargs))
        self.busy = True
        try:
            out = run()
        except ValueError as e:  # bad input (checked before any collective): every rank refuses it alike
            self._acks("refused", e)
            raise
        except BaseException as e:
            self.fail(e)
        finally:
            self.busy = False
        self._acks()
        return out

    def _acks(self, expect: str = "ok", cause: Optional[BaseException] = None) -> None:
        """Wait for every follower's answer to the last call, checking liveness; any other answer stops the group."""
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), 1):
            while not c.poll(ACK_POLL_S):
                if not p.is_alive():
                    self.fail(cause)
            try:
                status, msg = c.recv()
            except (EOFError, OSError):
                # NOTE: a pipe whose rank died reads as ready, then ends; reap the rank so that
                # fail() names its exit code instead of letting the EOFError escape.
                p.join(timeout=ACK_POLL_S)
                self.fail(cause)
            if status != expect:
                self.fail(cause, (rank, status, msg))

    def _check_alive(self) -> None:
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed (or one of its ranks failed)")
        if any(not p.is_alive() for p in self.procs):
            self.fail(None)

    def fail(self, cause: Optional[BaseException], answer: Optional[tuple] = None):
        """Stop the whole group and raise a ``RuntimeError`` that names each failed rank and says why.

        ``answer`` is a follower's (rank, status, traceback) already read off its pipe. Once the
        group is stopped, ``cause`` (the first failure's error) is raised again as it is.
        """
        if self.closed and cause is not None:
            raise cause
        reasons = []
        if answer is not None:
            rank, status, msg = answer
            reasons.append(f"rank {rank} raised:\n{msg}" if status == "error" else f"rank {rank} {status}:\n{msg}")
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), 1):
            if answer is not None and answer[0] == rank:
                continue
            p.join(timeout=ACK_POLL_S if cause is not None else 0)
            tb = None
            while c.poll(0):
                try:
                    status, msg = c.recv()
                except EOFError:
                    break
                tb = msg if status != "ok" else tb
            if tb is not None:
                reasons.append(f"rank {rank} raised:\n{tb}")
            elif not p.is_alive():
                reasons.append(f"rank {rank} exited with code {p.exitcode}")
        self.close(force=True)
        if not reasons and cause is not None:
            raise cause
        raise RuntimeError("tensor-parallel group stopped: " + "; ".join(reasons or ["a rank failed"])) from cause

    def close(self, force: bool = False) -> None:
        """Stop the followers (politely unless ``force``) and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for p, c in zip(self.procs, self.conns):
            if not force and p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)


def mirrored(method):
    """Make an engine method a call that every spawned follower replays (outputs discarded on followers).

    Without followers (one rank, torchrun, or a follower itself) and inside
    another mirrored call, the method just runs.
    """
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        followers = getattr(self, "followers", None)
        if followers is None or followers.busy:
            return method(self, *args, **kwargs)
        return followers.call(method.__name__, args, kwargs, lambda: method(self, *args, **kwargs))
    return call


def engine_args(values: dict[str, Any]) -> dict[str, Any]:
    """An engine's constructor arguments (from its ``locals()``) as followers receive them."""
    return {k: v for k, v in values.items() if k not in ("self", "__class__")}
