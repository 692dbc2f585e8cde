"""Multi-token prediction module checkpoints: DeepSeek-V3's / V3.2's, GLM-4.5's and XiaomiMiMo's layouts, loading
and random modules.

The module lives in the target's own checkpoint (or a stand-alone one with the
same config): DeepSeek-V3/V3.2 and GLM-4.5 append it as ``model.layers.{L}``
(L = its ``num_hidden_layers``), MiMo as ``model.mtp_layers.{i}``. The layouts
are declared in :mod:`funcspec.checkpoints.layouts`; the math is
:mod:`funcspec.nn.mtp`. The block is one decoder layer of the host (GQA, or MLA
with V3.2's indexer), a MoE layer where the host's rules make layer L one, its
experts stored one by one as the host's and stacked at load.
Hosts funcspec does not run (:data:`funcspec.checkpoints.llama.NOT_BUILT`:
hybrid linear attention, ...) are refused by name, with what they need.
"""

from __future__ import annotations

import dataclasses

from funcspec.checkpoints import experts, layouts
from funcspec.checkpoints.files import check_keys, nest, read_config, to_target
from funcspec.checkpoints.init import random_tensors
from funcspec.checkpoints.llama import NOT_BUILT, hf_config_dict, layer_shapes, model_config
from funcspec.nn.llama import ModelConfig, capture_index, lm_head
from funcspec.nn.mtp import MTPConfig

WRITTEN = "mtp-deepseek"
"""The layout :func:`init_params` writes: DeepSeek-V3's ``model.layers.{L}`` module."""


def _refuse_host(hf: dict, where: str) -> None:
    """``ValueError`` naming an MTP host architecture funcspec does not run (:data:`NOT_BUILT`) and what it needs."""
    for arch in hf.get("architectures") or []:
        if isinstance(arch, str) and arch in NOT_BUILT:
            raise ValueError(f"{where}: architectures [{arch!r}] needs {NOT_BUILT[arch]}, which funcspec does not "
                             f"build yet: its MTP module runs inside that model's layers, and funcspec runs the MTP "
                             f"modules of the targets it runs (Llama, Qwen2/3 and their MoE families, GLM-4.5, "
                             f"DeepSeek-V3/V3.2, MiMo) only")


def block_config(hf: dict, base: ModelConfig, ops, where: str) -> ModelConfig:
    """The module's block as one decoder layer of the host ``base`` (parsed from ``hf``): a MoE layer where
    the host's own rules make its layer L (``num_hidden_layers``) sparse, as vLLM builds the MTP block
    (GLM-4.5 and DeepSeek-V3: from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th)."""
    n = base.num_layers
    # NOTE: a per-layer mlp_layer_types list covers the decoder's layers only; vLLM sizes layer L by the rules.
    sparse = n in model_config({**hf, "num_hidden_layers": n + 1, "mlp_layer_types": None}, where).moe.sparse_layers
    return dataclasses.replace(base, num_layers=1, ops=ops,
                               moe=dataclasses.replace(base.moe, sparse_layers=(0,) if sparse else ()))


def _stack_experts(tensors: dict, cfg: MTPConfig, layer: int, where: str) -> dict:
    """``tensors`` (funcspec names) with the block's experts, stored one by one as the host's are, stacked as
    :mod:`funcspec.nn.moe` reads them; messages name the published keys (``model.layers.{L}.mlp.experts.{e}``)."""
    if not cfg.model.moe.sparse_layers:
        return tensors
    prefix = f"model.layers.{layer}."
    stacked = experts.stack({prefix + k: v for k, v in tensors.items()}, cfg.model.moe, where)
    return {k[len(prefix):]: v for k, v in stacked.items()}


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

    The config is the target's plus ``num_nextn_predict_layers: 1``, as DeepSeek-V3 and GLM-4.5 ship it; a MoE
    block's experts are written one by one, as theirs are.
    """
    hf = hf_config_dict(target_cfg, num_nextn_predict_layers=1)
    cfg = MTPConfig(block_config(hf, target_cfg, target_cfg.ops, "target config"), hidden_layer=target_cfg.num_layers)
    layout = next(lay for lay in layouts.LAYOUTS if lay.name == WRITTEN)
    shapes = experts.per_expert_shapes(head_shapes(cfg, own_head=True))
    names = layouts.publish(layout, shapes, {"L": target_cfg.num_layers})
    return hf, nest(random_tensors({names[k]: s for k, s in shapes.items()}, seed))


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
    where = str(path / "config.json")
    base, t = model_config(hf, where), target.cfg
    if (base.num_layers, base.hidden_size, base.vocab_size) != (t.num_layers, t.hidden_size, t.vocab_size):
        raise ValueError(f"{path}: MTP config num_hidden_layers/hidden_size/vocab_size ({base.num_layers}, "
                         f"{base.hidden_size}, {base.vocab_size}) must equal the target's "
                         f"({t.num_layers}, {t.hidden_size}, {t.vocab_size})")
    mimo = head.layout.name == "mtp-mimo"
    # NOTE: vLLM's MiMo model hands its MTP layer the last hidden state before the final norm; DeepSeek's, after.
    cfg = MTPConfig(block_config(hf, base, t.ops, where), hidden_first=mimo, norm_output=mimo,
                    hidden_layer=capture_index(t.num_layers, t.num_layers) if mimo else t.num_layers)
    tensors = _stack_experts(dict(head.tensors), cfg, base.num_layers, head.where)
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
