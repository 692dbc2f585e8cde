"""DFlash block drafter (z-lab, arXiv 2602.06036) and DSpark's heads (deepseek-ai/DeepSpec).

One forward drafts a whole block (no causal mask inside it)::

    ctx    = hidden_norm(fc(concat(target hidden states at target_layer_ids)))   # committed tokens
    x      = embed([anchor, MASK, ..., MASK])          # the target's embedding
    layer  : Q from rms(x); K/V = [k_proj(ctx); k_proj(rms(x))] with k_norm and RoPE at true positions
    h      = norm(x);  logits = lm_head(h)             # the target's LM head

Each layer's context K/V is kept per slot in :class:`ContextKV`, so a step only
projects the newly committed rows. DSpark adds a Markov logit bias
``W2(W1[x_{k-1}])`` applied left to right from the anchor, and a confidence head
``sigmoid(w·[h_k; W1[x_{k-1}]])``.

Checkpoint layout (HF names, no ``model.`` prefix; z-lab ``DFlashDraftModel``,
DeepSpec ``Qwen3DSparkModel``)::

    fc.weight [H, n·H]   hidden_norm.weight [H]   norm.weight [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight [D]      (Qwen3 layers, always)
    layers.{i}.mlp.{gate,up,down}_proj.weight   layers.{i}.{input,post_attention}_layernorm.weight
    embed_tokens.weight, lm_head.weight [V, H]       optional copies of the target's (DeepSpec ships them)
  dspark only:
    markov_head.markov_w1.weight [V, r]   markov_head.markov_w2.weight [V, r]
    confidence_head.proj.weight [1, H (+r)]   confidence_head.proj.bias [1]

config.json keys are read from ``dflash_config`` first, then the top level, as
z-lab's loader does: ``mask_token_id``, ``target_layer_ids``, ``block_size``,
``num_target_layers``; DeepSpec adds ``markov_rank``, ``markov_head_type``
("vanilla"), ``enable_confidence_head``, ``confidence_head_with_markov``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from funcspec import rng
from funcspec.checkpoints import check_keys, nest, read_config, read_safetensors
# NOTE: ``window_start`` is the draft-window rule that every head shares; it stays importable from here.
from funcspec.nn.llama import (FULL_READ, KVRead, ModelConfig, apply_rope, attend, linear, lm_head, mlp, project,
                               read_cache, rms_norm, rope_tables, window_start, write_kv)  # noqa: F401
from funcspec.tree import pytree_dataclass

# Newer z-lab options (Gemma-style targets) and their no-op values; any other value is refused.
_UNSUPPORTED = {"input_embedding_scale": (None, 1, 1.0), "output_multiplier": (None, 1, 1.0),
                "final_logit_softcapping": (None, 0, 0.0)}


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static config of a DFlash / DSpark drafter.

    Attributes:
        model: the draft decoder layers (Qwen3-style: q/k norm).
        target_layer_ids: target layers whose outputs form the context (-1: embeddings).
        mask_token_id: the token id that fills the block after the anchor.
        block_size: the block the checkpoint was trained with (informational).
        markov_rank: DSpark Markov head rank r; 0 for none (DFlash).
        confidence: DSpark confidence head input: "none", "hidden" or "hidden_markov".
    """

    model: ModelConfig
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    markov_rank: int = 0
    confidence: str = "none"


@pytree_dataclass
class ContextKV:
    """Per-slot context keys/values of every draft layer.

    Attributes:
        k: [L_d, S+1, H_kv, T_max, D] RoPE'd keys; positions < the slot's length are committed tokens.
        v: [L_d, S+1, H_kv, T_max, D] values.
    """

    k: torch.Tensor
    v: torch.Tensor


def init_context_kv(cfg: DFlashConfig, num_slots: int, max_len: int, dtype, device) -> ContextKV:
    """Zeroed context K/V [L_d, S+1, H_kv, T_max, D] for ``num_slots`` slots plus the scratch slot."""
    m = cfg.model
    shape = (m.num_layers, num_slots + 1, m.num_kv_heads, max_len, m.head_dim)
    return ContextKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: evenly spaced over 1..L-3 (the middle layer for one draft layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


# ----------------------------------------------------------------------------- forward


def _keys_values(m: ModelConfig, p: dict, x: torch.Tensor, cos, sin):
    """k (k_norm, RoPE) and v [B, T, H_kv, D] of x [B, T, H]."""
    b, t, _ = x.shape
    k = linear(x, p["k_proj"]).view(b, t, m.num_kv_heads, m.head_dim)
    v = linear(x, p["v_proj"]).view(b, t, m.num_kv_heads, m.head_dim)
    return apply_rope(rms_norm(k, p["k_norm"]["weight"], m.rms_norm_eps), cos, sin), v


def write_context(cfg: DFlashConfig, params: dict, kv: ContextKV, raw: torch.Tensor, slots, starts) -> ContextKV:
    """Project raw target features [B, T, n·H] into every layer's context K/V at ``starts[b] + t``.

    Donates: kv.
    """
    m = cfg.model
    pos = starts.unsqueeze(1) + torch.arange(raw.shape[1], device=raw.device)  # [B, T]
    ctx = rms_norm(linear(raw, params["fc"]), params["hidden_norm"]["weight"], m.rms_norm_eps)  # [B, T, H]
    cos, sin = rope_tables(m, pos, ctx.dtype)
    for i, p in enumerate(params["layers"]):
        k, v = _keys_values(m, p["self_attn"], ctx, cos, sin)
        write_kv(kv.k, i, slots, pos, k.to(kv.k.dtype))
        write_kv(kv.v, i, slots, pos, v.to(kv.v.dtype))
    return kv


def block_forward(cfg: DFlashConfig, params: dict, kv: ContextKV, tokens, slots, starts, first=None,
                  read: KVRead = FULL_READ):
    """Run the block tokens [B, T] at positions ``starts[b] + t``; returns (h [B, T, H] normed, kv).

    Every block token sees the context at positions ``[first, starts)`` and the
    whole block. The block's own K/V are written at its positions; they are
    scratch that the next committed context overwrites.

    Donates: kv.
    """
    m, (b, t) = cfg.model, tokens.shape
    pos = starts.unsqueeze(1) + torch.arange(t, device=tokens.device)  # [B, T]
    x = params["embed_tokens"]["weight"][tokens]  # [B, T, H]
    cos, sin = rope_tables(m, pos, x.dtype)
    t_read = kv.k.shape[3] if read.length is None else read.length
    j = torch.arange(t_read, device=tokens.device).view(1, -1)  # [1, T_read]
    visible = j < (starts + t).view(-1, 1)  # [B, T_read]: non-causal inside the block
    if first is not None:
        visible = visible & (j >= first.view(-1, 1))
    visible = visible.unsqueeze(1).expand(b, t, t_read)  # [B, T, T_read]
    for i, p in enumerate(params["layers"]):
        a = p["self_attn"]
        h = rms_norm(x, p["input_layernorm"]["weight"], m.rms_norm_eps)
        q = linear(h, a["q_proj"]).view(b, t, m.num_heads, m.head_dim)
        q = apply_rope(rms_norm(q, a["q_norm"]["weight"], m.rms_norm_eps), cos, sin)
        k, v = _keys_values(m, a, h, cos, sin)
        write_kv(kv.k, i, slots, pos, k.to(kv.k.dtype))
        write_kv(kv.v, i, slots, pos, v.to(kv.v.dtype))
        keys, vals = read_cache(kv.k, i, slots, read), read_cache(kv.v, i, slots, read)  # [B, H_kv, T_read, D]
        x = x + linear(attend(q, keys, vals, visible), a["o_proj"])
        x = x + mlp(p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], m.rms_norm_eps))
    return rms_norm(x, params["norm"]["weight"], m.rms_norm_eps), kv


def logits(params: dict, h: torch.Tensor) -> torch.Tensor:
    """float32 logits [..., V] of normed hidden states h [..., H] (the target's LM head)."""
    return project(h, params["lm_head"]["weight"]).float()


def max_prob(x: torch.Tensor) -> torch.Tensor:
    """Head-free confidence [...]: ``max softmax(x)`` clamped to [1e-6, 1] (vLLM-Ascend's DFlash proxy)."""
    return torch.softmax(x.float(), dim=-1).amax(-1).clamp(1e-6, 1.0)


# ----------------------------------------------------------------------------- DSpark heads


def markov_decode(cfg: DFlashConfig, params: dict, base: torch.Tensor, anchor: torch.Tensor, choose: Callable):
    """Apply the Markov bias left to right: ``U_k + W2(W1[x_{k-1}])`` with ``x_{-1}`` = anchor.

    Args:
        base: [B, K, V] backbone logits U.
        anchor: [B] the pending token.
        choose: ``choose(k, logits [B, V]) -> (token [B], extra)`` picks ``x_k``;
            ``extra`` is a tensor, or ``None`` at every k.

    Returns:
        tokens [B, K], corrected logits [B, K, V], the extras stacked on dim 1,
        and ``W1[x_{k-1}]`` [B, K, r] (``None`` without a Markov head).
    """
    prev, toks, outs, extras, embs = anchor, [], [], [], []
    for k in range(base.shape[1]):
        step = base[:, k]
        if cfg.markov_rank:
            emb = params["markov_head"]["markov_w1"]["weight"][prev]  # [B, r]
            step = step + project(emb, params["markov_head"]["markov_w2"]["weight"]).float()
            embs.append(emb)
        prev, extra = choose(k, step)
        toks.append(prev)
        outs.append(step)
        extras.append(extra)
    return (torch.stack(toks, 1), torch.stack(outs, 1), None if extras[0] is None else torch.stack(extras, 1),
            torch.stack(embs, 1) if embs else None)


def confidence(cfg: DFlashConfig, params: dict, h: torch.Tensor, prev_emb: Optional[torch.Tensor]) -> torch.Tensor:
    """DSpark's per-token confidence [B, K] = ``sigmoid(w·[h_k; W1[x_{k-1}]] + b)``."""
    feats = torch.cat([h, prev_emb.to(h.dtype)], dim=-1) if cfg.confidence == "hidden_markov" else h
    return torch.sigmoid(linear(feats, params["confidence_head"]["proj"]).squeeze(-1).float())


# ----------------------------------------------------------------------------- checkpoints


def expected_shapes(cfg: DFlashConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the drafter (without the optional embedding / LM head) and its shape."""
    m, h, d = cfg.model, cfg.model.hidden_size, cfg.model.head_dim
    shapes = {"fc.weight": (h, len(cfg.target_layer_ids) * target_hidden), "hidden_norm.weight": (h,),
              "norm.weight": (h,)}
    for i in range(m.num_layers):
        p = f"layers.{i}."
        for name, out, inp in (("q_proj", m.num_heads * d, h), ("k_proj", m.num_kv_heads * d, h),
                               ("v_proj", m.num_kv_heads * d, h), ("o_proj", h, m.num_heads * d)):
            shapes[p + f"self_attn.{name}.weight"] = (out, inp)
            if m.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in (("gate_proj", (m.intermediate_size, h)), ("up_proj", (m.intermediate_size, h)),
                            ("down_proj", (h, m.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
    if cfg.markov_rank:
        shapes["markov_head.markov_w1.weight"] = (m.vocab_size, cfg.markov_rank)
        shapes["markov_head.markov_w2.weight"] = (m.vocab_size, cfg.markov_rank)
    if cfg.confidence != "none":
        width = h + (cfg.markov_rank if cfg.confidence == "hidden_markov" else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes


def parse_config(hf: dict, target: ModelConfig, method: str = "dflash", target_layer_ids=None,
                 where: str = "config.json") -> DFlashConfig:
    """A :class:`DFlashConfig` from a drafter's config.json, checked against the target."""
    dcfg = hf.get("dflash_config") or {}

    def get(name, default=None):
        return dcfg.get(name, hf.get(name, default))

    archs = hf.get("architectures") or []
    if any("DFlash2" in a for a in archs):
        raise ValueError(f"{where}: architectures {archs}: DFlash2 (conv + candidate selector) is not supported")
    if method == "dflash" and any("DSpark" in a for a in archs):
        raise ValueError(f"{where}: architectures {archs} is a DSpark checkpoint; use method 'dspark'")
    if "sliding_attention" in (hf.get("layer_types") or []) or hf.get("is_causal") or get("causal"):
        raise ValueError(f"{where}: layer_types / is_causal: only non-causal full-attention drafters are supported")
    for key, off in _UNSUPPORTED.items():
        if get(key) not in off:
            raise ValueError(f"{where}: dflash_config.{key}={get(key)!r} is not supported")
    model = dataclasses.replace(ModelConfig.from_hf({**hf, "architectures": ["Qwen3ForCausalLM"]}), qk_norm=True)
    if (model.hidden_size, model.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(f"{where}: hidden_size/vocab_size {model.hidden_size}/{model.vocab_size} must equal the "
                         f"target's {target.hidden_size}/{target.vocab_size} (the drafter shares its embedding)")
    ids = target_layer_ids if target_layer_ids is not None else get("target_layer_ids")
    if ids is None:
        ids = build_target_layer_ids(int(get("num_target_layers", target.num_layers)), model.num_layers)
    ids = tuple(int(i) for i in ids)
    if not ids or any(not -1 <= i < target.num_layers for i in ids):
        raise ValueError(f"{where}: dflash_config.target_layer_ids {list(ids)} must be in [-1, {target.num_layers})")
    mask = get("mask_token_id")
    if mask is None or not 0 <= int(mask) < target.vocab_size:
        raise ValueError(f"{where}: dflash_config.mask_token_id must be a token id in [0, {target.vocab_size}), "
                         f"got {mask!r}")
    rank, conf = 0, "none"
    if method == "dspark":
        rank = int(get("markov_rank", 0))
        if rank and get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"{where}: markov_head_type {get('markov_head_type')!r}: only 'vanilla' is supported")
        if get("enable_confidence_head", False):
            conf = "hidden_markov" if get("confidence_head_with_markov", False) else "hidden"
            if conf == "hidden_markov" and not rank:
                raise ValueError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    return DFlashConfig(model, ids, int(mask), int(get("block_size", 16)), rank, conf)


def load_params(path, target, method: str = "dflash", target_layer_ids=None) -> tuple[DFlashConfig, dict]:
    """Load a DFlash (``method="dflash"``) or DSpark (``"dspark"``) checkpoint for ``target``.

    ``target`` is a loaded :class:`~funcspec.checkpoints.Model`; the params get
    its embedding and LM head unless the checkpoint ships its own. Raises
    ``ValueError`` naming the config key, or the missing / unexpected /
    mis-shaped tensors.
    """
    path, hf = read_config(path)
    cfg = parse_config(hf, target.cfg, method, target_layer_ids, str(path / "config.json"))
    emb = target.params["model"]["embed_tokens"]["weight"]
    tensors = {k: v for k, v in read_safetensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    shapes = expected_shapes(cfg, target.cfg.hidden_size)
    shapes.update({k: tuple(emb.shape) for k in ("embed_tokens.weight", "lm_head.weight") if k in tensors})
    check_keys(tensors, shapes, str(path))
    params = nest({k: v.to(device=emb.device, dtype=emb.dtype) for k, v in tensors.items()})
    params.setdefault("embed_tokens", {"weight": emb})
    params.setdefault("lm_head", {"weight": lm_head(target.cfg, target.params)})
    return cfg, params


def init_params(target_cfg: ModelConfig, seed: int = 0, method: str = "dflash", num_layers: int = 1,
                target_layer_ids=None, block_size: Optional[int] = None, mask_token_id: Optional[int] = None,
                markov_rank: int = 256, confidence_head_with_markov: bool = True, scale: float = 1.0,
                **sizes) -> tuple[dict, dict]:
    """A random drafter for ``target_cfg``: (config.json dict, params under checkpoint names).

    ``method`` "dflash" writes z-lab's layout, "dspark" DeepSpec's (with a
    vanilla Markov head of rank ``markov_rank`` and a confidence head). ``sizes``
    may override intermediate_size, num_attention_heads, num_key_value_heads, head_dim.
    The params hold no embedding or LM head: they come from the target.
    """
    t = target_cfg
    ids = tuple(target_layer_ids) if target_layer_ids is not None else build_target_layer_ids(t.num_layers, num_layers)
    block = block_size or (7 if method == "dspark" else 16)
    mask = t.vocab_size - 1 if mask_token_id is None else mask_token_id
    hf = {"model_type": "qwen3", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
          "intermediate_size": sizes.get("intermediate_size", t.intermediate_size), "num_hidden_layers": num_layers,
          "num_attention_heads": sizes.get("num_attention_heads", t.num_heads),
          "num_key_value_heads": sizes.get("num_key_value_heads", t.num_kv_heads),
          "head_dim": sizes.get("head_dim", t.head_dim), "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
          "max_position_embeddings": t.max_position_embeddings, "attention_bias": False,
          "tie_word_embeddings": False, "num_target_layers": t.num_layers, "block_size": block}
    if t.rope_scaling:
        hf["rope_scaling"] = dict(t.rope_scaling)
    if method == "dflash":
        hf.update(architectures=["DFlashDraftModel"],
                  dflash_config={"mask_token_id": mask, "target_layer_ids": list(ids), "block_size": block})
    else:
        hf.update(architectures=["Qwen3DSparkModel"], mask_token_id=mask, target_layer_ids=list(ids),
                  markov_rank=markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=confidence_head_with_markov)
    cfg = parse_config(hf, t, method)
    key = rng.key(seed)
    flat = {}
    for i, (name, shape) in enumerate(sorted(expected_shapes(cfg, t.hidden_size).items())):
        if name.endswith("norm.weight"):
            flat[name] = torch.ones(shape)
        elif name.endswith("bias"):
            flat[name] = torch.zeros(shape)
        else:
            # NOTE: uniform(-a, a) with a = scale/sqrt(fan_in), drawn from funcspec.rng (no torch RNG in nn/).
            u = rng.uniform(rng.fold_in(key, i), shape)
            flat[name] = (2 * u - 1) * (scale / math.sqrt(shape[-1]))
    return hf, nest(flat)
