"""The zoo's corpus: the running interpreter's standard library, split by a stable path hash.

Everything here is deterministic: the file list is sorted, the held-out split
is ``sha256(relative path) % 100 < HELDOUT_PERCENT``, and a training batch is a
pure function of ``(seed, step)`` so a resumed run sees exactly the batches a
straight run would.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import torch

HELDOUT_PERCENT = 5
SKIP_PARTS = ("site-packages", "test", "tests", "idlelib", "lib2to3")


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of the stdlib, without tests, site-packages, idlelib and lib2to3."""
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py") if not any(part in SKIP_PARTS for part in p.relative_to(root).parts))


def is_heldout(path: Path) -> bool:
    """Stable split: about ``HELDOUT_PERCENT``% of files by a hash of the path relative to the stdlib."""
    rel = path.relative_to(stdlib_root()).as_posix()
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def split_files(split: str) -> list[Path]:
    """``"train"`` or ``"heldout"`` files, sorted."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [p for p in stdlib_files() if is_heldout(p) == (split == "heldout")]


def manifest(split: str) -> dict:
    """What a recipe read: the stdlib root, file count, bytes and a digest of the sorted relative paths."""
    files = split_files(split)
    rels = [p.relative_to(stdlib_root()).as_posix() for p in files]
    return {"split": split, "stdlib": str(stdlib_root()), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "paths_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest()}


def read_text(path: Path) -> str:
    """A source file as text (undecodable bytes replaced)."""
    return path.read_text(encoding="utf-8", errors="replace")


def token_stream(tokenizer, split: str, cache: Path) -> np.ndarray:
    """All files of ``split`` as one int32 stream: ``BOS file EOS BOS file EOS ...`` (cached as .npy)."""
    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256((json.dumps(manifest(split)) + tokenizer.backend_tokenizer.to_str()).encode()).hexdigest()[:16]
    out = cache / f"{split}-{key}.npy"
    if out.exists():
        return np.load(out)
    ids = []
    for p in split_files(split):
        ids += [tokenizer.bos_token_id, *tokenizer.encode(read_text(p), add_special_tokens=False),
                tokenizer.eos_token_id]
    arr = np.asarray(ids, dtype=np.int32)
    np.save(out, arr)
    return arr


def batch(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Random windows [batch_size, seq_len] int64 of the stream, a pure function of (seed, step)."""
    g = np.random.default_rng([seed, step])
    starts = g.integers(0, len(stream) - seq_len, size=batch_size)
    return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int64))


def heldout_prompts(tokenizer, num: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens (after BOS) of the first ``num`` held-out files long enough."""
    out = []
    for p in split_files("heldout"):
        ids = tokenizer.encode(read_text(p), add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            out.append([tokenizer.bos_token_id, *ids[:prompt_tokens - 1]])
        if len(out) == num:
            break
    return out
