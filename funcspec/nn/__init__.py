"""Functional networks: params are pytrees keyed by HF names, functions are pure.

``forward``, ``init_kv_cache``, ``decoder_layer`` and ``rope_tables`` are the
names a caller that serves any decoder family uses (the target's runner, a
draft head whose block is one of the target's layers), with ``nn.llama``'s
signatures.
"""

from funcspec.nn.llama import KVCache, ModelConfig, decoder_layer, forward, init_kv_cache, rope_tables

__all__ = ["KVCache", "ModelConfig", "decoder_layer", "forward", "init_kv_cache", "rope_tables"]
