"""EAGLE-1 and EAGLE-3 head checkpoints: config, key layout, loading and random heads.

Four published layouts are read (:mod:`funcspec.checkpoints.layouts`):
SafeAILab's EAGLE-1 and EAGLE-3 heads (``pytorch_model.bin`` or
``model.safetensors``), vLLM's EAGLE-3 names, and speculators' EAGLE-3
(``speculators_config``, a nested ``transformer_layer_config``). The math is
:mod:`funcspec.nn.eagle`; this module turns each layout's config into an
:class:`~funcspec.nn.eagle.EagleConfig` and checks its tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec import rng
from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import check_keys, nest, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import hf_config_dict, layer_shapes, model_config
from funcspec.nn.eagle import EagleConfig
from funcspec.nn.llama import ModelConfig, lm_head

WRITTEN = {1: "eagle-safeailab", 3: "eagle3-safeailab"}
"""The layout :func:`init_params` writes for each EAGLE version: SafeAILab's, as published."""

_SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                       "norm_output", "eagle_aux_hidden_state_layer_ids")
_DRAFT_TYPES = {"llama": "llama", "qwen3": "qwen3"}
"""speculators' ``transformer_layer_config.model_type`` -> the draft layer family (vLLM's Eagle3 arch map)."""


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 auxiliary layers ``(2, L//2, L-3)``, clamped into ``[0, L-1]``."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def spread_aux_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """Distinct auxiliary layers for a new head: vLLM's default where it is distinct, else
    ``min(count, L)`` ids spread evenly over ``[0, L-1]`` (low, middle and high features)."""
    ids = default_aux_layers(num_layers)
    if len(set(ids)) == len(ids):
        return tuple(sorted(ids))
    n = min(count, num_layers)
    return tuple(sorted({round(j * (num_layers - 1) / max(n - 1, 1)) for j in range(n)}))


def aux_layers(hf: dict, num_layers: int, override=None) -> tuple[int, ...]:
    """EAGLE-3's auxiliary layer ids: ``override``, else the head's config, else vLLM's default.

    Ids are vLLM's capture ids: i is the input of decoder layer i, and i = L the
    last layer's output before the final norm.

    NOTE: duplicates are refused, not accepted: vLLM collects one hidden state per
    distinct layer, so a duplicated id would feed its ``fc`` fewer features than
    the checkpoint expects. Small targets, where the default collides, need the
    ids set explicitly (:func:`spread_aux_layers` chooses them for new heads).
    """
    ids = override or hf.get("eagle_aux_hidden_state_layer_ids") \
        or (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or default_aux_layers(num_layers)
    ids = tuple(sorted(int(i) for i in ids))
    if len(set(ids)) != len(ids) or not all(0 <= i <= num_layers for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids must be distinct target layer indices in [0, {num_layers}] "
            f"(the input of decoder layer i; {num_layers}: the last layer's output), got {list(ids)}; set it in "
            "the head's config.json or in speculative_config.draft_model_config.hf_config for a target this "
            f"small, e.g. {list(spread_aux_layers(num_layers))}"
        )
    return ids


def head_config(head: layouts.Head) -> dict:
    """The head's config as one flat dict, whatever its layout: speculators' nested
    ``transformer_layer_config`` with its EAGLE-3 fields lifted as vLLM lifts them."""
    hf = head.config
    if head.layout.name != "eagle3-speculators":
        return hf
    layer = layouts.speculators_layers(hf, head.path)
    kind = layer.get("model_type", "llama")
    if kind not in _DRAFT_TYPES:
        raise ValueError(f"{head.path / 'config.json'}: transformer_layer_config.model_type {kind!r} is not a draft "
                         f"layer funcspec runs (Eagle3 speculators: {sorted(_DRAFT_TYPES)})")
    flat = {**layer, **{k: hf[k] for k in _SPECULATORS_FIELDS if hf.get(k) is not None}}
    # NOTE: vLLM's default when the key is absent; speculators always writes it.
    flat.setdefault("norm_before_residual", True)
    return flat


def _draft_model(hf: dict, layout: str) -> ModelConfig:
    """The head's decoder dims. SafeAILab heads are Llama layers whatever the target (an EAGLE-1 head's
    q/k/v biases come from config ``qkv_bias``: Qwen2 heads); speculators' may be Qwen3 layers (q/k norms)."""
    if layout == "eagle3-speculators":
        kind = hf.get("model_type", "llama")
    else:  # vLLM: Eagle3Qwen3ForCausalLM is qwen3_eagle3.py's head; every other name a Llama layer
        kind = "qwen3" if layout == "eagle3-vllm" and "Eagle3Qwen3ForCausalLM" in (hf.get("architectures") or []) \
            else "llama"
    m = model_config({**hf, "architectures": [], "model_type": _DRAFT_TYPES.get(kind, "llama")})
    if layout == "eagle-safeailab":
        qkv = bool(hf.get("qkv_bias", False))  # cnets1: hasattr(config, "qkv_bias"); never attention_bias
        return dataclasses.replace(m, arch="qwen2" if qkv else "llama", attention_bias=qkv, mlp_bias=False)
    if layout == "eagle3-safeailab":  # cnets.py: one midlayer, no biases
        return dataclasses.replace(m, num_layers=1, attention_bias=False, mlp_bias=False)
    return m


def config_from_hf(hf: dict, layout: str, target_cfg: ModelConfig, override=None) -> EagleConfig:
    """The static head config from its (flat) config dict in ``layout``; its products take the target's kernels."""
    m = dataclasses.replace(_draft_model(hf, layout), ops=target_cfg.ops)
    if layout == "eagle-safeailab":
        return EagleConfig(1, m, (), m.vocab_size, bool(hf.get("bias", True)))
    return EagleConfig(3, m, aux_layers(hf, target_cfg.num_layers, override),
                       int(hf.get("draft_vocab_size") or m.vocab_size), False,
                       bool(hf.get("norm_before_residual", False)), bool(hf.get("norm_before_fc", False)),
                       bool(hf.get("fc_norm", False)), bool(hf.get("norm_output", False)))


def head_shapes(cfg: EagleConfig, target_hidden: int) -> dict:
    """Every tensor of the head under funcspec's names (without the optional ``embed_tokens.weight``) and its
    shape; ``target_hidden`` is H_t, the width of the target features EAGLE-3's ``fc`` reads."""
    m, h = cfg.model, cfg.model.hidden_size
    if cfg.version == 1:
        shapes = {"fc.weight": (h, 2 * h), **({"fc.bias": (h,)} if cfg.fc_bias else {})}
        for i in range(m.num_layers):
            shapes.update(layer_shapes(m, f"layers.{i}.", input_norm=i > 0))
        return shapes
    a = len(cfg.aux_layers)
    shapes = {"fc.weight": (h, a * target_hidden), "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
              "d2t": (cfg.draft_vocab_size,), "t2d": (m.vocab_size,), "layers.0.hidden_norm.weight": (h,)}
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (a * target_hidden,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (target_hidden,) for i in range(a)})
    shapes.update(layer_shapes(m, "layers.0.", in_features=2 * h))
    for i in range(1, m.num_layers):
        shapes.update(layer_shapes(m, f"layers.{i}."))
    return shapes


def init_params(target_cfg: ModelConfig, seed: int = 0, version: int = 1, num_layers: int = 1,
                draft_vocab_size: int | None = None, aux_layers: tuple[int, ...] | None = None):
    """A randomly initialised EAGLE-``version`` head for ``target_cfg`` in SafeAILab's layout:
    ``(hf_config, params under the published names)``.

    EAGLE-3 heads draw a random reduced vocabulary of ``draft_vocab_size``
    target tokens (default V/2) for ``d2t`` / ``t2d``.
    """
    base = dataclasses.replace(target_cfg, arch="llama", attention_bias=False, mlp_bias=False, qk_norm=False,
                               tie_word_embeddings=False, num_layers=num_layers if version == 1 else 1)
    if version == 1:
        hf = hf_config_dict(base, bias=True)
    else:
        vd = draft_vocab_size or target_cfg.vocab_size // 2
        ids = aux_layers or spread_aux_layers(target_cfg.num_layers)  # written down: usable on any depth
        hf = hf_config_dict(base, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vd,
                            eagle_aux_hidden_state_layer_ids=list(ids))
    layout = next(lay for lay in layouts.LAYOUTS if lay.name == WRITTEN[version])
    cfg = config_from_hf(hf, layout.name, target_cfg)
    shapes = head_shapes(cfg, target_cfg.hidden_size)
    names = layouts.publish(layout, shapes, {})
    # NOTE: drawn under the published names, in their sorted order (a seed keeps giving the same head).
    tensors = random_tensors({names[k]: s for k, s in shapes.items() if k not in ("d2t", "t2d")}, seed)
    if version == 3:
        # NOTE: stream -1 of the seed: random_tensors uses 0, 1, ... for the weights.
        order = torch.argsort(rng.uniform(rng.fold_in(rng.key(seed), -1), target_cfg.vocab_size))
        draft_ids = torch.sort(order[:cfg.draft_vocab_size]).values  # [V_d] target ids of the draft vocabulary
        tensors["d2t"] = draft_ids - torch.arange(cfg.draft_vocab_size)
        tensors["t2d"] = torch.zeros(target_cfg.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    return hf, nest(tensors)


def load_params(path, target, version: int = 1, aux_layers=None):
    """Load an EAGLE-``version`` head for ``target`` (a loaded Model): ``(cfg, params)`` under funcspec's names.

    ``params`` holds the head's tensors plus the target's shared ones (same
    objects, no copies): the embedding, unless the head ships a different one
    (vLLM's rule), and, for EAGLE-1, the LM head. Raises ``ValueError`` naming
    the file and the missing, unexpected, mis-shaped or unusable keys, or the
    config field that does not fit the target.
    """
    head = layouts.read_head(path, "eagle", "eagle" if version == 1 else "eagle3")
    hf, where, tensors = head_config(head), head.where, dict(head.tensors)
    cfg = config_from_hf(hf, head.layout.name, target.cfg, aux_layers)
    t, m = target.cfg, cfg.model
    h_t = int(hf.get("target_hidden_size") or m.hidden_size) if version == 3 else m.hidden_size
    embed = tensors.pop("embed_tokens.weight", None)
    if (h_t, m.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ValueError(f"{where}: the head reads target features of width {h_t} and vocabulary {m.vocab_size} "
                         f"(config {'target_hidden_size / ' if version == 3 else ''}hidden_size, vocab_size); "
                         f"the target has hidden_size {t.hidden_size}, vocab_size {t.vocab_size}")
    if version == 3 and m.hidden_size != t.hidden_size and embed is None:
        raise ValueError(f"{where}: a head of hidden_size {m.hidden_size} on a target of {t.hidden_size} must ship "
                         f"its own embed_tokens.weight [{m.vocab_size}, {m.hidden_size}]")
    if version == 3 and cfg.draft_vocab_size == m.vocab_size:  # vLLM: no map then; the ids are the target's
        tensors.pop("t2d", None)
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(m.vocab_size, dtype=torch.bool)
    shapes = head_shapes(cfg, h_t)
    if embed is not None:
        tensors["embed_tokens.weight"], shapes["embed_tokens.weight"] = embed, (m.vocab_size, m.hidden_size)
    check_keys(tensors, shapes, where, maps=("d2t", "t2d"), published=head.published)
    target_embed = target.params["model"]["embed_tokens"]["weight"]
    tensors.pop("embed_tokens.weight", None)
    params = nest(to_target(tensors, target_embed))
    params["embed_tokens"] = {"weight": layouts.share(embed, target_embed)}
    if version == 3:
        params["d2t"] = params["d2t"].long()
    else:
        params["lm_head"] = lm_head(target.cfg, target.params)
    return cfg, params
