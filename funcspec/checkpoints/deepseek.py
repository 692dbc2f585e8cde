"""The DeepSeek-V2 / V3 / V3.2 families' ``config.json`` fields and attention keys (multi-head latent attention).

Their decoder is the Llama one with MLA in place of GQA (:mod:`funcspec.nn.deepseek`) and DeepSeekMoE
(:func:`funcspec.checkpoints.experts.moe_config`). Attention keys, HF names::

    self_attn.q_proj [H·(nope+rope), hidden]                      without q_lora_rank (V2-Lite)
    self_attn.q_a_proj [q_lora, hidden], q_a_layernorm [q_lora], q_b_proj [H·(nope+rope), q_lora]
    self_attn.kv_a_proj_with_mqa [R+rope, hidden], kv_a_layernorm [R], kv_b_proj [H·(nope+v), R]
    self_attn.o_proj [hidden, H·v]
    self_attn.indexer.{wq_b, wk, k_norm, weights_proj}            V3.2's lightning indexer
"""

from __future__ import annotations

from typing import Any

from funcspec.nn.llama import GQA, MLAConfig, yarn_mscale

ARCHS = ("deepseek_v2", "deepseek_v3", "deepseek_v32")


def _positive(hf: dict, key: str, where: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def mla_config(hf: dict[str, Any], arch: str, rope: dict, where: str) -> MLAConfig:
    """The :class:`MLAConfig` of an HF config of family ``arch`` (``GQA`` for the others); ``rope``: its RoPE
    scaling parameters. A missing or bad field is a ``ValueError`` naming it."""
    if arch not in ARCHS:
        return GQA
    q_lora = hf.get("q_lora_rank")
    q_lora = 0 if q_lora is None else _positive(hf, "q_lora_rank", where)
    nope, rot = _positive(hf, "qk_nope_head_dim", where), _positive(hf, "qk_rope_head_dim", where)
    if rot % 2:
        raise ValueError(f"{where}: qk_rope_head_dim must be even (RoPE rotates pairs), got {rot}")
    scale = (nope + rot) ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    index = dict(index_n_heads=_positive(hf, "index_n_heads", where, 64),
                 index_head_dim=_positive(hf, "index_head_dim", where, 128),
                 index_topk=_positive(hf, "index_topk", where, 2048)) if arch == "deepseek_v32" else {}
    return MLAConfig(q_lora, _positive(hf, "kv_lora_rank", where), nope, rot, _positive(hf, "v_head_dim", where),
                     scale, bool(hf.get("rope_interleave", True)) or arch != "deepseek_v3", **index)


def hf_fields(m: MLAConfig, arch: str) -> dict:
    """The ``config.json`` fields of ``m`` (:func:`mla_config` parses them back)."""
    if arch not in ARCHS:
        return {}
    fields = dict(q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                  qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim)
    if arch == "deepseek_v3":
        fields["rope_interleave"] = m.rope_interleave
    if m.index_topk:
        fields.update(index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim, index_topk=m.index_topk)
    return fields


def attention_shapes(m: MLAConfig, heads: int, hidden: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every key of one MLA layer's ``self_attn`` under ``prefix`` (``model.layers.<i>.self_attn.``) and its shape."""
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes = {prefix + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, hidden),
              prefix + "kv_a_layernorm.weight": (m.kv_lora_rank,),
              prefix + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              prefix + "o_proj.weight": (hidden, heads * m.v_head_dim)}
    if m.q_lora_rank:
        shapes.update({prefix + "q_a_proj.weight": (m.q_lora_rank, hidden),
                       prefix + "q_a_layernorm.weight": (m.q_lora_rank,),
                       prefix + "q_b_proj.weight": (heads * qk, m.q_lora_rank)})
    else:
        shapes[prefix + "q_proj.weight"] = (heads * qk, hidden)
    if m.index_topk:
        i = prefix + "indexer."
        shapes.update({i + "wq_b.weight": (m.index_n_heads * m.index_head_dim, m.q_lora_rank),
                       i + "wk.weight": (m.index_head_dim, hidden), i + "k_norm.weight": (m.index_head_dim,),
                       i + "k_norm.bias": (m.index_head_dim,), i + "weights_proj.weight": (m.index_n_heads, hidden)})
    return shapes
