"""Write a float HF checkpoint in a published quantized layout: GPTQ, AWQ, compressed-tensors, vLLM-Ascend W8A8.

For tests and benchmarks: the linears of every decoder layer are quantized by
round-to-nearest (not by GPTQ's or AWQ's calibration: the layout is the point,
not the rounding) and stored exactly as :mod:`funcspec.checkpoints.quantized`
documents each format; the embeddings, norms and ``lm_head`` stay float, as the
published files keep them. A mixture of experts is written as GPTQModel,
AutoAWQ, llm-compressor and msmodelslim write one: every expert's linears
(``mlp.experts.<e>.{gate,up,down}_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2``)
and shared experts quantized, the router (``gate``) and Qwen2-MoE's
``shared_expert_gate`` float (compressed-tensors lists them in ``ignore``).
A DeepSeek (MLA) checkpoint is written by :func:`write_ascend` as msmodelslim
writes its W8A8 (:data:`MLA_LINEARS`; ``kv_b_proj`` and the indexer's ``wk`` and
``weights_proj`` float, :data:`MLA_FLOAT`); the other writers quantize only its
``o_proj`` (and V2-Lite's ``q_proj``) among the attention's linears.
``LLM(out)`` then reads the directory as it would a downloaded one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from funcspec.checkpoints.files import read_config, read_weights
from funcspec.checkpoints.quantized import AWQ_ORDER, DESCRIPTION

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
"""The linears of a decoder layer that published files quantize."""

MLA_LINEARS = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
               "self_attn.o_proj", "self_attn.indexer.wq_b")
"""An MLA layer's linears that msmodelslim quantizes in its DeepSeek W8A8 (V2-Lite's ``q_proj`` in place of
``q_a_proj`` / ``q_b_proj``; ``indexer.wq_b``: V3.2's)."""

MLA_FLOAT = ("self_attn.kv_b_proj", "self_attn.indexer.wk", "self_attn.indexer.weights_proj")
"""An MLA layer's linears msmodelslim keeps float: ``kv_b_proj``, whose heads MLA absorbs into the query and the
output, and the indexer's key and head-weight projections."""

DEEPSEEK_MIX = dict(kind="W8A8_DYNAMIC", attention="W8A8")
"""msmodelslim's DeepSeek W8A8 (its "mixed" quantization): the attention's linears W8A8 with static
activations, the MLPs' and experts' W8A8_DYNAMIC, the routers float (:func:`write_ascend`'s arguments)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, scale_dtype=torch.float16) -> tuple:
    """Round-to-nearest of W [N, K] in groups of ``group`` k (K: per channel): ``(q, s, z)``, q [N, K] unsigned
    values, s [N, K/G] in ``scale_dtype``, z [N, K/G] integer zero points; W ~ s (q - z).

    Symmetric: s = 2 max|w| / (2^b - 1), z = 2^(b-1) (GPTQ's rule). Asymmetric: s = (max - min) / (2^b - 1) over
    the group and 0, z = round(-min / s), at least 1 (GPTQ's v1 files store z - 1, which cannot hold -1).
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"a weight of {k} inputs does not hold whole groups of {group}")
    g = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        s = (2 * g.abs().amax(-1) / top).to(scale_dtype).float()  # [N, K/G]
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).to(scale_dtype).float()
        z = torch.round(-lo / s.clamp(min=1e-12)).clamp(1, top)
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s.unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, top)
    return q.reshape(n, k).to(torch.int32), s.to(scale_dtype), z.to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """The inverse of :func:`funcspec.checkpoints.quantized.unpack_int32`: values [..., C] (below 2^b) packed
    along ``dim`` into int32 words, value j of a word at bits j b (``order``: AWQ's column interleave)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    pad = -v.shape[-1] % per
    v = torch.nn.functional.pad(v, (0, pad)).unflatten(-1, (-1, per))  # [..., W, per]
    if order is not None:
        v = v[..., list(order)]
    words = (v << (torch.arange(per) * bits)).sum(-1)  # [..., W] below 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).movedim(-1, dim)


ROUTERS = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:gate|shared_expert_gate)")
"""A MoE layer's router and Qwen2-MoE's shared-expert gate: kept float by every producer."""

MTP_TABLES = (".embed_tokens.weight", ".shared_head.head.weight")
"""An MTP layer's own embedding and LM head (DeepSeek's layout): read by row or as the head, kept float."""

ROUTERS_IGNORED = ("re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")
"""llm-compressor's ``ignore`` entries for them (as RedHatAI's MoE checkpoints list them)."""


def _layers(hf: dict, tensors: dict, attention: tuple = LINEARS, mtp: bool = True) -> list[str]:
    """The decoder layers' linears a producer quantizes: a dense layer's :data:`LINEARS` (``attention``: the
    attention's among them), and in a MoE every expert's and shared expert's 2-D weights, not the routers.
    ``mtp``: an MTP layer's too (a layer at index ``num_hidden_layers`` or above), else they stay float."""
    n = hf["num_hidden_layers"]
    every = sorted({int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")})
    out = [f"model.layers.{i}.{m}" for i in every for m in dict.fromkeys(attention + LINEARS)]
    out = [m for m in out if m + ".weight" in tensors]
    out += [k[:-len(".weight")] for k, v in tensors.items() if k.startswith("model.layers.")
            and k.endswith(".weight") and v.dim() == 2 and k[:-len(".weight")] not in out
            and ".self_attn." not in k and not ROUTERS.fullmatch(k[:-len(".weight")])
            and not k.endswith(MTP_TABLES)]
    return [m for m in out if mtp or int(m.split(".")[2]) < n]


def _save(src: Path, out: Path, hf: dict, tensors: dict, extra_files: Optional[dict] = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def _floats(tensors: dict, quantized: list[str], dtype) -> dict:
    """The tensors a quantized file keeps in float: everything but the quantized linears' weights."""
    return {k: v.to(dtype) for k, v in tensors.items() if k.rsplit(".", 1)[0] not in quantized
            or not k.endswith(".weight")}


def write_gptq(src, out, bits: int = 4, group: int = 128, sym: bool = True, desc_act: bool = False,
               checkpoint_format: str = "gptq", seed: int = 0) -> Path:
    """``src`` as AutoGPTQ / GPTQModel save it: ``qweight``, ``qzeros``, ``scales``, ``g_idx`` per linear (fp16
    floats); ``desc_act``: a random act-order (GPTQ orders inputs by its Hessian; any order is a valid file)."""
    src, out = Path(src), Path(out)
    _, hf = read_config(src)
    tensors = read_weights(src)
    layers = _layers(hf, tensors)
    gen = torch.Generator().manual_seed(seed)
    new = _floats(tensors, layers, torch.float16)
    for m in layers:
        w = tensors[m + ".weight"].float()  # [N, K]
        n, k = w.shape
        g = group if group > 0 else k
        perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        qp, s, z = rtn(w[:, perm], bits, g, sym)  # groups of the inputs in act order
        q = torch.empty_like(qp)
        q[:, perm] = qp
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        stored_z = z - 1 if checkpoint_format == "gptq" else z
        new[m + ".qweight"] = pack_int32(q.t(), bits, 0)  # [K / (32/b), N]
        new[m + ".qzeros"] = pack_int32(stored_z.t() & ((1 << bits) - 1), bits, 1)  # [K/G, N / (32/b)]
        new[m + ".scales"] = s.t().contiguous()  # [K/G, N] fp16
        new[m + ".g_idx"] = g_idx
    hf = {**hf, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
        "true_sequential": True, "static_groups": False, "lm_head": False, "damp_percent": 0.01,
        "checkpoint_format": checkpoint_format}}
    return _save(src, out, hf, new)


def write_awq(src, out, group: int = 128) -> Path:
    """``src`` as AutoAWQ saves its GEMM layout: ``qweight``, ``qzeros`` (interleaved nibbles), ``scales``."""
    src, out = Path(src), Path(out)
    _, hf = read_config(src)
    tensors = read_weights(src)
    layers = _layers(hf, tensors)
    new = _floats(tensors, layers, torch.float16)
    for m in layers:
        q, s, z = rtn(tensors[m + ".weight"], 4, group, sym=False)
        new[m + ".qweight"] = pack_int32(q.t(), 4, 1, AWQ_ORDER)  # [K, N/8]
        new[m + ".qzeros"] = pack_int32(z.t(), 4, 1, AWQ_ORDER)  # [K/G, N/8]
        new[m + ".scales"] = s.t().contiguous()  # [K/G, N]
    hf = {**hf, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}}
    return _save(src, out, hf, new)


def write_compressed_tensors(src, out, scheme: str = "w4a16", group: int = 128, sym: bool = True,
                             activations: str = "dynamic", actorder: bool = False, seed: int = 0) -> Path:
    """``src`` as llm-compressor saves it: ``w4a16`` / ``w8a16`` ``pack-quantized`` (group ``group``, or per
    channel for 0), or ``w8a8`` ``int-quantized`` per channel with ``activations`` ``"dynamic"`` (per token) or
    ``"static"`` (a per-tensor ``input_scale``). bf16 floats and scales; ``lm_head`` in ``ignore``."""
    src, out = Path(src), Path(out)
    _, hf = read_config(src)
    tensors = read_weights(src)
    layers = _layers(hf, tensors)
    bits = 4 if scheme == "w4a16" else 8
    packed = scheme != "w8a8"
    gen = torch.Generator().manual_seed(seed)
    new = _floats(tensors, layers, torch.bfloat16)
    for m in layers:
        w = tensors[m + ".weight"].float()
        n, k = w.shape
        g = group if packed and group > 0 else k
        perm = torch.randperm(k, generator=gen) if actorder else torch.arange(k)
        qp, s, z = rtn(w[:, perm], bits, g, sym, torch.bfloat16)
        q = torch.empty_like(qp)
        q[:, perm] = qp
        if packed:
            new[m + ".weight_packed"] = pack_int32(q, bits, 1)  # [N, K b/32]: stored values + 2^(b-1)
            new[m + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                new[m + ".weight_zero_point"] = pack_int32(z, bits, 0)  # [N / (32/b), K/G]
            if actorder:
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
                new[m + ".weight_g_idx"] = g_idx
        else:
            new[m + ".weight"] = (q - (1 << (bits - 1))).to(torch.int8)
            if not sym:
                new[m + ".weight_zero_point"] = (z - 128).to(torch.int8)
            if activations == "static":
                new[m + ".input_scale"] = torch.tensor([0.05], dtype=torch.bfloat16)
        new[m + ".weight_scale"] = s  # [N, K/G] or [N, 1]
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "group" if packed and group > 0 else "channel",
               **({"group_size": group} if packed and group > 0 else {}),
               **({"actorder": "group"} if actorder else {})}
    acts = None if packed else {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": activations == "dynamic",
                                "strategy": "token" if activations == "dynamic" else "tensor"}
    fmt = "pack-quantized" if packed else "int-quantized"
    hf = {**hf, "torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head", *(ROUTERS_IGNORED if any(ROUTERS.fullmatch(k[:-len(".weight")]) for k in tensors)
                                else ())], "kv_cache_scheme": None}}
    return _save(src, out, hf, new)


def write_ascend(src, out, kind: str = "W8A8", input_offset: int = 3, attention: Optional[str] = None,
                 absorbed: bool = False, mtp: bool = False) -> Path:
    """``src`` as ModelSlim saves it for vLLM-Ascend: int8 ``weight`` per channel with ``weight_scale`` /
    ``weight_offset``; ``W8A8`` adds the static ``input_scale`` / ``input_offset`` (``input_offset`` here),
    ``deq_scale`` = input_scale weight_scale and ``quant_bias`` = round(b / deq_scale) - input_offset sum_k q;
    and ``quant_model_description.json`` naming every tensor's type.

    ``kind``: every quantized linear's type, or (``attention`` given) the MLPs' and experts', with the
    attention's in ``attention`` (:data:`DEEPSEEK_MIX`). An MLA model's attention linears are
    :data:`MLA_LINEARS`, its :data:`MLA_FLOAT` float, but for ``kv_b_proj`` where ``absorbed`` (a file that
    stores it quantized, as some producers do). ``mtp``: an MTP layer quantized too (msmodelslim's
    ``quant_mtp mix``; by default it stays float, as msmodelslim writes it)."""
    src, out = Path(src), Path(out)
    _, hf = read_config(src)
    tensors = read_weights(src)
    mla = MLA_LINEARS + (("self_attn.kv_b_proj",) if absorbed else ())
    layers = _layers(hf, tensors, mla if hf.get("kv_lora_rank") else LINEARS, mtp)
    new = _floats(tensors, layers, torch.bfloat16)
    desc = {"model_quant_type": kind, "version": "1.0.0", **{k: "FLOAT" for k in new}}
    for m in layers:
        kind_m = attention if attention and ".self_attn." in m else kind
        q, s, _ = rtn(tensors[m + ".weight"], 8, tensors[m + ".weight"].shape[1], True, torch.bfloat16)
        part = {"weight": (q - 128).to(torch.int8), "weight_scale": s, "weight_offset": torch.zeros_like(s)}
        if kind_m == "W8A8":
            in_scale = torch.tensor([0.05], dtype=torch.bfloat16)
            deq = in_scale.float() * s.float().flatten()  # [N]
            b = tensors.get(m + ".bias", torch.zeros(q.shape[0])).double()
            rowsum = (q - 128).double().sum(1)
            bias = (torch.round(b / deq.double()) - input_offset * rowsum).to(torch.int32)
            part.update(input_scale=in_scale, input_offset=torch.tensor([input_offset], dtype=torch.int8),
                        deq_scale=deq, quant_bias=bias)
        for name, t in part.items():
            new[f"{m}.{name}"] = t
            desc[f"{m}.{name}"] = kind_m
        desc[f"{m}.weight"] = kind_m
        if f"{m}.bias" in new:
            desc[f"{m}.bias"] = kind_m
    return _save(src, out, {**hf, "torch_dtype": "bfloat16"}, new, {DESCRIPTION: json.dumps(desc, indent=2)})
