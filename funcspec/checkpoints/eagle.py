"""EAGLE-1 and EAGLE-3 head checkpoints: config, key layout, loading and random heads.

The published layouts are described in :mod:`funcspec.nn.eagle`, which holds
the math; this module reads and writes them.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec import rng
from funcspec.checkpoints.files import check_keys, drop_ignored, nest, read_config, read_safetensors, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import hf_config_dict, layer_shapes, model_config
from funcspec.nn.eagle import EagleConfig
from funcspec.nn.llama import ModelConfig, lm_head


def _draft_model(hf: dict) -> ModelConfig:
    """The head's decoder dims: EAGLE heads are Llama layers whatever the target family."""
    return model_config({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


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

    NOTE: duplicates are refused, not accepted: vLLM collects one hidden state per
    distinct layer, so a duplicated id would feed its ``fc`` fewer features than
    the checkpoint expects. Small targets, where the default collides, need the
    ids set explicitly (:func:`spread_aux_layers` chooses them for new heads).
    """
    ids = override or hf.get("eagle_aux_hidden_state_layer_ids") \
        or (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or default_aux_layers(num_layers)
    ids = tuple(sorted(int(i) for i in ids))
    if len(set(ids)) != len(ids) or not all(0 <= i < num_layers for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids must be distinct target layer indices in [0, {num_layers - 1}] "
            f"(the input of decoder layer i), got {list(ids)}; set it in the head's config.json or in "
            "speculative_config.draft_model_config.hf_config for a target this small, "
            f"e.g. {list(spread_aux_layers(num_layers))}"
        )
    return ids


def config_from_hf(hf: dict, version: int, target_cfg: ModelConfig, fc_bias: bool, override=None) -> EagleConfig:
    """The static head config from its ``config.json`` dict."""
    m = _draft_model(hf)
    if version == 1:
        return EagleConfig(1, m, (), m.vocab_size, fc_bias)
    m = dataclasses.replace(m, num_layers=1)
    return EagleConfig(3, m, aux_layers(hf, target_cfg.num_layers, override),
                       int(hf.get("draft_vocab_size") or m.vocab_size), False,
                       bool(hf.get("norm_before_residual", False)))


def head_shapes(cfg: EagleConfig, target_hidden: int) -> dict:
    """Every key of the head's checkpoint (without the optional ``embed_tokens.weight``) and its shape."""
    m, h = cfg.model, cfg.model.hidden_size
    if cfg.version == 1:
        shapes = {"fc.weight": (h, 2 * h), **({"fc.bias": (h,)} if cfg.fc_bias else {})}
        for i in range(m.num_layers):
            shapes.update(layer_shapes(m, f"layers.{i}.", input_norm=i > 0))
        return shapes
    shapes = {"fc.weight": (h, len(cfg.aux_layers) * target_hidden), "norm.weight": (h,),
              "lm_head.weight": (cfg.draft_vocab_size, h), "d2t": (cfg.draft_vocab_size,), "t2d": (m.vocab_size,),
              "midlayer.hidden_norm.weight": (h,)}
    shapes.update(layer_shapes(m, "midlayer.", in_features=2 * h))
    return shapes


def init_params(target_cfg: ModelConfig, seed: int = 0, version: int = 1, num_layers: int = 1,
                draft_vocab_size: int | None = None, aux_layers: tuple[int, ...] | None = None):
    """A randomly initialised EAGLE-``version`` head for ``target_cfg``: ``(hf_config, params)``.

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
    cfg = config_from_hf(hf, version, target_cfg, fc_bias=version == 1)
    shapes = head_shapes(cfg, target_cfg.hidden_size)
    tensors = random_tensors({k: s for k, s in shapes.items() if k not in ("d2t", "t2d")}, seed)
    if version == 3:
        # NOTE: stream -1 of the seed: random_tensors uses 0, 1, ... for the weights.
        order = torch.argsort(rng.uniform(rng.fold_in(rng.key(seed), -1), target_cfg.vocab_size))
        ids = torch.sort(order[:cfg.draft_vocab_size]).values  # [V_d] target ids of the draft vocabulary
        tensors["d2t"] = ids - torch.arange(cfg.draft_vocab_size)
        tensors["t2d"] = torch.zeros(target_cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return hf, nest(tensors)


def load_params(path, target, version: int = 1, aux_layers=None):
    """Load an EAGLE-``version`` head checkpoint for ``target`` (a loaded Model): ``(cfg, params)``.

    ``params`` holds the head's tensors under their published names plus the
    target's shared tensors (same objects, no copies): ``embed_tokens.weight``
    (unless an EAGLE-3 head ships its own) and, for EAGLE-1, ``lm_head.weight``.
    Raises ``ValueError`` naming missing, unexpected or mis-shaped keys.
    """
    path, hf = read_config(path)
    tensors = drop_ignored(read_safetensors(path))
    embed = tensors.pop("embed_tokens.weight", None)
    cfg = config_from_hf(hf, version, target.cfg, "fc.bias" in tensors, aux_layers)
    h = target.cfg.hidden_size
    if cfg.model.hidden_size != h or cfg.model.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"{path}: head hidden_size/vocab_size ({cfg.model.hidden_size}, {cfg.model.vocab_size}) "
                         f"must equal the target's ({h}, {target.cfg.vocab_size})")
    if version == 3 and cfg.draft_vocab_size == cfg.model.vocab_size:  # vLLM: the maps are optional then
        tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(cfg.model.vocab_size, dtype=torch.bool))
    shapes = head_shapes(cfg, h)
    if version == 3 and embed is not None:  # an EAGLE-3 head may ship its own embedding
        tensors["embed_tokens.weight"], shapes["embed_tokens.weight"] = embed, (cfg.model.vocab_size, h)
    check_keys(tensors, shapes, str(path))
    target_embed = target.params["model"]["embed_tokens"]["weight"]
    params = nest(to_target(tensors, target_embed))
    params.setdefault("embed_tokens", {"weight": target_embed})
    if version == 3:
        params["d2t"] = params["d2t"].long()
    else:
        params["lm_head"] = {"weight": lm_head(target.cfg, target.params)}
    return cfg, params
