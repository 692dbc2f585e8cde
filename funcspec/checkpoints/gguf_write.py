"""GGUF files written from HF Llama checkpoints: what ``bench scale`` hands llama.cpp, and the tests' GGUF files.

The writer mirrors llama.cpp's ``convert_hf_to_gguf.py`` for the Llama
architecture: its tensor names, the q/k row permutation for its RoPE, the
Llama-3 RoPE factors as ``rope_freqs``, norms in f32, and a placeholder
SentencePiece vocabulary (the weights are random; llama.cpp needs a vocabulary
to load). Quantized files come from ``gguf``'s own Q8_0 / Q4_0 quantizers, or
from llama.cpp's ``llama_model_quantize`` (Q4_K_M and the rest) on the bf16 file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from funcspec.checkpoints.files import read_config, read_weights
from funcspec.checkpoints.gguf import LAYER
from funcspec.checkpoints.llama import model_config

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


def write(ckpt: Path, path: Path, kind: str) -> Path:
    """HF Llama checkpoint ``ckpt`` as GGUF file ``path`` (llama arch, a placeholder SentencePiece vocabulary), its
    2-D weights stored as ``kind`` (:data:`WRITE_KINDS`); an existing file is kept."""
    import gguf

    if kind not in WRITE_KINDS:
        raise ValueError(f"kind must be one of {WRITE_KINDS}, got {kind!r}")
    if path.exists():
        return path
    cfg = model_config(read_config(ckpt)[1])
    w = gguf.GGUFWriter(str(path) + ".tmp", "llama")
    w.add_name(Path(ckpt).name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    w.add_file_type(file_types[kind])
    _add_vocab(w, gguf, cfg)
    for name, t in tensors(cfg, read_weights(ckpt)).items():
        if kind == "float32" or t.dim() == 1:
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


def _add_vocab(w, gguf, cfg) -> None:
    """A placeholder SentencePiece vocab (llama.cpp needs one): <unk>, byte tokens, BOS / EOS, filler names."""
    n, bos, eos = cfg.vocab_size, cfg.bos_token_id, (cfg.eos_token_ids or (2,))[0]
    bos = 1 if bos is None else bos
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
