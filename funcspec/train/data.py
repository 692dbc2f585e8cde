"""The zoo's corpus: the running interpreter's standard library, split by a stable path hash.

Everything here is deterministic: the file list is sorted, the held-out split
is ``sha256(relative path) % 100 < HELDOUT_PERCENT``, and a training batch is a
pure function of ``(seed, step)`` so a resumed run sees exactly the batches a
straight run would.
"""

from __future__ import annotations

import hashlib
import json
import platform
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
    return {"split": split, "stdlib": str(stdlib_root()), "python": platform.python_version(), "files": len(files),
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
    return file_prompts(tokenizer, split_files("heldout"), num, prompt_tokens)


def package_files(name: str) -> list[Path]:
    """Sorted ``.py`` files of an installed package (without its tests): code from outside the stdlib,
    which no zoo model was trained on, for a second held-out corpus (``--prompts package:numpy``)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"prompts: package {name!r} is not an installed package")
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in root.rglob("*.py") if not any(part in SKIP_PARTS for part in p.relative_to(root).parts))


def file_prompts(tokenizer, files: list[Path], num: int, prompt_tokens: int) -> list[list[int]]:
    """BOS and the first ``prompt_tokens - 1`` tokens of each of the first ``num`` ``files`` long enough."""
    out = []
    for p in files:
        ids = tokenizer.encode(read_text(p), add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            out.append([tokenizer.bos_token_id, *ids[:prompt_tokens - 1]])
        if len(out) == num:
            break
    return out


# ----------------------------------------------------------------------------- the target's own text

GREEDY_PROMPT, GREEDY_NEW = 128, 128
"""Distillation rows: a training-split window of GREEDY_PROMPT tokens, then the target's greedy continuation."""
GREEDY_CHUNK = 128  # rows generated (and cached) per file


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """prompts [N, P] int64 continued greedily by the target for ``new`` tokens: [N, P + new] int64."""
    from funcspec.nn import llama

    n, p = prompts.shape
    cfg, params = target.cfg, target.params
    kv = llama.init_kv_cache(cfg, n, p + new)
    slots = torch.arange(n)
    logits, _, kv = llama.forward(cfg, params, kv, prompts, slots, torch.zeros(n, dtype=torch.int64))
    out = [prompts, logits[:, -1:].argmax(-1)]
    for t in range(p, p + new - 1):  # position t holds the token just drawn
        kv = llama.KVCache(kv.k, kv.v, torch.full_like(kv.lens, t))
        logits, _, kv = llama.forward(cfg, params, kv, out[-1], slots, torch.full((n,), t, dtype=torch.int64))
        out.append(logits[:, -1:].argmax(-1))
    return torch.cat(out, 1)


def greedy_rows(target, stream: np.ndarray, seed: int, num_rows: int, cache: Path) -> np.ndarray:
    """``num_rows`` distillation rows [num_rows, GREEDY_PROMPT + GREEDY_NEW] int32 (cached, resumable).

    Why: drafters are judged on what the target itself writes. Trained on raw
    text, a block row k's label is the target's distribution after the *true*
    tokens, which the target's own continuation matches only 28-56% of the time
    for k = 2..4; on the target's greedy text, every label is what verification
    will accept. Prompts are stream windows, a pure function of ``(seed, chunk)``;
    each chunk of GREEDY_CHUNK rows is its own file, so an interrupted run keeps
    what it generated.
    """
    from tqdm import tqdm

    cache.mkdir(parents=True, exist_ok=True)
    key = _digest([np.ascontiguousarray(stream).tobytes(), f"{seed}:{GREEDY_PROMPT}:{GREEDY_NEW}".encode(),
                   *(f.read_bytes() for f in sorted(Path(target.path).glob("*.safetensors")))])
    chunks = []
    for c in tqdm(range(-(-num_rows // GREEDY_CHUNK)), desc="greedy rows", mininterval=5):
        f = cache / f"greedy-{key}-{c:04d}.npy"
        if not f.exists():
            prompts = batch(stream, seed, c, GREEDY_CHUNK, GREEDY_PROMPT)
            np.save(f.with_suffix(".tmp.npy"), greedy_continue(target, prompts, GREEDY_NEW).numpy().astype(np.int32))
            f.with_suffix(".tmp.npy").replace(f)
        chunks.append(np.load(f))
    return np.concatenate(chunks)[:num_rows]


def _digest(parts) -> str:
    """A short cache key over byte strings (the stream, the settings, the target's weight files)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:12]


def row_batch(rows: np.ndarray, seed: int, step: int, batch_size: int) -> torch.Tensor:
    """``batch_size`` rows of ``rows`` [N, T] drawn as a pure function of (seed, step): [batch_size, T] int64."""
    g = np.random.default_rng([seed, step, 2])
    return torch.from_numpy(rows[g.integers(0, len(rows), size=batch_size)].astype(np.int64))
