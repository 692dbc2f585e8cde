"""EAGLE-1 and EAGLE-3 draft heads: pure functions over params under the published key names.

EAGLE-1 (SafeAILab/EAGLE ``eagle/model/cnets1.py``; vLLM ``llama_eagle.py``)::

    fc.weight [H, 2H], fc.bias [H] (config ``bias``, default true)
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ q/k/v biases with config ``qkv_bias``: Qwen2 heads),
    layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.input_layernorm.weight (i >= 1 only)
    embed_tokens.weight (optional: the head's own when it differs from the target's)

    x_t = fc([embed(x_{t+1}); f_t])      f_t: the target's final normed hidden state at t
    g_t = layers(x_t)                    layer 0 has no input_layernorm
    logits = target_lm_head(g_t)         no final norm; g_t is also the next step's feature

EAGLE-3 (SafeAILab/EAGLE ``eagle/model/cnets.py``; vLLM ``llama_eagle3.py``; speculators
``Eagle3DraftModel``), under funcspec's names (SafeAILab's ``midlayer.`` is ``layers.0.``)::

    fc.weight [H, A·H_t]                 over A auxiliary target layers of width H_t (default [2, L//2, L-3])
    input_norm.weight [A·H_t]            optional (speculators norm_before_fc): one norm before fc
    fc_norm.{a}.weight [H_t]             optional (speculators fc_norm): a norm per auxiliary state
    layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
    layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj [H, *]; layers.0.mlp.*
    layers.{i >= 1}.*                    plain decoder layers (speculators heads may have several)
    (Qwen3 draft layers add self_attn.{q,k}_norm.weight [D])
    norm.weight [H], lm_head.weight [V_d, H], d2t [V_d] int64, t2d [V] bool
    embed_tokens.weight [V, H] (optional, else the target's)

    u_t = fc([a_1; ...; a_A]) (target features) or the previous step's g (own features)
    h   = r + attn([input_layernorm(embed(x_{t+1})); hidden_norm(u_t)])
          r = u_t, or hidden_norm(u_t) with norm_before_residual (speculators)
    y   = layers 1.. of (h + mlp(post_attention_layernorm(h)))
    g_t = y, or norm(y) with norm_output (fed back as the next feature)
    draft id d = argmax lm_head(g_t if norm_output else norm(g_t));  target id = d + d2t[d]

NOTE (aux layers): EAGLE-3 layer id i is the *input* of decoder layer i (vLLM's
``aux_hidden_states.append(hidden_states + residual)`` before layer i; the EAGLE
repo's ``all_hidden_states += (hidden_states,)`` before layer i), which is HF
``hidden_states[i]`` and funcspec's ``forward(hidden_layers=(i,))``: the
indices map one to one. Id L is the last layer's output before the final norm
(vLLM's capture after layer L-1), funcspec's hidden index L + 1
(:func:`~funcspec.nn.llama.capture_index`). They are used in ascending order
(both references collect them in one loop over layers).

Reading and writing the layouts (config, aux layers, random heads): :mod:`funcspec.checkpoints.eagle`.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.kernels import first_max
from funcspec.nn.llama import (FULL_READ, KVRead, ModelConfig, TreeMask, decoder_layer, rms_norm,
                               rope_tables)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static config of an EAGLE head.

    Attributes:
        version: 1 (EAGLE-1) or 3 (EAGLE-3).
        model: the draft decoder's dims; ``num_layers`` is its layer count (1 for EAGLE-3).
        aux_layers: EAGLE-3's target hidden-state indices, ascending; () for EAGLE-1.
        draft_vocab_size: V_d, the EAGLE-3 head's vocabulary (= V for EAGLE-1).
        fc_bias: whether ``fc`` has a bias.
        norm_before_residual: EAGLE-3 variant where the residual is ``hidden_norm(u)``.
        norm_before_fc: EAGLE-3: ``input_norm`` over the concatenated auxiliary states before ``fc``.
        fc_norm: EAGLE-3: ``fc_norm.{a}`` over each auxiliary state before ``fc``.
        norm_output: EAGLE-3: the fed-back feature is ``norm(y)``, not the pre-norm ``y``.
    """

    version: int
    model: ModelConfig
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    fc_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False


# ----------------------------------------------------------------------------- network


def target_features(cfg: EagleConfig, params, feats: torch.Tensor) -> torch.Tensor:
    """The head's input feature [.., H] from stored target features [.., F] (EAGLE-3: the norms, then ``fc``)."""
    if cfg.version == 1:
        return feats
    eps = cfg.model.rms_norm_eps
    if cfg.norm_before_fc:
        feats = rms_norm(feats, params["input_norm"]["weight"], eps)
    if cfg.fc_norm:
        chunks = feats.chunk(len(cfg.aux_layers), -1)  # A × [.., H_t]
        feats = torch.cat([rms_norm(c, p["weight"], eps) for c, p in zip(chunks, params["fc_norm"])], -1)
    return cfg.model.ops.linear(feats, params["fc"])


def forward(cfg: EagleConfig, params, kv, tokens, h, slots, starts, window=None, read: KVRead = FULL_READ,
            tree: TreeMask | None = None):
    """Run the head over tokens [B, T] (x_{t+1}) and features h [B, T, H] (f_t) at positions starts[b] + t.

    Returns ``(g [B, T, H], kv)``: g is the feature fed back at the next step.
    ``tree``: tree attention over the head's own drafts (RoPE at its positions).
    Donates: kv.k, kv.v.
    """
    m = cfg.model
    pos = starts.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
    emb = params["embed_tokens"]["weight"][tokens]  # [B, T, H]
    h = h.to(emb.dtype)
    cos, sin = rope_tables(m, pos if tree is None else tree.positions, emb.dtype)
    if cfg.version == 3:
        p = params["layers"][0]
        hn = rms_norm(h, p["hidden_norm"]["weight"], m.rms_norm_eps)
        attn_in = torch.cat([rms_norm(emb, p["input_layernorm"]["weight"], m.rms_norm_eps), hn], -1)  # [B, T, 2H]
        x = hn if cfg.norm_before_residual else h
    else:
        x = attn_in = m.ops.linear(torch.cat([emb, h], -1), params["fc"])  # [B, T, H]
    for i, p in enumerate(params["layers"]):
        # NOTE: layer 0 reads attn_in (EAGLE-1: no input_layernorm; EAGLE-3: [embedding; feature]).
        x = decoder_layer(m, p, kv, i, x, slots, pos, cos, sin, window, read, attn_in if i == 0 else None, tree)
    if cfg.version == 3 and cfg.norm_output:
        x = rms_norm(x, params["norm"]["weight"], m.rms_norm_eps)
    return x, kv


def draft_logits(cfg: EagleConfig, params, g: torch.Tensor) -> torch.Tensor:
    """float32 logits [.., V_d] of head outputs g [.., H] over the head's vocabulary (EAGLE-1: V_d = V)."""
    if cfg.version == 1 or cfg.norm_output:  # EAGLE-1 has no final norm; norm_output fed back norm(y) already
        return cfg.model.ops.linear(g, params["lm_head"]).float()
    x = rms_norm(g, params["norm"]["weight"], cfg.model.rms_norm_eps)
    return cfg.model.ops.linear(x, params["lm_head"]).float()


def draft_tokens(cfg: EagleConfig, params, g: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B] int64 (target vocabulary ids) from head outputs g [B, H]."""
    d = first_max(draft_logits(cfg, params, g))  # [B] draft-vocab ids
    return d if cfg.version == 1 else d + params["d2t"][d]


def draft_top(cfg: EagleConfig, params, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely drafts [.., k] int64 (target ids, best first) and their log-probabilities [.., k]
    from head outputs g [.., H]: tree children and their EAGLE-2 scores."""
    top = torch.topk(torch.log_softmax(draft_logits(cfg, params, g), dim=-1), k, dim=-1)  # draft-vocab ids
    d = top.indices
    return (d if cfg.version == 1 else d + params["d2t"][d]), top.values
