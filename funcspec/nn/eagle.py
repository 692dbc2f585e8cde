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
"""

from __future__ import annotations

import dataclasses
import math

import torch

from funcspec import rng
from funcspec.checkpoints import check_keys, expected_shapes, nest, read_config, read_safetensors
from funcspec.nn.llama import (ARCHITECTURES, FULL_READ, KVRead, ModelConfig, attention, linear, lm_head, mlp,
                               project, rms_norm, rope_tables)

_IGNORED = ("rotary_emb.inv_freq",)


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


def _block(cfg: ModelConfig, p, kv, layer, residual, attn_in, slots, pos, cos, sin, window, read):
    """A pre-norm decoder block whose attention input is given: [B, T, H] -> [B, T, H]."""
    h = residual + attention(cfg, p["self_attn"], kv, layer, attn_in, slots, pos, cos, sin, window, read)
    return h + mlp(p["mlp"], rms_norm(h, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps))


def target_features(cfg: EagleConfig, params, feats: torch.Tensor) -> torch.Tensor:
    """The head's input feature [.., H] from stored target features [.., F] (EAGLE-3: ``fc``)."""
    return linear(feats, params["fc"]) if cfg.version == 3 else feats


def forward(cfg: EagleConfig, params, kv, tokens, h, slots, starts, window=None, read: KVRead = FULL_READ):
    """Run the head over tokens [B, T] (x_{t+1}) and features h [B, T, H] (f_t) at positions starts[b] + t.

    Returns ``(g [B, T, H], kv)``: g is the feature fed back at the next step.
    Donates: kv.k, kv.v.
    """
    m = cfg.model
    pos = starts.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
    emb = params["embed_tokens"]["weight"][tokens]  # [B, T, H]
    h = h.to(emb.dtype)
    cos, sin = rope_tables(m, pos, emb.dtype)
    if cfg.version == 3:
        p = params["midlayer"]
        hn = rms_norm(h, p["hidden_norm"]["weight"], m.rms_norm_eps)
        attn_in = torch.cat([rms_norm(emb, p["input_layernorm"]["weight"], m.rms_norm_eps), hn], -1)  # [B, T, 2H]
        return _block(m, p, kv, 0, hn if cfg.norm_before_residual else h, attn_in, slots, pos, cos, sin, window, read), kv
    x = linear(torch.cat([emb, h], -1), params["fc"])  # [B, T, H]
    for i, p in enumerate(params["layers"]):
        attn_in = x if i == 0 else rms_norm(x, p["input_layernorm"]["weight"], m.rms_norm_eps)
        x = _block(m, p, kv, i, x, attn_in, slots, pos, cos, sin, window, read)
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


# ----------------------------------------------------------------------------- checkpoints


def layer_shapes(m: ModelConfig, prefix: str, in_features: int | None = None, input_norm: bool = True) -> dict:
    """Shapes of one decoder block of ``m`` under ``prefix`` (q/k/v read ``in_features``)."""
    one = dataclasses.replace(m, num_layers=1, tie_word_embeddings=True)
    shapes = {prefix + k[len("model.layers.0."):]: s for k, s in expected_shapes(one).items()
              if k.startswith("model.layers.0.")}
    if in_features is not None:
        for name in ("q_proj", "k_proj", "v_proj"):
            key = f"{prefix}self_attn.{name}.weight"
            shapes[key] = (shapes[key][0], in_features)
    if not input_norm:
        del shapes[prefix + "input_layernorm.weight"]
    return shapes


def random_tensors(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors for ``shapes``: norms 1, matrices U(±1/√fan_in), vectors U(±0.02).

    NOTE: drawn with funcspec's counter-based ``rng`` (no torch RNG), one
    stream per name in sorted order, so a seed gives the same head everywhere.
    """
    base, out = rng.key(seed), {}
    for i, name in enumerate(sorted(shapes)):
        shape = tuple(shapes[name])
        u = rng.uniform(rng.fold_in(base, i), shape) * 2 - 1
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = u / math.sqrt(shape[1]) if len(shape) == 2 else u * 0.02
    return out


def hf_config_dict(m: ModelConfig, **extra) -> dict:
    """An HF ``config.json`` dict that :meth:`ModelConfig.from_hf` parses back to ``m``."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[m.arch]
    hf = dict(architectures=[arch], model_type=m.arch, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
              intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
              rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, hidden_act="silu",
              tie_word_embeddings=m.tie_word_embeddings, attention_bias=m.attention_bias, mlp_bias=m.mlp_bias,
              max_position_embeddings=m.max_position_embeddings)
    if m.rope_scaling:
        hf["rope_scaling"] = dict(m.rope_scaling)
    hf.update(extra)
    return hf


def to_target(tensors: dict, ref: torch.Tensor) -> dict:
    """Floating tensors cast to ``ref``'s dtype, all moved to its device (d2t / t2d keep theirs)."""
    return {k: v.to(device=ref.device, dtype=ref.dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()}


def _draft_model(hf: dict) -> ModelConfig:
    """The head's decoder dims: EAGLE heads are Llama layers whatever the target family."""
    return ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


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
    tensors = {k: v for k, v in read_safetensors(path).items() if not k.endswith(_IGNORED)}
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
