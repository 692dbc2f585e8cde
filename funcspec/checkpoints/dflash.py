"""DFlash and DSpark drafter checkpoints: config.json parsing, key layout, loading and random drafters.

Three layouts are read (:mod:`funcspec.checkpoints.layouts`): z-lab's
``DFlashDraftModel``, DeepSpec's ``Qwen3DSparkModel`` and speculators' DFlash
(``speculators_config``, a nested ``transformer_layer_config``, the DFlash
fields at the top level). Their tensors are described in :mod:`funcspec.nn.dflash`,
which holds the math.

NOTE (layer ids): z-lab's ``target_layer_ids`` j is the output of target layer
j (HF ``hidden_states[j + 1]``; j = L - 1 is HF's normed last state, -1 the
embeddings); speculators' ``aux_hidden_state_layer_ids`` k is vLLM's capture id,
the input of layer k (k = L: the last output before the final norm). vLLM maps
k to z-lab's k - 1, and so does funcspec, reading hidden index
``nn.llama.capture_index(k, L)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import check_keys, nest, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import model_config
from funcspec.nn.dflash import DFlashConfig
from funcspec.nn.llama import ModelConfig, capture_index, lm_head

# Newer z-lab options (Gemma-style targets) and their no-op values; any other value is refused.
_UNSUPPORTED = {"input_embedding_scale": (None, 1, 1.0), "output_multiplier": (None, 1, 1.0),
                "final_logit_softcapping": (None, 0, 0.0)}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: evenly spaced over 1..L-3 (the middle layer for one draft layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def head_shapes(cfg: DFlashConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
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


def speculators_config(hf: dict, where) -> dict:
    """A speculators DFlash config.json as vLLM reads it: ``transformer_layer_config`` plus the DFlash fields,
    z-lab's names where they exist (``dflash_config.mask_token_id``, ``target_layer_ids`` = aux ids - 1)."""
    layer = layouts.speculators_layers(hf, where)
    for key in ("aux_hidden_state_layer_ids", "mask_token_id"):
        if hf.get(key) is None:
            raise ValueError(f"{where}: speculators DFlash config needs {key}")
    if hf.get("sample_from_anchor"):
        raise ValueError(f"{where}: sample_from_anchor=true is not supported (vLLM refuses it too)")
    aux = hf["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids must be a list of ints, got {aux!r}")
    extra = {k: hf[k] for k in ("block_size", "draft_vocab_size", "target_hidden_size") if hf.get(k) is not None}
    return {**layer, **extra, "aux_hidden_state_layer_ids": aux,
            "dflash_config": {"mask_token_id": hf["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}}


def parse_config(hf: dict, target: ModelConfig, method: str = "dflash", aux_layers=None,
                 where: str = "config.json", embedding: bool = False) -> DFlashConfig:
    """A :class:`DFlashConfig` from a drafter's config.json (flat: z-lab's or DeepSpec's, or
    :func:`speculators_config`'s), checked against the target.

    ``aux_layers``: vLLM's ``eagle_aux_hidden_state_layer_ids`` override (capture ids, as speculators'
    ``aux_hidden_state_layer_ids``). ``embedding``: the drafter ships its own embedding and LM head, so
    its hidden size may differ from the target's.
    """
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
    model = dataclasses.replace(model_config({**hf, "architectures": ["Qwen3ForCausalLM"]}, where), qk_norm=True,
                                ops=target.ops)
    width = int(hf.get("target_hidden_size") or model.hidden_size)
    if width != target.hidden_size or model.vocab_size != target.vocab_size or \
            (model.hidden_size != target.hidden_size and not embedding):
        raise ValueError(f"{where}: hidden_size/vocab_size {model.hidden_size}/{model.vocab_size} (target_hidden_size "
                         f"{width}) must equal the target's {target.hidden_size}/{target.vocab_size} (a drafter of "
                         f"another width must ship its own embed_tokens and lm_head)")
    aux = list(aux_layers) if aux_layers is not None else hf.get("aux_hidden_state_layer_ids")
    if aux is None:
        ids = get("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(int(get("num_target_layers", target.num_layers)), model.num_layers)
        ids = tuple(int(i) for i in ids)
        if not ids or any(not -1 <= i < target.num_layers for i in ids):
            raise ValueError(f"{where}: dflash_config.target_layer_ids {list(ids)} must be in "
                             f"[-1, {target.num_layers})")
        hidden = tuple(i + 1 for i in ids)
    else:  # speculators: vLLM's capture ids
        if not aux or any(not 0 <= i <= target.num_layers for i in aux):
            raise ValueError(f"{where}: aux_hidden_state_layer_ids {aux} must be in [0, {target.num_layers}]")
        ids, hidden = tuple(i - 1 for i in aux), tuple(capture_index(i, target.num_layers) for i in aux)
    mask = get("mask_token_id")
    if mask is None or not 0 <= int(mask) < target.vocab_size:
        raise ValueError(f"{where}: dflash_config.mask_token_id must be a token id in [0, {target.vocab_size}), "
                         f"got {mask!r}")
    draft_vocab = int(get("draft_vocab_size") or model.vocab_size)
    if draft_vocab != model.vocab_size and method == "dspark":
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab}: DSpark drafters need the full vocabulary")
    rank, conf = 0, "none"
    if method == "dspark":
        rank = int(get("markov_rank", 0))
        if rank and get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"{where}: markov_head_type {get('markov_head_type')!r}: only 'vanilla' is supported")
        if get("enable_confidence_head", False):
            conf = "hidden_markov" if get("confidence_head_with_markov", False) else "hidden"
            if conf == "hidden_markov" and not rank:
                raise ValueError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    return DFlashConfig(model, ids, int(mask), int(get("block_size", 16)), rank, conf, hidden,
                        draft_vocab != model.vocab_size)


def load_params(path, target, method: str = "dflash", aux_layers=None) -> tuple[DFlashConfig, dict]:
    """Load a DFlash (``method="dflash"``) or DSpark (``"dspark"``) drafter for ``target``.

    ``aux_layers``: ``speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``,
    vLLM's capture ids (the input of layer i), which override the checkpoint's layers.

    ``target`` is a loaded :class:`~funcspec.checkpoints.Model`; the params get
    its embedding and LM head unless the checkpoint ships different ones.
    Raises ``ValueError`` naming the config key, or the file and the missing /
    unexpected / mis-shaped / unusable tensors.
    """
    head = layouts.read_head(path, "dflash", method)
    where, tensors = head.where, dict(head.tensors)
    hf = speculators_config(head.config, head.path / "config.json") \
        if head.layout.name == "dflash-speculators" else head.config
    own = "embed_tokens.weight" in tensors and "lm_head.weight" in tensors
    cfg = parse_config(hf, target.cfg, method, aux_layers, str(head.path / "config.json"), own)
    m = cfg.model
    vd = int(hf.get("draft_vocab_size") or m.vocab_size)
    shapes = head_shapes(cfg, target.cfg.hidden_size)
    shapes.update({k: s for k, s in (("embed_tokens.weight", (m.vocab_size, m.hidden_size)),
                                     ("lm_head.weight", (vd, m.hidden_size))) if k in tensors})
    if cfg.draft_vocab:
        shapes.update({"d2t": (vd,), "t2d": (m.vocab_size,)})
    else:
        tensors.pop("t2d", None)
    check_keys(tensors, shapes, where, maps=("d2t", "t2d"), published=head.published)
    emb = target.params["model"]["embed_tokens"]["weight"]
    shipped = {k: tensors.pop(k, None) for k in ("embed_tokens.weight", "lm_head.weight")}
    params = nest(to_target(tensors, emb))
    params["embed_tokens"] = {"weight": layouts.share(shipped["embed_tokens.weight"], emb)}
    params["lm_head"] = layouts.share_linear(shipped["lm_head.weight"], lm_head(target.cfg, target.params),
                                                 emb.dtype)
    if cfg.draft_vocab:
        params["d2t"] = params["d2t"].long()
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
    # NOTE: biases 0, matrices U(±scale/√fan_in); the params hold no embedding or LM head.
    return hf, nest(random_tensors(head_shapes(cfg, t.hidden_size), seed, scale=scale, zero_biases=True))
