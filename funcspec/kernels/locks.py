"""Lock files between processes (``filelock``, torch's own dependency), private to their user (mode 0600): the
kernel library's build takes them, and so do the compiled-step store and the default model's build.

:func:`once` makes a file that several processes may ask for at the same moment (two test workers, two
notebook kernels, two replicas): one makes it while the others wait, then find it made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from filelock import FileLock


def lock(path: Path, timeout: float = -1) -> FileLock:
    """The lock file ``path`` (created on first use); ``timeout`` seconds to wait for it (-1: as long as it takes,
    0: not at all)."""
    return FileLock(str(path), timeout=timeout, mode=0o600)


def once(ready: Path, lock_file: Path, make: Callable[[], object]) -> None:
    """Run ``make`` unless ``ready`` exists, holding ``lock_file`` and looking again once it holds it: of the
    processes that call this together one runs ``make``, the others wait and skip it. ``make`` must create
    ``ready`` last (a rename), so that nothing reads a half-made file."""
    if ready.exists():
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock(lock_file):
        if not ready.exists():
            make()
