"""The MoE families' checkpoint side: their ``config.json`` fields and their experts' key layouts.

Published checkpoints (and transformers' ``save_pretrained``) store each expert
as its own linears: ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (Qwen2/Qwen3-MoE,
GLM-4.5) or ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` with the router at
``block_sparse_moe.gate`` (Mixtral). funcspec holds a layer's experts stacked, as
transformers does in memory: ``mlp.experts.gate_up_proj.weight`` [E, 2I, H] and
``mlp.experts.down_proj.weight`` [E, H, I] (:mod:`funcspec.nn.moe`). :func:`stack`
converts once, at load. A checkpoint stored quantized (GPTQ, AWQ,
compressed-tensors, vLLM-Ascend, GGUF) keeps its experts quantized: each is read
as one quantized linear and the layer's are stacked by
:func:`funcspec.kernels.moe.stack_quantized` (:func:`stack_quantized`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from funcspec.kernels import moe as moe_kernels
from funcspec.nn.moe import DENSE, MoEConfig, check
from funcspec.quant import formats

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32")
DEEPSEEK = ("deepseek_v2", "deepseek_v3", "deepseek_v32")


def _int(hf: dict, key: str, where: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def moe_config(hf: dict[str, Any], arch: str, where: str) -> MoEConfig:
    """The :class:`MoEConfig` of an HF config of family ``arch`` (dense for a dense family); a bad field is a
    ``ValueError`` naming it."""
    if arch not in MOE_ARCHS:
        return DENSE
    layers = range(_int(hf, "num_hidden_layers", where))
    if arch == "mixtral":
        n = _int(hf, "num_local_experts", where)
        m = MoEConfig(n, _int(hf, "num_experts_per_tok", where), _int(hf, "intermediate_size", where),
                      tuple(layers), norm_topk_prob=True)
    elif arch == "glm4_moe" or arch in DEEPSEEK:
        m = _deepseek_moe(hf, arch, layers, where)
    else:  # Qwen2-MoE, Qwen3-MoE: sparse every decoder_sparse_step-th layer, except mlp_only_layers
        n = _int({"num_experts": hf.get("num_experts", hf.get("num_local_experts"))}, "num_experts", where)
        step = _int(hf, "decoder_sparse_step", where, 1)
        if step < 1:
            raise ValueError(f"{where}: decoder_sparse_step must be positive, got {step}")
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
        shared = _int(hf, "shared_expert_intermediate_size", where, 0) if arch == "qwen2_moe" else 0
        m = MoEConfig(n, _int(hf, "num_experts_per_tok", where), _int(hf, "moe_intermediate_size", where),
                      tuple(i for i in layers if i not in dense and n > 0 and (i + 1) % step == 0),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                      shared_gate=shared > 0)
    if not m.routed_scaling_factor > 0:
        raise ValueError(f"{where}: routed_scaling_factor must be positive, got {m.routed_scaling_factor}")
    check(m, where)
    return m


def _deepseek_moe(hf: dict[str, Any], arch: str, layers: range, where: str) -> MoEConfig:
    """DeepSeekMoE (GLM-4.5 routes as DeepSeek-V3 does): dense layers first, shared experts, and V2's softmax router
    (group-limited by each group's best expert, unnormalised) or V3's sigmoid one with a selection bias."""
    first = _int(hf, "first_k_dense_replace", where, 0)
    freq = _int(hf, "moe_layer_freq", where, 1)
    if freq < 1:
        raise ValueError(f"{where}: moe_layer_freq must be positive, got {freq}")
    kinds = hf.get("mlp_layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != len(layers)
                              or not set(kinds) <= {"dense", "sparse"}):
        raise ValueError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the {len(layers)} "
                         f"layers, got {kinds!r}")
    sparse = tuple(i for i in layers if kinds[i] == "sparse") if kinds else \
        tuple(i for i in layers if i >= first and i % freq == 0)
    v2 = arch == "deepseek_v2"
    greedy = v2 and hf.get("topk_method", "greedy") == "greedy"  # V2-Lite: no groups
    moe_i = _int(hf, "moe_intermediate_size", where)
    return MoEConfig(_int(hf, "n_routed_experts", where), _int(hf, "num_experts_per_tok", where), moe_i, sparse,
                     scoring="softmax" if v2 else "sigmoid",
                     norm_topk_prob=False if v2 else bool(hf.get("norm_topk_prob", True)),
                     n_group=1 if greedy else _int(hf, "n_group", where, 1),
                     topk_group=1 if greedy else _int(hf, "topk_group", where, 1),
                     group_score="max" if v2 else "top2",
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), correction_bias=not v2,
                     shared_intermediate_size=_int(hf, "n_shared_experts", where, 1) * moe_i)


def hf_fields(m: MoEConfig, arch: str, num_layers: int) -> dict:
    """The ``config.json`` fields of ``m`` for family ``arch`` of ``num_layers`` layers (:func:`moe_config` parses
    them back)."""
    if arch not in MOE_ARCHS:
        return {}
    if arch == "mixtral":
        return dict(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k)
    common = dict(num_experts_per_tok=m.top_k, moe_intermediate_size=m.intermediate_size,
                  norm_topk_prob=m.norm_topk_prob)
    if arch == "glm4_moe" or arch in DEEPSEEK:
        fields = dict(common, n_routed_experts=m.num_experts,
                      mlp_layer_types=["sparse" if i in m.sparse_layers else "dense" for i in range(num_layers)],
                      first_k_dense_replace=min(m.sparse_layers, default=0), n_group=m.n_group,
                      topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
                      n_shared_experts=m.shared_intermediate_size // m.intermediate_size)
        if arch == "deepseek_v2":
            fields["topk_method"] = "greedy" if m.n_group == 1 else "group_limited_greedy"
        if arch == "glm4_moe":
            del fields["mlp_layer_types"]
        return fields
    return dict(common, num_experts=m.num_experts, decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(num_layers) if i not in m.sparse_layers],
                **({"shared_expert_intermediate_size": m.shared_intermediate_size} if arch == "qwen2_moe" else {}))


def layer_shapes(m: MoEConfig, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one sparse layer's feed-forward under ``prefix`` (``model.layers.<i>.mlp.``)."""
    e, i = m.num_experts, m.intermediate_size
    shapes = {prefix + "gate.weight": (e, hidden), prefix + "experts.gate_up_proj.weight": (e, 2 * i, hidden),
              prefix + "experts.down_proj.weight": (e, hidden, i)}
    if m.correction_bias:
        shapes[prefix + "gate.e_score_correction_bias"] = (e,)
    if m.shared_intermediate_size:
        s = m.shared_intermediate_size
        name = "shared_expert" if m.shared_gate else "shared_experts"
        shapes.update({f"{prefix}{name}.gate_proj.weight": (s, hidden), f"{prefix}{name}.up_proj.weight": (s, hidden),
                       f"{prefix}{name}.down_proj.weight": (hidden, s)})
        if m.shared_gate:
            shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def published_keys(keys) -> bool:
    """Whether ``keys`` hold experts one by one (a published checkpoint), which :func:`stack` converts."""
    return any(_PER_EXPERT.fullmatch(k) or ".block_sparse_moe." in k for k in keys)


def stack(tensors: dict[str, torch.Tensor], m: MoEConfig, where: str) -> dict[str, torch.Tensor]:
    """``tensors`` with each layer's per-expert linears stacked into funcspec's layout and Mixtral's
    ``block_sparse_moe`` named ``mlp``; the per-expert tensors are dropped as they are stacked."""
    out: dict[str, torch.Tensor] = {}
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key in list(tensors):
        hit = _PER_EXPERT.fullmatch(key)
        role = _ROLES.get(hit.group(3)) if hit else None
        if role is not None and hit is not None:  # (a role: a hit)
            found.setdefault(hit.group(1), {}).setdefault(role, {})[int(hit.group(2))] = tensors.pop(key)
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(key)
    for layer, roles in found.items():
        missing = sorted({f"{layer}mlp.experts.{e}.{r}_proj.weight" for r in ("gate", "up", "down")
                          for e in range(m.num_experts) if e not in roles.get(r, {})})
        if missing:
            raise ValueError(f"{where}: missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        extra = sorted(e for r in roles.values() for e in r if e >= m.num_experts)
        if extra:
            raise ValueError(f"{where}: {layer}mlp has experts {extra[:8]} beyond num_experts={m.num_experts}")
        one = lambda r: torch.stack([roles[r].pop(e) for e in range(m.num_experts)])  # noqa: E731, B023 (local, used at once)
        gate, up = one("gate"), one("up")  # [E, I, H] each
        out[layer + "mlp.experts.gate_up_proj.weight"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        del gate, up
        out[layer + "mlp.experts.down_proj.weight"] = one("down")  # [E, H, I]
    return out


def per_expert_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each layer's stacked experts (``<prefix>mlp.experts.gate_up_proj.weight`` [E, 2I, H] and
    ``down_proj`` [E, H, I]) as the experts one by one, as published checkpoints store them (:func:`stack`
    reads them back)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        if key.endswith("mlp.experts.gate_up_proj.weight"):
            e, two_i, h = shape
            out.update({f"{key[:-len('gate_up_proj.weight')]}{x}.{r}_proj.weight": (two_i // 2, h)
                        for x in range(e) for r in ("gate", "up")})
        elif key.endswith("mlp.experts.down_proj.weight"):
            e, h, i = shape
            out.update({f"{key[:-len('down_proj.weight')]}{x}.down_proj.weight": (h, i) for x in range(e)})
        else:
            out[key] = shape
    return out


def expert_linears(m: MoEConfig, hidden: int, keys) -> dict[str, tuple[int, int]]:
    """Every routed expert's linear module under the names a file of ``keys`` uses (Mixtral's
    ``block_sparse_moe.experts.<e>.w1/w3/w2``, else ``mlp.experts.<e>.{gate,up,down}_proj``) -> its (N, K)."""
    mixtral = any(".block_sparse_moe." in k for k in keys)
    part, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj",
                                                                                     "down_proj"))
    i = m.intermediate_size
    return {f"model.layers.{layer}.{part}.experts.{e}.{name}": shape for layer in m.sparse_layers
            for e in range(m.num_experts) for name, shape in zip(names, ((i, hidden), (i, hidden), (hidden, i)))}


def stack_quantized(linears: dict[str, dict], m: MoEConfig, dtype, where: str) -> tuple[dict, dict]:
    """The quantized experts among ``linears`` (module path -> quantized params, as
    :func:`expert_linears` names them) stacked per layer: ``({"model.layers.<i>.mlp.experts": {"gate_up_proj":
    ..., "down_proj": ...}}, {stacked float key: tensor})``.

    A layer whose experts the kernel cannot stack as stored (GPTQ's act-order
    gives each expert its own input order; an intermediate size not a multiple
    of 32) is dequantized to float experts instead, with a warning, as their
    exact values: vLLM loads such files, so funcspec does too, at float's memory.
    A layer with only some experts quantized is a ``ValueError`` naming them.
    """
    by_layer: dict[str, dict] = {}
    for module, p in linears.items():
        hit = _PER_EXPERT.fullmatch(module + ".weight")
        prefix, kind, expert = hit.group(1, 3, 2)  # type: ignore[union-attr]  # expert_linears' names: all match
        by_layer.setdefault(prefix, {}).setdefault(_ROLES[kind], {})[int(expert)] = p
    stacked, floats = {}, {}
    for layer, roles in by_layer.items():
        missing = [f"{r}[{e}]" for r in ("gate", "up", "down") for e in range(m.num_experts)
                   if e not in roles.get(r, {})]
        if missing:
            raise ValueError(f"{where}: {layer}mlp: some experts are quantized and others not (not quantized: "
                             f"{missing[:8]}{' ...' if len(missing) > 8 else ''}); funcspec stacks a layer's experts "
                             f"in one format")
        gates, ups, downs = ([roles[r][e] for e in range(m.num_experts)] for r in ("gate", "up", "down"))
        why = ("act-order (GPTQ desc_act / g_idx): each expert reads its inputs in its own order"
               if any("perm" in p for p in gates + ups + downs) else
               f"the intermediate size {m.intermediate_size} is not a multiple of 32"
               if m.intermediate_size % 32 else None)
        if why is None:
            try:
                stacked[layer + "mlp.experts"] = moe_kernels.stack_quantized(gates, ups, downs)
            except ValueError as e:
                raise ValueError(f"{where}: {layer}mlp.experts: {e}") from e
            continue
        warnings.warn(f"{where}: {layer}mlp.experts are dequantized to float ({why}); the routed-expert kernel "
                      f"runs them at float's memory", RuntimeWarning, stacklevel=3)
        one = (lambda ps: torch.stack([formats.dequantize(p, dtype) for p in ps]))  # noqa: E731 (a local one-liner)
        floats[layer + "mlp.experts.gate_up_proj.weight"] = torch.cat([one(gates), one(ups)], dim=1)
        floats[layer + "mlp.experts.down_proj.weight"] = one(downs)
    return stacked, floats
