"""Random draft heads written in their published formats, for any target."""

from __future__ import annotations

from pathlib import Path

from funcspec.checkpoints import dflash, eagle, medusa, mtp
from funcspec.checkpoints.files import save_params
from funcspec.checkpoints.llama import Model, load_model

# method -> (format module, its init_params keywords)
HEAD_FORMATS = {"medusa": (medusa, {}), "eagle": (eagle, {"version": 1}), "eagle3": (eagle, {"version": 3}),
                "mtp": (mtp, {}), "dflash": (dflash, {"method": "dflash"}), "dspark": (dflash, {"method": "dspark"})}


def init_draft_head(method: str, target_model, path, seed: int = 0, **sizes) -> Path:
    """Write a randomly initialised ``method`` draft head for ``target_model`` in its published format.

    ``method``: medusa | eagle | eagle3 | mtp | dflash | dspark. ``target_model``
    is a checkpoint path or a loaded :class:`Model`; ``sizes`` go to the head's
    ``init_params`` (e.g. ``num_heads`` for medusa, ``num_layers``). Returns
    ``path``, which ``speculative_config["model"]`` can point at.
    """
    if method not in HEAD_FORMATS:
        raise ValueError(f"method must be one of {sorted(HEAD_FORMATS)}, got {method!r}")
    target = target_model if isinstance(target_model, Model) else load_model(target_model)
    module, kwargs = HEAD_FORMATS[method]
    hf_config, params = module.init_params(target.cfg, seed, **kwargs, **sizes)
    save_params(path, params, hf_config)
    return Path(path)
