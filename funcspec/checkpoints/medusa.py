"""Medusa head checkpoints: config, key layout, loading and random heads.

The layout is described in :mod:`funcspec.nn.medusa`, which holds the math.
"""

from __future__ import annotations

from funcspec.checkpoints.files import check_keys, nest, read_config, read_safetensors, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.nn.llama import ModelConfig
from funcspec.nn.medusa import MedusaConfig


def head_shapes(cfg: MedusaConfig) -> dict:
    """Every key of the checkpoint and its shape."""
    h, shapes = cfg.hidden_size, {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            shapes[f"medusa_head.{k}.{j}.linear.weight"] = (h, h)
            shapes[f"medusa_head.{k}.{j}.linear.bias"] = (h,)
        shapes[f"medusa_head.{k}.{cfg.num_layers}.weight"] = (cfg.vocab_size, h)
    return shapes


def config_from_hf(hf: dict, target_cfg: ModelConfig) -> MedusaConfig:
    """FasterDecoding's config keys (or vLLM's); H and V default to the target's."""
    heads = hf.get("medusa_num_heads", hf.get("num_heads"))
    layers = hf.get("medusa_num_layers", hf.get("num_hidden_layers", 1))
    if not isinstance(heads, int) or heads < 1 or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"config.json: medusa_num_heads must be an int >= 1 and medusa_num_layers an int >= 0, "
                         f"got {heads!r}, {layers!r}")
    return MedusaConfig(heads, layers, hf.get("hidden_size", target_cfg.hidden_size),
                        hf.get("vocab_size", target_cfg.vocab_size))


def init_params(target_cfg: ModelConfig, seed: int = 0, num_heads: int = 4, num_layers: int = 1):
    """Random Medusa heads for ``target_cfg``: ``(hf_config, params)``."""
    hf = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
          "hidden_size": target_cfg.hidden_size, "vocab_size": target_cfg.vocab_size}
    return hf, nest(random_tensors(head_shapes(config_from_hf(hf, target_cfg)), seed))


def load_params(path, target):
    """Load Medusa heads for ``target`` (a loaded Model): ``(cfg, params)``.

    Raises ``ValueError`` naming missing, unexpected or mis-shaped keys.
    """
    path, hf = read_config(path)
    cfg = config_from_hf(hf, target.cfg)
    if (cfg.hidden_size, cfg.vocab_size) != (target.cfg.hidden_size, target.cfg.vocab_size):
        raise ValueError(f"{path}: Medusa hidden_size/vocab_size ({cfg.hidden_size}, {cfg.vocab_size}) must equal "
                         f"the target's ({target.cfg.hidden_size}, {target.cfg.vocab_size})")
    tensors = read_safetensors(path)
    check_keys(tensors, head_shapes(cfg), str(path))
    return cfg, nest(to_target(tensors, target.params["model"]["embed_tokens"]["weight"]))
