"""GGUF files written from HF Llama checkpoints: what ``bench scale`` hands llama.cpp, and the tests' GGUF files.

The writer mirrors llama.cpp's ``convert_hf_to_gguf.py`` for the Llama
architecture: its tensor names, the q/k row permutation for its RoPE, the
Llama-3 RoPE factors as ``rope_freqs``, norms in f32, and a placeholder
SentencePiece vocabulary (the weights are random; llama.cpp needs a vocabulary
to load). Quantized files come from ``gguf``'s own Q8_0 / Q4_0 quantizers, or
from llama.cpp's ``llama_model_quantize`` (Q4_K_M and the rest) on the bf16 file.
A mixture of experts is written as the converter writes ``qwen3moe``,
``qwen2moe``, ``glm4moe`` and Mixtral (``llama`` with experts): its
``{arch}.expert_*`` keys, each layer's experts as 3-D ``ffn_{gate,up,down}_exps``
tensors, shared experts as ``ffn_*_shexp``, and the router (``ffn_gate_inp``)
in f32, as the converter keeps it. DeepSeek-V2 / V3 are written as ``deepseek2``
(:mod:`funcspec.checkpoints.gguf_deepseek`: the latent attention's keys and its
``kv_b_proj`` split per head), from the HF config itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from funcspec.checkpoints import experts, gguf_deepseek
from funcspec.checkpoints.files import read_config, read_weights
from funcspec.checkpoints.gguf import EXPERTS, LAYER, MOE_LAYER, SHARED
from funcspec.checkpoints.llama import model_config

GGUF_ARCH = {"llama": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "glm4_moe": "glm4moe",
             "mixtral": "llama"}
"""funcspec's decoder family -> the GGUF architecture the writer writes it as (dense families as ``llama``)."""

FLOAT = ("ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b")
"""Tensors the converter keeps in f32 whatever the file type: MoE routers."""

WRITE_KINDS = ("float32", "bfloat16", "q8_0", "q4_0")
"""What :func:`write` stores the 2-D weights as (norms and RoPE factors stay f32, as llama.cpp's converter keeps
them); q8_0 / q4_0 are gguf's own quantizers (for Q4_K files use llama.cpp's ``llama_model_quantize``)."""


def rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> GGUF q/k row order (llama.cpp's rotary pairs), as convert_hf_to_gguf's ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(cfg, hf: dict) -> dict[str, torch.Tensor]:
    """HF Llama tensors under llama.cpp's GGUF names (q/k permuted; ``rope_freqs`` for llama3 RoPE)."""
    import dataclasses

    from funcspec.nn.llama import rope_inv_freq

    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = hf["lm_head.weight"]
    if cfg.moe.num_experts:
        return {**out, **_moe_tensors(cfg, hf)}
    names = {v: k for k, v in LAYER.items() if k not in ("attn_q_norm", "attn_k_norm")}
    for i in range(cfg.num_layers):
        for name, gg in names.items():
            w = hf[f"model.layers.{i}.{name}.weight"]
            if gg == "attn_q":
                w = rope_permute(w, cfg.num_heads)
            elif gg == "attn_k":
                w = rope_permute(w, cfg.num_kv_heads)
            out[f"blk.{i}.{gg}.weight"] = w
    if cfg.rope_scaling:  # llama.cpp divides each frequency by its factor: default / scaled
        plain = dataclasses.replace(cfg, rope_scaling=())
        out["rope_freqs.weight"] = rope_inv_freq(plain) / rope_inv_freq(cfg)  # [D/2]
    return out


def _moe_tensors(cfg, hf: dict) -> dict[str, torch.Tensor]:
    """A MoE decoder's layer tensors (``hf``: experts stacked, :func:`funcspec.checkpoints.experts.stack`) under
    the converter's names; q/k rows permuted for Mixtral (``llama``) only."""
    gguf_name = {v: k for k, v in LAYER.items()}
    gguf_name.update({v: k for k, v in MOE_LAYER.items() if k != "exp_probs_b"})
    if cfg.arch == "glm4_moe":
        gguf_name["post_attention_layernorm"] = "post_attention_norm"
    out = {}
    for key, w in hf.items():
        if not key.startswith("model.layers."):
            continue
        _, _, i, rest = key.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj.weight":
            half = w.shape[1] // 2
            out[blk + EXPERTS[0] + ".weight"], out[blk + EXPERTS[1] + ".weight"] = w[:, :half], w[:, half:]
        elif rest == "mlp.experts.down_proj.weight":
            out[blk + EXPERTS[2] + ".weight"] = w
        elif rest == "mlp.gate.e_score_correction_bias":
            out[blk + "exp_probs_b.bias"] = w
        elif module.startswith(("mlp.shared_expert.", "mlp.shared_experts.")):
            out[blk + {v: k for k, v in SHARED.items()}[module.split(".")[-1]] + "." + leaf] = w
        elif module == "mlp.shared_expert_gate":
            out[blk + "ffn_gate_inp_shexp." + leaf] = w.flatten()  # llama.cpp holds it as [H]
        else:
            name = gguf_name[module]
            if cfg.arch == "mixtral" and name in ("attn_q", "attn_k"):
                w = rope_permute(w, cfg.num_heads if name == "attn_q" else cfg.num_kv_heads)
            out[blk + name + "." + leaf] = w
    return out


def write(ckpt: Path, path: Path, kind: str) -> Path:
    """HF checkpoint ``ckpt`` as GGUF file ``path`` (:data:`GGUF_ARCH`'s architecture, ``deepseek2`` for
    DeepSeek-V2 / V3; a placeholder SentencePiece vocabulary), its 2-D and 3-D weights stored as ``kind``
    (:data:`WRITE_KINDS`); an existing file is kept."""
    import gguf

    if kind not in WRITE_KINDS:
        raise ValueError(f"kind must be one of {WRITE_KINDS}, got {kind!r}")
    if path.exists():
        return path
    hf = read_config(ckpt)[1]
    if gguf_deepseek.is_deepseek(hf):
        return _write_deepseek(ckpt, path, kind, hf)
    cfg = model_config(hf)
    arch = GGUF_ARCH.get(cfg.arch, "llama")
    w = gguf.GGUFWriter(str(path) + ".tmp", arch)
    w.add_name(Path(ckpt).name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    if cfg.moe.num_experts:
        _add_moe(w, gguf, cfg, arch)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size or cfg.moe.num_experts:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    _add_vocab(w, gguf, cfg.vocab_size, cfg.bos_token_id, (cfg.eos_token_ids or (2,))[0])
    weights = read_weights(ckpt)
    if cfg.moe.num_experts:
        weights = experts.stack(weights, cfg.moe, str(ckpt))
    return _finish(w, gguf, tensors(cfg, weights), kind, path)


def _write_deepseek(ckpt: Path, path: Path, kind: str, hf: dict) -> Path:
    """DeepSeek-V2 / V3 checkpoint ``ckpt`` (HF config ``hf``) as a ``deepseek2`` GGUF file, as :func:`write`."""
    import gguf

    w = gguf.GGUFWriter(str(path) + ".tmp", gguf_deepseek.ARCH)
    w.add_name(Path(ckpt).name)
    w.add_context_length(hf.get("max_position_embeddings", 2048))
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_layer_norm_rms_eps(hf.get("rms_norm_eps", 1e-6))
    w.add_vocab_size(hf["vocab_size"])
    gguf_deepseek.add_metadata(w, gguf, hf)
    eos = hf.get("eos_token_id")
    _add_vocab(w, gguf, hf["vocab_size"], hf.get("bos_token_id"), eos[0] if isinstance(eos, list) else eos)
    weights = experts.stack(read_weights(ckpt), experts.MoEConfig(hf["n_routed_experts"]), str(ckpt))
    out = {"token_embd.weight": weights["model.embed_tokens.weight"],
           "output_norm.weight": weights["model.norm.weight"]}
    if not hf.get("tie_word_embeddings", False):
        out["output.weight"] = weights["lm_head.weight"]
    return _finish(w, gguf, {**out, **gguf_deepseek.tensors(hf, weights)}, kind, path)


def _finish(w, gguf, named: dict[str, torch.Tensor], kind: str, path: Path) -> Path:
    """Writes the file type, the tensors ``named`` (stored as ``kind``: 1-D ones and routers in f32) and the file,
    then moves it into place at ``path``."""
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    w.add_file_type(file_types[kind])
    for name, t in named.items():
        if kind == "float32" or t.dim() == 1 or name.split(".")[-2] in FLOAT:
            w.add_tensor(name, t.float().contiguous().numpy())
        elif kind == "bfloat16":  # bf16 bits as int16, tagged BF16
            w.add_tensor(name, t.to(torch.bfloat16).contiguous().view(torch.int16).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
            w.add_tensor(name, gguf.quants.quantize(t.float().contiguous().numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".tmp").replace(path)
    return path


def _add_moe(w, gguf, cfg, arch: str) -> None:
    """The converter's ``{arch}.expert_*`` keys of ``cfg.moe``."""
    m = cfg.moe
    w.add_expert_count(m.num_experts)
    w.add_expert_used_count(m.top_k)
    if arch == "llama":  # Mixtral: the experts' size is feed_forward_length
        return
    w.add_expert_feed_forward_length(m.intermediate_size)
    w.add_expert_weights_norm(m.norm_topk_prob)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(m.shared_intermediate_size)
    if arch == "glm4moe":
        w.add_leading_dense_block_count(min(m.sparse_layers, default=0))
        w.add_expert_shared_count(m.shared_intermediate_size // m.intermediate_size)
        w.add_expert_weights_scale(m.routed_scaling_factor)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(m.n_group)
        w.add_expert_group_used_count(m.topk_group)
        w.add_nextn_predict_layers(0)


def _add_vocab(w, gguf, n: int, bos, eos) -> None:
    """A placeholder SentencePiece vocab of ``n`` tokens (llama.cpp needs one): <unk>, byte tokens, BOS / EOS
    (1 and 2 where ``None``), filler names."""
    bos, eos = 1 if bos is None else bos, 2 if eos is None else eos
    tokens = [f"t{i}" for i in range(n)]
    types = [gguf.TokenType.NORMAL] * n
    tokens[0], types[0] = "<unk>", gguf.TokenType.UNKNOWN
    for b in range(256):  # ids 3..258 as in Llama 2's vocab: "<0x0A>" is the newline llama.cpp looks up
        if 3 + b < n and 3 + b not in (bos, eos):
            tokens[3 + b], types[3 + b] = f"<0x{b:02X}>", gguf.TokenType.BYTE
    tokens[bos], types[bos] = "<s>", gguf.TokenType.CONTROL
    tokens[eos], types[eos] = "</s>", gguf.TokenType.CONTROL
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
