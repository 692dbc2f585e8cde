"""Donation declared at the capture boundary: ``capture(..., donated=...)`` records the donated leaves on every
backend, and a device graph binds them by address (a call that moves one is refused by name) while it still
copies per-step inputs. The device graph runs on CPU through a fake device module (torch.cuda's graph API)."""

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import torch.utils._pytree as pytree

from funcspec.capture import backends
from funcspec.capture.backends import CaptureStats, DeviceGraph, capture, declare_donation
from funcspec.pytree import pytree_dataclass, replace, slot_field


@pytree_dataclass
class Cache:
    buf: torch.Tensor = slot_field()  # [S, 2]
    lens: torch.Tensor = slot_field()  # [S]


@pytree_dataclass
class State:
    cache: Cache
    seen: torch.Tensor = slot_field()  # [S]


@pytree_dataclass
class Loose:
    buf: torch.Tensor  # a tensor without a declared slot axis


DONATED = ("state.cache.buf", "state.cache.lens", "state.seen")


def step(params, state, inputs):
    """Add ``inputs["x"]`` [S, 2] into the buffer and ``inputs["n"]`` [S] into the lengths and ``seen``;
    return the scaled buffer. Donates: state."""
    state.cache.buf.add_(inputs["x"])
    state.cache.lens.add_(inputs["n"])
    state.seen.add_(inputs["n"])
    return state.cache.buf * params["w"], state


def new_state():
    return State(Cache(torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64)), torch.zeros(2, dtype=torch.int64))


def zero_inputs():
    """Example inputs that change nothing: warm-up and capture run the step on them."""
    return {"x": torch.zeros(2, 2), "n": torch.zeros(2, dtype=torch.int64)}


def inputs(x, n):
    return {"x": torch.tensor(x, dtype=torch.float32), "n": torch.tensor(n, dtype=torch.int64)}


class FakeGraph:
    """A recorded call: ``replay()`` runs it again on the tensors it was captured with and writes its results
    into the captured outputs, as a device graph's kernels do."""

    def __init__(self):
        self.recorded = None
        self.replays = 0

    def replay(self):
        fn, args, out = self.recorded
        new = fn(*args)
        for o, n in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
            if o is not n:
                o.copy_(n)
        self.replays += 1


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeDevice:
    """torch.cuda's graph API on CPU: ``graph()`` records the call made under it (through :meth:`recorded`)."""

    CUDAGraph = FakeGraph
    Stream = FakeStream

    def __init__(self):
        self.capturing = None
        self.pools = {}  # handle -> weak refs of the graphs captured into it

    def stream(self, s):
        return contextlib.nullcontext()

    def current_stream(self):
        return FakeStream()

    def synchronize(self):
        pass

    def memory_allocated(self):
        return 0

    def graph_pool_handle(self):
        handle = (0, len(self.pools) + 1)
        self.pools[handle] = []
        return handle

    @contextlib.contextmanager
    def graph(self, g, pool=None):
        # NOTE: as CUDA's caching allocator: a pool whose graphs were all freed is released, and capturing into
        # its handle again fails (an internal assert there).
        graphs = self.pools[pool]
        if graphs and all(r() is None for r in graphs):
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a released pool)")
        graphs.append(weakref.ref(g))
        self.capturing = g
        try:
            yield
        finally:
            self.capturing = None

    def recorded(self, fn):
        """``fn``, recorded into the graph being captured when called under :meth:`graph`."""
        @functools.wraps(fn)
        def run(*args):
            out = fn(*args)
            if self.capturing is not None:
                self.capturing.recorded = (fn, args, out)
            return out

        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    """``capture(..., "cudagraph")`` on the fake device."""
    dev = FakeDevice()
    monkeypatch.setattr(backends, "_graph_module", lambda backend: dev)
    return dev


def device_graph(dev, donated=(1,)):
    params, state = {"w": torch.tensor(10.0)}, new_state()
    fn = dev.recorded(step)
    graph = capture(fn, (params, state, zero_inputs()), "cudagraph", donated=donated)
    return graph, params, state


# ------------------------------------------------------------ device graphs
def test_a_donated_state_at_its_address_is_updated_in_place_across_calls(fake_cuda):
    graph, params, state = device_graph(fake_cuda)
    assert graph.donated == DONATED
    out, new = graph(params, state, inputs([[1, 2], [3, 4]], [1, 2]))
    out, new = graph(params, new, inputs([[10, 20], [30, 40]], [1, 0]))
    assert new.cache.buf is state.cache.buf and new.seen is state.seen  # the caller's tensors, written in place
    assert state.cache.buf.tolist() == [[11.0, 22.0], [33.0, 44.0]]
    assert state.cache.lens.tolist() == [2, 2] and state.seen.tolist() == [2, 2]
    assert out.tolist() == [[110.0, 220.0], [330.0, 440.0]]
    assert graph._call.graph.replays == 2


@pytest.mark.parametrize("moved", DONATED)
def test_a_donated_leaf_at_another_address_is_refused_by_name(fake_cuda, moved):
    graph, params, state = device_graph(fake_cuda)
    graph(params, state, inputs([[1, 1], [1, 1]], [1, 1]))
    copy = pytree.tree_map(lambda x: x, state)  # the same tensors, one of them reallocated below
    field = moved.split(".")[-1]
    if moved.startswith("state.cache."):
        copy = replace(copy, cache=replace(copy.cache, **{field: getattr(copy.cache, field).clone()}))
    else:
        copy = replace(copy, **{field: getattr(copy, field).clone()})
    with pytest.raises(ValueError, match=rf"^{moved}: donated leaf arrived at another address than the graph "
                                         r"was captured with; the graph updates it in place, so a copy would "
                                         r"lose its writes"):
        graph(params, copy, inputs([[5, 5], [5, 5]], [3, 3]))
    # NOTE: refused before anything ran or was copied: the caller's state is as the first call left it.
    assert graph._call.graph.replays == 1
    assert state.cache.buf.tolist() == [[1.0, 1.0], [1.0, 1.0]] and state.seen.tolist() == [1, 1]
    assert graph._call.static[-2].tolist() == [[1.0, 1.0], [1.0, 1.0]]  # the inputs' static buffer: untouched


def test_a_donated_leaf_of_another_shape_is_refused_by_name(fake_cuda):
    graph, params, state = device_graph(fake_cuda)
    short = replace(state, seen=state.seen[:1])  # same address, one slot
    with pytest.raises(ValueError, match=r"^state.seen: donated leaf was captured as \(2,\) torch.int64, "
                                         r"got \(1,\) torch.int64$"):
        graph(params, short, inputs([[1, 1], [1, 1]], [1, 1]))


def test_inputs_at_new_addresses_are_copied_and_params_read_in_place(fake_cuda):
    graph, params, state = device_graph(fake_cuda)
    first, second = inputs([[1, 2], [3, 4]], [1, 1]), inputs([[5, 6], [7, 8]], [2, 0])
    out, _ = graph(params, state, first)
    assert out.tolist() == [[10.0, 20.0], [30.0, 40.0]]
    params["w"].fill_(2.0)  # params: the same storage at every call, read where they are
    out, _ = graph(params, state, second)
    assert out.tolist() == [[12.0, 16.0], [20.0, 24.0]]
    assert state.cache.lens.tolist() == [3, 1]
    static = graph._call.static
    assert static[0] is params["w"]  # bound, never copied
    assert static[-2].tolist() == [[5.0, 6.0], [7.0, 8.0]] and static[-2] is not second["x"]  # copied in


def test_without_a_declaration_a_moved_state_is_copied_and_its_writes_are_lost(fake_cuda):
    """The old behaviour, still the default: the hazard the declaration turns into an error."""
    graph, params, state = device_graph(fake_cuda, donated=())
    assert graph.donated == ()
    rebuilt = pytree.tree_map(torch.clone, state)
    rebuilt.cache.buf.fill_(1.0)
    out, new = graph(params, rebuilt, inputs([[1, 1], [1, 1]], [1, 1]))
    assert out.tolist() == [[20.0, 20.0], [20.0, 20.0]]  # it ran on a copy of the rebuilt state...
    assert rebuilt.cache.buf.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # ...whose own tensor never saw the write
    assert new.cache.buf is state.cache.buf and state.cache.buf.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_device_graph_binds_donated_leaves_at_their_flat_positions():
    dev = FakeDevice()
    args = ({"w": torch.tensor(1.0)}, new_state(), zero_inputs())
    fn = dev.recorded(step)
    graph = DeviceGraph(fn, args, dev, dev.graph_pool_handle(), CaptureStats("cudagraph"),
                        donation=declare_donation(fn, args, (1,)))
    # params: leaf 0; state: leaves 1-3; inputs: leaves 4-5
    assert [(i, leaf.path) for i, leaf in graph.donated] == [(1, "state.cache.buf"), (2, "state.cache.lens"),
                                                              (3, "state.seen")]
    assert graph.copied == [0, 4, 5]


# --------------------------------------------------------- eager, inductor
def test_eager_records_the_declaration_and_checks_shapes():
    state = new_state()
    graph = capture(step, ({"w": torch.tensor(1.0)}, state, zero_inputs()), "eager", donated=(1,))
    assert graph.donated == DONATED and graph.donation.argnums == (1,) and graph.donation.names == ("state",)
    moved = pytree.tree_map(torch.clone, state)  # eager writes wherever the state is: no address check
    out, new = graph({"w": torch.tensor(3.0)}, moved, inputs([[1, 2], [3, 4]], [1, 1]))
    assert out.tolist() == [[3.0, 6.0], [9.0, 12.0]] and new.cache.buf is moved.cache.buf
    with pytest.raises(ValueError, match=r"^state.cache.buf: donated leaf was captured as \(2, 2\) torch.float32, "
                                         r"got \(2, 2\) torch.float64$"):
        graph({"w": torch.tensor(1.0)}, replace(moved, cache=replace(moved.cache, buf=moved.cache.buf.double())),
              zero_inputs())
    with pytest.raises(ValueError, match=r"^state.cache.buf: donated leaf is missing from the arguments$"):
        graph({"w": torch.tensor(1.0)}, Cache(moved.cache.buf, moved.cache.lens), zero_inputs())


def test_inductor_records_the_declaration_and_checks_shapes_with_its_guards(monkeypatch):
    """The inductor path's wrapper, with compilation swapped for the function itself (no compile here):
    donated shapes are checked on the calls that check the guards, then neither is (the hot path)."""
    monkeypatch.setattr(backends, "compile_inductor", lambda fn, name, stats, args, symbolic=(): fn)
    state = new_state()
    graph = capture(step, ({"w": torch.tensor(1.0)}, state, zero_inputs()), "inductor", donated=(1,))
    assert isinstance(graph, backends.TrustedAfterChecks) and graph.donated == DONATED
    with pytest.raises(ValueError, match=r"^state.seen: donated leaf was captured as \(2,\) torch.int64"):
        graph({"w": torch.tensor(1.0)}, replace(state, seen=torch.zeros(3, dtype=torch.int64)), zero_inputs())
    for _ in range(backends.TrustedAfterChecks.CHECKED_CALLS):
        graph({"w": torch.tensor(1.0)}, state, inputs([[1, 1], [1, 1]], [1, 1]))
    assert graph.trusted and state.seen.tolist() == [2, 2]
    checks = []
    monkeypatch.setattr(graph, "_check", checks.append)
    graph({"w": torch.tensor(1.0)}, state, inputs([[1, 1], [1, 1]], [1, 1]))
    assert checks == [] and state.seen.tolist() == [3, 3]  # a trusted bucket checks nothing


def test_nothing_donated_by_default():
    graph = capture(step, ({"w": torch.tensor(1.0)}, new_state(), zero_inputs()), "eager")
    assert graph.donated == () and graph._check is None
    wide = new_state()
    wide = replace(wide, cache=replace(wide.cache, buf=wide.cache.buf.double()))  # unchecked: nothing declared
    out, _ = graph({"w": torch.tensor(1.0)}, wide, inputs([[1, 2], [3, 4]], [0, 0]))
    assert out.dtype == torch.float64 and out.tolist() == [[1.0, 2.0], [3.0, 4.0]]


# ------------------------------------------------------------ declaration
def test_a_donated_tensor_argument_is_donated_whole_and_named_by_the_signature():
    def add(cfg, acc, x):
        acc.add_(x)
        return acc

    fn = functools.partial(add, "cfg")  # a step's shape: a static config bound first
    d = declare_donation(fn, (torch.zeros(3), torch.ones(3)), (0,))
    assert d.paths == ("acc",) and d.leaves[0].shape == (3,) and d.leaves[0].dtype == torch.float32
    anon = declare_donation(lambda *a: a, ({"w": torch.ones(1)}, new_state()), [1])
    assert anon.paths == ("args[1].cache.buf", "args[1].cache.lens", "args[1].seen")


@pytest.mark.parametrize("donated, message", [
    (1, r"donated must be a sequence of argument positions, got 1"),
    ("1", r"donated must be a sequence of argument positions, got '1'"),
    ((3,), r"donated: argument positions must be ints in \[0, 3\), got 3"),
    ((-1,), r"donated: argument positions must be ints in \[0, 3\), got -1"),
    ((True,), r"donated: argument positions must be ints in \[0, 3\), got True"),
    ((1, 1), r"donated: positions must be distinct, got \(1, 1\)"),
])
def test_bad_declarations_are_refused(donated, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        capture(step, ({"w": torch.tensor(1.0)}, new_state(), zero_inputs()), "eager", donated=donated)


def test_a_donated_state_must_declare_its_slot_leaves():
    with pytest.raises(TypeError, match=r"^state.buf declares no slot axis"):
        capture(lambda params, state: state, ({}, Loose(torch.zeros(2))), "eager", donated=(1,))
    with pytest.raises(TypeError, match=r"^params: a state holds tensors and pytree dataclasses, got dict$"):
        capture(step, ({"w": torch.tensor(1.0)}, new_state(), zero_inputs()), "eager", donated=(0,))


def test_a_donated_leaf_cannot_be_symbolic():
    state = new_state()
    with pytest.raises(ValueError, match=r"^symbolic: state.seen is donated, and a donated leaf keeps its shape "
                                         r"\(dim 0 was marked symbolic\)$"):
        capture(step, ({"w": torch.tensor(1.0)}, state, zero_inputs()), "eager", donated=(1,),
                symbolic=[(state.seen, 0)])


def test_graphs_share_a_pool_while_alive_and_a_new_group_gets_a_new_pool(fake_cuda):
    """A runner's buckets share its pool; after they are freed (an engine dropped) the next engine's graphs
    capture into a pool of their own, never the released one (which failed the second engine of a process)."""
    params, state = {"w": torch.tensor(10.0)}, new_state()
    fn = fake_cuda.recorded(step)
    pool = backends.graph_pool("cudagraph")
    first = [capture(fn, (params, state, zero_inputs()), "cudagraph", donated=(1,), pool=pool) for _ in range(2)]
    assert len(fake_cuda.pools[pool]) == 2
    del first
    gc.collect()
    with pytest.raises(RuntimeError, match="released pool"):
        capture(fn, (params, state, zero_inputs()), "cudagraph", donated=(1,), pool=pool)
    fresh = backends.graph_pool("cudagraph")
    again = capture(fn, (params, state, zero_inputs()), "cudagraph", donated=(1,), pool=fresh)
    alone = capture(fn, (params, state, zero_inputs()), "cudagraph", donated=(1,))
    assert again is not None and alone is not None and backends.graph_pool("eager") is None
