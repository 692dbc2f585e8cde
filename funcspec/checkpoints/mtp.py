"""Multi-token prediction module checkpoints: DeepSeek-V3's and XiaomiMiMo's layouts, loading and random modules.

The module lives in the target's own checkpoint (or a stand-alone one with the
same config): DeepSeek-V3 appends it as ``model.layers.{L}`` (L = its
``num_hidden_layers``), MiMo as ``model.mtp_layers.{i}``. The layouts are
declared in :mod:`funcspec.checkpoints.layouts`; the math is :mod:`funcspec.nn.mtp`.
Only MTP modules whose block is a Llama/Qwen decoder layer run here: hosts with
MLA, MoE or hybrid layers (:data:`UNSUPPORTED_HOSTS`) are refused by name.
"""

from __future__ import annotations

import dataclasses

from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import check_keys, nest, read_config, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import hf_config_dict, layer_shapes, model_config
from funcspec.nn.llama import ModelConfig, capture_index, lm_head
from funcspec.nn.mtp import MTPConfig

WRITTEN = "mtp-deepseek"
"""The layout :func:`init_params` writes: DeepSeek-V3's ``model.layers.{L}`` module."""

UNSUPPORTED_HOSTS = {
    "DeepseekV3ForCausalLM": "DeepSeek-V3 (MLA attention, MoE)",
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2 (MLA and sparse attention, MoE)",
    "DeepseekV4ForCausalLM": "DeepSeek-V4 (MLA attention, MoE)",
    "Glm4MoeForCausalLM": "GLM-4.5 (its MTP layer is a MoE block)",
    "Glm4MoeLiteForCausalLM": "GLM-4.5 lite (MLA attention, MoE)",
    "Ernie4_5_MoeForCausalLM": "ERNIE-4.5 (MoE)",
    "Qwen3NextForCausalLM": "Qwen3-Next (hybrid Gated DeltaNet layers, MoE)",
    "Qwen3_5ForCausalLM": "Qwen3.5 (hybrid Gated DeltaNet layers)",
    "Qwen3_5MoeForCausalLM": "Qwen3.5-MoE (hybrid Gated DeltaNet layers, MoE)",
    "LongcatFlashForCausalLM": "LongCat-Flash (MLA attention, MoE)",
    "MiMoV2FlashForCausalLM": "MiMo-V2-Flash (hybrid sliding-window attention, MoE)",
    "BailingMoeV2_5ForCausalLM": "Ling 2.5 (hybrid linear attention, MoE)",
    "PanguUltraMoEForCausalLM": "openPangu Ultra MoE (MLA attention, MoE)",
}
"""Architectures whose MTP modules vLLM reads but whose host model funcspec cannot run, and why."""


def _refuse_host(hf: dict, where: str) -> None:
    """``ValueError`` naming an MTP host architecture funcspec does not run (an MLA / MoE / hybrid model)."""
    for arch in hf.get("architectures") or []:
        if arch in UNSUPPORTED_HOSTS:
            raise ValueError(f"{where}: architectures [{arch!r}] is {UNSUPPORTED_HOSTS[arch]}: its MTP module runs "
                             f"inside that model's layers, and funcspec runs the MTP modules of dense Llama / Qwen2 / "
                             f"Qwen3 targets (DeepSeek- or MiMo-style) only")


def head_shapes(cfg: MTPConfig, own_head: bool) -> dict:
    """Every tensor of the module under funcspec's names (without the optional embedding) and its shape;
    ``own_head``: the module ships its LM head (DeepSeek's ``shared_head.head``; MiMo uses the target's)."""
    m = cfg.model
    h = m.hidden_size
    shapes = layer_shapes(m, "")
    shapes.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "norm.weight": (h,)})
    if own_head:
        shapes["head.weight"] = (m.vocab_size, h)
    return shapes


def init_params(target_cfg: ModelConfig, seed: int = 0):
    """A random MTP module for ``target_cfg`` as a stand-alone DeepSeek-style checkpoint:
    ``(hf_config, params under the published names)``.

    The config is the target's plus ``num_nextn_predict_layers: 1``, as DeepSeek-V3 ships it.
    """
    cfg = MTPConfig(dataclasses.replace(target_cfg, num_layers=1), hidden_layer=target_cfg.num_layers)
    layout = next(l for l in layouts.LAYOUTS if l.name == WRITTEN)
    shapes = head_shapes(cfg, own_head=True)
    names = layouts.publish(layout, shapes, {"L": target_cfg.num_layers})
    return (hf_config_dict(target_cfg, num_nextn_predict_layers=1),
            nest(random_tensors({names[k]: s for k, s in shapes.items()}, seed)))


def load_params(path, target):
    """The first MTP module of checkpoint ``path`` (the target's own or a separate one) for ``target``.

    Returns ``(cfg, params)`` under funcspec's names; params share the target's
    embedding unless the module ships a different one, and MiMo's use the
    target's LM head. Raises ``ValueError`` naming an unsupported host
    architecture, a config that does not fit the target, or the file and the
    missing, unexpected, mis-shaped or unusable keys.
    """
    path, hf = read_config(path)
    _refuse_host(hf, str(path / "config.json"))
    count = hf.get("num_nextn_predict_layers", 1)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{path}: num_nextn_predict_layers is {count!r}: this checkpoint has no MTP module")
    head = layouts.read_head(path, "mtp", "mtp")
    base, t = model_config(hf, str(path / "config.json")), target.cfg
    if (base.num_layers, base.hidden_size, base.vocab_size) != (t.num_layers, t.hidden_size, t.vocab_size):
        raise ValueError(f"{path}: MTP config num_hidden_layers/hidden_size/vocab_size ({base.num_layers}, "
                         f"{base.hidden_size}, {base.vocab_size}) must equal the target's "
                         f"({t.num_layers}, {t.hidden_size}, {t.vocab_size})")
    mimo = head.layout.name == "mtp-mimo"
    # NOTE: vLLM's MiMo model hands its MTP layer the last hidden state before the final norm; DeepSeek's, after.
    cfg = MTPConfig(dataclasses.replace(base, num_layers=1, ops=t.ops), hidden_first=mimo, norm_output=mimo,
                    hidden_layer=capture_index(t.num_layers, t.num_layers) if mimo else t.num_layers)
    tensors = dict(head.tensors)
    embed = tensors.pop("embed_tokens.weight", None)
    shapes = head_shapes(cfg, own_head=not mimo)
    if embed is not None:
        tensors["embed_tokens.weight"], shapes["embed_tokens.weight"] = embed, (base.vocab_size, base.hidden_size)
    check_keys(tensors, shapes, head.where, published=head.published)
    tensors.pop("embed_tokens.weight", None)
    target_embed = target.params["model"]["embed_tokens"]["weight"]
    params = nest(to_target(tensors, target_embed))
    params["embed_tokens"] = {"weight": layouts.share(embed, target_embed)}
    if mimo:
        params["head"] = lm_head(target.cfg, target.params)
    return cfg, params
