"""Functional networks: params are pytrees keyed by HF names, functions are pure.

The decoder families share one interface, picked by the static config: Llama-style GQA blocks
(:mod:`funcspec.nn.llama`) or DeepSeek's latent attention (:mod:`funcspec.nn.deepseek`, ``cfg.mla``).
"""

from __future__ import annotations

import torch

from funcspec.nn import deepseek, llama
from funcspec.nn.llama import KVCache, ModelConfig


def is_mla(cfg: ModelConfig) -> bool:
    """Whether the decoder attends through a latent cache (the DeepSeek families)."""
    return cfg.mla.kv_lora_rank > 0


def forward(cfg: ModelConfig, *args, **kwargs):
    """The decoder's forward (:func:`funcspec.nn.llama.forward`'s signature) for cfg's family."""
    return (deepseek.forward if is_mla(cfg) else llama.forward)(cfg, *args, **kwargs)


def init_kv_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype=None, device=None):
    """The empty cache cfg's family declares: K/V per head, or one latent per token."""
    dtype = torch.float32 if dtype is None else dtype
    return (deepseek.init_latent_cache if is_mla(cfg) else llama.init_kv_cache)(cfg, num_slots, max_len, dtype,
                                                                                device)


def decoder_layer(cfg: ModelConfig, *args, **kwargs):
    """One block (:func:`funcspec.nn.llama.decoder_layer`'s signature) of cfg's family."""
    return (deepseek.decoder_layer if is_mla(cfg) else llama.decoder_layer)(cfg, *args, **kwargs)


__all__ = ["KVCache", "ModelConfig", "decoder_layer", "forward", "init_kv_cache", "is_mla"]
