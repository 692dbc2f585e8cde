"""A store of compiled step functions, so that a warm start traces nothing.

A warm inductor cache still leaves Dynamo to trace every graph again at each
start: inductor's caches hold compiled kernels, not the traced program.
``torch.compile(...).aot_compile`` keeps the traced program as well, and
``torch.compiler.load_compiled_function`` brings it back without tracing. This
module files those functions under a key that names everything a graph's
output depends on:

- the step's static configuration (the closure of the bucket's function:
  dataclasses, tuples, numbers, modules, functions and tensors, walked by
  :func:`fingerprint`; an object it cannot name makes the graph uncacheable);
- the example arguments' tree structure and tensor metadata (dtype, shape,
  strides, device), which sizes are symbolic (by position, not by the
  example's size), and which leaves share storage (a graph traced with two
  arguments aliased reads one tensor for both);
- the global state Dynamo guards (thread count, grad mode, default dtype,
  determinism, autocast) and the configuration of inductor, Dynamo and
  AOTAutograd (a flag that changes codegen changes the key);
- the code of the funcspec package (its syntax tree without docstrings, so a
  comment or docstring does not invalidate), torch and Python, and the CPU's
  flags.

Concurrency: a process holds a graph's lock file while it looks that graph up,
compiles and files it (:func:`compiling`), so another process that wants the
same graph at the same time (two replicas or notebook kernels starting at
once) waits and loads it instead of compiling it too.

NOTE: the functions are saved with Dynamo's portable guards only: the key
stands in for the guards on the closure and on globals, which cannot be
serialized. A loaded function whose guards still fail is not used (the caller
compiles, with a warning). A global that tracing reads and a caller
monkeypatches is invisible to the key: ``FUNCSPEC_GRAPH_STORE=0`` turns the
store off.

Trust. A stored function is code: loading it unpickles and runs it. So the
store is a directory funcspec creates with mode 0700 and refuses when another
user owns it, and every file carries an HMAC-SHA256, under a key of this
user's kept in that directory, over the file's name and content: a file this
user's funcspec did not write, or one moved under another key, is never
unpickled. The directory is ``funcspec-graphs/`` under inductor's cache
directory (``TORCHINDUCTOR_CACHE_DIR``), so an empty inductor cache is an
empty store too; torch's default one (``/tmp/torchinductor_<user>``) is
replaced by a private one when another user created it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import functools
import hashlib
import hmac
import json
import os
import platform
import secrets
import stat
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from funcspec.kernels import locks

_PACKAGE = Path(__file__).resolve().parents[1]
MAGIC = b"funcspec-graph-1\n"
"""The first bytes of a stored function's file; the HMAC follows, then torch's serialized function."""
_MAC_BYTES = 32
_KEY_FILE = ".hmac-key"
_CODE_MEMO = ".code-digests.json"
TEMP_PREFIX = ".tmp-"
"""Files being written carry this prefix until they are renamed into place."""


class Unnameable(Exception):
    """An object in a step's closure that :func:`fingerprint` cannot name by value."""


class Untrusted(Exception):
    """A directory the store must not read code from (another user's, or writable by others)."""


def enabled() -> bool:
    """Whether compiled functions are filed and reused (``FUNCSPEC_GRAPH_STORE=0`` turns it off, e.g. while
    monkeypatching a module global that tracing reads, which no key can see)."""
    return os.environ.get("FUNCSPEC_GRAPH_STORE", "1") != "0"


def warn(message: str) -> None:
    """One warning per distinct ``message`` and process (a fallback is worth knowing once, not per graph)."""
    _warn_once(message)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"compiled-step store: {message}", RuntimeWarning, stacklevel=4)


# ------------------------------------------------------------------ the directory
def check_private(path: Path) -> None:
    """Raise :class:`Untrusted` unless ``path`` is a directory owned by this user (or root) that nobody else may
    write: ssh's rule for the files it trusts."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is not a directory")
    uid = getattr(os, "getuid", None)
    if uid is None:  # no POSIX owners (Windows): nothing to compare
        return
    if st.st_uid not in (uid(), 0):
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


def _inductor_dir() -> Path:
    """Inductor's cache directory; torch's default one is replaced by a private one when it is not this user's
    (another user could have created ``/tmp/torchinductor_<user>`` first and planted code in it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir())
    path = Path(cache_dir())
    try:
        check_private(path)
    except Untrusted as e:
        if not default:
            raise
        private = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "funcspec" / "inductor"
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(private)
        warn(f"torch's default cache directory is not safe to run code from ({e}); "
             f"TORCHINDUCTOR_CACHE_DIR is now {private}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private)
        path = Path(cache_dir())
    return path


def directory() -> Path:
    """Where compiled functions are filed: ``funcspec-graphs/`` in inductor's cache directory (not created)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "funcspec-graphs"


def open_store() -> Optional[Path]:
    """The store's directory, created with mode 0700 and checked (with inductor's own directory); ``None``,
    with one warning, when either is not this user's alone: nothing is then loaded or filed."""
    try:
        path = _inductor_dir() / "funcspec-graphs"
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if hasattr(os, "getuid") and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)  # our own directory made under another umask: no one else may read or write it
        check_private(path)
    except (Untrusted, OSError) as e:
        warn(f"not used: {e}. Set TORCHINDUCTOR_CACHE_DIR to a directory only you can write.")
        return None
    return path


def _mac_key(store: Path) -> bytes:
    """This user's HMAC key for ``store`` (32 random bytes in a 0600 file, created on first use; concurrent
    first uses agree, as the file is linked into place whole)."""
    path = store / _KEY_FILE
    if not path.exists():
        _publish(store, path, secrets.token_bytes(_MAC_BYTES), replace=False)
    data = path.read_bytes()
    if len(data) != _MAC_BYTES:
        raise Untrusted(f"{path} is not a store key ({len(data)} bytes)")
    return data


def _publish(store: Path, path: Path, data: bytes, replace: bool = True) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600: a temporary file in ``store``, synced, then renamed
    (``replace``) or linked (only if ``path`` does not exist yet). The temporary file never outlives a failure."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=store)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
    finally:
        if os.path.exists(tmp):  # a failure's leftover, or the name a link was made from
            os.unlink(tmp)


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def sign(store: Path, name: str, payload: bytes) -> bytes:
    """The file content that files ``payload`` (a serialized function) as ``name`` in ``store``."""
    return MAGIC + _mac(_mac_key(store), name, payload) + payload


def verify(store: Path, name: str, data: bytes) -> bytes:
    """The payload of file content ``data`` filed as ``name``; raises :class:`Untrusted` unless this user's key
    signed it under that name."""
    head = len(MAGIC) + _MAC_BYTES
    if len(data) < head or not data.startswith(MAGIC):
        raise Untrusted("not a funcspec stored function")
    payload = data[head:]
    if not hmac.compare_digest(data[len(MAGIC):head], _mac(_mac_key(store), name, payload)):
        raise Untrusted("its signature is not this user's (written elsewhere, changed, or moved under another key)")
    return payload


# ------------------------------------------------------------------------ the key
def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(source: bytes) -> str:
    """What a Python file computes, as a digest: its syntax tree without docstrings (so neither comments,
    docstrings nor layout change it)."""
    return hashlib.sha256(ast.dump(_strip_docstrings(ast.parse(source))).encode()).hexdigest()


def _package_digest(memo_dir: Optional[Path]) -> str:
    """The digest of the package's code: each ``.py`` file's :func:`code_digest`, each ``.cpp``/``.h`` file's
    text. NOTE: parsing the whole package takes over a second, so digests are memoised by each file's text
    hash in ``memo_dir`` (rewritten when a file changed)."""
    memo_path = memo_dir / _CODE_MEMO if memo_dir is not None else None
    try:
        memo = json.loads(memo_path.read_text()) if memo_path is not None else {}
    except (OSError, ValueError):
        memo = {}
    fresh, h = {}, hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h") or "__pycache__" in path.parts:
            continue
        data = path.read_bytes()
        text = hashlib.sha256(data).hexdigest()
        digest = text if path.suffix != ".py" else memo.get(text) or code_digest(data)
        fresh[text] = digest
        h.update(f"{path.relative_to(_PACKAGE)}:{digest}\n".encode())
    if memo_path is not None and fresh != memo:
        try:
            _publish(memo_dir, memo_path, json.dumps(fresh).encode())  # type: ignore[arg-type]  # a memo_path: a dir
        except OSError:
            pass
    return h.hexdigest()


@functools.cache
def _environment(memo_dir: Optional[Path] = None) -> str:
    """The package's code, torch, Python and the CPU's flags: what every key shares (hashed once a process)."""
    text = f"{_package_digest(memo_dir)}|{torch.__version__}|{platform.python_version()}|{platform.machine()}"
    return hashlib.sha256(f"{text}|{_cpu_flags()}".encode()).hexdigest()


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which decide inductor's vector ISA and funcspec's kernels."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _canonical(value: Any) -> Any:
    """``value`` with sets sorted, so that its repr is the same in every process."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, dict):
        return sorted((repr(k), _canonical(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def global_state() -> str:
    """What Dynamo's global-state guard checks (thread count, grad mode, default dtype, determinism, autocast,
    torch-function mode) and the configuration of inductor, Dynamo and AOTAutograd, as one string."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    configs = [repr(_canonical(m.save_config_portable())) for m in (inductor_config, dynamo_config,
                                                                   functorch_config)]
    return "|".join([torch._C._dynamo.guards.GlobalStateGuard().__getstate__(), *configs])  # type: ignore[list-item]  # a str


def fingerprint(obj: Any, h: "hashlib._Hash", values: bool = True) -> None:
    """Feed a stable description of ``obj`` into ``h``. Tensors are described by metadata, and by their
    bytes when ``values`` (a closure's constants; a step's arguments are inputs, so metadata only).
    Raises :class:`Unnameable` for an object whose identity is all it has (its repr names an address)."""
    if isinstance(obj, torch.Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}{obj.stride()}{obj.device.type}".encode())
        if values:
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, functools.partial):
        h.update(b"P")
        for part in (obj.func, obj.args, obj.keywords):
            fingerprint(part, h, values)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(f"D{type(obj).__module__}.{type(obj).__qualname__}".encode())
        for f in dataclasses.fields(obj):
            if not f.compare:  # NOTE: carried, not identity (a proposer's params: the graph takes them as input)
                continue
            h.update(f.name.encode())
            fingerprint(getattr(obj, f.name), h, values)
    elif isinstance(obj, (tuple, list)):
        h.update(f"L{type(obj).__name__}{len(obj)}".encode())
        for x in obj:
            fingerprint(x, h, values)
    elif isinstance(obj, dict):
        h.update(f"M{len(obj)}".encode())
        for k, v in obj.items():
            fingerprint(k, h, values)
            fingerprint(v, h, values)
    elif isinstance(obj, types.ModuleType):
        h.update(f"m{obj.__name__}".encode())
    elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        if "<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__:
            raise Unnameable(f"{obj.__qualname__} is a local function")
        h.update(f"f{obj.__module__}.{obj.__qualname__}".encode())
    elif isinstance(obj, (str, bytes, int, float, bool, complex, enum.Enum, torch.dtype, torch.device,
                          type(None), type(Ellipsis))):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        text = repr(obj)
        if " at 0x" in text or " object at " in text:
            raise Unnameable(f"{type(obj).__qualname__} has no value-based repr")
        h.update(f"O{type(obj).__module__}.{type(obj).__qualname__}:{text}".encode())


def _describe_leaf(leaf: Any, dims: tuple[int, ...], h: "hashlib._Hash") -> None:
    """An argument leaf's metadata, with each symbolic size (``dims``) written as ``?``. NOTE: a symbolic
    tensor's strides are written from its first symbolic dim on (a row-major stride before it multiplies the
    size), with whether it is contiguous: the example's size never enters the key."""
    if not dims or not isinstance(leaf, torch.Tensor):
        fingerprint(leaf, h, values=False)
        return
    shape = ["?" if d in dims else s for d, s in enumerate(leaf.shape)]
    h.update(f"S{leaf.dtype}{shape}{leaf.stride()[min(dims):]}{leaf.is_contiguous()}{leaf.device.type}".encode())


def aliasing(leaves: list) -> list[tuple[int, int, int]]:
    """Which tensor leaves share storage: ``(leaf, first leaf of its storage, storage offset)`` for every leaf
    whose storage an earlier leaf already holds (empty when none alias)."""
    first: dict[tuple, int] = {}
    shared = []
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) or x.is_mkldnn:
            continue
        where = (x.device.type, x.untyped_storage().data_ptr())
        if where in first:
            shared.append((i, first[where], x.storage_offset()))
        else:
            first[where] = i
    return shared  # type: ignore[return-value]  # offsets of real tensors: ints


def key(fn: Callable, example_args: tuple, symbolic: tuple, options: dict,
        memo_dir: Optional[Path] = None) -> Optional[str]:
    """The store key of ``fn`` compiled for ``example_args`` with ``options`` under the current global state
    (``None``: the closure cannot be named). ``symbolic``: the ``(tensor, dim)`` sizes left symbolic."""
    h = hashlib.sha256(_environment(memo_dir).encode())
    try:
        fingerprint(fn, h)
        fingerprint(sorted((k, repr(v)) for k, v in options.items()), h)
    except Unnameable:
        return None
    h.update(global_state().encode())
    leaves, spec = pytree.tree_flatten(example_args)
    h.update(str(spec).encode())
    free: dict[int, tuple[int, ...]] = {}
    for tensor, dim in symbolic:
        free[id(tensor)] = free.get(id(tensor), ()) + (dim,)
    for leaf in leaves:
        _describe_leaf(leaf, free.get(id(leaf), ()), h)
    ids = {id(t): i for i, t in enumerate(leaves)}
    h.update(str(sorted((ids.get(id(t), -1), d) for t, d in symbolic)).encode())
    h.update(str(aliasing(leaves)).encode())
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------ files
def path_for(store: Path, name: str, key_: str) -> Path:
    """The file of graph ``name`` under ``key_``."""
    return store / f"{name}-{key_}.bin"


def lock_path(path: Path) -> Path:
    """The lock file that :func:`compiling` holds for stored function ``path``."""
    return path.with_name(f".{path.name}.lock")


def compiling(path: Optional[Path]):
    """Held while this process looks up, compiles and files the graph of ``path``: another process that wants
    the same graph meanwhile (two replicas or notebook kernels starting at once, two test workers) waits, then
    loads what this one filed instead of compiling it again. Graphs of other keys are never held up. A no-op
    context for ``None`` (no store)."""
    return contextlib.nullcontext() if path is None else locks.lock(lock_path(path))


def load(path: Path) -> Optional[Callable]:
    """The compiled function in ``path``, or ``None`` when there is none. A file that is not this user's, or
    no longer loads (another torch, a truncated file), is removed with one warning saying why: the caller
    then compiles, and files the graph afresh."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn(f"{path.name} could not be read ({e}); compiling instead")
        return None
    try:
        payload = verify(path.parent, path.name, data)
        import io

        fn = torch.compiler.load_compiled_function(io.BytesIO(payload))
    except Exception as e:  # noqa: BLE001 (an untrusted, stale or corrupt file is a cache miss, never an error)
        discard(path, f"{type(e).__name__}: {e}")
        return None
    try:
        os.utime(path)  # its last use: what `funcspec cache prune --older-than` reads
    except OSError:
        pass
    return fn


def discard(path: Path, reason: str) -> None:
    """Remove stored function ``path`` (it is recompiled and filed again), with one warning giving ``reason``."""
    warn(f"{path.name} was not used ({reason[:300]}); it is removed and the graph compiled again")
    try:
        path.unlink()
    except OSError:
        pass


def serialized(compiled) -> bytes:
    """The bytes of an ``aot_compile`` result (what ``torch.compiler.load_compiled_function`` reads)."""
    return type(compiled).serialize(compiled).serialized_data


def save(compiled, path: Path) -> bool:
    """File ``compiled`` (an ``aot_compile`` result) at ``path``, signed and atomically; ``False``, with one
    warning, if it cannot be serialized or written (the graph still runs; the next start compiles it again)."""
    try:
        payload = serialized(compiled)
    except Exception as e:  # noqa: BLE001 (e.g. a graph over oneDNN-packed weights, which torch cannot serialize)
        warn(f"a graph could not be filed, so the next start compiles it again ({type(e).__name__}: "
             f"{str(e)[:200]})")
        return False
    try:
        _publish(path.parent, path, sign(path.parent, path.name, payload))
    except (OSError, Untrusted) as e:
        warn(f"{path.name} could not be written ({e}); the next start compiles it again")
        return False
    return True


def import_payload(store: Path, name: str, payload: bytes) -> Path:
    """File ``payload`` (a serialized function from a file the user named, such as a compile cache) under
    ``name`` in ``store``, signed with this user's key."""
    path = store / name
    _publish(store, path, sign(store, name, payload))
    return path


def read_payload(path: Path) -> bytes:
    """The serialized function of stored file ``path``, checked (:func:`verify`)."""
    return verify(path.parent, path.name, path.read_bytes())


# ------------------------------------------------------------------- maintenance
@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of the store."""

    path: Path
    bytes: int
    last_used: float  # seconds since the epoch: its last load or write


def entries(store: Path) -> list[Entry]:
    """The stored functions in ``store``, oldest use first (temporary and bookkeeping files left out)."""
    out = []
    for path in store.glob("*.bin"):
        try:
            st = path.stat()
        except OSError:
            continue
        out.append(Entry(path, st.st_size, st.st_mtime))
    return sorted(out, key=lambda e: e.last_used)


def prune(store: Path, older_than_s: Optional[float] = None, now: Optional[float] = None) -> list[Path]:
    """Remove the stored functions unused for ``older_than_s`` seconds (every one when ``None``), every
    leftover temporary file of an interrupted write, and the lock file (:func:`compiling`) of every graph no
    longer filed that no process is compiling; returns what was removed."""
    now = time.time() if now is None else now
    removed = [e.path for e in entries(store) if older_than_s is None or now - e.last_used > older_than_s]
    removed += [p for p in store.glob(TEMP_PREFIX + "*") if now - p.stat().st_mtime > 60]
    for path in removed:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return removed + _prune_locks(store)


def _prune_locks(store: Path) -> list[Path]:
    """Remove the lock files whose graph is not filed and that no process holds (each taken without waiting,
    then removed while held)."""
    from filelock import Timeout

    removed = []
    for path in store.glob(".*.bin.lock"):
        if (store / path.name[1:-len(".lock")]).exists():
            continue
        try:
            with locks.lock(path, timeout=0):
                path.unlink()
        except (Timeout, FileNotFoundError):
            continue
        removed.append(path)
    return removed
