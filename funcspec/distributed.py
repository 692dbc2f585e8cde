"""Launching a tensor-parallel engine: the process group, the follower ranks, shutdown and failures.

Every rank runs the same engine on the same requests with the same seeds.
Keys are counter-based (``rng.py``) and every rank sees the same all-reduced
logits, so all ranks sample the same tokens without a broadcast, and their
host loops take the same branches.

Two ways to start N ranks:

- **torchrun** (``WORLD_SIZE``/``RANK`` set, or a process group already
  initialised): every rank runs the user's script, so every rank makes the
  same API calls itself. :func:`setup` joins (or initialises) torch's default
  group, and the engine's all-reduces run on it.
- **a plain process** (a script or a notebook): :func:`setup` spawns N-1
  follower processes (``torch.multiprocessing``, spawn start method); rank 0
  is the caller's process and serves the API. Each spawned engine has a group
  of its own, never torch's default one: rank 0 opens a ``TCPStore`` on a port
  the OS picks, and every rank builds the group on it under a name of its own
  (``funcspec-tp0``, ``funcspec-tp1``, ...: the lowest this process has free),
  so two engines of one process never share a group or a port. Each follower
  builds the same engine from rank 0's arguments (``EngineArgs.to_dict()``, plain
  data) and rank 0's serialised plan (``EnginePlan.to_dict()``, passed as the
  engine's ``_plan``: a follower never plans for itself, so no rank can run
  other buckets than rank 0's), then
  replays every public call rank 0 makes (:func:`mirrored`), sent over a pipe,
  and acknowledges it.

Failures stop the group, never hang it: a follower that raises reports its
traceback and exits (its sockets close, so rank 0's pending all-reduce fails
at once); rank 0 checks that every follower is alive before each call and
after any error, raises a ``RuntimeError`` naming the rank (its traceback, or
its exit code and signal), and tears the group down: the followers stop, the
group is destroyed and its name is free again, so a new engine starts
cleanly; the stopped engine's later calls raise a ``RuntimeError`` that says
why it stopped. Collectives run under a process-group timeout as a last resort.

Closing: :meth:`Followers.close` (``Engine.close``) stops the followers and
destroys the group; so does garbage collection of the engine, and interpreter
exit for an engine still open.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import itertools
import os
import signal
import socket
import threading
import traceback
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from funcspec.parallel import SINGLE, TPGroup

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""torch.distributed backend of each device type."""

TIMEOUT_S = 120.0
"""Process-group timeout: the longest a collective waits for a rank that neither answers nor dies."""

ACK_POLL_S = 0.5
"""How often rank 0 checks that its followers are alive while it waits for their acknowledgement."""

STOP_S = 10.0
"""How long a polite stop waits for a follower to exit before killing it."""

HOST = "127.0.0.1"

_joined: Optional[TPGroup] = None
"""In a spawned follower: the group it joined before building its engine (that engine's :func:`setup` returns it)."""

_names: set[str] = set()
"""Names of the groups this process's spawned engines hold (a name is free again once its group is destroyed)."""
_names_lock = threading.Lock()


def _free_port() -> int:
    """A free local port, for a launcher that must name one up front (torchrun's master port, in the tests)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rank_device(device, rank: int) -> torch.device:
    """The device of ``rank``: accelerator ``rank`` of the machine, or the CPU."""
    device = torch.device(device)
    return device if device.type == "cpu" else torch.device(device.type, rank)


def local_rank() -> int:
    """This process's rank on its machine (its device index): a follower's, torchrun's, the group's, or 0
    (a spawning rank 0)."""
    if _joined is not None:
        return _joined.rank
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def global_rank() -> int:
    """This process's rank in its group before the engine joins it: a follower's, the group's, torchrun's, or 0."""
    if _joined is not None:
        return _joined.rank
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _backend(device) -> str:
    """The backend of ``device``'s type, once that device is this process's current one."""
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"tensor_parallel_size > 1 needs a cpu, cuda or npu device, got {device!r}")
    if kind == "npu":
        from funcspec.capture.backends import _npu_module

        _npu_module()  # registers hccl, or says clearly why it cannot
    if kind != "cpu":
        getattr(torch, kind).set_device(torch.device(device))  # NCCL/HCCL bind a rank to its current device
    return BACKENDS[kind]


def _init_group(device, rank: int, size: int, init_method: Optional[str] = None) -> None:
    """torchrun: initialise torch's default group (every rank runs the script; its engines share the group)."""
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    """At exit, destroy the default group this module initialised (if the script has not): left to interpreter
    teardown, gloo's threads were destroyed still running and the rank aborted ("terminate called without an
    active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _store(port: int, size: int, master: bool) -> dist.TCPStore:
    """The rendezvous store of one spawned group: rank 0 serves it (``port=0``: the OS picks a free port, so
    no other process can take it between choosing and binding), followers connect to it."""
    return dist.TCPStore(HOST, port, size, is_master=master, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                         wait_for_workers=False)


def _new_group(device, rank: int, size: int, store, name: str):
    """A process group of ranks 0..size-1 on ``store``, registered under ``name`` (for the functional
    all-reduces, which find their group by name), beside torch's default group rather than as it.

    NOTE: torch has no public call that builds a group without the default one; the default group is one
    per process, and a second spawned engine on it ran its all-reduces with the first one's followers
    (a gloo timeout). This is what ``init_process_group`` does for the default group, minus making it the
    default (torch is pinned to 2.13, whose helper this is).
    """
    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(size, rank, [], c10d.Backend(_backend(device)), store,
                                           c10d.GroupName(name), timeout=datetime.timedelta(seconds=TIMEOUT_S),
                                           group_desc=name)
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(size)}  # what destroy_process_group(pg) reads
    return pg


def _reserve_name() -> str:
    """The lowest free group name of this process (the first engine's is the same in every run, so the
    compiled-step store, whose key names the group, finds its graphs again)."""
    with _names_lock:
        name = next(n for n in (f"funcspec-tp{i}" for i in itertools.count()) if n not in _names)
        _names.add(name)
    return name


def _release_name(name: str) -> None:
    with _names_lock:
        _names.discard(name)


def _group(size: int) -> TPGroup:
    """The world group as this rank's :class:`TPGroup` (under torchrun one tensor-parallel group spans the world)."""
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} must equal the torch.distributed world size {world}")
    world_group = dist.group.WORLD
    assert world_group is not None  # initialized: the caller checked
    return TPGroup(size, dist.get_rank(), world_group.group_name)


def check_devices(size: int, device) -> None:
    """Refuse more ranks than the machine has accelerators (a CPU takes any number)."""
    kind = torch.device(device).type
    if kind in ("cuda", "npu"):
        count = getattr(torch, kind).device_count()
        if size > count:
            raise ValueError(f"tensor_parallel_size={size} exceeds the {count} {kind} device(s) of this machine")


def setup(size: int, device, engine_cls, engine_args, plan) -> tuple[TPGroup, Optional["Followers"]]:
    """Join or start a group of ``size`` ranks; returns this rank's group and, on a spawning rank 0, its followers.

    Spawned followers rebuild their engine as ``engine_cls(EngineArgs.from_dict(engine_args.to_dict()),
    _plan=plan.to_dict())``: the class is passed in (this module never imports the engine), ``engine_args``
    is rank 0's :class:`~funcspec.args.EngineArgs` and ``plan`` its ``EnginePlan``, both sent as plain data;
    followers run that plan instead of planning from their own arguments.
    """
    if size == 1:
        return SINGLE, None
    check_devices(size, device)
    if _joined is not None:  # a spawned follower building its engine: the group is already up
        if _joined.size != size:
            raise ValueError(f"tensor_parallel_size={size} must equal the spawned group's size {_joined.size}")
        return _joined, None
    if dist.is_initialized():
        return _group(size), None
    if "WORLD_SIZE" in os.environ:  # torchrun: every rank runs the script
        _init_group(device, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return _group(size), None
    followers = Followers.spawn(size, device, engine_cls, engine_args.to_dict(), plan.to_dict())
    assert followers.tp is not None  # spawn() sets it once the group is up
    return followers.tp, followers


def _follow(rank: int, size: int, port: int, name: str, threads: int, engine_cls, engine_args: dict,
            plan: dict, conn) -> None:
    """A spawned follower: join group ``name`` as rank ``rank``, build the engine from rank 0's arguments
    (``EngineArgs.to_dict()``) on rank 0's ``plan`` (its ``to_dict()``), then replay rank 0's calls until told
    to stop."""
    from funcspec.args import EngineArgs

    global _joined
    try:
        conn.send(("up", None))  # started: rank 0 may now wait in the rendezvous
        torch.set_num_threads(threads)
        pg = _new_group(rank_device(engine_args["device"], rank), rank, size, _store(port, size, False), name)
        _joined = TPGroup(size, rank, name)
        engine = engine_cls(EngineArgs.from_dict(engine_args), _plan=plan)
        conn.send(("ok", None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if msg is None:
                break
            method, args, kwargs = msg
            try:
                getattr(engine, method)(*args, **kwargs)
            except ValueError:  # bad input: rank 0 refuses it alike, and the group lives on
                conn.send(("refused", traceback.format_exc()))
                continue
            conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 (a follower reports whatever killed it, then exits)
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)  # NOTE: no clean-up: closing our sockets is what unblocks rank 0's collectives
    dist.destroy_process_group(pg)


def exit_reason(rank: int, code: int) -> str:
    """``"tensor-parallel rank 1 exited with code -9 (SIGKILL)"``: a negative code is the signal that ended it."""
    try:
        why = f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        why = ""
    return f"tensor-parallel rank {rank} exited with code {code}{why}"


class _Ranks:
    """What rank 0 stops when its engine closes, fails or is collected: the follower processes, their pipes
    and the group. It holds no reference to the engine or to :class:`Followers` (their finaliser holds it)."""

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        self.pg = None  # the group, once rank 0 has joined it
        self.name: Optional[str] = None  # its reserved name, released once the group is destroyed

    def stop(self, polite: bool) -> set[int]:
        """Stop the followers (asking them first if ``polite``) and destroy the group; returns the ranks
        that had to be killed."""
        if polite:
            for p, c in zip(self.procs, self.conns):
                if p.is_alive():
                    try:
                        c.send(None)
                    except OSError:  # it died meanwhile: its exit code says how
                        pass
        killed = set()
        for rank, p in enumerate(self.procs, 1):
            p.join(timeout=STOP_S if polite else 0)
            if p.is_alive():
                killed.add(rank)
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception as e:  # noqa: BLE001 (keep the name reserved: torch may still hold a group under it)
                warnings.warn(f"tensor-parallel group {self.name} was not destroyed: {e!r}", stacklevel=2)
                return killed
            self.pg = None
        if self.name is not None:
            _release_name(self.name)
        return killed


class Followers:
    """Rank 0's handle on its spawned follower processes (ranks 1..N-1) and their group.

    Attributes:
        procs, conns: the follower processes and rank 0's end of their pipes, rank 1 first.
        tp: rank 0's :class:`TPGroup` (``None`` until the group is up).
        closed: the group was stopped (by :meth:`close` or a failure); ``failure`` says why, if a rank failed.
    """

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        self.tp: Optional[TPGroup] = None
        self.busy = False  # inside a mirrored call: nested public calls are not sent again
        self.closed = False
        self.failure: Optional[str] = None
        self._ranks = _Ranks(procs, conns)
        # NOTE: a collected engine stops its ranks. The finaliser holds _Ranks, never self; atexit holds the
        # finaliser (registered now, after multiprocessing's own exit hook, so that it runs first and asks the
        # followers to stop before multiprocessing terminates them).
        self._finalizer = weakref.finalize(self, self._ranks.stop, True)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    @classmethod
    def spawn(cls, size: int, device, engine_cls, engine_args: dict, plan: dict) -> "Followers":
        """Start ranks 1..size-1 on rank 0's serialised ``plan``, then join their new group as rank 0 (the
        rendezvous waits for all of them)."""
        ctx = torch.multiprocessing.get_context("spawn")
        name = _reserve_name()
        try:
            store = _store(0, size, master=True)
        except BaseException:
            _release_name(name)
            raise
        procs, conns = [], []
        for rank in range(1, size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_follow, name=f"funcspec-tp-rank{rank}", daemon=True,
                            args=(rank, size, store.port, name, torch.get_num_threads(), engine_cls, engine_args,
                                  plan, theirs))
            p.start()
            theirs.close()  # the follower holds its own end: its death ends the pipe here
            procs.append(p)
            conns.append(mine)
        followers = cls(procs, conns)
        followers._ranks.name = name
        followers._acks("up")  # NOTE: a follower that dies starting up must not leave rank 0 in the rendezvous
        try:
            followers._ranks.pg = _new_group(device, 0, size, store, name)
        except BaseException as e:  # noqa: BLE001 (fail() stops every rank and re-raises)
            followers.fail(e)
        followers.tp = TPGroup(size, 0, name)
        return followers

    def wait_ready(self) -> None:
        """Wait until every follower has built its engine (they load and shard in parallel with rank 0)."""
        self._acks()

    def call(self, name: str, args: tuple, kwargs: dict, run):
        """Send call ``name`` to every follower, run it here (``run()``), then collect their acknowledgements."""
        self._check_alive()
        try:
            for c in self.conns:
                c.send((name, args, kwargs))
        except OSError as e:  # a rank died since the check: its end of the pipe is closed
            self.fail(e)
        self.busy = True
        try:
            out = run()
        except ValueError as e:  # bad input (checked before any collective): every rank refuses it alike
            self._acks("refused", e)
            raise
        except BaseException as e:  # noqa: BLE001 (fail() stops every rank and re-raises)
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
                # NOTE: a pipe whose rank died reads as ready, then ends (or is reset, when a call was left
                # unread); reap the rank so that fail() names its exit code instead of letting the error escape.
                p.join(timeout=ACK_POLL_S)
                self.fail(cause)
            if status != expect:
                self.fail(cause, (rank, status, msg))

    def _check_alive(self) -> None:
        if self.closed:
            why = self.failure or "close() stopped its ranks"
            raise RuntimeError(f"this tensor-parallel engine is closed: {why}; build a new engine")
        if any(not p.is_alive() for p in self.procs):
            self.fail(None)

    def _reasons(self, cause: Optional[BaseException], answer: Optional[tuple] = None) -> list[str]:
        """Why each failed follower stopped: its traceback (``answer``, or one left on its pipe) or its exit code."""
        reasons = []
        if answer is not None:
            rank, status, msg = answer
            reasons.append(f"tensor-parallel rank {rank} raised:\n{msg}" if status == "error"
                           else f"tensor-parallel rank {rank} {status}:\n{msg}")
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), 1):
            if answer is not None and answer[0] == rank:
                continue
            p.join(timeout=ACK_POLL_S if cause is not None else 0)
            tb = None
            while True:
                try:
                    if not c.poll(0):
                        break
                    status, msg = c.recv()
                except (EOFError, OSError):  # ended, or reset by a rank killed with a call unread
                    break
                tb = msg if status != "ok" else tb
            if tb is not None:
                reasons.append(f"tensor-parallel rank {rank} raised:\n{tb}")
            elif not p.is_alive():
                reasons.append(exit_reason(rank, p.exitcode))
        return reasons

    def fail(self, cause: Optional[BaseException], answer: Optional[tuple] = None):
        """Stop the whole group and raise a ``RuntimeError`` that names each failed rank and says why.

        ``answer`` is a follower's (rank, status, traceback) already read off its pipe. Once the
        group is stopped, ``cause`` (the first failure's error) is raised again as it is.
        """
        if self.closed and cause is not None:
            raise cause
        reasons = self._reasons(cause, answer)
        self._stop(polite=False)
        if not reasons and cause is not None:
            raise cause
        self.failure = "; ".join(reasons or ["a tensor-parallel rank failed"])
        raise RuntimeError(f"{self.failure}; the tensor-parallel group was stopped: build a new engine") from cause

    def _stop(self, polite: bool) -> set[int]:
        """Stop the followers and destroy the group, once; returns the ranks that had to be killed."""
        self.closed = True
        atexit.unregister(self._finalizer)
        return self._ranks.stop(polite) if self._finalizer.detach() is not None else set()

    def close(self) -> None:
        """Stop the followers politely and destroy the group. Idempotent.

        A follower that died since the last call (or while stopping) is reported as a call would report it:
        a ``RuntimeError`` naming the rank and its exit code, raised once everything is stopped.
        """
        if self.closed:
            return
        if any(not p.is_alive() for p in self.procs):
            self.fail(None)
        killed = self._stop(polite=True)
        reasons = [exit_reason(rank, p.exitcode) for rank, p in enumerate(self.procs, 1)
                   if rank not in killed and p.exitcode != 0]
        if reasons:
            self.failure = "; ".join(reasons)
            raise RuntimeError(f"{self.failure}; the tensor-parallel group was stopped")


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
