"""Multi-token prediction (MTP) modules: DeepSeek-V3's / V3.2's, GLM-4.5's and XiaomiMiMo's, one pure function.

funcspec's names (``funcspec.checkpoints.layouts`` maps the published ones onto them)::

    enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H]
    self_attn.*, mlp.*, input_layernorm.weight, post_attention_layernorm.weight   (the block)
    norm.weight [H], head.weight [V, H]
    embed_tokens.weight [V, H] (the module's own, or the target's)

DeepSeek-V3 and GLM-4.5 (``model.layers.{L}``; vLLM ``deepseek_mtp.py``, ``glm4_moe_mtp.py``)::

    x_t = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])     embed zeroed at position 0 (as vLLM)
    g_t = block(x_t)                                        fed back as h at the next step
    logits = head(norm(g_t))                                shared_head.{head,norm}

XiaomiMiMo (``model.mtp_layers.{i}``; vLLM ``mimo_mtp.py``; ``hidden_first``, ``norm_output``)::

    x_t = eh_proj([hnorm(h_t); enorm(embed(x_{t+1}))])     input_proj, hidden first; embed zeroed at 0
    g_t = norm(block(x_t))                                  final_layernorm; fed back as h
    logits = head(g_t)                                      the target's LM head

NOTE: the block is one decoder layer of the target's family, run through
``funcspec.nn``'s family dispatch (``decoder_layer``: GQA, or DeepSeek's latent
attention over a latent draft cache); a MoE layer routes through the target's
own router and expert kernel. h_t for the
first step is the target's final hidden state: normed for DeepSeek and GLM
(what their vLLM models return to the MTP drafter), before the final norm for
MiMo (vLLM's ``MiMoModel`` returns the pre-norm state). Further MTP modules are
not read: the first one is applied autoregressively for every draft step, as
vLLM does with one module. Reading and writing the layouts:
:mod:`funcspec.checkpoints.mtp`.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.kernels import first_max
from funcspec.nn import decoder_layer
from funcspec.nn.llama import FULL_READ, KVRead, ModelConfig, TreeMask, rms_norm, rope_tables


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Static config of an MTP module.

    Attributes:
        model: the block's dims (``num_layers`` 1).
        hidden_first: ``eh_proj`` reads ``[hidden; embedding]`` (MiMo) instead of ``[embedding; hidden]``.
        norm_output: the module's output is ``norm(block(x))``, fed back and projected as is (MiMo);
            otherwise the block's output is fed back and ``norm`` applies before the head (DeepSeek).
        hidden_layer: the target hidden index the first step reads (``nn.llama.forward``'s
            ``hidden_layers``: L for the normed state, L + 1 before the final norm).
    """

    model: ModelConfig
    hidden_first: bool = False
    norm_output: bool = False
    hidden_layer: int = 0


def target_features(cfg: MTPConfig, params, feats: torch.Tensor) -> torch.Tensor:
    """MTP reads the target's hidden state as is."""
    return feats


def forward(cfg: MTPConfig, params, kv, tokens, h, slots, starts, window=None, read: KVRead = FULL_READ,
            tree: TreeMask | None = None):
    """Run the module over tokens [B, T] (x_{t+1}) and hidden states h [B, T, H] (h_t) at starts[b] + t.

    Returns ``(g [B, T, H], kv)``. ``window`` is ignored (vLLM-Ascend turns the
    draft window off for MTP). ``tree``: tree attention over the module's own
    drafts (RoPE at its positions). Donates: kv.k, kv.v.
    """
    m, p = cfg.model, params
    pos = starts.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
    emb = p["embed_tokens"]["weight"][tokens].masked_fill((pos == 0).unsqueeze(-1), 0.0)  # [B, T, H]
    e = rms_norm(emb, p["enorm"]["weight"], m.rms_norm_eps)
    hn = rms_norm(h.to(emb.dtype), p["hnorm"]["weight"], m.rms_norm_eps)
    x = m.ops.linear(torch.cat([hn, e] if cfg.hidden_first else [e, hn], -1), p["eh_proj"])  # [B, T, H]
    cos, sin = rope_tables(m, pos if tree is None else tree.positions, x.dtype)
    g = decoder_layer(m, p, kv, 0, x, slots, pos, cos, sin, read=read, tree=tree)
    return (rms_norm(g, p["norm"]["weight"], m.rms_norm_eps) if cfg.norm_output else g), kv


def draft_logits(cfg: MTPConfig, params, g: torch.Tensor) -> torch.Tensor:
    """float32 logits [.., V] of module outputs g [.., H] through its head."""
    x = g if cfg.norm_output else rms_norm(g, params["norm"]["weight"], cfg.model.rms_norm_eps)
    return cfg.model.ops.linear(x, params["head"]).float()


def draft_tokens(cfg: MTPConfig, params, g: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [B] int64 from module outputs g [B, H]."""
    return first_max(draft_logits(cfg, params, g))


def draft_top(cfg: MTPConfig, params, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely drafts [.., k] int64 (best first) and their log-probabilities [.., k] from module
    outputs g [.., H]: tree children and their EAGLE-2 scores."""
    top = torch.topk(torch.log_softmax(draft_logits(cfg, params, g), dim=-1), k, dim=-1)
    return top.indices, top.values
