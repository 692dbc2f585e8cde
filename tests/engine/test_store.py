"""The compiled-step store: a warm start never changes results, never crashes where a compile works, and never
runs code this user's funcspec did not write. Every test runs on a fresh inductor cache of its own."""

import os
import pickle
import zipfile

import pytest
import torch

from funcspec import Engine, SamplingParams
from funcspec.capture import cache, capture, store
from funcspec.capture.backends import AheadOfTime


def affine(params, x):
    """Two params and an input: a graph that reads ``a`` and ``b`` apart unless they alias."""
    return params["a"] * x + params["b"]


def _args(aliased: bool):
    a = torch.linspace(-1.0, 1.0, 16)
    return {"a": a, "b": a if aliased else a + 0.5}, torch.arange(16.0)


def _expected(args):
    return affine(*args)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh inductor cache (so an empty store) for this test; the store's one-per-message warnings reset."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    store._warn_once.cache_clear()
    yield tmp_path / "inductor" / "funcspec-graphs"
    store._warn_once.cache_clear()


def _stored(where):
    return sorted(p.name for p in where.glob("*.bin"))


def test_aliased_and_separate_arguments_are_different_graphs(fresh):
    """A graph traced with ``a`` and ``b`` aliased reads one tensor for both: the same function with separate
    tensors (equal-shaped, another value) must compile its own graph, not load that one."""
    first = capture(affine, _args(True), "inductor", name="affine")
    assert first.stats.stored and not first.stats.loaded
    second = capture(affine, _args(False), "inductor", name="affine")
    assert not second.stats.loaded and second.stats.compiles == 1 and len(_stored(fresh)) == 2
    assert torch.equal(second(*_args(False)), _expected(_args(False)))
    again = capture(affine, _args(True), "inductor", name="affine")
    assert again.stats.loaded and torch.equal(again(*_args(True)), _expected(_args(True)))


def test_thread_count_is_in_the_key(fresh):
    """A store filled by a 2-thread process is not loaded by a 1-thread one (its guard would fail): it compiles."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        capture(affine, _args(False), "inductor", name="affine")
        torch.set_num_threads(1)
        one = capture(affine, _args(False), "inductor", name="affine")
        assert not one.stats.loaded and one.stats.compiles == 1 and len(_stored(fresh)) == 2
        assert torch.equal(one(*_args(False)), _expected(_args(False)))
    finally:
        torch.set_num_threads(before)


def test_a_call_that_fails_the_guards_compiles_again_with_a_warning(fresh):
    """A loaded graph called under another thread count compiles for it, with one warning naming the guard,
    instead of raising ``GuardManager check failed``; under ``fail_on_recompile`` it raises, as a recompile
    would."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        capture(affine, _args(False), "inductor", name="affine")
        loaded = capture(affine, _args(False), "inductor", name="affine")
        assert loaded.stats.loaded
        torch.set_num_threads(2)
        with torch.compiler.set_stance("fail_on_recompile"):
            with pytest.raises(RuntimeError, match="affine: a call failed the compiled graph's guards .*num_threads"):
                loaded(*_args(False))
        with pytest.warns(RuntimeWarning, match="affine: a call failed the compiled graph's guards .*num_threads.*"
                                                "compiling it again"):
            out = loaded(*_args(False))
        assert torch.equal(out, _expected(_args(False)))
        assert loaded.stats.recompiles == 1 and len(_stored(fresh)) == 2  # filed under the 2-thread key too
    finally:
        torch.set_num_threads(before)


def test_inductor_configuration_is_in_the_key(fresh):
    """A flag that changes inductor's code (``emulate_precision_casts``) is another key."""
    capture(affine, _args(False), "inductor", name="affine")
    with torch._inductor.config.patch(emulate_precision_casts=True):
        flagged = capture(affine, _args(False), "inductor", name="affine")
    assert not flagged.stats.loaded and len(_stored(fresh)) == 2


def test_a_planted_file_is_never_unpickled_and_is_replaced(fresh, tmp_path):
    """A file this user's funcspec did not sign (a pickle that would run code) is not loaded: it is removed with a
    warning, the graph compiles and is filed again, and the result is right."""
    capture(affine, _args(False), "inductor", name="affine")
    (path,) = fresh.glob("*.bin")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path.write_bytes(store.MAGIC + b"\0" * 32 + pickle.dumps(Payload()))
    with pytest.warns(RuntimeWarning, match="its signature is not this user's"):
        got = capture(affine, _args(False), "inductor", name="affine")
    assert not marker.exists() and not got.stats.loaded and got.stats.compiles == 1
    assert torch.equal(got(*_args(False)), _expected(_args(False)))
    assert store.read_payload(path)  # filed again, signed
    moved = fresh / ("affine-" + "0" * 32 + ".bin")  # a signed file moved under another key is not trusted
    moved.write_bytes(path.read_bytes())
    with pytest.raises(store.Untrusted, match="moved under another key"):
        store.read_payload(moved)


def test_the_store_refuses_a_directory_others_can_write(fresh):
    """The store is a 0700 directory; one that others may write is not read (nor written), with a warning."""
    capture(affine, _args(False), "inductor", name="affine")
    assert oct(fresh.stat().st_mode & 0o777) == "0o700" and oct((fresh / store._KEY_FILE).stat().st_mode & 0o777) \
        == "0o600"
    fresh.parent.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="writable by other users .*Set TORCHINDUCTOR_CACHE_DIR"):
        again = capture(affine, _args(False), "inductor", name="affine")
    assert not again.stats.loaded and again.stats.stored is None
    fresh.parent.chmod(0o755)


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    """ssh's rule: a directory owned by someone else is untrusted whatever its mode."""
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(d, 4321, 4321)  # root gives it away (root's own directories are trusted, as by ssh)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)
    with pytest.raises(store.Untrusted, match="is owned by uid .*not by this user"):
        store.check_private(d)


def test_torch_default_cache_dir_made_by_another_user_is_replaced(tmp_path, monkeypatch):
    """``/tmp/torchinductor_<user>`` created first by someone else (here: world-writable) is not used: funcspec
    moves inductor's cache to a private directory, and says so."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    os.makedirs(default_cache_dir(), mode=0o777)
    os.chmod(default_cache_dir(), 0o777)
    store._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="torch's default cache directory is not safe"):
        where = store.open_store()
    assert where == tmp_path / "xdg" / "funcspec" / "inductor" / "funcspec-graphs"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "funcspec" / "inductor")


def test_an_unserializable_graph_runs_and_says_why_it_is_not_filed(fresh):
    """oneDNN-packed bf16 weights cannot be compiled ahead of time: the graph compiles as usual, right, and a
    warning says it is not filed."""
    from funcspec.kernels import onednn

    w = torch.randn(8, 16).bfloat16()
    args = ({"packed": onednn.pack(w)}, torch.randn(2, 16).bfloat16())
    with pytest.warns(RuntimeWarning, match="packed_step cannot be compiled ahead of time"):
        got = capture(packed_step, args, "inductor", name="packed_step")
    assert got.stats.stored is None and not isinstance(got._call, AheadOfTime)
    assert torch.equal(got(*args), packed_step(*args))


def packed_step(params, x):
    from funcspec.kernels import onednn

    return onednn.packed_op(x, params["packed"], None, 8)


def test_code_digest_ignores_comments_and_docstrings():
    src = b'def f(x):\n    """Add one."""\n    return x + 1  # one\n'
    same = b'def f(x):\n    """Add one to x."""\n\n    # comment\n    return x + 1\n'
    assert store.code_digest(src) == store.code_digest(same)
    assert store.code_digest(src) != store.code_digest(b'def f(x):\n    return x + 2\n')


def test_a_failed_write_leaves_no_temporary_file(fresh, monkeypatch):
    """A full disk (here: fsync fails) files nothing and leaves nothing behind; the graph still runs."""
    def full(fd):
        raise OSError(28, "No space left on device")

    fresh.mkdir(parents=True, mode=0o700)
    store._mac_key(fresh)  # the key exists before the disk fills
    monkeypatch.setattr(os, "fsync", full)
    with pytest.warns(RuntimeWarning, match="could not be written .*No space left"):
        got = capture(affine, _args(False), "inductor", name="affine")
    assert got.stats.stored is None  # nothing left but the key (and the graph's lock file, which stays)
    assert [p.name for p in fresh.iterdir() if p.suffix != ".lock"] == [store._KEY_FILE]
    assert torch.equal(got(*_args(False)), _expected(_args(False)))


def test_prune_and_info(fresh, capsys):
    from funcspec.cli import main

    capture(affine, _args(False), "inductor", name="affine")
    capture(affine, _args(True), "inductor", name="affine")
    (fresh / (store.TEMP_PREFIX + "left")).write_bytes(b"x")
    os.utime(fresh / (store.TEMP_PREFIX + "left"), (0, 0))
    old = sorted(fresh.glob("*.bin"))[0]
    os.utime(old, (1, 1))
    main(["cache", "info"])
    out = capsys.readouterr().out
    assert "2 compiled step(s)" in out and "private to this user" in out
    main(["cache", "prune", "--older-than", "1"])
    assert "removed 3 file(s)" in capsys.readouterr().out  # the old step, its lock file, the temporary file
    assert len(_stored(fresh)) == 1 and not (fresh / (store.TEMP_PREFIX + "left")).exists()
    assert not store.lock_path(old).exists() and store.lock_path(fresh / _stored(fresh)[0]).exists()
    main(["cache", "prune"])
    assert _stored(fresh) == [] and not list(fresh.glob("*.lock")) and not list(fresh.glob(".*.lock"))


def test_prune_keeps_the_lock_of_a_graph_being_compiled(fresh):
    """A lock file that a process holds (it is compiling that graph) stays; one nobody holds goes."""
    fresh.mkdir(parents=True)
    held, free = fresh / "a-1.bin", fresh / "b-2.bin"
    store.lock_path(free).touch()
    with store.compiling(held):
        assert store.prune(fresh) == [store.lock_path(free)]
        assert store.lock_path(held).exists()


_RACER = """
import json, os, sys, time, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_store import _args, affine
from funcspec.capture import capture
Path(sys.argv[1]).touch()
while len(list(Path(sys.argv[1]).parent.glob("ready-*"))) < 2:  # both processes capture at the same moment
    time.sleep(0.01)
got = capture(affine, _args(False), "inductor", name="affine")
assert torch.equal(got(*_args(False)), affine(*_args(False)))
print(json.dumps({{"compiles": got.stats.compiles, "loaded": got.stats.loaded}}))
"""


def test_two_processes_wanting_one_graph_at_once_compile_it_once(fresh, tmp_path):
    """Two processes (two replicas, two notebook kernels) that capture the same graph at the same moment on one
    store: one compiles and files it, the other waits for it and loads it, and both compute the same."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    script = _RACER.format(tests=os.path.dirname(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"ready-{i}")], env=env,
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    got = sorted(((json.loads(p.communicate(timeout=300)[0]), p.returncode) for p in procs),
                 key=lambda r: r[0]["compiles"])
    assert got == [({"compiles": 0, "loaded": True}, 0), ({"compiles": 1, "loaded": False}, 0)]
    assert len(_stored(fresh)) == 1


def test_compile_cache_members_are_checked(tmp_path, fresh):
    """A zip without torch's member, or with a member `funcspec precompile` does not write (a path that leaves the
    store), is a ValueError naming the member, before anything is loaded."""
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("something.bin", b"")
    with pytest.raises(ValueError, match="has no member 'torch-cache-artifacts.bin'"):
        cache.load(bad)
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("torch-cache-artifacts.bin", b"")
        z.writestr("funcspec-graphs/../../evil.bin", b"")
    with pytest.raises(ValueError, match="has a member 'funcspec-graphs/../../evil.bin'"):
        cache.load(bad)
    assert not (tmp_path / "evil.bin").exists()


@pytest.mark.slow
def test_a_symbolic_batch_is_one_key_whatever_the_first_batch(tiny_llama, fresh, rows_free_ops):
    """Lazy capture at batch 3, then (another engine) at batch 2, then 3: one file, compiled once, loaded twice."""
    args = dict(backend="inductor", max_num_seqs=4, max_model_len=32,
                compilation_config={"capture": "lazy"}, ops=rows_free_ops)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    loads = []
    for n in (3, 2, 3):
        eng = Engine(tiny_llama, **args)
        eng.generate([[5, 6, 7]] * n, greedy)
        (graph,) = eng.runner.compiled.values()
        loads.append(graph.stats.loaded)
    assert loads == [False, True, True] and len(_stored(fresh)) == 1
