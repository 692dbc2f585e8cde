"""``bench scale``'s random checkpoints: the family shapes, the checkpoint built once per (shape, dtype, seed),
the bytes a decode step streams, and the prompts."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from funcspec.bench.timing import random_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EMBED_SCALE = 3.0
"""Random init (std 0.02) gives near-uniform logits, so bf16 rounding flips greedy
near-ties between HF and funcspec; the embedding / lm_head are scaled by this
(top-2 logit gap about 7x wider) so both pick the same argmax."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model family's shape: the HF config class kwargs and the non-special prompt-id range."""

    arch: str  # "llama" | "qwen2" | "qwen3_moe" | "deepseek_v2"
    config: dict
    prompt_ids: tuple[int, int]  # [lo, hi): ids sampled for prompts, no special tokens


_LLAMA_32K = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  max_position_embeddings=8192)
_DEEPSEEK_V2_LITE: dict[str, Any] = dict(
                         vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                         num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                         q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                         norm_topk_prob=False, routed_scaling_factor=1.0, topk_method="greedy", rms_norm_eps=1e-6,
                         tie_word_embeddings=False, max_position_embeddings=163840, bos_token_id=100000,
                         eos_token_id=100001,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                          "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})
"""DeepSeek-V2-Lite's config.json (transformers 5's field names)."""

SHAPES = {
    "tiny": Shape("llama", dict(_LLAMA_32K, vocab_size=512, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), (3, 512)),
    # 153M params: 12 x 8.65M layers + 2 x 24.6M (untied embedding and lm_head).
    "llama-150m": Shape("llama", dict(_LLAMA_32K, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=4), (3, 32000)),
    # 156M params, 594 MiB in fp32 (untied).
    "llama-600m": Shape("llama", dict(_LLAMA_32K, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4), (3, 32000)),
    "qwen2.5-0.5b": Shape("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        max_position_embeddings=32768, bos_token_id=151643,
                                        eos_token_id=151643), (0, 151643)),
    "llama-3.2-1b": Shape("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192},
                                        max_position_embeddings=131072, bos_token_id=128000,
                                        eos_token_id=128001), (0, 128000)),
    # Qwen3-30B-A3B's layer (2048 wide, 128 experts of 768, top-8) with 4 of its 48 layers: fits 24 GB.
    "qwen3-moe-30b-a3b-4l": Shape("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                                    norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=32,
                                                    num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                                                    rope_theta=1000000.0, rms_norm_eps=1e-6,
                                                    max_position_embeddings=40960, bos_token_id=151643,
                                                    eos_token_id=151645), (0, 151643)),
    # DeepSeek-V2-Lite's layers (MLA: 16 heads over a 512 + 64 latent; 64 experts of 1408, top-6, 2 shared; the
    # first layer dense; YaRN) with 4 of its 27 layers: fits 24 GB.
    "deepseek-v2-lite-4l": Shape("deepseek_v2", dict(_DEEPSEEK_V2_LITE, num_hidden_layers=4), (0, 100000)),
    # The same structure at test size (every width a multiple of 32: GGUF's Q8_0 / Q4_0 blocks).
    "deepseek-tiny": Shape("deepseek_v2", dict(_DEEPSEEK_V2_LITE, vocab_size=512, hidden_size=64, intermediate_size=128,
                                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32,
                                               qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                                               num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
                                               max_position_embeddings=8192,
                                               rope_parameters={**_DEEPSEEK_V2_LITE["rope_parameters"], "factor": 2.0,
                                                                "original_max_position_embeddings": 4096}), (3, 512)),
}


def checkpoint_dir(shape: str, dtype: str, cache_dir=None, seed: int = 0) -> Path:
    """Where the random checkpoint lives: ``<cache_dir>/<shape>-<dtype>`` (``-seed<n>`` appended for seed != 0)."""
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "funcspec" / "scale"
    return root / (f"{shape}-{dtype}" + (f"-seed{seed}" if seed else ""))


def build_checkpoint(shape: str, dtype: str = "float32", cache_dir=None, seed: int = 0) -> Path:
    """The random-weight HF checkpoint (safetensors) of ``shape``, built on first use, then reused.

    Weights: transformers' default init (normal, std 0.02) with the embedding and
    lm_head scaled by :data:`EMBED_SCALE`, saved in ``dtype``.
    """
    import transformers

    path = checkpoint_dir(shape, dtype, cache_dir, seed)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    spec = SHAPES[shape]
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)}[spec.arch]
    torch.manual_seed(seed)
    model = classes[1](classes[0](**spec.config)).eval()
    with torch.no_grad():
        emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        emb.mul_(EMBED_SCALE)
        if out is not emb:  # untied: scale lm_head too (tied: it is the same tensor)
            out.mul_(EMBED_SCALE)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    model.to(DTYPES[dtype]).save_pretrained(str(tmp))  # safetensors
    tmp.replace(path)  # NOTE: atomic: a killed build never leaves a half checkpoint that looks complete
    return path


def weight_bytes(path: Path, dtype: str) -> tuple[int, int]:
    """(parameters, bytes) a decode step of one token streams: every funcspec param once (a tied lm_head is the
    embedding; an untied embedding is read by one row, which is left out), of a MoE layer's experts only the
    ``top_k`` of ``E`` the token is routed to (the active bytes)."""
    from funcspec.checkpoints import expected_shapes, model_config, read_config

    cfg = model_config(read_config(path)[1])
    active = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe.num_experts else 1.0
    shapes = expected_shapes(cfg)
    if "lm_head.weight" in shapes:  # untied: the step reads one row of the embedding, the LM head whole
        shapes = {k: s for k, s in shapes.items() if k != "model.embed_tokens.weight"}
    n = int(sum(math.prod(s) * (active if ".experts." in k else 1) for k, s in shapes.items()))
    return n, n * torch.empty(0, dtype=DTYPES[dtype]).element_size()


def cache_bytes(path: Path, dtype: str) -> dict:
    """Bytes per token of one sequence's decode cache, from the checkpoint's config: ``kv`` (keys and values of
    every KV head), and for multi-head latent attention (DeepSeek) ``latent`` (``kv_lora_rank +
    qk_rope_head_dim`` a layer, what an MLA cache holds) with ``kv`` the K/V the latent expands to."""
    from funcspec.checkpoints import read_config

    hf, size = read_config(path)[1], DTYPES[dtype].itemsize
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    if "kv_lora_rank" in hf:
        k = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        return {"latent": layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * size,
                "kv": layers * heads * (k + hf["v_head_dim"]) * size}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return {"kv": 2 * layers * (hf.get("num_key_value_heads") or heads) * head_dim * size}


def make_prompts(shape: str, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` deterministic pseudo-random prompts of ``length`` ids from the shape's non-special range."""
    return random_prompts(SHAPES[shape].prompt_ids, num, length, seed)
