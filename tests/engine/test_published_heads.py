"""Draft heads as people download them: every published layout loads through ``funcspec.LLM``, decodes
greedy-losslessly on eager (every layout) and inductor (one layout per compiled head), and drafts what its authors' own forward drafts.

Each case writes a tiny random head in exactly the published file names, config.json fields and key names
(``tests/engine/published.py``, from reading the authors' code and vLLM's loaders):

- EAGLE-1 (SafeAILab/EAGLE ``eagle/model/cnets1.py``, loaded by ``ea_model.py``: ``pytorch_model.bin``;
  ``qkv_bias`` for the Qwen2 heads, ``bias`` for ``fc``);
- EAGLE-3 (SafeAILab ``cnets.py``: ``midlayer.*``, ``d2t``/``t2d``, ``target_hidden_size`` heads narrower
  than their target with their own ``embed_tokens``);
- EAGLE-3 and DFlash in the speculators format (vllm-project/speculators ``Eagle3DraftModel`` / DFlash, read as
  vLLM's ``transformers_utils/configs/speculators/algos.py`` reads them: ``transformer_layer_config`` flattened,
  ``norm_before_residual`` true when absent, ``fc_norm`` / ``norm_before_fc`` / ``norm_output``, Qwen3 q/k norms,
  ``aux_hidden_state_layer_ids`` as capture ids);
- Medusa (FasterDecoding ``medusa_model.py`` / ``train_legacy.py``: ``medusa_lm_head.pt`` and ``.safetensors``
  with unprefixed keys, configs that undercount heads, "version 2" heads without their own projection; Medusa-2
  whole models; vLLM ``medusa.py``: ``blocks.{k}.layers.{j}``, ``lm_heads.{k}``, ``medusa_fc_bias``,
  ``truncated_vocab_size`` with ``token_map``);
- MTP in XiaomiMiMo's layout (vLLM ``mimo_mtp.py``: ``model.mtp_layers.0.{token,hidden,final}_layernorm``,
  ``input_proj`` over [hidden; embedding], the pre-norm target state).
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Callable

import pytest
import torch

import published as pub
from conftest import make_hf_model
from funcspec import LLM, Engine, SamplingParams
from funcspec.checkpoints import layouts

PROMPTS = [[5, 17, 33], list(range(10, 30)), [44, 9, 71, 8, 3, 90, 12, 6, 51, 7, 23], [7, 7, 7, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
K = 3


@dataclasses.dataclass
class Case:
    """A published head: where it is, its method, its layout, its authors' drafts ``reference(seq, k)``."""

    target: str
    head: str
    method: str
    layout: str
    reference: Callable
    spec: dict = dataclasses.field(default_factory=dict)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- the cases


def eagle1_bin(root, t):
    """SafeAILab EAGLE-1 as ``pytorch_model.bin``: 2 layers, ``fc.bias`` (config without ``bias``: true), and the
    head's own copy of the target's embedding (shared, as vLLM does when identical)."""
    cfg, g = t["llama"].cfg, _gen(1)
    h = cfg.hidden_size
    p = {"fc.weight": pub.rand(g, h, 2 * h, scale=3.0), "fc.bias": pub.rand(g, h),
         "embed_tokens.weight": t["llama"].params["model"]["embed_tokens"]["weight"].clone()}
    for i in range(2):
        p.update(pub.block_tensors(g, f"layers.{i}.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                                   input_norm=i > 0))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **pub.llama_fields(cfg, num_hidden_layers=2),
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "rope_scaling": None, "torch_dtype": "float32"}
    path = pub.save(root / "eagle1_bin", config, p, "pytorch_model.bin")
    c = pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta)
    step = pub.eagle1_step(c, p, t["llama_hf"].lm_head.weight.detach())
    return Case(t["llama_dir"], str(path), "eagle", "eagle-safeailab",
                lambda seq, k: pub.chain_drafts(step, pub.target_states(t["llama_hf"], seq[:-1])[0][-1], seq[1:], k))


def eagle1_qwen2(root, t):
    """SafeAILab's EAGLE-Qwen2 heads: ``qkv_bias: true`` (q/k/v biases, none on o_proj), ``Qwen2ForCausalLM``,
    ``model.safetensors``, no embedding shipped (the target's)."""
    cfg, g = t["qwen2"].cfg, _gen(2)
    h = cfg.hidden_size
    p = {"fc.weight": pub.rand(g, h, 2 * h, scale=3.0), "fc.bias": pub.rand(g, h),
         **pub.block_tensors(g, "layers.0.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                             qkv_bias=True, input_norm=False)}
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qkv_bias": True,
              **pub.llama_fields(cfg, rope_theta=cfg.rope_theta)}
    path = pub.save(root / "eagle1_qwen2", config, p)
    ref = {**p, "embed_tokens.weight": t["qwen2"].params["model"]["embed_tokens"]["weight"]}
    step = pub.eagle1_step(pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta), ref,
                           t["qwen2_hf"].lm_head.weight.detach())
    return Case(t["qwen2_dir"], str(path), "eagle", "eagle-safeailab",
                lambda seq, k: pub.chain_drafts(step, pub.target_states(t["qwen2_hf"], seq[:-1])[0][-1], seq[1:], k))


def _draft_vocab(g, v, vd):
    ids = torch.sort(torch.randperm(v, generator=g)[:vd]).values  # EAGLE-3's recipe: ascending target ids
    return ids - torch.arange(vd), torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)


def _eagle3_case(name, t, path, p, layout, aux, c, **flags):
    n_target = len(aux) * t["llama"].cfg.hidden_size
    ref = {**p}
    ref.setdefault("embed_tokens.weight", t["llama"].params["model"]["embed_tokens"]["weight"])
    step = pub.eagle3_step(c, ref, n_target, num_aux=len(aux), **flags)
    num_layers = t["llama"].cfg.num_layers

    def reference(seq, k):
        states, prenorm, _ = pub.target_states(t["llama_hf"], seq[:-1])
        feats = torch.cat([pub.capture(states, prenorm, i, num_layers) for i in aux], -1)
        return pub.chain_drafts(step, feats, seq[1:], k)

    return Case(t["llama_dir"], str(path), "eagle3", layout, reference)


def eagle3_bin(root, t):
    """SafeAILab EAGLE-3 as ``pytorch_model.bin``: ``midlayer.*``, a 48-token draft vocabulary (``d2t`` offsets,
    ``t2d``), the default auxiliary layers (2, L//2, L-3) of the 8-layer target, no embedding shipped."""
    cfg, g = t["llama"].cfg, _gen(3)
    h, v, vd = cfg.hidden_size, cfg.vocab_size, 48
    d2t, t2d = _draft_vocab(g, v, vd)
    p = {"fc.weight": pub.rand(g, h, 3 * h), "norm.weight": pub.norm_weight(g, h),
         "lm_head.weight": pub.rand(g, vd, h, scale=3.0), "d2t": d2t, "t2d": t2d,
         "midlayer.hidden_norm.weight": pub.norm_weight(g, h),
         **pub.block_tensors(g, "midlayer.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                             in_features=2 * h)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "draft_vocab_size": vd,
              **pub.llama_fields(cfg)}
    path = pub.save(root / "eagle3_bin", config, p, "pytorch_model.bin")
    c = pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta)
    return _eagle3_case("eagle3_bin", t, path, p, "eagle3-safeailab", (2, 4, 5), c, prefix="midlayer.")


def eagle3_narrow(root, t):
    """A SafeAILab EAGLE-3 head narrower than its target (``target_hidden_size``, as EAGLE3-LLaMA3.3-70B):
    ``fc`` [H_d, 3·H_t] and its own ``embed_tokens`` [V, H_d]; ``model.safetensors``."""
    cfg, g = t["llama"].cfg, _gen(4)
    h, ht, v, vd = 16, cfg.hidden_size, cfg.vocab_size, 64
    d2t, t2d = _draft_vocab(g, v, vd)
    p = {"fc.weight": pub.rand(g, h, 3 * ht), "norm.weight": pub.norm_weight(g, h),
         "lm_head.weight": pub.rand(g, vd, h, scale=3.0), "d2t": d2t, "t2d": t2d,
         "embed_tokens.weight": pub.rand(g, v, h, scale=3.0), "midlayer.hidden_norm.weight": pub.norm_weight(g, h),
         **pub.block_tensors(g, "midlayer.", h, 2, 1, 48, in_features=2 * h)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "draft_vocab_size": vd,
              "target_hidden_size": ht, **pub.llama_fields(cfg, hidden_size=h, intermediate_size=48,
                                                            num_attention_heads=2, num_key_value_heads=1)}
    path = pub.save(root / "eagle3_narrow", config, p)
    return _eagle3_case("eagle3_narrow", t, path, p, "eagle3-safeailab", (2, 4, 5), pub.dims(h, 2, cfg.rms_norm_eps, cfg.rope_theta),
                        prefix="midlayer.")


def _speculators(kind, layer_config, proposal_tokens=3, **top):
    """A speculators config.json: ``speculators_config``, the nested ``transformer_layer_config``, the
    algorithm's fields at the top level (no top-level ``model_type``), as speculators' ``save_pretrained`` writes."""
    return {"architectures": ["Eagle3DraftModel" if kind == "eagle3" else "DFlashDraftModel"],
            "auto_map": {"": f"config.{'Eagle3' if kind == 'eagle3' else 'DFlash'}SpeculatorConfig"},
            "speculators_model_type": kind, "speculators_version": "0.9.0", "dtype": "float32",
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": proposal_tokens,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"architectures": ["LlamaForCausalLM"],
                                                "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}},
            "tie_word_embeddings": False, "target_hidden_size": None, "transformer_layer_config": layer_config, **top}


def eagle3_speculators_llama(root, t):
    """speculators EAGLE-3 (Llama layers): 2 draft layers, ``fc_norm``, no ``norm_before_residual`` key (vLLM:
    true), auxiliary ids [1, 4, 8] with 8 = L (the last layer's output before the final norm), a 48-token draft
    vocabulary, the shipped embedding (a copy of the target's)."""
    cfg, g = t["llama"].cfg, _gen(5)
    h, v, vd, aux = cfg.hidden_size, cfg.vocab_size, 48, (1, 4, 8)
    d2t, t2d = _draft_vocab(g, v, vd)
    p = {"fc.weight": pub.rand(g, h, 3 * h), "norm.weight": pub.norm_weight(g, h),
         "lm_head.weight": pub.rand(g, vd, h, scale=3.0), "d2t": d2t, "t2d": t2d,
         "embed_tokens.weight": t["llama"].params["model"]["embed_tokens"]["weight"].clone(),
         "layers.0.hidden_norm.weight": pub.norm_weight(g, h),
         **{f"fc_norm.{i}.weight": pub.norm_weight(g, h) for i in range(3)},
         **pub.block_tensors(g, "layers.0.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                             in_features=2 * h),
         **pub.block_tensors(g, "layers.1.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)}
    layer = {"model_type": "llama", "attention_bias": False, "mlp_bias": False, "head_dim": h // cfg.num_heads,
             **pub.llama_fields(cfg, num_hidden_layers=2), "rope_theta": None,
             "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}}
    config = _speculators("eagle3", layer, draft_vocab_size=vd, eagle_aux_hidden_state_layer_ids=list(aux),
                          fc_norm=True, norm_before_fc=False, norm_output=False, embed_requires_grad=False)
    path = pub.save(root / "eagle3_speculators", config, p)
    return _eagle3_case("eagle3_speculators", t, path, p, "eagle3-speculators", aux,
                        pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta), norm_before_residual=True)


def eagle3_speculators_qwen3(root, t):
    """speculators EAGLE-3 with Qwen3 layers (``q_norm``/``k_norm``), ``norm_before_fc`` (``input_norm``),
    ``norm_output``, ``norm_before_residual: false``, the full vocabulary (no ``d2t``/``t2d``), default aux layers."""
    cfg, g = t["llama"].cfg, _gen(6)
    h, v = cfg.hidden_size, cfg.vocab_size
    p = {"fc.weight": pub.rand(g, h, 3 * h), "norm.weight": pub.norm_weight(g, h),
         "lm_head.weight": pub.rand(g, v, h, scale=3.0), "input_norm.weight": pub.norm_weight(g, 3 * h),
         "embed_tokens.weight": t["llama"].params["model"]["embed_tokens"]["weight"].clone(),
         "layers.0.hidden_norm.weight": pub.norm_weight(g, h),
         **pub.block_tensors(g, "layers.0.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                             in_features=2 * h, qk_norm=True)}
    layer = {"model_type": "qwen3", "attention_bias": False, "head_dim": h // cfg.num_heads,
             "layer_types": ["full_attention"], **pub.llama_fields(cfg)}
    config = _speculators("eagle3", layer, draft_vocab_size=v, norm_before_residual=False, norm_before_fc=True,
                          fc_norm=False, norm_output=True)
    path = pub.save(root / "eagle3_speculators_qwen3", config, p)
    return _eagle3_case("eagle3_speculators_qwen3", t, path, p, "eagle3-speculators", (2, 4, 5),
                        pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta), norm_output=True)


def dflash_speculators(root, t):
    """speculators DFlash: Qwen3 layers in ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` [1, 4, 8]
    (vLLM capture ids; 8 = L, pre-norm), ``mask_token_id``, ``block_size``, a 64-token draft vocabulary (``d2t``,
    ``t2d``, ``lm_head`` [64, H]) and the shipped embedding."""
    cfg, g = t["llama"].cfg, _gen(7)
    h, v, vd, aux, mask = cfg.hidden_size, cfg.vocab_size, 64, (1, 4, 8), 95
    d2t, t2d = _draft_vocab(g, v, vd)
    p = {"fc.weight": pub.rand(g, h, 3 * h), "hidden_norm.weight": pub.norm_weight(g, h),
         "norm.weight": pub.norm_weight(g, h), "lm_head.weight": pub.rand(g, vd, h, scale=4.0), "d2t": d2t,
         "t2d": t2d, "embed_tokens.weight": t["llama"].params["model"]["embed_tokens"]["weight"].clone()}
    for i in range(2):
        p.update(pub.block_tensors(g, f"layers.{i}.", h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                                   qk_norm=True))
    layer = {"model_type": "qwen3", "attention_bias": False, "head_dim": h // cfg.num_heads,
             "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False,
             **pub.llama_fields(cfg, num_hidden_layers=2)}
    config = _speculators("dflash", layer, proposal_tokens=7, aux_hidden_state_layer_ids=list(aux), block_size=8,
                          draft_vocab_size=vd, mask_token_id=mask, sample_from_anchor=False,
                          sliding_window_non_causal=False)
    path = pub.save(root / "dflash_speculators", config, p)
    c, num_layers = pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta), cfg.num_layers

    def reference(seq, k):
        states, prenorm, _ = pub.target_states(t["llama_hf"], seq[:-1])
        feats = torch.cat([pub.capture(states, prenorm, i, num_layers) for i in aux], -1)
        return pub.dflash_drafts(c, p, feats, seq[-1], mask, k, cfg.rope_theta)

    return Case(t["llama_dir"], str(path), "dflash", "dflash-speculators", reference)


def _medusa_tensors(g, h, v, heads, prefix="", own_head=True, bias=True, rows=None):
    p = {}
    for k in range(heads):
        p[f"{prefix}{k}.0.linear.weight"] = pub.rand(g, h, h, scale=2.0)
        if bias:
            p[f"{prefix}{k}.0.linear.bias"] = pub.rand(g, h)
        if own_head:
            p[f"{prefix}{k}.1.weight"] = pub.rand(g, rows or v, h, scale=4.0)
    return p


def _medusa_case(t, path, layout, p, heads, names, proj, token_map=None, target="llama", spec=None, head_dir=None):
    hf = t[target + "_hf"]

    def reference(seq, k):
        states, _, _ = pub.target_states(hf, seq[:-1])
        return pub.medusa_drafts(p, states[-1][-1], k, 1, names, proj, token_map)

    return Case(t[target + "_dir"] if head_dir is None else head_dir, str(path), "medusa", layout, reference,
                spec or {})


def medusa_pt(root, t):
    """FasterDecoding Medusa-1 as published: ``medusa_lm_head.pt`` (unprefixed ``{k}.{j}.linear.*``, ``{k}.1.weight``),
    a config that says 2 heads beside a file of 5 (the authors' loader hard-codes 5), no hidden or vocab size."""
    cfg = t["llama"].cfg
    p = _medusa_tensors(_gen(8), cfg.hidden_size, cfg.vocab_size, 5)
    config = {"base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": 2, "medusa_num_layers": 1,
              "transformers_version": "4.31.0"}
    path = pub.save(root / "medusa_pt", config, p, "medusa_lm_head.pt")
    return _medusa_case(t, path, "medusa-fasterdecoding", p, 5, lambda k, j: (f"{k}.{j}.linear.weight",
                        f"{k}.{j}.linear.bias"), lambda k: f"{k}.1.weight")


def medusa_v2_safetensors(root, t):
    """FasterDecoding's ``medusa_lm_head.safetensors`` in its "version 2" form (``train_legacy.py`` since
    2b8020f): ResBlocks only, every head projecting through the base model's LM head."""
    cfg = t["llama"].cfg
    p = _medusa_tensors(_gen(9), cfg.hidden_size, cfg.vocab_size, 3, own_head=False)
    config = {"base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": 3, "medusa_num_layers": 1,
              "version": "2"}
    path = pub.save(root / "medusa_v2", config, p, "medusa_lm_head.safetensors")
    ref = {**p, "lm_head": t["llama_hf"].lm_head.weight.detach()}
    return _medusa_case(t, path, "medusa-fasterdecoding", ref, 3, lambda k, j: (f"{k}.{j}.linear.weight",
                        f"{k}.{j}.linear.bias"), lambda k: "lm_head")


def medusa2_whole(root, t):
    """A Medusa-2 whole model (the axolotl fork's ``add_medusa_heads``): the target's LlamaConfig plus
    ``medusa_num_heads`` / ``medusa_num_layers``, its weights plus ``medusa_head.*``, in sharded
    ``pytorch_model-0000i-of-00002.bin`` files; the same directory is the target and the head."""
    cfg, src = t["llama"].cfg, Path(t["llama_dir"])
    path = root / "medusa2"
    path.mkdir()
    config = {**json.loads((src / "config.json").read_text()), "medusa_num_heads": 4, "medusa_num_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    p = _medusa_tensors(_gen(10), cfg.hidden_size, cfg.vocab_size, 4, prefix="medusa_head.")
    target = {k: v for k, v in t["llama_hf"].state_dict().items()}
    pub.save_sharded_bin(path, {**target, **p})
    return _medusa_case(t, path, "medusa-2", p, 4, lambda k, j: (f"medusa_head.{k}.{j}.linear.weight",
                        f"medusa_head.{k}.{j}.linear.bias"), lambda k: f"medusa_head.{k}.1.weight",
                        head_dir=str(path))


def medusa_vllm(root, t):
    """vLLM's Medusa layout (``abhigoyal/vllm-medusa-*``): ``model_type: medusa``, ``num_heads``,
    ``blocks.{k}.layers.{j}.weight`` without biases (``medusa_fc_bias`` absent: false), ``lm_heads.{k}.weight``."""
    cfg, g = t["llama"].cfg, _gen(11)
    h, v = cfg.hidden_size, cfg.vocab_size
    p = {}
    for k in range(4):
        p[f"blocks.{k}.layers.0.weight"] = pub.rand(g, h, h, scale=2.0)
        p[f"lm_heads.{k}.weight"] = pub.rand(g, v, h, scale=4.0)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": h, "num_heads": 4,
              "num_hidden_layers": 1, "truncated_vocab_size": None, "vocab_size": v}
    path = pub.save(root / "medusa_vllm", config, p)
    return _medusa_case(t, path, "medusa-vllm", p, 4, lambda k, j: (f"blocks.{k}.layers.{j}.weight", "-"),
                        lambda k: f"lm_heads.{k}.weight")


def medusa_vllm_truncated(root, t):
    """vLLM's Medusa with ``medusa_fc_bias: true`` and ``truncated_vocab_size`` 64 < V: a ``token_map`` of target
    ids, full-vocabulary ``lm_heads`` whose mapped rows vLLM keeps, drafts mapped back to target ids."""
    cfg, g = t["llama"].cfg, _gen(12)
    h, v, vt = cfg.hidden_size, cfg.vocab_size, 64
    token_map = torch.sort(torch.randperm(v, generator=g)[:vt]).values
    p = {"token_map": token_map}
    for k in range(3):
        p[f"blocks.{k}.layers.0.weight"] = pub.rand(g, h, h, scale=2.0)
        p[f"blocks.{k}.layers.0.bias"] = pub.rand(g, h)
        p[f"lm_heads.{k}.weight"] = pub.rand(g, v, h, scale=4.0)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": h, "num_heads": 3,
              "num_hidden_layers": 1, "truncated_vocab_size": vt, "vocab_size": v, "medusa_fc_bias": True}
    path = pub.save(root / "medusa_vllm_truncated", config, p)
    ref = {**p, **{f"lm_heads.{k}.weight": p[f"lm_heads.{k}.weight"][token_map] for k in range(3)}}
    return _medusa_case(t, path, "medusa-vllm", ref, 3, lambda k, j: (f"blocks.{k}.layers.{j}.weight",
                        f"blocks.{k}.layers.{j}.bias"), lambda k: f"lm_heads.{k}.weight", token_map)


def mtp_mimo(root, t):
    """XiaomiMiMo: a Qwen2 decoder saved as ``MiMoForCausalLM`` (``model_type: mimo``,
    ``num_nextn_predict_layers: 1``) with ``model.mtp_layers.0.*`` in its own ``model.safetensors``."""
    cfg, g = t["mimo"].cfg, _gen(13)
    h, pre = cfg.hidden_size, "model.mtp_layers.0."
    p = {pre + "token_layernorm.weight": pub.norm_weight(g, h), pre + "hidden_layernorm.weight": pub.norm_weight(g, h),
         pre + "input_proj.weight": pub.rand(g, h, 2 * h, scale=3.0), pre + "final_layernorm.weight": pub.norm_weight(g, h),
         **pub.block_tensors(g, pre, h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, qkv_bias=True)}
    path = Path(t["mimo_dir"])
    tensors = {**t["mimo_hf"].state_dict(), **p}
    pub.save(path, {**json.loads((path / "config.json").read_text()), "architectures": ["MiMoForCausalLM"],
                    "model_type": "mimo", "num_nextn_predict_layers": 1}, tensors)
    ref = {**p, "model.embed_tokens.weight": t["mimo_hf"].model.embed_tokens.weight.detach()}
    step = pub.mimo_mtp_step(pub.dims(h, cfg.num_heads, cfg.rms_norm_eps, cfg.rope_theta), ref,
                             t["mimo_hf"].lm_head.weight.detach())

    def reference(seq, k):
        _, prenorm, _ = pub.target_states(t["mimo_hf"], seq[:-1])
        return pub.chain_drafts(step, prenorm, seq[1:], k)

    return Case(str(path), str(path), "mtp", "mtp-mimo", reference)


CASES = {f.__name__: f for f in (eagle1_bin, eagle1_qwen2, eagle3_bin, eagle3_narrow, eagle3_speculators_llama,
                                 eagle3_speculators_qwen3, dflash_speculators, medusa_pt, medusa_v2_safetensors,
                                 medusa2_whole, medusa_vllm, medusa_vllm_truncated, mtp_mimo)}
@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from funcspec import load_model

    root = tmp_path_factory.mktemp("published")
    t = {}
    for name, arch, layers in (("llama", "llama", 8), ("qwen2", "qwen2", 2), ("mimo", "qwen2", 2)):
        t[name + "_hf"] = make_hf_model(root / name, arch=arch, num_hidden_layers=layers)
        t[name + "_dir"] = str(root / name)
        t[name] = load_model(root / name)
    return {name: build(root, t) for name, build in CASES.items()}


def _greedy_ar(target):
    return [o.outputs[0].token_ids for o in Engine(target, max_num_seqs=4,
                                                   enforce_eager=True).generate(PROMPTS, GREEDY)]


def _spec(case, **extra):
    return {"method": case.method, "model": case.head, "num_speculative_tokens": K, **case.spec, **extra}


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", sorted(CASES))
def test_published_layout_loads_through_llm_and_decodes_losslessly(cases, name):
    case = cases[name]
    assert layouts.detect(case.head)[0].name == case.layout
    llm = LLM(model=case.target, speculative_config=_spec(case), enforce_eager=True, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == _greedy_ar(case.target)
    assert llm.engine.stats()["steps"] > 0 and len(llm.engine.stats()["per_position_acceptance"]) == K


@pytest.mark.parametrize("name", sorted(CASES))
def test_drafts_equal_the_authors_forward(cases, name):
    """Every step's drafts, over two slots and every acceptance count (the synthetic verifier commits 1..K+1
    tokens a step), equal the authors' module recomputed from scratch on the same context."""
    case = cases[name]
    synthetic = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8, 0.6, 0.4]}
    eng = Engine(case.target, speculative_config=_spec(case, **synthetic), max_num_seqs=2, enforce_eager=True)
    rec = pub.record_drafts(eng, rows=2)
    eng.generate(PROMPTS[1:3], GREEDY)
    for context, drafts in rec:
        assert drafts == case.reference(context, K), context
    assert len(rec) >= 8


INDUCTOR_CASES = {"eagle1_bin": "inductor", "medusa2_whole": "inductor", "mtp_mimo": "inductor",
                  "dflash_speculators": "traced", "eagle3_speculators_llama": "traced", "eagle3_narrow": "traced",
                  "medusa_vllm_truncated": "traced"}
"""One layout per distinct compiled head (each family, and the config flags that change its graph), by codegen.
Each head's graph compiles by real inductor once in the suite: here EAGLE-1, Medusa-2 and MiMo's MTP, and the
zoo's EAGLE-3 and DFlash heads in tests/engine/test_logprobs.py's inductor matrix. The other cases run Dynamo's
graph in place of inductor's codegen (``traced_codegen``: one fullgraph, its guards, no recompile), because a
cold compile costs tens of seconds a case on CI's 2 cores. The other layouts reach the same nn code with other
key names, and their drafts are checked against the authors' modules above on eager."""


@pytest.mark.parametrize("name", list(INDUCTOR_CASES))
def test_published_layout_on_inductor_without_recompiles(cases, name, request):
    """One (4, K) bucket compiled by inductor (or traced: :data:`INDUCTOR_CASES`): greedy output equal to AR, one
    fullgraph, 0 recompiles after warm-up."""
    if INDUCTOR_CASES[name] == "traced":
        request.getfixturevalue("traced_codegen")
    case = cases[name]
    llm = LLM(model=case.target, speculative_config=_spec(case), backend="inductor", max_num_seqs=4,
              compilation_config={"cudagraph_capture_sizes": [4 * (K + 1)], "capture": "lazy"})
    eng = llm.engine
    ar = _greedy_ar(case.target)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
    with torch.compiler.set_stance("fail_on_recompile"):
        assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
    (key, graph), = eng.graphs.items()
    assert key[:2] == (4, K) and graph.stats.compiles + graph.stats.loaded == 1 and graph.stats.graph_breaks == 0
    assert eng.stats()["recompiles"] == 0


# ----------------------------------------------------------------------------- what the user types, what inspect says


def test_method_and_k_come_from_the_checkpoint_when_omitted(cases):
    """vLLM's detection without ``method``: speculators' algorithm and its proposal's speculative_tokens, a
    Medusa config, an MTP target, an EAGLE head's layout (whatever its directory is called)."""
    from funcspec.config import SpecConfig

    for name, method in (("eagle3_speculators_llama", "eagle3"), ("dflash_speculators", "dflash"),
                         ("medusa_vllm", "medusa"), ("medusa_pt", "medusa"), ("mtp_mimo", "mtp"),
                         ("eagle1_bin", "eagle"), ("eagle3_bin", "eagle3")):
        spec = SpecConfig.from_vllm({"model": cases[name].head, "num_speculative_tokens": 2})
        assert spec.method == method, name
    assert SpecConfig.from_vllm({"model": cases["eagle3_speculators_llama"].head}).num_speculative_tokens == 3
    assert SpecConfig.from_vllm({"model": cases["dflash_speculators"].head}).num_speculative_tokens == 7
    llm = LLM(model=cases["mtp_mimo"].target, speculative_config={"method": "mimo_mtp", "num_speculative_tokens": 2},
              enforce_eager=True, max_num_seqs=4)  # vLLM's deprecated alias; the module comes from the target
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == _greedy_ar(cases["mtp_mimo"].target)


def test_inspect_reports_the_layout_and_whether_it_fits(cases, capsys):
    from funcspec.checkpoints.report import inspect
    from funcspec.cli import main

    case = cases["eagle3_speculators_llama"]
    alone = inspect(case.head)
    assert alone.fits and alone.layout.name == "eagle3-speculators" and alone.speculative_tokens == 3
    assert alone.fields["draft_vocab_size"] == 48 and alone.fields["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert "norm_before_residual" not in alone.fields  # absent: vLLM reads it as true (parsed, below)
    assert alone.shapes["fc.weight"] == ("fc.weight", (32, 96), torch.float32)
    fit = inspect(case.head, case.target)
    assert fit.fits and fit.parsed.aux_layers == (1, 4, 8) and fit.parsed.norm_before_residual
    assert fit.parsed.model.num_layers == 2 and fit.parsed.draft_vocab_size == 48
    other = inspect(case.head, cases["eagle1_qwen2"].target)  # a 2-layer target: aux id 8 is out of range
    assert not other.fits and "eagle_aux_hidden_state_layer_ids" in other.problem
    mimo = inspect(cases["mtp_mimo"].head)
    assert mimo.layout.name == "mtp-mimo" and mimo.skipped > 0  # the target's own tensors, beside the module
    assert mimo.shapes["eh_proj.weight"][0] == "model.mtp_layers.0.input_proj.weight"
    target = inspect(cases["eagle1_bin"].target)  # a target, not a head: its decoder and float weights
    assert target.problem is None and target.layout is None
    assert target.model["quantization"] == "none (float weights)" and target.model["cfg"].num_layers == 8

    main(["inspect", cases["medusa_pt"].head, "--target", cases["medusa_pt"].target])
    out = capsys.readouterr().out
    assert "layout:  medusa-fasterdecoding" in out and "fits:    yes" in out and "num_heads: 5" in out
    assert "medusa_head.4.1.weight <- 4.1.weight: [96, 32] float32" in out
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", case.head, "--target", cases["eagle1_qwen2"].target])
    assert exit_.value.code == 1 and "fits:    no: " in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad files get clear errors


def _copy(case_dir, dst):
    import shutil

    return Path(shutil.copytree(case_dir, dst))


def _load(method, head, target):
    from funcspec import load_model
    from funcspec.config import SpecConfig
    from funcspec.proposers import BuildContext, build_proposer

    spec = SpecConfig.from_vllm({"method": method, "model": str(head), "num_speculative_tokens": 2})
    return build_proposer(spec, load_model(target), BuildContext(256, torch.device("cpu")))


def test_a_directory_in_no_known_layout_says_what_was_found(cases, tmp_path):
    pub.save(tmp_path / "odd", {"architectures": ["SomethingElse"]}, {"foo.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"odd: no EAGLE head in a layout funcspec reads \(eagle3-speculators, "
                                         r".*'foo.weight'"):
        _load("eagle3", tmp_path / "odd", cases["eagle3_bin"].target)
    with pytest.raises(ValueError, match=r"a eagle3 checkpoint \(layout eagle3-safeailab.*use method 'eagle3', "
                                         r"not 'eagle'"):
        _load("eagle", cases["eagle3_bin"].head, cases["eagle3_bin"].target)
    pub.save(tmp_path / "peagle", {"speculators_config": {}, "speculators_model_type": "peagle"}, {})
    with pytest.raises(ValueError, match="speculators_model_type 'peagle' .*P-EAGLE"):
        _load("eagle3", tmp_path / "peagle", cases["eagle3_bin"].target)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"empty: no weight file; looked for \*\.safetensors .*\*\.bin"):
        _load("eagle3", tmp_path / "empty", cases["eagle3_bin"].target)


def test_a_head_for_another_target_names_the_field(cases, tmp_path):
    """Hidden size, vocabulary and layer count that do not fit the target: ValueError naming what differs."""
    wide = _copy(cases["eagle3_bin"].head, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "target_hidden_size": 64}))
    with pytest.raises(ValueError, match=r"target features of width 64 .*the target has hidden_size 32"):
        _load("eagle3", wide, cases["eagle3_bin"].target)
    vocab = _copy(cases["medusa_pt"].head, tmp_path / "vocab")
    state = torch.load(vocab / "medusa_lm_head.pt")
    torch.save({**state, "2.1.weight": torch.zeros(100, 32)}, vocab / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"medusa_lm_head.pt \(layout medusa-fasterdecoding\): mis-shaped keys "
                                         r"\['2.1.weight \(as medusa_head.2.1.weight\): expected \(96, 32\), "
                                         r"got \(100, 32\)'\]"):
        _load("medusa", vocab, cases["medusa_pt"].target)
    with pytest.raises(ValueError, match=r"MTP config num_hidden_layers/hidden_size/vocab_size \(2, 32, 96\) must "
                                         r"equal the target's \(8, 32, 96\)"):
        _load("mtp", cases["mtp_mimo"].head, cases["eagle3_bin"].target)
    with pytest.raises(ValueError, match=r"aux_hidden_state_layer_ids \[1, 4, 8\] must be in \[0, 2\]"):
        _load("dflash", cases["dflash_speculators"].head, cases["eagle1_qwen2"].target)


def test_unsupported_mtp_hosts_are_named(cases, tmp_path):
    for arch, why in (("DeepseekV4ForCausalLM", "DeepSeek-V4's attention \\(compressed sparse attention"),
                      ("Qwen3NextForCausalLM", "hybrid linear attention")):
        path = pub.save(tmp_path / arch, {"architectures": [arch], "num_hidden_layers": 2, "hidden_size": 32,
                                          "num_nextn_predict_layers": 1},
                        {"model.layers.2.eh_proj.weight": torch.zeros(32, 64)})
        with pytest.raises(ValueError, match=f"architectures \\['{arch}'\\] needs {why}"):
            _load("mtp", path, cases["eagle1_qwen2"].target)


def test_a_speculators_config_without_decoder_fields_is_a_value_error(cases, tmp_path):
    """The crash the issue reported (``KeyError: 'num_attention_heads'``) is now a ValueError naming the fields."""
    head = _copy(cases["eagle3_speculators_llama"].head, tmp_path / "nofields")
    config = json.loads((head / "config.json").read_text())
    del config["transformer_layer_config"]["num_attention_heads"]
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing or non-integer decoder fields \['num_attention_heads'\]"):
        _load("eagle3", head, cases["eagle3_speculators_llama"].target)
    (head / "config.json").write_text(json.dumps({**config, "transformer_layer_config": "llama"}))
    with pytest.raises(ValueError, match="needs a transformer_layer_config object"):
        _load("eagle3", head, cases["eagle3_speculators_llama"].target)


def test_broken_files_name_the_file(cases, tmp_path):
    """A missing shard, truncated files, pickled Python objects and dtypes that cannot be used."""
    sharded = _copy(cases["medusa2_whole"].head, tmp_path / "sharded")
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"pytorch_model-00002-of-00002.bin: shard listed in "
                                                r"pytorch_model.bin.index.json is missing"):
        _load("medusa", sharded, cases["medusa2_whole"].target)
    for name, file in (("eagle1_bin", "pytorch_model.bin"), ("eagle1_qwen2", "model.safetensors"),
                       ("medusa_pt", "medusa_lm_head.pt")):
        cut = _copy(cases[name].head, tmp_path / f"cut_{name}")
        data = (cut / file).read_bytes()
        (cut / file).write_bytes(data[: len(data) // 2])
        with pytest.raises(ValueError, match=f"cut_{name}/{file}: (unreadable PyTorch file, truncated or corrupt"
                                             f"|corrupt safetensors file)"):
            _load(cases[name].method, cut, cases[name].target)
    evil = _copy(cases["eagle1_bin"].head, tmp_path / "evil")
    torch.save({"fc.weight": torch.zeros(32, 64), "note": types.SimpleNamespace(x=1)}, evil / "pytorch_model.bin")
    with pytest.raises(ValueError, match="evil/pytorch_model.bin: holds Python objects that are not tensors; .*never "
                                         "unpickles arbitrary objects"):
        _load("eagle", evil, cases["eagle1_bin"].target)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        odd = _copy(cases["eagle3_speculators_qwen3"].head, tmp_path / f"dtype_{str(dtype)[6:]}")
        tensors = pub.read_back(odd / "model.safetensors")
        tensors["fc.weight"] = tensors["fc.weight"].to(dtype)
        pub.save(odd, json.loads((odd / "config.json").read_text()), tensors)
        with pytest.raises(ValueError, match=rf"keys of an unusable dtype \['fc.weight: {dtype}, expected float32, "
                                             rf"bfloat16, float16 or float64'\]"):
            _load("eagle3", odd, cases["eagle3_speculators_qwen3"].target)

