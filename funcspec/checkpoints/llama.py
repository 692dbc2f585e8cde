"""The target decoder's HF format: Llama / Qwen2 / Qwen3 and the MoE families' ``config.json`` and key layout.

``load_model(path)`` returns a :class:`Model`: the static config, the params
pytree (the HF state dict nested on its dots) and the tokenizer, if any.
The math over those params is :mod:`funcspec.nn.llama`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from funcspec.checkpoints import deepseek, experts, gguf, quantized
from funcspec.checkpoints.files import check_keys, find_weights, load_tokenizer, nest, read_config, read_json_object
from funcspec.nn.llama import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",  # XiaomiMiMo: a Qwen2 decoder plus MTP layers (model.mtp_layers.*)
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
}
"""HF ``architectures`` names and the decoder family (``ModelConfig.arch``) each one is."""

NOT_BUILT = {
    "Qwen3NextForCausalLM": "hybrid linear attention (Gated DeltaNet layers with a recurrent state, not a KV cache)",
    "Qwen3_5ForCausalLM": "hybrid linear attention (Gated DeltaNet layers)",
    "Qwen3_5MoeForCausalLM": "hybrid linear attention (Gated DeltaNet layers)",
    "DeepseekV4ForCausalLM": "DeepSeek-V4's attention (compressed sparse attention and hash routing)",
    "Glm4MoeLiteForCausalLM": "GLM-4.5 lite's MLA with GLM's router and RoPE",
    "GlmMoeDsaForCausalLM": "GLM's MLA with DeepSeek sparse attention",
    "LongcatFlashForCausalLM": "LongCat-Flash's shortcut-connected MoE with zero-computation experts",
    "MiMoV2FlashForCausalLM": "hybrid sliding-window attention with attention sinks",
    "BailingMoeV2_5ForCausalLM": "hybrid linear attention",
}
"""Published architectures funcspec knows but does not run, and what in them is not built: refused by name."""

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
"""config.json fields every decoder needs."""


def model_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Parse an HF config dict; unsupported architectures or missing fields raise ``ValueError`` naming them."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None and model_type in ARCHITECTURES.values():
        arch = model_type
    missing_part = next((f"{a} needs {NOT_BUILT[a]}" for a in archs if a in NOT_BUILT), None)
    if arch is None and missing_part:
        raise ValueError(f"{where}: {missing_part}, which funcspec does not build yet; supported: "
                         f"{sorted(ARCHITECTURES)}")
    if arch is None:
        raise ValueError(
            f"{where}: unsupported architecture (architectures={archs}, "
            f"model_type={model_type!r}); supported: {sorted(ARCHITECTURES)}"
        )
    missing = [k for k in REQUIRED if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool)]
    if missing:
        raise ValueError(f"{where}: missing or non-integer decoder fields {missing} (a decoder config needs "
                         f"{list(REQUIRED)})")
    empty = [k for k in REQUIRED if hf[k] < (0 if k == "num_hidden_layers" else 1)]  # 0 layers: embed, norm, head
    if empty:
        raise ValueError(f"{where}: decoder fields {empty} must be positive (layers: >= 0), got "
                         f"{[hf[k] for k in empty]}")
    if arch in deepseek.ARCHS:  # MLA: RoPE rotates the qk_rope_head_dim part of each head (HF's head_dim); its
        # one latent replaces K/V heads, so num_key_value_heads (transformers' default: 128) means nothing
        hf = {**hf, "head_dim": hf.get("qk_rope_head_dim"), "num_key_value_heads": hf["num_attention_heads"]}
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if hf["num_attention_heads"] % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={hf['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    if (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) < 1:
        raise ValueError(f"{where}: head_dim is 0 (hidden_size={hf['hidden_size']} // "
                         f"num_attention_heads={hf['num_attention_heads']}); set head_dim or fewer heads")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor",  # transformers' default for GLM-4.5 is half the head
                             hf.get("partial_rotary_factor", 0.5 if arch == "glm4_moe" else 1.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "factors", "yarn"):
        raise ValueError(f"{where}: rope_scaling type {rope_type!r} is not supported")
    scaling = () if rope_type == "default" else \
        tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope.items() if k != "type"))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rotary_dim = int(head_dim * partial)
    if not (0 < partial <= 1 and rotary_dim % 2 == 0 and rotary_dim > 0):
        raise ValueError(f"{where}: partial_rotary_factor={partial} must rotate an even, positive number of the "
                         f"head's {head_dim} dims")
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelConfig(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe") or bool(arch == "glm4_moe" and hf.get("use_qk_norm")),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        moe=experts.moe_config(hf, arch, where),
        mla=deepseek.mla_config(hf, arch, rope, where),
    )


def hf_config_dict(m: ModelConfig, **extra) -> dict:
    """An HF ``config.json`` dict that :func:`model_config` parses back to ``m``."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[m.arch]
    hf = dict(architectures=[arch], model_type=m.arch, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
              intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
              rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, hidden_act="silu",
              tie_word_embeddings=m.tie_word_embeddings, attention_bias=m.attention_bias, mlp_bias=m.mlp_bias,
              max_position_embeddings=m.max_position_embeddings)
    if m.rope_scaling:
        hf["rope_scaling"] = dict(m.rope_scaling)
    if m.rotary_dim:
        hf["partial_rotary_factor"] = m.rotary_dim / m.head_dim
    if m.arch == "glm4_moe":
        hf["use_qk_norm"] = m.qk_norm
    hf.update(experts.hf_fields(m.moe, m.arch, m.num_layers))
    hf.update(deepseek.hf_fields(m.mla, m.arch))
    hf.update(extra)
    return hf


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of a decoder with ``cfg`` and its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        proj = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d}
        if cfg.mla.kv_lora_rank:
            shapes.update(deepseek.attention_shapes(cfg.mla, cfg.num_heads, h, p + "self_attn."))
            proj = {}
        for name, out in proj.items():
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        if not cfg.mla.kv_lora_rank:
            shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias and cfg.arch == "llama":
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if i in cfg.moe.sparse_layers:
            shapes.update(experts.layer_shapes(cfg.moe, p + "mlp.", h))
        for name, shape in () if i in cfg.moe.sparse_layers else (
                ("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                ("down_proj", (h, cfg.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def layer_shapes(m: ModelConfig, prefix: str, in_features: int | None = None, input_norm: bool = True) -> dict:
    """Shapes of one decoder block of ``m`` under ``prefix`` (q/k/v read ``in_features``): heads reuse the block."""
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


@dataclasses.dataclass
class Model:
    """A loaded checkpoint.

    Attributes:
        cfg: static decoder config.
        params: nested params pytree under HF names.
        tokenizer: a transformers tokenizer, or ``None`` if the checkpoint has none.
        path: the checkpoint directory.
        hf_config: the raw ``config.json`` dict.
        quantization: how its weights were stored quantized (:class:`funcspec.checkpoints.quantized.Scheme`:
            GPTQ, AWQ, compressed-tensors, vLLM-Ascend, GGUF), or ``None``.
    """

    cfg: ModelConfig
    params: dict
    tokenizer: Any
    path: str
    hf_config: dict
    quantization: Optional[quantized.Scheme] = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config, the generation config and the tokenizer."""
        ids = set(self.cfg.eos_token_ids) | set(generation_eos(Path(self.path)))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def generation_eos(path: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` of checkpoint ``path``'s ``generation_config.json`` (an id or a list), ``()`` without
    one; ``ValueError`` naming the file when it is corrupt or the ids are not integers."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = read_json_object(gen).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{gen}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


EMBEDDED_HEADS = (r"model\.layers\.(\d+)\.", r"model\.mtp_layers\.", r"medusa_head\.")
"""Keys of draft heads saved inside a target's checkpoint, which the target skips: DeepSeek-style MTP modules
after the last decoder layer (layer index >= L), MiMo's ``model.mtp_layers``, Medusa-2's ``medusa_head``."""


def _embedded_head(key: str, num_layers: int) -> bool:
    for pattern in EMBEDDED_HEADS:
        m = re.match(pattern, key)
        if m and (not m.groups() or int(m.group(1)) >= num_layers):
            return True
    return False


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint ``path`` (a directory or a GGUF file), read without its weights:
    what an engine plans from before it loads them. Errors as :func:`load_model`'s."""
    gguf_file = gguf.path_of(path)
    if gguf_file is not None:
        return model_config(gguf.read_config(gguf_file), str(gguf_file))
    path, hf = read_config(path)
    return model_config(hf, str(path / "config.json"))


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu",
               tokenizer: Optional[str | os.PathLike] = None, quantization: Optional[str] = None) -> Model:
    """Load an HF Llama / Qwen2 / Qwen3 checkpoint directory (safetensors or ``pytorch_model.bin``, sharded or not),
    or a GGUF file (:mod:`funcspec.checkpoints.gguf`: its Q8_0 / Q4_0 / Q4_K blocks stay quantized).

    A directory quantized as published (GPTQ, AWQ, compressed-tensors,
    vLLM-Ascend W8A8: :mod:`funcspec.checkpoints.quantized`) keeps its
    quantized linears, read as they are stored; a MoE's quantized experts are
    stacked per layer (:func:`funcspec.checkpoints.experts.stack_quantized`). ``quantization``: a stored
    format's vLLM name (``"gptq"``, ``"awq"``, ``"gguf"``, ...) the checkpoint
    must be in; ``None`` reads whatever it declares.

    Draft heads saved in the same checkpoint (:data:`EMBEDDED_HEADS`) are
    skipped: they belong to their proposer. ``tokenizer``: a directory to take
    the tokenizer from instead of the checkpoint's. Raises ``FileNotFoundError``
    for a missing directory or file and ``ValueError`` for an unsupported
    architecture or quantization, a corrupt file, or missing / unexpected / mis-shaped keys.
    """
    gguf_file = gguf.path_of(path)
    if gguf_file is not None:
        model = _load_gguf(gguf_file, dtype, device, tokenizer)
        quantized.check_requested(quantization, model.quantization, str(gguf_file))
        return model
    path, hf = read_config(path)
    cfg = model_config(hf, str(path / "config.json"))
    generation_eos(path)  # NOTE: read on every stop check; a corrupt file is refused here, before any request
    scheme = quantized.detect(path, hf)
    quantized.check_requested(quantization, scheme, str(path))
    shapes = expected_shapes(cfg)
    weights = find_weights(path)
    every = weights.keys()
    keys = [k for k in every if not _embedded_head(k, cfg.num_layers)]
    if cfg.tie_word_embeddings and "lm_head.weight" in keys:
        keys.remove("lm_head.weight")  # some exporters save the tied copy
    tensors = weights.read(keys)
    linears: dict[str, dict] = {}
    stacked: dict[str, dict] = {}
    if scheme is not None:
        quantized.check_description(scheme, every)
    if cfg.moe.num_experts:
        if scheme is not None:  # quantized experts, one linear each, stacked per layer
            per_expert, used = quantized.read(tensors, scheme, experts.expert_linears(cfg.moe, cfg.hidden_size, keys),
                                              dtype, str(weights))
            tensors = {k: v for k, v in tensors.items() if k not in used}
            stacked, floats = experts.stack_quantized(per_expert, cfg.moe, dtype, str(weights))
            tensors.update(floats)
            for module in stacked:
                for name in ("gate_up_proj", "down_proj"):
                    shapes.pop(f"{module}.{name}.weight")
        tensors = experts.stack(tensors, cfg.moe, str(weights))
    if scheme is not None:
        linears, used = quantized.read(tensors, scheme, _linear_shapes(shapes), dtype, str(weights))
        linears, absorbed = deepseek.dequantize_absorbed(linears, dtype, str(weights))
        tensors = {**{k: v for k, v in tensors.items() if k not in used}, **absorbed}
        for module, p in linears.items():
            shapes.pop(module + ".weight")
            if "bias" in p or module + ".bias" in used:
                shapes.pop(module + ".bias", None)
    check_keys(tensors, shapes, str(weights))
    params = _with_linears(nest({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}), linears, device)
    params = _with_linears(params, {m: {name: _to(p, device) for name, p in e.items()} for m, e in stacked.items()},
                           device)
    return Model(cfg, params, load_tokenizer(Path(tokenizer)) if tokenizer else load_tokenizer(path), str(path), hf,
                 scheme)


ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
"""A MoE layer's router and Qwen2-MoE's shared-expert gate: float whatever the file's format (vLLM builds them
without a quantization method)."""


def _linear_shapes(shapes: dict) -> dict[str, tuple]:
    """Every linear module of a decoder's ``shapes`` that a quantized file may store quantized (not the embedding,
    read by row, nor a MoE router) -> (N, K)."""
    return {k[:-len(".weight")]: s for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2
            and k != "model.embed_tokens.weight" and not k.endswith(ROUTERS)}


def _to(p: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def _with_linears(params: dict, linears: dict, device) -> dict:
    """``params`` with each quantized linear (module path -> its params) put at its path, beside a float bias
    the file keeps there."""
    for module, p in linears.items():
        p = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
        *parents, leaf = module.split(".")
        node = params
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[leaf] = {**p, **({"bias": node[leaf]["bias"]} if isinstance(node.get(leaf), dict) else {})}
    return params


def _load_gguf(path: Path, dtype, device, tokenizer) -> Model:
    """A GGUF file as a :class:`Model`: float tensors as usual, quantized linears as funcspec's (kept quantized)."""
    hf, floats, linears = gguf.read(path, dtype, device)
    cfg = model_config(hf, str(path))
    shapes = expected_shapes(cfg)
    names = set()
    for module, p in linears.items():
        if module.endswith(".experts"):  # stacked quantized experts: gate_up [I, H] and down [H, I] per expert
            want_experts = [shapes.pop(f"{module}.{n}.weight", None) for n in ("gate_up_proj", "down_proj")]
            gf, df = p["gate_up_proj"]["format"], p["down_proj"]["format"]
            got = [(p["gate_up_proj"]["qweight"].shape[0], 2 * gf.out_features, gf.in_features),
                   (p["down_proj"]["qweight"].shape[0], df.out_features, df.in_features)]
            if want_experts != got:
                raise ValueError(f"{path}: {module}: expected {want_experts}, got quantized experts {got}")
            linears[module] = {n: _to(q, device) for n, q in p.items()}
            names |= {gf.name, df.name}
            continue
        want = shapes.pop(module + ".weight", (cfg.vocab_size, cfg.hidden_size) if module == "lm_head" else None)
        f = p["format"]
        if want != (f.out_features, f.in_features):
            raise ValueError(f"{path}: {module}: expected {want}, got a quantized [{f.out_features}, "
                             f"{f.in_features}]")
        names.add(f.name)
    check_keys(floats, shapes, str(path))
    scheme = quantized.Scheme("gguf", "GGUF " + ", ".join(sorted(names)), {}, str(path)) if linears else None
    return Model(cfg, _with_linears(nest(floats), linears, device), gguf.load_tokenizer(path, tokenizer), str(path),
                 hf, scheme)
