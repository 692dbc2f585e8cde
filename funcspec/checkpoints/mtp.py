"""DeepSeek-V3 MTP module checkpoints: key layout, loading and random modules.

The layout is described in :mod:`funcspec.nn.mtp`, which holds the math. The
module lives at ``model.layers.{L}`` of the target's own checkpoint (L = its
``num_hidden_layers``) or of a stand-alone one with the same config.
"""

from __future__ import annotations

import dataclasses

from funcspec.checkpoints.files import check_keys, nest, read_config, read_safetensors, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import hf_config_dict, layer_shapes, model_config
from funcspec.nn.llama import ModelConfig
from funcspec.nn.mtp import MTPConfig


def head_shapes(cfg: MTPConfig) -> dict:
    """Every key of the MTP module (without the optional embedding) and its shape."""
    m, pre = cfg.model, f"model.layers.{cfg.layer}."
    h = m.hidden_size
    shapes = layer_shapes(m, pre)
    shapes.update({pre + "enorm.weight": (h,), pre + "hnorm.weight": (h,), pre + "eh_proj.weight": (h, 2 * h),
                   pre + "shared_head.norm.weight": (h,), pre + "shared_head.head.weight": (m.vocab_size, h)})
    return shapes


def init_params(target_cfg: ModelConfig, seed: int = 0):
    """A random MTP module for ``target_cfg`` as a stand-alone checkpoint: ``(hf_config, params)``.

    The config is the target's plus ``num_nextn_predict_layers: 1``, as DeepSeek-V3 ships it.
    """
    cfg = MTPConfig(dataclasses.replace(target_cfg, num_layers=1), target_cfg.num_layers)
    return hf_config_dict(target_cfg, num_nextn_predict_layers=1), nest(random_tensors(head_shapes(cfg), seed))


def load_params(path, target):
    """The MTP module ``model.layers.{L}.*`` of checkpoint ``path`` (the target's own or a separate one).

    Returns ``(cfg, params)``; params share the target's embedding unless the
    module ships one. Raises ``ValueError`` naming missing or mis-shaped keys.
    """
    path, hf = read_config(path)
    base = model_config(hf)
    if (base.num_layers, base.hidden_size) != (target.cfg.num_layers, target.cfg.hidden_size):
        raise ValueError(f"{path}: MTP config num_hidden_layers/hidden_size ({base.num_layers}, {base.hidden_size})"
                         f" must equal the target's ({target.cfg.num_layers}, {target.cfg.hidden_size})")
    if hf.get("num_nextn_predict_layers", 1) < 1:
        raise ValueError(f"{path}: num_nextn_predict_layers is 0: this checkpoint has no MTP module")
    cfg = MTPConfig(dataclasses.replace(base, num_layers=1), base.num_layers)
    shapes = head_shapes(cfg)
    embed_key = f"model.layers.{cfg.layer}.embed_tokens.weight"
    tensors = read_safetensors(path, set(shapes) | {embed_key})
    if not tensors:
        raise ValueError(f"{path}: no MTP module (keys model.layers.{cfg.layer}.*) in this checkpoint")
    if embed_key in tensors:
        shapes[embed_key] = (base.vocab_size, base.hidden_size)
    check_keys(tensors, shapes, str(path))
    target_embed = target.params["model"]["embed_tokens"]["weight"]
    params = nest(to_target(tensors, target_embed))
    params["model"]["layers"][str(cfg.layer)].setdefault("embed_tokens", {"weight": target_embed})
    return cfg, params
