"""HF checkpoint files, whatever the model: ``config.json``, safetensors and params nested on names.

Every problem is reported with the file or key it concerns.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some exporters include that are not parameters."""


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


def read_safetensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """All tensors (or those in ``names``) of a single-file or sharded checkpoint in ``path``."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: shard listed in model.safetensors.index.json is missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if names is None or name in names:
                        out[name] = sf.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from e
    return out


def drop_ignored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` without the exporters' non-parameter buffers (:data:`IGNORED_SUFFIXES`)."""
    return {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}


def check_keys(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], where: str) -> None:
    """Raise ``ValueError`` naming missing, unexpected or mis-shaped keys."""
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    bad = [f"{k}: expected {shapes[k]}, got {tuple(t.shape)}" for k, t in tensors.items()
           if k in shapes and tuple(t.shape) != shapes[k]]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if bad:
        problems.append(f"mis-shaped keys {bad[:8]}")
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
    return path, json.loads(cfg_file.read_text())


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer via ``AutoTokenizer``, or ``None`` if it ships none."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def save_params(path: str | os.PathLike, params: dict, hf_config: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` for a params pytree."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    flat = {k: v.detach().contiguous().cpu() for k, v in flatten(params).items()}
    save_file(flat, str(path / "model.safetensors"), metadata={"format": "pt"})


def to_target(tensors: dict, ref: torch.Tensor) -> dict:
    """Floating tensors cast to ``ref``'s dtype, all moved to its device (integer / bool maps keep theirs)."""
    return {k: v.to(device=ref.device, dtype=ref.dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()}
