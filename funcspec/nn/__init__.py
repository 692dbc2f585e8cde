"""Functional networks: params are pytrees keyed by HF names, functions are pure."""

from funcspec.nn.llama import KVCache, ModelConfig, forward, init_kv_cache

__all__ = ["KVCache", "ModelConfig", "forward", "init_kv_cache"]
