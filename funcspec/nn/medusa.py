"""Medusa heads (FasterDecoding/Medusa ``medusa_model.py``): pure functions under the published key names.

Layout (``medusa_head`` is ``ModuleList[Sequential(ResBlock × n, Linear)]``), N heads, n layers::

    medusa_head.{k}.{j}.linear.weight [H, H], medusa_head.{k}.{j}.linear.bias [H]   j < n
    medusa_head.{k}.{n}.weight [V, H]                                               (no bias)
    config.json: medusa_num_heads = N, medusa_num_layers = n (vLLM's num_heads /
    num_hidden_layers are accepted too)

    head_k(h) = W_k · ResBlocks(h),  ResBlock(x) = x + SiLU(linear(x))

Head k reads the target's final normed hidden state h_t and predicts token
t+k+2 (the target's own lm_head predicts t+1).

NOTE: FasterDecoding ships the heads as ``medusa_lm_head.pt`` (a pickled
state dict); funcspec reads the same key names from ``model.safetensors``.
vLLM's re-keyed Medusa layout (``blocks.{k}.layers.{j}``, ``lm_heads.{k}``) is not read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from funcspec.checkpoints import check_keys, nest, read_config, read_safetensors
from funcspec.nn.eagle import random_tensors, to_target
from funcspec.nn.llama import ModelConfig, linear, project


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """N heads of n ResBlocks each, over hidden size H and vocabulary V."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int


def head_logits(cfg: MedusaConfig, params, h: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [B, V] float32 of head ``k`` for hidden states h [B, H]."""
    p = params["medusa_head"][k]
    for j in range(cfg.num_layers):
        h = h + F.silu(linear(h, p[j]["linear"]))  # [B, H]
    return project(h, p[cfg.num_layers]["weight"]).float()


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
