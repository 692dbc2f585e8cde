"""Checkpoint files, whatever the model: ``config.json``, the weight files and params nested on names.

Weights are found as vLLM finds them (every ``*.safetensors`` file, narrowed to
those a ``*.safetensors.index.json`` lists, else the ``*.bin`` files likewise)
and read from safetensors and from PyTorch pickles (``pytorch_model.bin``, its
shards, or a named file such as Medusa's ``medusa_lm_head.pt``) through
``torch.load(weights_only=True)``:
tensors and containers only, never arbitrary Python objects. Every problem
is reported with the file and key it concerns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some exporters include that are not parameters."""

WEIGHT_FILES = ("*.safetensors", "*.bin")
"""Where a checkpoint keeps its tensors, as vLLM's loader looks: every file of the first pattern that matches
any, narrowed to the files its ``<pattern>.index.json`` indexes list where it has any (a directory may hold
another copy beside its shards, such as ``consolidated.safetensors``). So msmodelslim's
``quant_model_weights-00001-of-00002.safetensors`` and ``quant_model_weight_w8a8.safetensors`` are found."""

NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
"""Files a weight pattern matches that hold no weights (vLLM's ``filter_files_not_needed_for_inference``)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Weight dtypes funcspec reads (cast to the model's dtype at load). float8 and integer weights are
quantized formats, whose scales live elsewhere: they are refused, not misread."""


def nest(flat: dict[str, torch.Tensor]) -> dict:
    """``{"a.0.b": t}`` -> ``{"a": [{"b": t}]}``: numeric parts become list indices."""
    root: dict = {}
    for name, t in flat.items():
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = t
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        n = max(int(k) for k in node) + 1
        if sorted(int(k) for k in node) == list(range(n)):
            return [_lists(node[str(i)]) for i in range(n)]
    return {k: _lists(v) for k, v in node.items()}


def flatten(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Inverse of :func:`nest`."""
    if isinstance(tree, torch.Tensor):
        return {prefix[:-1]: tree}
    items = enumerate(tree) if isinstance(tree, list) else tree.items()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}."))
    return out


# ----------------------------------------------------------------------------- reading weight files


@dataclasses.dataclass(frozen=True)
class Weights:
    """The weight files of a checkpoint directory, found but not yet read.

    Attributes:
        path: the checkpoint directory.
        entry: the file that was found (a weight file, or a shard index).
        files: the files holding tensors: ``entry``, or the shards its index names.
    """

    path: Path
    entry: Path
    files: tuple[Path, ...]

    def __str__(self) -> str:
        shards = f" ({len(self.files)} shards)" if self.entry not in self.files else ""
        return f"{self.entry}{shards}"

    def keys(self) -> dict[str, Path]:
        """Every tensor name and the file holding it (key names only: safetensors reads no tensor data,
        pickles are memory-mapped)."""
        return {k: f for f in self.files for k in _read_file(f, names=None, data=False)
                if not k.endswith(IGNORED_SUFFIXES)}

    def read(self, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        """The tensors (those in ``names``, if given) of every file, exporters' buffers dropped."""
        names = None if names is None else set(names)
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            out.update(_read_file(f, names, data=True))
        return drop_ignored(out)


def find_weights(path: str | os.PathLike, patterns: Iterable[str] = WEIGHT_FILES) -> Weights:
    """The weight files of checkpoint directory ``path``: those of the first of ``patterns`` (globs, or plain
    file names) that matches a file or an index, narrowed by its indexes (:data:`WEIGHT_FILES`).

    Raises ``FileNotFoundError`` naming what was looked for, or a shard an index lists that is missing;
    ``ValueError`` for an index that is not valid JSON with a ``weight_map``.
    """
    path, patterns = Path(path), tuple(patterns)
    for pattern in patterns:
        files = sorted(f for f in path.glob(pattern) if f.is_file() and f.name not in NOT_WEIGHTS)
        indexes = sorted(f for f in path.glob(pattern + ".index.json") if f.is_file())
        if files or indexes:
            return _narrow(path, pattern, files, indexes)
    raise FileNotFoundError(f"{path}: no weight file; looked for {looked_for(patterns)}")


def looked_for(patterns: Iterable[str]) -> str:
    """What :func:`find_weights` looked for, as a message says it: each pattern, and the indexes that narrow it."""
    return ", ".join(f"{p} (narrowed by {p}.index.json)" if "*" in p else p for p in patterns)


def has_weights(path: Path, patterns: Iterable[str]) -> bool:
    """Whether directory ``path`` holds a file matching one of ``patterns`` (or its index)."""
    return any(any(path.glob(p)) or any(path.glob(p + ".index.json")) for p in patterns)


def _narrow(path: Path, pattern: str, files: list[Path], indexes: list[Path]) -> Weights:
    """``files`` narrowed to those ``indexes`` list (every listed shard must exist), or all of them."""
    if not indexes:
        return Weights(path, files[0] if len(files) == 1 else path / pattern, tuple(files))
    listed: dict[Path, Path] = {}  # shard -> the index that lists it
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            listed.update({path / f: index for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a shard index (JSON with a 'weight_map' of key -> file): {e!r}") from e
    for f, index in listed.items():
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard listed in {index.name} is missing")
    return Weights(path, indexes[0], tuple(sorted(listed)))


def _read_file(f: Path, names: Optional[set], data: bool) -> dict:
    """The tensors of one file (``data=False``: the keys only, mapped to ``None``)."""
    if f.suffix == ".safetensors":
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys = [k for k in sf.keys() if names is None or k in names]
                return {k: sf.get_tensor(k) if data else None for k in keys}
        except SafetensorError as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from e
    state = _load_pickle(f)
    return {k: v if data else None for k, v in state.items() if names is None or k in names}


def _load_pickle(f: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state dict file, read with ``weights_only=True`` (memory-mapped when it is a zip archive).

    NOTE: ``weights_only`` rebuilds tensors and plain containers only; a pickle
    that names any other Python object is refused, never executed.
    """
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except pickle.UnpicklingError as e:
        raise ValueError(f"{f}: holds Python objects that are not tensors; funcspec reads PyTorch files with "
                         f"weights_only=True and never unpickles arbitrary objects") from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise ValueError(f"{f}: unreadable PyTorch file, truncated or corrupt ({str(e).splitlines()[0]})") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{f}: expected a flat state dict of name -> tensor, got {type(state).__name__}")
    return state


def read_weights(path: str | os.PathLike, names=None) -> dict[str, torch.Tensor]:
    """All tensors (or those in ``names``) of the weight files of ``path`` (:data:`WEIGHT_FILES`)."""
    return find_weights(path).read(names)


def drop_ignored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` without the exporters' non-parameter buffers (:data:`IGNORED_SUFFIXES`)."""
    return {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}


def check_keys(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], where: str,
               maps: Iterable[str] = (), published: Optional[Callable[[str], str]] = None) -> None:
    """Raise ``ValueError`` naming missing, unexpected, mis-shaped or unusable-dtype keys.

    ``maps`` are the keys that hold integer or bool maps (every other tensor is a
    weight and must have one of :data:`FLOAT_DTYPES`); ``published`` gives a
    key's name in the file, for messages, where it differs from funcspec's.
    """
    maps = set(maps)

    def shown(k):
        name = published(k) if published else k
        return k if name == k else f"{name} (as {k})"

    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    bad = [f"{shown(k)}: expected {shapes[k]}, got {tuple(t.shape)}" for k, t in tensors.items()
           if k in shapes and tuple(t.shape) != shapes[k]]
    dtypes = [f"{shown(k)}: {t.dtype}, expected " + ("an integer or bool map" if k in maps else
                                                      "float32, bfloat16, float16 or float64")
              for k, t in sorted(tensors.items()) if k in shapes
              and not ((t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex())) if k in maps
                       else t.dtype in FLOAT_DTYPES)]
    problems = []
    if missing:
        problems.append(f"missing keys {[shown(k) for k in missing[:8]]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {[shown(k) for k in unexpected[:8]]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    if bad:
        problems.append(f"mis-shaped keys {bad[:8]}")
    if dtypes:
        problems.append(f"keys of an unusable dtype {dtypes[:8]}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def read_config(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory and its parsed ``config.json``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file}: missing config.json")
    return path, read_json_object(cfg_file)


def read_json_object(file: str | os.PathLike) -> dict:
    """A JSON file that must hold an object; ``ValueError`` naming the file otherwise."""
    try:
        value = json.loads(Path(file).read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
"""A directory with one of these has a tokenizer."""


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether directory ``path`` holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer via ``AutoTokenizer``, or ``None`` if it ships none.

    A tokenizer that does not load because one of its JSON files is corrupt is a ``ValueError`` naming that file.
    """
    path = Path(path)
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # transformers' errors name no file (a corrupt one: a bare JSONDecodeError)
        for name in (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json"):
            if (path / name).is_file():
                read_json_object(path / name)  # a corrupt one: ValueError naming it
        raise  # not a corrupt file (a missing dependency, an unknown tokenizer class): transformers' own error


def save_params(path: str | os.PathLike, params: dict, hf_config: dict, file: str = "model.safetensors") -> None:
    """Write ``config.json`` and ``file`` (safetensors, or a PyTorch pickle for ``.bin`` / ``.pt``) for a
    params pytree."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    flat = {k: v.detach().contiguous().cpu() for k, v in flatten(params).items()}
    if file.endswith(".safetensors"):
        save_file(flat, str(path / file), metadata={"format": "pt"})
    else:
        torch.save(flat, path / file)


def to_target(tensors: dict, ref: torch.Tensor) -> dict:
    """Floating tensors cast to ``ref``'s dtype, all moved to its device (integer / bool maps keep theirs)."""
    return {k: v.to(device=ref.device, dtype=ref.dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()}
