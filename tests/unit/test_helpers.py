"""Start-up helper processes: how many, which graphs each takes, what the engine does with what they filed."""

import subprocess
import sys
import types

import pytest

from funcspec import build
from funcspec.capture import helpers
from funcspec.config import CompilationConfig

GB = 1 << 30
TODO = [(0, 4, 99, "filtered"), (0, 4, 99, "greedy"), (1, 4, 99, "filtered"), (1, 4, 99, "greedy")]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(helpers.ENV, raising=False)


def test_count_takes_idle_cores_up_to_the_missing_graphs_and_half_the_free_memory(no_env):
    assert helpers.count(None, 4, GB, cores=2, free=64 * GB) == 1
    assert helpers.count(None, 4, GB, cores=16, free=64 * GB) == 3  # one graph each, the engine's included
    assert helpers.count(None, 4, 10 * GB, cores=16, free=64 * GB) == 3
    assert helpers.count(None, 4, 20 * GB, cores=16, free=64 * GB) == 1  # 32 GB hold one copy more
    assert helpers.count(None, 4, 40 * GB, cores=16, free=64 * GB) == 0
    assert helpers.count(None, 4, GB, cores=16, free=None) == 3  # free memory unknown: no limit
    assert helpers.count(None, 4, GB, cores=1, free=64 * GB) == 0
    assert helpers.count(None, 1, GB, cores=16, free=64 * GB) == 0  # one graph: nothing to share
    assert helpers.count(None, 4, GB, auto=False, cores=16, free=64 * GB) == 0  # not a CPU engine


def test_count_takes_the_config_then_the_environment(no_env, monkeypatch):
    assert helpers.count(2, 4, GB, cores=1, free=0) == 2  # asked for: cores and memory do not limit it
    assert helpers.count(5, 4, GB) == 3  # but the graphs do
    assert helpers.count(0, 4, GB, cores=16) == 0
    monkeypatch.setenv(helpers.ENV, "2")
    assert helpers.count(None, 8, GB, cores=1) == 2
    assert helpers.count(0, 8, GB, cores=1) == 0  # the config first
    assert helpers.count(None, 8, GB, auto=False) == 2
    monkeypatch.setenv(helpers.ENV, "two")
    with pytest.raises(ValueError, match="FUNCSPEC_COMPILE_HELPERS must be a number of helper processes >= 0, "
                                         "got 'two'"):
        helpers.count(None, 8, GB)


def test_shares_deal_the_graphs_in_turn_the_engine_first():
    assert helpers.shares(TODO, 1) == [[TODO[0], TODO[2]], [TODO[1], TODO[3]]]
    assert helpers.shares(TODO, 3) == [[g] for g in TODO]
    assert helpers.shares(TODO[:3], 2) == [[TODO[0]], [TODO[1]], [TODO[2]]]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_compile_helpers_must_be_a_count(bad):
    with pytest.raises(ValueError, match=r"compilation_config\.compile_helpers must be a number of processes >= 0"):
        CompilationConfig.from_vllm({"compile_helpers": bad})
    assert CompilationConfig.from_vllm({"compile_helpers": 2}).compile_helpers == 2


def _helper(code: str, share: list) -> helpers.Helpers:
    """A stand-in helper process running ``code``, with one share."""
    from pathlib import Path
    import tempfile

    log = Path(tempfile.mkstemp(prefix="funcspec-test-helper-")[1])
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True)
    return helpers.Helpers([(p, log)], [share])


class _Runner:
    """Records what the engine captured; a graph counts as loaded from the store when a helper filed it."""

    def __init__(self, filed: set):
        self.filed, self.calls, self.made = filed, [], {}

    def graph_key(self, b, k, t, mode):
        return b, k, t, mode.name

    def graph(self, b, k, t, mode):
        key = b, k, t, mode.name
        self.calls.append(key)
        stats = types.SimpleNamespace(loaded=key in self.filed, helper=None)
        return self.made.setdefault(key, types.SimpleNamespace(stats=stats))


def test_the_engine_compiles_its_share_first_then_loads_what_the_helper_filed():
    h = _helper("import sys; from funcspec.capture import helpers; print('a line of its own'); "
                "helpers.report((0, 4, 99, 'greedy'), sys.stdout); helpers.report((1, 4, 99, 'greedy'), sys.stdout)",
                [TODO[1], TODO[3]])
    runner = _Runner({TODO[1], TODO[3]})
    build.capture_all(runner, TODO, h)
    assert runner.calls == [TODO[0], TODO[2], TODO[1], TODO[3]]
    assert [runner.made[g].stats.helper for g in TODO] == [None, 1, None, 1]
    assert h.procs[0][0].returncode == 0 and not h.procs[0][1].exists()  # waited for; its log removed


def test_a_failed_helper_is_named_and_the_engine_compiles_its_graphs():
    h = _helper("import sys; from funcspec.capture import helpers; helpers.report((0, 4, 99, 'greedy'), sys.stdout); "
                "print('out of memory', file=sys.stderr); sys.exit(3)", [TODO[1], TODO[3]])
    runner = _Runner({TODO[1]})  # it filed one graph before it died
    with pytest.warns(RuntimeWarning, match=r"(?s)start-up helper 1 failed \(exit status 3\); this process compiles "
                                            r"the graphs it did not file.*out of memory"):
        build.capture_all(runner, TODO, h)
    assert runner.calls == [TODO[0], TODO[2], TODO[1], TODO[3]]
    assert [runner.made[g].stats.helper for g in TODO] == [None, 1, None, None]


def test_an_engine_that_fails_stops_its_helpers():
    h = _helper("import time; time.sleep(60)", [TODO[1]])

    class Failing(_Runner):
        def graph(self, b, k, t, mode):
            raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        build.capture_all(Failing(set()), TODO, h)
    assert h.procs[0][0].poll() is not None and not h.procs[0][1].exists()
