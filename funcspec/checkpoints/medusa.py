"""Medusa head checkpoints: FasterDecoding's, Medusa-2 whole models and vLLM's layout; loading and random heads.

The layouts are declared in :mod:`funcspec.checkpoints.layouts`; the math is
:mod:`funcspec.nn.medusa`. The number of heads and of ResBlocks is read from the
tensors, not the config: FasterDecoding's published configs say
``medusa_num_heads: 2`` beside files that hold 5 heads (its loader hard-codes
5), and vLLM builds one head per speculative token whatever ``num_heads`` says.
"""

from __future__ import annotations

import re
import warnings

from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import check_keys, nest, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.nn.llama import ModelConfig, lm_head
from funcspec.nn.medusa import MedusaConfig

WRITTEN = "medusa-2"
"""The layout :func:`init_params` writes: ``medusa_head.*`` in ``model.safetensors`` (a Medusa-2 checkpoint's
heads, without the target)."""


def head_shapes(cfg: MedusaConfig, bias: bool = True) -> dict:
    """Every tensor of the heads under funcspec's names and its shape (``bias``: the ResBlocks have biases)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            shapes[f"medusa_head.{k}.{j}.linear.weight"] = (h, h)
            if bias:
                shapes[f"medusa_head.{k}.{j}.linear.bias"] = (h,)
        if not cfg.shared_head:
            shapes[f"medusa_head.{k}.{cfg.num_layers}.weight"] = (cfg.vocab_size, h)
    if cfg.shared_head:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.token_map:
        shapes["token_map"] = (cfg.vocab_size,)
    return shapes


def init_params(target_cfg: ModelConfig, seed: int = 0, num_heads: int = 4, num_layers: int = 1):
    """Random Medusa heads for ``target_cfg``: ``(hf_config, params)`` under ``medusa_head.*``."""
    hf = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
          "hidden_size": target_cfg.hidden_size, "vocab_size": target_cfg.vocab_size}
    cfg = MedusaConfig(num_heads, num_layers, target_cfg.hidden_size, target_cfg.vocab_size)
    return hf, nest(random_tensors(head_shapes(cfg), seed))


def _count(tensors: dict, where: str) -> tuple[int, int]:
    """(heads, ResBlocks per head) present in ``tensors`` (funcspec names)."""
    heads = {int(m.group(1)) for k in tensors if (m := re.match(r"medusa_head\.(\d+)\.", k))}
    blocks = {int(m.group(1)) for k in tensors if (m := re.match(r"medusa_head\.0\.(\d+)\.linear\.", k))}
    if not heads:
        raise ValueError(f"{where}: no Medusa head tensors")
    return max(heads) + 1, len(blocks)


def load_params(path, target):
    """Load Medusa heads for ``target`` (a loaded Model): ``(cfg, params)`` under funcspec's names.

    Raises ``ValueError`` naming the file and the missing, unexpected,
    mis-shaped or unusable keys, or the head that does not fit the target.
    """
    head = layouts.read_head(path, "medusa", "medusa")
    hf, where, tensors, t = head.config, head.where, dict(head.tensors), target.cfg
    heads, blocks = _count(tensors, where)
    vllm = head.layout.name == "medusa-vllm"
    bias = bool(hf.get("medusa_fc_bias", False)) if vllm else any(k.endswith(".linear.bias") for k in tensors)
    dropped = [k for k in tensors if k.endswith(".linear.bias") and not bias]
    if dropped:  # vLLM builds bias-free ResBlocks unless medusa_fc_bias: it drops these, and so does funcspec
        warnings.warn(f"{where}: {len(dropped)} ResBlock biases ignored: config.json has no medusa_fc_bias: true",
                      stacklevel=2)
        tensors = {k: v for k, v in tensors.items() if k not in dropped}
    if vllm and hf.get("original_lm_head") and "lm_head.weight" not in tensors:  # vLLM reads lm_heads.0 then
        tensors["lm_head.weight"] = tensors[f"medusa_head.0.{blocks}.weight"]
    if "lm_head.weight" in tensors or (vllm and hf.get("original_lm_head")):
        tensors = {k: v for k, v in tensors.items() if not re.fullmatch(rf"medusa_head\.\d+\.{blocks}\.weight", k)}
    projections = {k for k in tensors if re.fullmatch(rf"medusa_head\.\d+\.{blocks}\.weight", k)}
    shared = not projections  # FasterDecoding "version 2" heads project through the target's LM head
    truncated = int(hf.get("truncated_vocab_size") or t.vocab_size) if vllm else t.vocab_size
    token_map = truncated < t.vocab_size
    if token_map and "token_map" in tensors:  # vLLM: a full-vocabulary projection keeps the mapped rows
        rows = tensors["token_map"].long()
        tensors = {k: v[rows] if k in projections | {"lm_head.weight"} and v.shape[0] == t.vocab_size else v
                   for k, v in tensors.items()}
    elif not token_map:
        tensors.pop("token_map", None)
    if shared and "lm_head.weight" not in tensors and token_map:
        raise ValueError(f"{where}: truncated_vocab_size {truncated} needs the heads' own projections")
    cfg = MedusaConfig(heads, blocks, t.hidden_size, truncated, shared, token_map, t.ops)
    size = hf.get("hidden_size", t.hidden_size)
    if size != t.hidden_size:
        raise ValueError(f"{where}: Medusa hidden_size {size} must equal the target's {t.hidden_size}")
    shapes = head_shapes(cfg, bias)
    if "lm_head.weight" not in tensors:  # heads that project through the target's own LM head, as it is
        shapes.pop("lm_head.weight", None)
    check_keys(tensors, shapes, where, maps=("token_map",), published=head.published)
    ref = target.params["model"]["embed_tokens"]["weight"]
    params = nest(to_target({k: v for k, v in tensors.items() if k != "lm_head.weight"}, ref))
    if shared:
        params["lm_head"] = layouts.share_linear(tensors.get("lm_head.weight"), lm_head(t, target.params), ref.dtype)
    if token_map:
        params["token_map"] = params["token_map"].long()
    return cfg, params
