"""GGUF files (llama.cpp's format) as funcspec models: config from the metadata, weights block for block.

``load_model("model.gguf")`` (and ``LLM(model="model.gguf")``) reads a Llama /
Qwen2 / Qwen3 GGUF, and the mixtures of experts llama.cpp's converter writes as
``qwen3moe``, ``qwen2moe``, ``glm4moe`` and ``llama`` with experts (Mixtral), with
the ``gguf`` package. Its blocks become funcspec's quantized linears
(:mod:`funcspec.kernels.quant`) without dequantizing:

=======  ==========================================================================  ================
GGUF     block (llama.cpp's ``ggml-quants.c``)                                       funcspec format
=======  ==========================================================================  ================
Q8_0     32 values: fp16 d, int8 q; w = d q                                          8-bit, G 32
Q4_0     32 values: fp16 d, 16 bytes of nibbles (j and j + 16); w = d (q - 8)        4-bit, G 32
Q4_K     256 values: fp16 d, dmin, 12 bytes of 6-bit scales and mins for 8          4-bit, G 32,
         sub-blocks of 32, nibbles (64 a step: the low 32, then the high 32);        asymmetric
         w = d sc_j q - dmin m_j                                                     (s = d sc_j,
                                                                                     o = dmin m_j)
Q6_K     256 values: 4 low bits (128 bytes), 2 high bits (64), 16 int8 sub-block     6-bit, G 16
         scales, fp16 d; w = d sc_j (q - 32)                                         (s = d sc_j)
=======  ==========================================================================  ================

(Q4_K's and Q6_K's d sc_j and dmin m_j are stored in fp16: a relative rounding
of at most 2^-11, far below their steps. Q4_K_M files hold Q4_K and Q6_K.)
Other tensor types (F32, F16, BF16, and block types without a kernel here) are
dequantized by ``gguf`` into the model's dtype. Llama's q and
k rows, which llama.cpp's converter permutes for its RoPE, are permuted back.
Token embeddings stay floats (they are read by row); a model without
``output.weight`` (tied embeddings) projects through the quantized
``token_embd`` as its LM head.

A MoE's experts are 3-D tensors, ``blk.N.ffn_{gate,up,down}_exps`` ([E, I, H] /
[E, H, I]): each expert's slice of a quantized one is read as one quantized
linear and the layer's are stacked (:func:`funcspec.kernels.moe.stack_quantized`);
float ones (or a layer whose three types differ in kind) become the float stack.
The router (``ffn_gate_inp``), Qwen2-MoE's ``ffn_gate_inp_shexp`` and GLM's
``exp_probs_b`` are float, as the converter keeps them; shared experts
(``ffn_*_shexp``) are ordinary linears. The MoE config comes from the
``{arch}.expert_*`` keys; GLM's MTP blocks (``nextn_predict_layers``, after the
decoder's) are skipped. DeepSeek-V2 / V3 (``deepseek2``: multi-head latent
attention) has its own names and keys (:mod:`funcspec.checkpoints.gguf_deepseek`);
its ``kv_b_proj``, split per head in the file, is read back whole, as floats.

The tokenizer is transformers' conversion of the GGUF's own vocabulary
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), or a directory given as
``tokenizer``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from funcspec.checkpoints import gguf_deepseek
from funcspec.quant import formats

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM",
         "deepseek2": "DeepseekV2ForCausalLM"}
"""GGUF ``general.architecture`` values funcspec runs, and their HF architectures (``llama`` with
``llama.expert_count``: Mixtral; ``deepseek2`` with a sigmoid router and its bias: DeepSeek-V3)."""

FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
          "glm4moe": "glm4_moe", "deepseek2": "deepseek_v2"}
"""GGUF architecture -> funcspec's decoder family (``ModelConfig.arch``)."""

MOE_LAYER = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "exp_probs_b": "mlp.gate.e_score_correction"}
"""A MoE layer's router tensors (GLM's ``exp_probs_b.bias`` is HF's ``gate.e_score_correction_bias``)."""

SHARED = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}
"""A shared expert's linears, under ``mlp.shared_expert`` (Qwen2-MoE) or ``mlp.shared_experts`` (GLM)."""

EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""A MoE layer's 3-D expert tensors: gate and up [E, I, H], down [E, H, I] (numpy order)."""

LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""llama.cpp's per-layer tensor names -> HF's."""

QUANTIZED = {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q6_K": 6}
"""GGUF block types that become funcspec's quantized linears, and their bits in funcspec's format."""


def is_gguf(path) -> bool:
    """Whether ``path`` is a GGUF file (by name: ``*.gguf``)."""
    return str(path).endswith(".gguf") and Path(path).is_file()


def _field(reader, key: str, default: Any = None) -> Any:
    """A metadata value (strings decoded, arrays as lists)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config(reader, where: str) -> dict:
    """The HF ``config.json`` dict of a GGUF's metadata (and its tensors' shapes)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{where}: general.architecture {arch!r} is not a decoder funcspec runs "
                         f"(GGUF architectures: {sorted(ARCHS)})")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{where}: no token_embd.weight tensor")
    vocab, hidden = (int(x) for x in names["token_embd.weight"].shape[::-1])

    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{where}: missing metadata {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    hf = {"architectures": [ARCHS[arch]], "model_type": FAMILY[arch], "vocab_size": vocab, "hidden_size": hidden,
          "intermediate_size": int(get("feed_forward_length", 0)), "num_hidden_layers": layers,
          "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
          "head_dim": int(get("attention.key_length", hidden // heads)),
          "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
          "rope_theta": float(get("rope.freq_base", 10000.0)),
          "max_position_embeddings": int(get("context_length", 2048)),
          "tie_word_embeddings": "output.weight" not in names,
          "attention_bias": "blk.0.attn_q.bias" in names}
    for key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                        ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        value = _field(reader, key)
        if value is not None:
            hf[hf_key] = int(value)
    if "rope_freqs.weight" in names:  # Llama-3.1's RoPE scaling, stored as one factor per frequency
        factors = np.asarray(names["rope_freqs.weight"].data, dtype=np.float32)
        hf["rope_scaling"] = {"rope_type": "factors", "factors": [float(f) for f in factors]}
    if arch == gguf_deepseek.ARCH:
        return gguf_deepseek.config(get, names, hf)
    if int(get("expert_count", 0)):
        hf.update(_moe_config(arch, get, names, layers, hf))
    return hf


def _moe_config(arch: str, get, names: dict, layers: int, hf: dict) -> dict:
    """The HF MoE fields of a GGUF's ``{arch}.expert_*`` metadata (sparse layers: those with a router)."""
    e, k = int(get("expert_count")), int(get("expert_used_count"))
    size = int(get("expert_feed_forward_length", hf["intermediate_size"]))
    norm = bool(get("expert_weights_norm", arch != "qwen2moe"))  # llama.cpp's defaults: qwen2moe keeps raw weights
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": e,
                "num_experts_per_tok": k, "intermediate_size": size}
    if arch == "glm4moe":
        head_dim = hf["head_dim"]
        return {"n_routed_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": size,
                "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
                "n_shared_experts": int(get("expert_shared_count", 1)),
                "routed_scaling_factor": float(get("expert_weights_scale", 1.0)), "norm_topk_prob": norm,
                "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1)),
                "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
                "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim}
    out = {"num_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": size, "norm_topk_prob": norm,
           "decoder_sparse_step": 1, "mlp_only_layers": dense}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    return out


def _hf_name(name: str, arch: str = "llama") -> Optional[str]:
    """The HF name of a GGUF tensor of architecture ``arch``, or ``None`` for tensors that are not weights
    (rope_freqs)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "rope_freqs.weight":
        return None
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and arch == gguf_deepseek.ARCH:
        return gguf_deepseek.hf_name(name)
    if parts[0] == "blk" and len(parts) == 4:
        if parts[2] in LAYER:
            return f"model.layers.{parts[1]}.{LAYER[parts[2]]}.{parts[3]}"
        if parts[2] == "post_attention_norm" and arch == "glm4moe":  # GLM's post_attention_layernorm
            return f"model.layers.{parts[1]}.post_attention_layernorm.{parts[3]}"
        if parts[2] in MOE_LAYER:
            return f"model.layers.{parts[1]}.{MOE_LAYER[parts[2]]}_{parts[3]}" if parts[2] == "exp_probs_b" \
                else f"model.layers.{parts[1]}.{MOE_LAYER[parts[2]]}.{parts[3]}"
        if parts[2] in SHARED:
            shared = "shared_experts" if arch == "glm4moe" else "shared_expert"
            return f"model.layers.{parts[1]}.mlp.{shared}.{SHARED[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no funcspec counterpart")


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order back to HF's (the inverse of its ``LlamaModel.permute``)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def blocks(data: np.ndarray, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A quantized tensor's rows [N, row bytes] as ``(q [N, K] uint8, scales [N, K/32], offsets or None)``."""
    data = np.ascontiguousarray(data).reshape(n, -1)
    if kind == "Q8_0":
        b = data.reshape(n, k // 32, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(n, k), d.astype(np.float32), None
    if kind == "Q4_0":
        b = data.reshape(n, k // 32, 18)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        nib = b[..., 2:]  # [N, K/32, 16]: element j low, j + 16 high
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)
        return q.reshape(n, k), d.astype(np.float32), None
    if kind == "Q4_K":
        b = data.reshape(n, k // 256, 144)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/256]
        dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc, mn = _k4_scales(b[..., 4:16])  # [N, K/256, 8] each
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 steps of 64 values: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
        scales = (d[..., None] * sc).reshape(n, k // 32)
        offsets = (dmin[..., None] * mn).reshape(n, k // 32)
        return q.astype(np.uint8), scales, offsets
    if kind == "Q6_K":
        b = data.reshape(n, k // 256, 210)
        ql, qh = b[..., :128].reshape(n, -1, 2, 1, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, K/256, 16]
        d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/256]
        low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [N, B, 2, 2, 64]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03  # [N, B, 2, 4, 32]
        q6 = low.reshape(n, -1, 2, 4, 32) | (high << 4)  # [N, B, half, quarter, 32]: 6-bit values, zero 32
        return q6.astype(np.uint8).reshape(n, k), (d[..., None] * sc).reshape(n, k // 16), None
    raise ValueError(f"GGUF block type {kind} has no funcspec kernel")


def _k4_scales(s: np.ndarray) -> tuple:
    """Q4_K's 12 bytes of packed 6-bit scales and mins [..., 12] -> ([..., 8], [..., 8]) as float32."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def quantized_linear(q: np.ndarray, scales: np.ndarray, offsets, bits: int, name: str) -> dict:
    """funcspec's quantized linear of GGUF blocks (:func:`blocks`), packed for the kernel."""
    return formats.linear(torch.from_numpy(q), torch.from_numpy(scales), bits, name,
                          offsets=None if offsets is None else torch.from_numpy(offsets))


def _reader(path):
    """A ``gguf.GGUFReader`` of ``path`` (it maps the file: nothing is read until asked), or a ``ValueError``."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf's reader fails on a bad file with whatever it meets first
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_config(path) -> dict:
    """A GGUF file's HF ``config.json`` dict, from its metadata alone (no tensor data is read)."""
    return config(_reader(path), str(path))


def read(path, dtype: torch.dtype = torch.float32, device="cpu") -> tuple[dict, dict, dict]:
    """A GGUF file's ``(hf_config, flat float tensors under HF names, quantized linears by HF module path)``:
    ``model.layers.0.self_attn.q_proj`` (its ``.weight``), and ``lm_head`` for a tied model's quantized head."""
    import gguf

    where = str(path)
    reader = _reader(path)
    hf = config(reader, where)
    arch = _field(reader, "general.architecture")
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    permute = hf["model_type"] in ("llama", "mixtral")
    floats: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    experts: dict[int, dict] = {}
    kv_b: dict[int, dict] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= hf["num_hidden_layers"]:
            continue  # GLM's MTP blocks (nextn_predict_layers): a draft head's, not the decoder's
        if parts[0] == "blk" and parts[2] in EXPERTS:
            experts.setdefault(int(parts[1]), {})[parts[2]] = t
            continue
        if parts[0] == "blk" and parts[2] in gguf_deepseek.SPLIT:
            kv_b.setdefault(int(parts[1]), {})[parts[2]] = t
            continue
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = tuple(int(x) for x in t.shape[::-1])  # ggml lists ne0 (the contiguous dim) first
        rows = heads if name.endswith("q_proj.weight") else kv_heads if name.endswith("k_proj.weight") else None
        if kind in QUANTIZED and len(shape) == 2 and name != "model.embed_tokens.weight":
            q, s, o = blocks(t.data, kind, *shape)
            if permute and rows is not None:
                q, s, o = unpermute(q, rows), unpermute(s, rows), None if o is None else unpermute(o, rows)
            quantized[name[:-len(".weight")]] = quantized_linear(q, s, o, QUANTIZED[kind], f"gguf-{kind.lower()}")
            continue
        w = _dense(t, gguf)
        if permute and rows is not None:
            w = torch.from_numpy(unpermute(w.float().numpy(), rows))
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp holds it as [H]
        floats[name] = w.to(device=device, dtype=dtype)
    for layer, ts in kv_b.items():  # DeepSeek's W_UK / W_UV halves: HF's kv_b_proj, as floats
        if len(ts) != 2:
            raise ValueError(f"{where}: blk.{layer} has {sorted(ts)} of {list(gguf_deepseek.SPLIT)}")
        k_b, v_b = (_dense(ts[n], gguf).float() for n in gguf_deepseek.SPLIT)
        floats[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = \
            gguf_deepseek.join_kv_b(k_b, v_b).to(device=device, dtype=dtype)
    for layer, ts in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        stacked = _experts(ts, f"{where}: blk.{layer}", gguf)
        if "gate_up_proj" in stacked:
            quantized[prefix] = stacked
        else:
            floats.update({f"{prefix}.{k}": v.to(device=device, dtype=dtype) for k, v in stacked.items()})
    if hf["tie_word_embeddings"]:  # the LM head is token_embd: keep its blocks for the product
        t = next(x for x in reader.tensors if x.name == "token_embd.weight")
        if t.tensor_type.name in QUANTIZED:
            q, s, o = blocks(t.data, t.tensor_type.name, hf["vocab_size"], hf["hidden_size"])
            quantized["lm_head"] = quantized_linear(q, s, o, QUANTIZED[t.tensor_type.name],
                                                    f"gguf-{t.tensor_type.name.lower()}")
    return hf, floats, quantized


def _experts(ts: dict, where: str, gguf) -> dict:
    """A layer's expert tensors (:data:`EXPERTS`) stacked: quantized where all three are a block type with a
    kernel (:func:`funcspec.kernels.moe.stack_quantized`), else ``{"gate_up_proj.weight", "down_proj.weight"}``
    floats."""
    from funcspec.kernels import moe

    missing = [n for n in EXPERTS if n not in ts]
    if missing:
        raise ValueError(f"{where}: missing {missing} (a MoE layer needs gate, up and down experts)")
    gate, up, down = (ts[n] for n in EXPERTS)
    if all(t.tensor_type.name in QUANTIZED for t in (gate, up, down)):
        def each(t):
            kind = t.tensor_type.name
            e, n, k = (int(x) for x in t.shape[::-1])
            data = np.asarray(t.data).reshape(e, n, -1)
            return [quantized_linear(*blocks(data[i], kind, n, k), QUANTIZED[kind], f"gguf-{kind.lower()}")
                    for i in range(e)]
        try:
            return moe.stack_quantized(each(gate), each(up), each(down))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def dense(t):
        return _dense(t, gguf).float()

    return {"gate_up_proj.weight": torch.cat([dense(gate), dense(up)], dim=1), "down_proj.weight": dense(down)}


def _dense(t, gguf) -> torch.Tensor:
    """A GGUF tensor's values in HF's shape: BF16 / F16 / F32 as stored, other block types dequantized by ``gguf``."""
    shape = tuple(int(x) for x in t.shape[::-1])  # ggml lists ne0 (the contiguous dim) first
    kind = t.tensor_type.name
    if kind == "BF16":  # gguf hands over its bytes
        return torch.from_numpy(np.ascontiguousarray(t.data).view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data).reshape(shape))
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))


def load_tokenizer(path, tokenizer=None):
    """The tokenizer of a GGUF file (transformers converts its vocabulary), or of directory ``tokenizer``;
    ``None`` (with a warning) when its vocabulary cannot be converted."""
    from transformers import AutoTokenizer

    from funcspec.checkpoints.files import load_tokenizer as from_directory

    if tokenizer is not None:
        return from_directory(Path(tokenizer))
    path = Path(path)
    if not _has_vocabulary(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for vocabularies it cannot convert
        import warnings

        warnings.warn(f"{path}: its vocabulary could not be converted to a tokenizer ({type(e).__name__}: {e}); "
                      f"pass tokenizer=DIR to decode text", RuntimeWarning, stacklevel=3)
        return None


def _has_vocabulary(path: Path) -> bool:
    import gguf

    return "tokenizer.ggml.model" in gguf.GGUFReader(str(path)).fields


def path_of(model) -> Optional[Path]:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a directory holding exactly one; else ``None``."""
    model = Path(os.fspath(model))
    if is_gguf(model):
        return model
    if model.is_dir() and not (model / "config.json").exists():
        files = sorted(model.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None
