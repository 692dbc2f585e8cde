"""Capture backends: one compiled callable per bucket, behind one interface.

``capture(fn, example_args, backend)`` returns a :class:`Captured` callable
with the same signature as ``fn`` and a ``stats`` attribute (:class:`CaptureStats`). ``fn`` must be pure
except for donated buffers, which it updates in place and returns. The caller declares which arguments
are donated (``capture(..., donated=(1,))``, as JAX's ``donate_argnums``); ``captured.donated`` names
their leaves, and a device graph refuses a donated leaf that arrives at another address.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch._dynamo
import torch.utils._pytree as pytree

from funcspec.capture import store
from funcspec.capture.window import Window
from funcspec.pytree import slot_leaves

BACKENDS = ("eager", "inductor", "cudagraph", "aclgraph", "auto")
"""Backend names; ``auto`` is resolved per device by :func:`resolve_backend`."""


@dataclasses.dataclass
class CaptureStats:
    """What one bucket cost. ``replay_ms`` keeps the caller's recent wall times (a bounded :class:`Window`)."""

    backend: str
    capture_seconds: float = 0.0
    compiles: int = 0
    loaded: bool = False  # inductor: the compiled function came from the store (nothing traced or compiled)
    helper: Optional[int] = None  # inductor: the start-up helper process that compiled and filed it (then loaded)
    stored: Optional[str] = None  # inductor: its file in the store (what a compile cache bundles), if filed
    graph_breaks: int = 0
    graph_memory_bytes: int | None = None
    replay_ms: Window = dataclasses.field(default_factory=Window)

    @property
    def recompiles(self) -> int:
        """Compiles beyond the first graph, loaded or compiled (0 for a static bucket)."""
        return max(0, self.compiles + int(self.loaded) - 1)

    def summary(self) -> dict:
        """JSON-friendly stats: capture seconds, median replay (of the recent calls), calls (all of them),
        recompiles, whether it was loaded from (or filed in) the compiled-step store, graph breaks, memory."""
        return {
            "backend": self.backend,
            "capture_seconds": round(self.capture_seconds, 4),
            "replay_ms_median": round(statistics.median(self.replay_ms), 4) if self.replay_ms else None,
            "calls": self.replay_ms.total,
            "recompiles": self.recompiles,
            "loaded": self.loaded,
            "helper": self.helper,
            "stored": self.stored,
            "graph_breaks": self.graph_breaks,
            "graph_memory_bytes": self.graph_memory_bytes,
        }


@dataclasses.dataclass(frozen=True)
class DonatedLeaf:
    """One donated tensor of a bucket's arguments, as it was at capture."""

    path: str  # the argument's name, then the leaf's pytree path: "state.kv.k"
    arg: int  # the argument's position
    keypath: tuple  # the leaf's pytree key path in ``args[arg]`` (``pytree.key_get``)
    index: int  # the leaf's position in ``pytree.tree_leaves(args[arg])``
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Donation:
    """What a captured graph donates: the arguments (``argnums``) and their tensor leaves.

    A donated leaf is updated in place by the graph, so the caller must hand
    back the very tensor the graph was captured with (the state it returned).
    ``names[i]``: argument ``argnums[i]``'s name.
    """

    argnums: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    leaves: tuple[DonatedLeaf, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        """The donated leaves' names, in argument order: ``("state.kv.k", "state.kv.v", ...)``."""
        return tuple(leaf.path for leaf in self.leaves)

    def check_shapes(self, args: tuple) -> None:
        """Raise a ValueError naming the first donated leaf whose shape or dtype differs from capture.

        NOTE: reads host metadata only (no sync). Each leaf is reached by its
        key path, not by flattening the arguments, which is several times
        cheaper (graphs/results/notes/code-notes.md).
        """
        for leaf in self.leaves:
            try:
                x = pytree.key_get(args[leaf.arg], leaf.keypath)
            except (AttributeError, IndexError, KeyError, TypeError):
                raise ValueError(f"{leaf.path}: donated leaf is missing from the arguments") from None
            _check_like(leaf, x)


NO_DONATION = Donation()
"""A graph that donates nothing (the default): every argument is an input."""


def _check_like(leaf: DonatedLeaf, x: Any) -> None:
    """A ValueError naming ``leaf`` unless ``x`` is a tensor of its captured shape and dtype."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{leaf.path}: donated leaf must be a tensor, got {type(x).__name__}")
    if x.shape != leaf.shape or x.dtype != leaf.dtype:
        raise ValueError(f"{leaf.path}: donated leaf was captured as {tuple(leaf.shape)} {leaf.dtype}, "
                         f"got {tuple(x.shape)} {x.dtype}")


def _arg_names(fn: Callable, n: int) -> list[str]:
    """Names of ``fn``'s first ``n`` positional parameters (``params, state, inputs`` for a step, through
    a ``functools.partial``), or ``args[i]`` where the signature does not say."""
    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        ps = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in ps if p.kind in positional]
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


def declare_donation(fn: Callable, example_args: tuple, donated: Sequence[int],
                     symbolic: Sequence[tuple[torch.Tensor, int]] = ()) -> Donation:
    """The :class:`Donation` of ``fn`` called on ``example_args`` with arguments ``donated`` donated.

    A donated argument is a tensor (donated whole) or a state pytree, whose
    donated leaves are its declared slot leaves (:func:`funcspec.pytree.slot_leaves`,
    which refuses a tensor without a declared slot axis). A donated leaf keeps
    its shape, so none may be ``symbolic``.
    """
    if isinstance(donated, (str, bytes)) or not isinstance(donated, Sequence):
        raise ValueError(f"donated must be a sequence of argument positions, got {donated!r}")
    n = len(example_args)
    for i in donated:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"donated: argument positions must be ints in [0, {n}), got {i!r}")
    if len(set(donated)) != len(donated):
        raise ValueError(f"donated: positions must be distinct, got {tuple(donated)}")
    names = _arg_names(fn, n)
    free = {id(t): d for t, d in symbolic}
    argnums, leaves = tuple(sorted(donated)), []
    for i in argnums:
        arg = example_args[i]
        # NOTE: the declaration is the tree's own (slot_field); identity maps it onto the flattened leaves.
        ids = {id(arg)} if isinstance(arg, torch.Tensor) else {id(t) for t, _ in slot_leaves(arg, names[i])}
        for j, (keypath, x) in enumerate(pytree.tree_flatten_with_path(arg)[0]):
            if id(x) not in ids:
                continue
            path = names[i] + pytree.keystr(keypath)
            if id(x) in free:
                raise ValueError(f"symbolic: {path} is donated, and a donated leaf keeps its shape "
                                 f"(dim {free[id(x)]} was marked symbolic)")
            leaves.append(DonatedLeaf(path, i, keypath, j, x.shape, x.dtype))
    return Donation(argnums, tuple(names[i] for i in argnums), tuple(leaves))


class Captured:
    """A captured callable: ``out = captured(*args)``; ``captured.stats`` for its costs and
    ``captured.donated`` for the leaves it updates in place (``captured.donation``: the full declaration).

    ``check_shapes``: check the donated leaves' shapes and dtypes at every call (eager and inductor; a
    device graph checks their addresses itself).
    """

    def __init__(self, call: Callable, stats: CaptureStats, donation: Donation = NO_DONATION,
                 check_shapes: bool = True):
        self._call, self.stats, self.donation = call, stats, donation
        self._check = donation.check_shapes if check_shapes and donation.leaves else None

    @property
    def donated(self) -> tuple[str, ...]:
        """The donated leaves by name (``("state.kv.k", ...)``); empty if the graph donates nothing."""
        return self.donation.paths

    def __call__(self, *args):
        if self._check is not None:
            self._check(args)
        return self._call(*args)


class TrustedAfterChecks(Captured):
    """An inductor bucket whose guards stop being evaluated once it is known to be static.

    NOTE: the guards of a compiled function are checked at every call, and on a
    step whose params are ~100 tensors they are a visible share of a small
    model's decode step (graphs/results/notes/code-notes.md). The host loop calls a
    bucket with the same shapes, dtypes and strides every step, so after
    :data:`CHECKED_CALLS` calls its guards can only pass; the later calls skip
    them. A bucket that ever recompiled keeps its guards (an ahead-of-time
    function never recompiles: a call that fails its guards raises). The stance
    in force (e.g. a test's ``fail_on_recompile``) is kept.
    """

    CHECKED_CALLS = 2

    def __init__(self, call: Callable, stats: CaptureStats, donation: Donation = NO_DONATION):
        super().__init__(call, stats, donation)
        self.checked = 0

    @property
    def trusted(self) -> bool:
        """Whether calls now skip the guards."""
        return self.checked >= self.CHECKED_CALLS and self.stats.recompiles == 0

    def __call__(self, *args):
        if not self.trusted:
            # NOTE: the donated leaves are checked with the guards, on the calls that prove the bucket
            # static; afterwards neither runs.
            if self._check is not None:
                self._check(args)
            self.checked += 1
            out = self._call(*args)
            if self.trusted and hasattr(self._call, "disable_guard_check"):
                self._call.disable_guard_check()  # an ahead-of-time function
            return out
        if hasattr(self._call, "disable_guard_check"):
            return self._call(*args)
        from torch._dynamo.eval_frame import _stance  # the stance in force, to keep it

        with torch.compiler.set_stance(_stance.stance, skip_guard_eval_unsafe=True):
            return self._call(*args)


def fresh_code_copy(fn: Callable, name: str) -> Callable:
    """A function with its own code object that calls ``fn`` (a function or a partial).

    NOTE: Dynamo's recompile budget (8) counts per code object, so buckets that
    share one function would exhaust it; each bucket compiles its own copy.
    ``torch.compile`` of a ``functools.partial`` wraps it in one shared
    ``inner`` function, so partials are turned into a copied closure instead.
    """
    if isinstance(fn, functools.partial):
        func, args, kwargs = fn.func, fn.args, fn.keywords

        def bound(*a, **k):
            return func(*args, *a, **kwargs, **k)

        fn = bound
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


INDUCTOR_OPTIONS = {"realize_opcount_threshold": 8, "size_asserts": False}
"""Inductor config for bucket graphs. NOTE: inductor inlines funcspec.rng's hash
chains (tens of int64 ops) into every consumer and re-traces them at codegen;
materialising intermediates of more than 8 ops (default 30) cuts a bucket's
cold compile several fold (graphs/results/notes/code-notes.md). Without size
asserts the graph's Python wrapper no longer checks each input's and custom
op output's sizes and strides at every call (about 200 checks a step of an
8-layer model): the host loop passes a bucket the same buffers every step, as
:class:`TrustedAfterChecks` relies on for its guards."""


def _counting_inductor(stats: CaptureStats):
    """An inductor backend (with :data:`INDUCTOR_OPTIONS`) that counts how often Dynamo hands it a graph."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        stats.compiles += 1
        return compile_fx(gm, example_inputs, config_patches=INDUCTOR_OPTIONS)

    return backend


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@functools.cache
def probe_isa_early() -> None:
    """Start inductor's probe of this CPU's vector ISAs in a thread, once per process. On an empty cache it builds
    and loads a test library per ISA (seconds), which the first compile would otherwise wait for; in a thread
    it overlaps loading the weights and tracing the first graph. A compile that asks meanwhile waits on the
    probe's file locks and reuses its libraries, so the ISA it picks is the same."""
    import threading

    from torch._inductor import cpu_vec_isa

    threading.Thread(target=cpu_vec_isa.valid_vec_isa_list, name="funcspec-isa-probe", daemon=True).start()


def wrap_int64_overflow() -> None:
    """Compile inductor's C++ kernels with ``-fwrapv`` (idempotent).

    NOTE: funcspec.rng's splitmix64 hash relies on int64 multiply/add wrapping
    around. Signed overflow is undefined behaviour in C++, and GCC was seen to
    miscompile the hash in an inductor scalar loop (torch 2.13 CPU), breaking
    eager/compiled bit-identity. ``-fwrapv`` makes wrap-around defined. torch
    has no public option for kernel cflags, hence the wrapper.
    """
    from torch._inductor import cpp_builder

    orig = cpp_builder._get_optimization_cflags
    if getattr(orig, "funcspec_fwrapv", False):
        return

    def with_fwrapv(*args, **kwargs):
        cflags, ldflags = orig(*args, **kwargs)
        return cflags + ["fwrapv"], ldflags

    with_fwrapv.funcspec_fwrapv = True  # type: ignore[attr-defined]  # a marker on the function
    cpp_builder._get_optimization_cflags = with_fwrapv


def compile_inductor(fn: Callable, name: str, stats: CaptureStats, example_args: tuple,
                     symbolic: Sequence[tuple[torch.Tensor, int]] = ()) -> Callable:
    """``fn`` compiled by inductor for ``example_args`` (fullgraph), static but for the ``symbolic`` sizes:
    loaded from :mod:`funcspec.capture.store` when a start before compiled the same graph, else traced and
    compiled ahead of time (``aot_compile``) and filed there. Either way an :class:`AheadOfTime` step, which
    compiles again where a call fails its guards; a graph that cannot be compiled ahead of time (or named by a
    store key) compiles as a plain ``torch.compile`` does, with one warning saying why.

    NOTE: ``dynamic=False`` keeps Dynamo's automatic dynamic shapes off, which would otherwise make symbolic
    any int that differed between calls of a shared code object: the compile regions' static configs
    (a quantized format's group size came out as a symbol and failed the region's lookup).
    """
    wrap_int64_overflow()
    at = _leaf_positions(example_args, symbolic)
    compiled = _ahead_of_time(fn, name, stats, example_args, at)
    if compiled is None:
        return _compile_plain(fn, name, stats, example_args, at)
    return AheadOfTime(compiled, fn, name, stats, at)


def _leaf_positions(args: tuple, symbolic: Sequence[tuple[torch.Tensor, int]]) -> tuple[tuple[int, int], ...]:
    """``symbolic``'s (tensor, dim) as (position among ``args``' leaves, dim): the same sizes of other arguments."""
    ids = {id(x): i for i, x in enumerate(pytree.tree_leaves(args))}
    return tuple((ids[id(t)], d) for t, d in symbolic)


def _with_symbolic(args: tuple, at: tuple[tuple[int, int], ...]) -> tuple[tuple, list]:
    """``args`` with the leaves at ``at`` copied (marking a size symbolic tags the tensor, and the caller's must
    stay unmarked), and those copies' (tensor, dim)."""
    leaves, spec = pytree.tree_flatten(args)
    for i in {i for i, _ in at}:
        leaves[i] = leaves[i].clone()
    return pytree.tree_unflatten(leaves, spec), [(leaves[i], d) for i, d in at]


def _filing(fn: Callable, name: str, args: tuple, at: tuple) -> tuple[tuple, list, Optional[Path], Optional[str],
                                                                      Optional[Path]]:
    """Where ``fn``'s graph for ``args`` is filed: ``args`` with their symbolic leaves copied
    (:func:`_with_symbolic`), those copies' (tensor, dim), the store's directory, the key and the file (``None``
    each where the store is off or no key names the graph)."""
    args, symbolic = _with_symbolic(args, at) if at else (args, [])
    where = store.open_store() if store.enabled() else None
    key = store.key(fn, args, tuple(symbolic), INDUCTOR_OPTIONS, where) if where is not None else None
    path = store.path_for(where, name, key) if where is not None and key else None  # (a key: a store)
    return args, symbolic, where, key, path


def filed(fn: Callable, example_args: tuple, name: str, symbolic: Sequence[tuple[torch.Tensor, int]] = ()) -> bool:
    """Whether :func:`compile_inductor` would load ``fn``'s graph for ``example_args`` from the store (a file
    under its key exists; its guards are checked only when it loads)."""
    path = _filing(fn, name, example_args, _leaf_positions(example_args, symbolic))[4]
    return path is not None and path.is_file()


def _ahead_of_time(fn: Callable, name: str, stats: CaptureStats, args: tuple, at: tuple) -> Optional[Callable]:
    """The ahead-of-time function of ``fn`` for ``args``: loaded from the store, else compiled and filed;
    ``None`` (with one warning) where it cannot be compiled ahead of time."""
    args, symbolic, where, key, path = _filing(fn, name, args, at)
    # NOTE: under the graph's lock, so a process that wants the same graph meanwhile loads this one's
    with store.compiling(path):
        loaded = store.load(path) if path else None
        if loaded is not None:
            reason = guard_failure(loaded, args)
            if reason is None:
                stats.loaded, stats.stored = True, str(path)
                return loaded
            store.discard(path, f"its guards fail in this process: {reason}")  # type: ignore[arg-type]  # loaded: a path
        if where is not None and key is None:
            store.warn(f"{name}'s static config holds an object no key can name; it compiles without the store")
        # NOTE: sizes are marked only for a compile: a loaded function's guards were rebuilt without the marks
        # (torch 2.13), so a marked argument would fail them; the steps' own inputs are never marked.
        for tensor, dim in symbolic:
            torch._dynamo.mark_dynamic(tensor, dim)
        options: dict[str, Any] = {**INDUCTOR_OPTIONS, "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe}
        compiled: Any = torch.compile(fresh_code_copy(fn, name), fullgraph=True, dynamic=False, options=options)
        try:
            aot = compiled.aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 (a real error in the function raises again from the plain compile)
            store.warn(f"{name} cannot be compiled ahead of time, so it is compiled at its first call and not "
                       f"filed ({type(e).__name__}: {str(e)[:200]})")
            return None
        stats.compiles += 1
        if path is not None and store.save(aot, path):
            stats.stored = str(path)
        return aot


def guard_failure(compiled, args: tuple) -> Optional[str]:
    """Why ahead-of-time function ``compiled`` may not run on ``args`` (its failing guards), or ``None``."""
    if compiled.guard_check(*args):
        return None
    try:
        f_locals = compiled.prepare_f_locals(*args)
        return " ".join(str(compiled._artifacts.guard_manager.check_verbose(f_locals)).split())[:300]
    except Exception:  # noqa: BLE001 (the reason is for a warning; its absence must not stop the fallback)
        return "its guards fail"


class AheadOfTime:
    """An ahead-of-time compiled step that compiles again, with one warning naming the failed guard, where a call
    fails the guards of every graph it holds (another shape, thread count, grad mode or default dtype than they
    were compiled under): the function itself would raise where a compile works. It keeps each graph, as
    Dynamo's cache does, so shapes that alternate compile once each. Under the ``fail_on_recompile`` stance it
    raises, as a recompile would."""

    def __init__(self, compiled, fn: Callable, name: str, stats: CaptureStats, at: tuple):
        self.compiled, self._fn, self._name, self._stats, self._at = compiled, fn, name, stats, at
        self.variants = [compiled]  # every graph compiled so far, the one in use first
        self.checking = True
        compiled.disable_guard_check()  # NOTE: checked here instead, once a call

    def __call__(self, *args):
        if self.checking and not self.compiled.guard_check(*args):
            self.compiled = self._variant(args)
        return self.compiled(*args)

    def _variant(self, args: tuple):
        """A held graph whose guards ``args`` pass, else a new one compiled for them."""
        held = next((v for v in self.variants if v.guard_check(*args)), None)
        if held is not None:
            return held
        reason = guard_failure(self.compiled, args)
        from torch._dynamo.eval_frame import _stance

        if _stance.stance == "fail_on_recompile":
            raise RuntimeError(f"{self._name}: a call failed the compiled graph's guards ({reason}) under the "
                               f"fail_on_recompile stance")
        store.warn(f"{self._name}: a call failed the compiled graph's guards ({reason}); compiling it again")
        compiled = _ahead_of_time(self._fn, self._name, self._stats, args, self._at)
        if compiled is None:  # a plain compile, which checks its own guards (and recompiles) at every call
            self.checking = False
            return _compile_plain(self._fn, self._name, self._stats, args, self._at)
        compiled.disable_guard_check()  # type: ignore[attr-defined]  # an ahead-of-time function
        self.variants.insert(0, compiled)
        return compiled

    def disable_guard_check(self) -> None:
        """Stop evaluating the guards (:class:`TrustedAfterChecks`, once the bucket is known to be static)."""
        self.checking = False


def _compile_plain(fn: Callable, name: str, stats: CaptureStats, first_args: tuple = (), at: tuple = ()) -> Callable:
    """``torch.compile`` of a private code copy of ``fn`` (compiled at its first call; not filed in the store).
    ``first_args``, the arguments of that first call, get their sizes at ``at`` marked symbolic (a symbolic
    batch), as Dynamo reads the marks when it traces."""
    leaves = pytree.tree_leaves(first_args)
    for i, dim in at:
        torch._dynamo.mark_dynamic(leaves[i], dim)
    return torch.compile(fresh_code_copy(fn, name), backend=_counting_inductor(stats), fullgraph=True, dynamic=False)


class DeviceGraph:
    """Manual CUDA / NPU graph of ``fn`` with static input buffers (vLLM pattern).

    The graph reads and writes the tensors of ``example_args`` at their
    addresses. Donated leaves (``donation``: the state the graph updates in
    place) are bound there: a call must pass the very tensors it was captured
    with, and one at another address is a ValueError naming the leaf. A copy
    would be wrong for them: the graph's writes would land in the static
    buffer and the caller's tensor would never see them. Other tensors that
    are the same storage at every call (params) are read in place; the rest
    (per-step inputs) are copied into the static buffers before ``replay()``.
    torch.npu mirrors torch.cuda's graph API, so one class serves both.
    """

    def __init__(self, fn, example_args, device_mod, pool, stats: CaptureStats, warmup: int = 2,
                 donation: Donation = NO_DONATION):
        self.mod = device_mod
        leaves, self.spec = pytree.tree_flatten(example_args)
        self.static = list(leaves)
        # NOTE: a tuple's leaves are its arguments' leaves in order, so a donated leaf's flat position is
        # its argument's offset plus its own index there.
        offsets = [0]
        for arg in example_args:
            offsets.append(offsets[-1] + len(pytree.tree_leaves(arg)))
        self.donated = [(offsets[leaf.arg] + leaf.index, leaf) for leaf in donation.leaves]
        bound = {i for i, _ in self.donated}
        self.copied = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i not in bound]
        stream = device_mod.Stream()
        stream.wait_stream(device_mod.current_stream())
        with device_mod.stream(stream):  # NOTE: warm-up off the default stream, as capture requires
            for _ in range(warmup):
                fn(*example_args)
        device_mod.current_stream().wait_stream(stream)
        device_mod.synchronize()
        before = device_mod.memory_allocated()
        self.graph = device_mod.CUDAGraph() if hasattr(device_mod, "CUDAGraph") else device_mod.NPUGraph()
        with device_mod.graph(self.graph, pool=pool):
            self.out = fn(*pytree.tree_unflatten(self.static, self.spec))
        device_mod.synchronize()
        stats.graph_memory_bytes = device_mod.memory_allocated() - before

    def __call__(self, *args):
        leaves, spec = pytree.tree_flatten(args)
        if spec != self.spec:
            raise ValueError("captured graph called with a different argument structure")
        # NOTE: every donated leaf is checked before anything is copied, so a refused call changes nothing.
        for i, leaf in self.donated:
            x = leaves[i]
            _check_like(leaf, x)
            if x.data_ptr() != self.static[i].data_ptr():
                raise ValueError(
                    f"{leaf.path}: donated leaf arrived at another address than the graph was captured with; "
                    "the graph updates it in place, so a copy would lose its writes: pass the tensor the graph "
                    "returned (or update the state in place, as tree.move_slot does)")
        for i in self.copied:
            buf, x = self.static[i], leaves[i]
            if buf.data_ptr() != x.data_ptr():
                buf.copy_(x)
        self.graph.replay()
        return self.out


def _npu_module():
    """torch.npu after a lazy ``import torch_npu``, or a clear error where it cannot run."""
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # ImportError, or CANN missing at import time
        raise RuntimeError(
            "backend='aclgraph' needs an Ascend NPU host with CANN and `pip install 'funcspec[npu]'` "
            f"(torch-npu==2.13.0, which brings torchair); torch_npu could not be imported here: {e}"
        ) from e
    return torch.npu  # type: ignore[attr-defined]  # torch_npu adds it


def _graph_module(backend: str):
    """The device module whose graph API ``backend`` drives: torch.cuda, or torch.npu (imported lazily)."""
    if backend == "aclgraph":
        return _npu_module()
    if not torch.cuda.is_available():
        raise RuntimeError("backend='cudagraph' needs a CUDA GPU; none is available")
    return torch.cuda


AUTO_BACKENDS = {"cuda": "cudagraph", "npu": "aclgraph"}
"""What ``auto`` picks per device type; any other device (CPU) gets ``inductor``.

NOTE: a fixed rule, not a lookup of benchmark files, so an installed package
behaves as a checkout does. Device graphs replay a whole step in one launch.
On CPU every committed ``funcspec bench capture`` run measured inductor
faster than eager in every bucket (graphs/results/notes/code-notes.md); ``bench capture`` still reports the
measured winner (:func:`funcspec.bench.capture.best_cpu_backend`)."""


def auto_backend(device: torch.device | str) -> str:
    """The backend ``auto`` means on ``device``: see :data:`AUTO_BACKENDS`."""
    return AUTO_BACKENDS.get(torch.device(device).type, "inductor")


def resolve_backend(backend: str, device: torch.device | str = "cpu") -> str:
    """Map ``auto`` to a concrete backend for ``device`` (:func:`auto_backend`); reject unknown names."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "aclgraph":
        _npu_module()  # refuse now, not at the first capture
    if backend == "cudagraph" and not torch.cuda.is_available():
        raise RuntimeError("backend='cudagraph' needs a CUDA GPU; torch.cuda.is_available() is False here")
    return auto_backend(device) if backend == "auto" else backend


def graph_pool(backend: str):
    """A memory pool that a group of device graphs may share (``None`` for the other backends).

    NOTE: one pool per group whose graphs stay alive together (an engine's):
    once every graph of a pool is freed the pool is released, and capturing
    into its handle again fails inside the CUDA caching allocator. A
    process-wide pool broke the second engine a process built."""
    return _graph_module(backend).graph_pool_handle() if backend in ("cudagraph", "aclgraph") else None


def capture(fn: Callable, example_args: tuple, backend: str = "eager", *, name: str = "step",
            precompile: bool = False, npu_mode: str = "graph",
            symbolic: Sequence[tuple[torch.Tensor, int]] = (), donated: Sequence[int] = (),
            pool=None) -> Captured:
    """Capture ``fn`` for the shapes of ``example_args`` with ``backend``.

    Args:
        fn: a pure function (it may update donated buffers in place).
        example_args: arguments with the bucket's shapes. Device-graph
            backends run ``fn`` on them while capturing, so point their
            writes at scratch slots.
        backend: eager | inductor | cudagraph | aclgraph (``auto`` must be
            resolved first with :func:`resolve_backend`).
        name: a unique name per bucket (used for the code-object copy).
        precompile: for device graphs, compile ``fn`` with inductor first.
        npu_mode: ``graph`` (torch.npu.NPUGraph, shared with CUDA) or
            ``npugraph_ex`` (torchair's backend).
        symbolic: ``(tensor, dim)`` of ``example_args`` whose size the graph
            leaves symbolic (inductor only: one graph then serves every size;
            device graphs replay fixed addresses and shapes).
        donated: positions of ``example_args`` that ``fn`` donates (updates in
            place and returns), as JAX's ``donate_argnums``: ``(1,)`` for a
            step's ``state``. A tensor is donated whole; a state pytree donates
            its declared slot leaves (:func:`funcspec.pytree.slot_leaves`). Every
            backend records them (``Captured.donated``); eager checks their
            shapes and dtypes at each call, inductor while it checks its
            guards (:class:`TrustedAfterChecks`), and a device graph
            also refuses one at another address than at capture (a copy would
            lose its writes). ``()`` (the default): nothing is declared, and a
            device graph copies any argument at a new address.
        pool: device graphs: the memory pool to capture into (:func:`graph_pool`, shared by graphs that live
            together); ``None``: a pool of this graph's own.
    """
    donation = declare_donation(fn, example_args, donated, symbolic)
    stats = CaptureStats(backend)
    t0 = time.perf_counter()
    breaks0 = _graph_breaks()
    if backend == "eager":
        call = fn
    elif backend == "inductor":
        call = compile_inductor(fn, name, stats, example_args, symbolic)
        call(*example_args)  # the first call loads kernels: part of capture_seconds
    elif backend in ("cudagraph", "aclgraph"):
        mod = _graph_module(backend)
        inner = compile_inductor(fn, name, stats, example_args) if precompile else fn
        if backend == "aclgraph" and npu_mode == "npugraph_ex":
            importlib.import_module("torchair")
            call = torch.compile(fresh_code_copy(fn, name), backend="npugraph_ex", fullgraph=True, dynamic=False,
                                 options={"frozen_parameter": True, "capture_limit": 1})
            call(*example_args)
        else:
            pool = mod.graph_pool_handle() if pool is None else pool
            call = DeviceGraph(inner, example_args, mod, pool, stats, donation=donation)
    else:
        raise ValueError(f"backend must be one of {BACKENDS[:-1]} here, got {backend!r}")
    stats.capture_seconds = time.perf_counter() - t0
    stats.graph_breaks = _graph_breaks() - breaks0
    if backend == "inductor":
        return TrustedAfterChecks(call, stats, donation)
    return Captured(call, stats, donation, check_shapes=not isinstance(call, DeviceGraph))
