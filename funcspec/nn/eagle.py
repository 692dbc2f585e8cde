"""EAGLE-1 and EAGLE-3 draft heads: pure functions over params under the published key names.

EAGLE-1 (SafeAILab/EAGLE ``eagle/model/cnets1.py``; vLLM ``llama_eagle.py``)::

    fc.weight [H, 2H], fc.bias [H] (bias=True in cnets1; optional here)
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight (i >= 1 only)
    embed_tokens.weight (optional, ignored: the target's embedding is shared, as vLLM does)

    x_t = fc([embed(x_{t+1}); f_t])      f_t: the target's final normed hidden state at t
    g_t = layers(x_t)                    layer 0 has no input_layernorm
    logits = target_lm_head(g_t)         no final norm; g_t is also the next step's feature

EAGLE-3 (SafeAILab/EAGLE ``eagle/model/cnets.py``; vLLM ``llama_eagle3.py``)::

    fc.weight [H, A·H_t]                 over A auxiliary target layers (default [2, L//2, L-3])
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj [H, *]; midlayer.mlp.*
    norm.weight [H], lm_head.weight [V_d, H], d2t [V_d] int64, t2d [V] bool
    embed_tokens.weight [V, H] (optional, else the target's)

    u_t = fc([a_1; ...; a_A]) (target features) or the previous step's g (own features)
    h   = u_t + attn([input_layernorm(embed(x_{t+1})); hidden_norm(u_t)])
    g_t = h + mlp(post_attention_layernorm(h))            fed back as the next feature
    draft id d = argmax lm_head(norm(g_t));  target id = d + d2t[d]

NOTE (aux layers): EAGLE-3 layer id i is the *input* of decoder layer i (vLLM's
``aux_hidden_states.append(hidden_states + residual)`` before layer i; the EAGLE
repo's ``all_hidden_states += (hidden_states,)`` before layer i), which is HF
``hidden_states[i]`` and funcspec's ``forward(hidden_layers=(i,))``: the
indices map one to one. They are used in ascending order (both references
collect them in one loop over layers). Id L is refused: funcspec's index L is
the final *normed* state, while references that allow L mean the pre-norm one.

Reading and writing the layouts (config, aux layers, random heads): :mod:`funcspec.checkpoints.eagle`.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.nn.llama import (FULL_READ, KVRead, ModelConfig, TreeMask, decoder_layer, linear, project, rms_norm,
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
    """

    version: int
    model: ModelConfig
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    fc_bias: bool = False
    norm_before_residual: bool = False


# ----------------------------------------------------------------------------- network


def target_features(cfg: EagleConfig, params, feats: torch.Tensor) -> torch.Tensor:
    """The head's input feature [.., H] from stored target features [.., F] (EAGLE-3: ``fc``)."""
    return linear(feats, params["fc"]) if cfg.version == 3 else feats


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
        p = params["midlayer"]
        hn = rms_norm(h, p["hidden_norm"]["weight"], m.rms_norm_eps)
        attn_in = torch.cat([rms_norm(emb, p["input_layernorm"]["weight"], m.rms_norm_eps), hn], -1)  # [B, T, 2H]
        residual = hn if cfg.norm_before_residual else h
        return decoder_layer(m, p, kv, 0, residual, slots, pos, cos, sin, window, read, attn_in, tree), kv
    x = linear(torch.cat([emb, h], -1), params["fc"])  # [B, T, H]
    for i, p in enumerate(params["layers"]):
        attn_in = x if i == 0 else rms_norm(x, p["input_layernorm"]["weight"], m.rms_norm_eps)
        x = decoder_layer(m, p, kv, i, x, slots, pos, cos, sin, window, read, attn_in, tree)
    return x, kv


def draft_logits(cfg: EagleConfig, params, g: torch.Tensor) -> torch.Tensor:
    """float32 logits [.., V_d] of head outputs g [.., H] over the head's vocabulary (EAGLE-1: V_d = V)."""
    if cfg.version == 1:
        return project(g, params["lm_head"]["weight"]).float()
    x = rms_norm(g, params["norm"]["weight"], cfg.model.rms_norm_eps)
    return project(x, params["lm_head"]["weight"]).float()


def draft_tokens(cfg: EagleConfig, params, g: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B] int64 (target vocabulary ids) from head outputs g [B, H]."""
    d = torch.argmax(draft_logits(cfg, params, g), dim=-1)  # [B] draft-vocab ids
    return d if cfg.version == 1 else d + params["d2t"][d]


def draft_top(cfg: EagleConfig, params, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely drafts [.., k] int64 (target ids, best first) and their log-probabilities [.., k]
    from head outputs g [.., H]: tree children and their EAGLE-2 scores."""
    top = torch.topk(torch.log_softmax(draft_logits(cfg, params, g), dim=-1), k, dim=-1)  # draft-vocab ids
    d = top.indices
    return (d if cfg.version == 1 else d + params["d2t"][d]), top.values
