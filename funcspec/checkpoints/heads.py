"""Random draft heads written in their published formats, for any target."""

from __future__ import annotations

import importlib
from pathlib import Path

from funcspec import methods
from funcspec.checkpoints.files import save_params
from funcspec.checkpoints.llama import Model, load_model


def init_draft_head(method: str, target_model, path, seed: int = 0, **sizes) -> Path:
    """Write a randomly initialised ``method`` draft head for ``target_model`` in its published format.

    ``method``: medusa | eagle | eagle3 | mtp | dflash | dspark. ``target_model``
    is a checkpoint path or a loaded :class:`Model`; ``sizes`` go to the head's
    ``init_params`` (e.g. ``num_heads`` for medusa, ``num_layers``). Returns
    ``path``, which ``speculative_config["model"]`` can point at.
    """
    heads = sorted(m.name for m in methods.METHODS.values() if m.head)
    if method not in heads:
        raise ValueError(f"method must be one of {heads}, got {method!r}")
    row = methods.METHODS[method]
    target = target_model if isinstance(target_model, Model) else load_model(target_model)
    module = importlib.import_module(f"funcspec.checkpoints.{row.head}")  # the family's format module
    hf_config, params = module.init_params(target.cfg, seed, **dict(row.head_args), **sizes)
    save_params(path, params, hf_config)
    return Path(path)
