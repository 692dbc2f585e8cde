"""The zoo's corpus: the running interpreter's standard library, split by a stable path hash.

Everything here is deterministic: the file list is sorted, the held-out split
is ``sha256(relative path) % 100 < HELDOUT_PERCENT``, and a training batch is a
pure function of ``(seed, step)`` so a resumed run sees exactly the batches a
straight run would.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import platform
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import torch

HELDOUT_PERCENT = 5
SKIP_PARTS = ("site-packages", "test", "tests", "idlelib", "lib2to3")

CORPUS_CACHE: Path | None = None
"""A prepared folder (:func:`prepare_cache`) that stands in for the stdlib, or ``None`` (read the stdlib).

Why: a machine without this interpreter's stdlib (a GPU box) trains on the
token stream made here; its manifests keep the cache keys and the cards' facts.
"""


def use_corpus_cache(folder: Path | None) -> None:
    """Read manifests, token streams and the tokenizer from ``folder`` (``None``: from the stdlib again)."""
    global CORPUS_CACHE
    CORPUS_CACHE = None if folder is None else Path(folder)


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
    if CORPUS_CACHE is not None:
        raise RuntimeError(f"the corpus is the prepared folder {CORPUS_CACHE}, which holds no source files")
    return [p for p in stdlib_files() if is_heldout(p) == (split == "heldout")]


def manifest(split: str) -> dict:
    """What a recipe read: the stdlib root, file count, bytes and a digest of the sorted relative paths
    (the prepared folder's copy under :data:`CORPUS_CACHE`)."""
    if CORPUS_CACHE is not None:
        return json.loads((CORPUS_CACHE / f"manifest-{split}.json").read_text())
    files = split_files(split)
    rels = [p.relative_to(stdlib_root()).as_posix() for p in files]
    return {"split": split, "stdlib": str(stdlib_root()), "python": platform.python_version(), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "paths_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest()}


def read_text(path: Path) -> str:
    """A source file as text (undecodable bytes replaced)."""
    return path.read_text(encoding="utf-8", errors="replace")


def stream_key(tokenizer, split: str) -> str:
    """The cache key of a split's token stream: its manifest and the tokenizer."""
    text = json.dumps(manifest(split)) + tokenizer.backend_tokenizer.to_str()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_stream(tokenizer, split: str, cache: Path) -> np.ndarray:
    """All files of ``split`` as one int32 stream: ``BOS file EOS BOS file EOS ...`` (cached as .npy)."""
    if CORPUS_CACHE is not None:  # NOTE: by name, not key: another `tokenizers` may serialise the same BPE apart
        found = sorted((CORPUS_CACHE / "tokens").glob(f"{split}-*.npy.xz"))
        if len(found) != 1:
            raise FileNotFoundError(f"{CORPUS_CACHE / 'tokens'}: want one {split}-<key>.npy.xz, found {len(found)} "
                                    "(make the folder with `funcspec train prepare` where the stdlib is)")
        arr = np.load(io.BytesIO(lzma.decompress(found[0].read_bytes()))).astype(np.int32)
        if arr.size and int(arr.max()) >= len(tokenizer):
            raise ValueError(f"{found[0]}: token id {int(arr.max())} is outside the tokenizer ({len(tokenizer)})")
        return arr
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{split}-{stream_key(tokenizer, split)}.npy"
    if out.exists():
        return np.load(out)
    ids = []
    for p in split_files(split):
        ids += [tokenizer.bos_token_id, *tokenizer.encode(read_text(p), add_special_tokens=False),
                tokenizer.eos_token_id]
    arr = np.asarray(ids, dtype=np.int32)
    np.save(out, arr)
    return arr


def tokenizer_dir(default: Path) -> Path:
    """Where the zoo's tokenizer is read: the prepared folder's copy, else ``default`` (``models/target``)."""
    return default if CORPUS_CACHE is None else CORPUS_CACHE / "tokenizer"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(tokenizer: Path, out: Path, work: Path):
    """Copy the tokenizer at ``tokenizer`` into the checkpoint folder ``out`` (never retrained) and load it, with
    its training token stream: ``(tokenizer, stream)``. What a target trained beside the zoo's reuses."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (tokenizer / f).exists():
            shutil.copyfile(tokenizer / f, out / f)
    tok = AutoTokenizer.from_pretrained(str(out))
    return tok, token_stream(tok, "train", work / "tokens")


def prepare_cache(tokenizer_path: Path, work: Path, out: Path) -> Path:
    """Write into ``out`` what training needs without the stdlib: the training token stream
    (``tokens/train-<key>.npy.xz``), the train and held-out manifests and the tokenizer's files.

    The stream is stored as uint16 and xz-compressed (about 2 MB, not 13): the folder travels with a
    working tree whose size is capped.
    """
    from transformers import AutoTokenizer

    if CORPUS_CACHE is not None:
        raise ValueError("prepare_cache reads the stdlib: call it without a corpus cache")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    stream = token_stream(tok, "train", work / "tokens")
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(exist_ok=True)
    for split in ("train", "heldout"):
        (out / f"manifest-{split}.json").write_text(json.dumps(manifest(split), indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (tokenizer_path / f).exists():
            shutil.copyfile(tokenizer_path / f, out / "tokenizer" / f)
    if len(tok) > 1 << 16:
        raise ValueError(f"a vocabulary of {len(tok)} does not fit the folder's uint16 stream")
    for old in (out / "tokens").glob("train-*.npy*"):
        old.unlink()
    buf = io.BytesIO()
    np.save(buf, stream.astype(np.uint16))
    (out / "tokens" / f"train-{stream_key(tok, 'train')}.npy.xz").write_bytes(lzma.compress(buf.getvalue()))
    return out


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
    dev = llama.activation_ref(params).device  # the target's device; the rows come back on the CPU
    kv = llama.init_kv_cache(cfg, n, p + new, device=dev)
    slots, prompts = torch.arange(n, device=dev), prompts.to(dev)
    logits, _, kv = llama.forward(cfg, params, kv, prompts, slots, torch.zeros(n, dtype=torch.int64, device=dev))
    out = [prompts, logits[:, -1:].argmax(-1)]
    for t in range(p, p + new - 1):  # position t holds the token just drawn
        kv = llama.KVCache(kv.k, kv.v, torch.full_like(kv.lens, t))
        logits, _, kv = llama.forward(cfg, params, kv, out[-1], slots,
                                      torch.full((n,), t, dtype=torch.int64, device=dev))
        out.append(logits[:, -1:].argmax(-1))
    return torch.cat(out, 1).cpu()


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
