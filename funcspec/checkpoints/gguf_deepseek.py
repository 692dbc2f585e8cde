"""DeepSeek-V2 / V3 (multi-head latent attention) in GGUF: llama.cpp's ``deepseek2`` architecture, both ways.

llama.cpp's converter writes MLA as one key/value head (MQA) of the latent:
``attention.head_count_kv`` 1, ``attention.key_length`` ``kv_lora_rank +
qk_rope_head_dim`` and ``attention.value_length`` ``kv_lora_rank``; the heads'
own sizes are ``attention.key_length_mla`` (``qk_nope_head_dim +
qk_rope_head_dim``) and ``attention.value_length_mla`` (``v_head_dim``). HF's
``kv_b_proj`` [H (nope + v), R] is split per head for the absorbed decode:
``attn_k_b`` [H, R, nope] (W_UK, transposed: its rows are the latent) and
``attn_v_b`` [H, v, R] (W_UV). Files written before that split hold
``attn_kv_b`` whole, with the heads' sizes in ``key_length`` / ``value_length``;
both read back as HF's ``kv_b_proj``. RoPE is not permuted: HF's DeepSeek rotates
adjacent pairs, as llama.cpp's ``deepseek2`` does.

The MoE is the converter's: ``expert_*`` keys, ``leading_dense_block_count``
dense first layers, shared experts as ``ffn_*_shexp``, the router and V3's
correction bias (``exp_probs_b``) in f32, and ``expert_gating_func`` (softmax
for V2, sigmoid for V3, which the file must say: llama.cpp reads a missing one as
softmax). Routing groups go to ``expert_group_count`` / ``expert_group_used_count``;
llama.cpp scores a group by its best two experts (V3's rule), so a V2 file with
group-limited greedy (a group's best one) runs there with V3's grouping, and in
funcspec as written. YaRN is ``rope.scaling.*`` with ``yarn_log_multiplier`` = 0.1
``mscale_all_dim``, the converter's convention. A model without ``q_lora_rank``
(V2-Lite) is written with ``attention.q_lora_rank`` 0: llama.cpp only skips the
key for the layer counts of the published Lite models.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

ARCH = "deepseek2"
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
"""HF ``model_type`` -> architecture, for the families written as ``deepseek2``."""

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
         "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
"""HF module (under ``model.layers.<i>.``) -> llama.cpp's tensor name (under ``blk.<i>.``); ``attn_kv_b`` only in
files from before the split."""

GGUF_LAYER = {v: k for k, v in LAYER.items()}
SPLIT = ("attn_k_b", "attn_v_b")
"""The per-head halves of ``kv_b_proj`` (W_UK transposed, W_UV), joined back on reading."""


def is_deepseek(hf: dict) -> bool:
    """Whether HF config ``hf`` is a family written as ``deepseek2``."""
    return hf.get("model_type") in ARCHITECTURES


def split_kv_b(w: torch.Tensor, heads: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``kv_b_proj`` [H (nope + v), R] -> (``attn_k_b`` [H, R, nope], ``attn_v_b`` [H, v, R])."""
    kv = w.reshape(heads, nope + v, w.shape[-1])
    return kv[:, :nope].transpose(1, 2).contiguous(), kv[:, nope:].contiguous()


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`split_kv_b`: HF's ``kv_b_proj`` [H (nope + v), R]."""
    rank = k_b.shape[1]
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank)


def _rope(hf: dict) -> tuple[float, dict]:
    """(rope theta, the scaling dict without it) of an HF config, transformers 5's ``rope_parameters`` or the
    older ``rope_scaling`` with a top-level ``rope_theta``."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    return theta, rope


def scoring(hf: dict) -> str:
    """The router's scoring function: the config's ``scoring_func``, else V3's sigmoid or V2's softmax."""
    return hf.get("scoring_func") or ("sigmoid" if hf.get("model_type") == "deepseek_v3" else "softmax")


def tensors(hf: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF DeepSeek tensors (experts stacked: :func:`funcspec.checkpoints.experts.stack`) under llama.cpp's names,
    ``kv_b_proj`` split (:func:`split_kv_b`); the embedding, final norm and LM head are the caller's."""
    heads, nope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
    out = {}
    for key, w in weights.items():
        if not key.startswith("model.layers."):
            continue
        _, _, i, rest = key.split(".", 3)
        if int(i) >= hf["num_hidden_layers"]:
            continue  # MTP layers (num_nextn_predict_layers): the converter skips them
        module, leaf = rest.rsplit(".", 1)
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj.weight":
            half = w.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = w[:, :half], w[:, half:]
        elif rest == "mlp.experts.down_proj.weight":
            out[blk + "ffn_down_exps.weight"] = w
        elif rest == "mlp.gate.e_score_correction_bias":
            out[blk + "exp_probs_b.bias"] = w
        elif module == "self_attn.kv_b_proj":
            out[blk + "attn_k_b.weight"], out[blk + "attn_v_b.weight"] = split_kv_b(w, heads, nope, v)
        else:
            out[f"{blk}{LAYER[module]}.{leaf}"] = w
    return out


def add_metadata(w, gguf, hf: dict) -> None:
    """The converter's ``deepseek2.*`` keys of HF config ``hf`` (beyond the ones every architecture has)."""
    rank, rope_dim = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    w.add_head_count_kv(1)  # MLA as MQA over the latent
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(hf["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(hf["v_head_dim"])
    w.add_kv_lora_rank(rank)
    w.add_q_lora_rank(hf.get("q_lora_rank") or 0)
    w.add_rope_dimension_count(rope_dim)
    w.add_leading_dense_block_count(hf.get("first_k_dense_replace", 0))
    w.add_expert_count(hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_expert_shared_count(hf.get("n_shared_experts") or 0)
    w.add_expert_weights_scale(float(hf.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(hf.get("norm_topk_prob", False)))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring(hf) == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    if hf.get("n_group"):
        w.add_expert_group_count(hf["n_group"])
        w.add_expert_group_used_count(hf["topk_group"])
    theta, rope = _rope(hf)
    w.add_rope_freq_base(theta)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if rope.get(key) is not None:
                add(float(rope[key]))
        if rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def config(get: Callable[[str, Any], Any], names: dict, base: dict) -> dict:
    """The HF config (transformers' DeepseekV2Config / V3Config fields) of a ``deepseek2`` file's metadata.

    ``get(key, default)`` reads ``deepseek2.<key>`` (raising where a required key is missing), ``names`` holds
    the file's tensors and ``base`` the fields every architecture has (vocabulary, hidden size, layers, heads,
    norm epsilon, positions, tied head, token ids). V3 is told from V2 by its router: sigmoid with a correction
    bias.
    """
    rope_dim = int(get("rope.dimension_count", None))
    legacy = "blk.0.attn_kv_b.weight" in names
    k_len = int(get("attention.key_length", None) if legacy else get("attention.key_length_mla", None))
    v_len = int(get("attention.value_length", None) if legacy else get("attention.value_length_mla", None))
    v3 = int(get("expert_gating_func", 1)) == 2 and any(n.endswith("exp_probs_b.bias") for n in names)
    model_type = "deepseek_v3" if v3 else "deepseek_v2"
    groups = int(get("expert_group_count", 0)) or None
    hf = {**base, "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
          "num_key_value_heads": base["num_attention_heads"], "head_dim": rope_dim,
          "q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,
          "kv_lora_rank": int(get("attention.kv_lora_rank", None)), "qk_nope_head_dim": k_len - rope_dim,
          "qk_rope_head_dim": rope_dim, "v_head_dim": v_len, "qk_head_dim": k_len,
          "n_routed_experts": int(get("expert_count", None)),
          "num_experts_per_tok": int(get("expert_used_count", None)),
          "moe_intermediate_size": int(get("expert_feed_forward_length", None)),
          "n_shared_experts": int(get("expert_shared_count", 0)),
          "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
          "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
          "norm_topk_prob": bool(get("expert_weights_norm", False)), "n_group": groups,
          "topk_group": int(get("expert_group_used_count", 0)) or None,
          "scoring_func": "sigmoid" if int(get("expert_gating_func", 1)) == 2 else "softmax",
          "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups else "greedy",
          "rope_parameters": _rope_parameters(get), "attention_bias": False}
    if v3:  # the file holds no MTP layers (the converter skips them); V3 rotates adjacent pairs, as the file does
        hf.update(num_nextn_predict_layers=0, rope_interleave=True)
    return hf


def _rope_parameters(get) -> dict:
    """transformers 5's ``rope_parameters`` of the ``rope.*`` keys: YaRN's with ``mscale`` = ``mscale_all_dim``
    (the file keeps one; DeepSeek's checkpoints set both equal)."""
    theta = float(get("rope.freq_base", 10000.0))
    if get("rope.scaling.type", "none") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    out = {"rope_type": "yarn", "rope_theta": theta, "factor": float(get("rope.scaling.factor", None)),
           "original_max_position_embeddings": int(get("rope.scaling.original_context_length", None))}
    for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                      ("attention_factor", "yarn_attn_factor")):
        value = get(f"rope.scaling.{name}", 0) or None
        if value is not None:
            out[key] = float(value)
    log_mul = get("rope.scaling.yarn_log_multiplier", 0) or None
    if log_mul is not None:
        out["mscale"] = out["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
    return out


def hf_name(name: str) -> Optional[str]:
    """The HF name of a ``deepseek2`` layer tensor ``blk.<i>.<name>.<leaf>``, or ``None`` for one that is not a
    plain HF tensor (the experts and the ``kv_b_proj`` halves: the reader assembles them)."""
    _, i, base, leaf = name.split(".")
    if base in SPLIT or base.endswith("_exps"):
        return None
    if base == "exp_probs_b":
        return f"model.layers.{i}.mlp.gate.e_score_correction_bias"
    if base not in GGUF_LAYER:
        raise ValueError(f"GGUF tensor {name!r} has no funcspec counterpart")
    return f"model.layers.{i}.{GGUF_LAYER[base]}.{leaf}"
