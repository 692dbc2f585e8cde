"""HF-format checkpoints: ``config.json`` + weight files (+ tokenizer files), read and written.

The checkpoints layer owns every format concern, so :mod:`funcspec.nn` is math
only: ``files`` (config.json, safetensors and ``.bin`` files, sharded or not,
params nested on names), ``llama`` (the target decoder: config parsing, key
layout, :func:`load_model`), ``layouts`` (every published draft-head layout:
one key table each, detection, :func:`read_head`, :func:`inspect`), one module
per draft-head family (``eagle``, ``mtp``, ``medusa``, ``dflash``: config,
shapes, ``load_params``, ``init_params``), ``init`` (the one random
initialiser) and ``heads`` (:func:`init_draft_head`).

This package re-exports the names that callers use most.
"""

from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import (
    check_keys,
    find_weights,
    flatten,
    load_tokenizer,
    nest,
    read_config,
    read_weights,
    save_params,
    to_target,
)
from funcspec.checkpoints.heads import init_draft_head
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import Model, expected_shapes, hf_config_dict, layer_shapes, load_model, model_config

__all__ = [
    "Model",
    "check_keys",
    "expected_shapes",
    "find_weights",
    "flatten",
    "hf_config_dict",
    "init_draft_head",
    "layer_shapes",
    "load_model",
    "load_tokenizer",
    "model_config",
    "nest",
    "random_tensors",
    "read_config",
    "layouts",
    "read_weights",
    "save_params",
    "to_target",
]
