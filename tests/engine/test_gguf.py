"""GGUF files run as they are: Q8_0 / Q4_0 / Q4_K blocks become funcspec's quantized linears exactly as llama.cpp's
block formats define them (checked against gguf's own dequantizer), llama's q/k rows are put back in HF order,
the tokenizer comes from the file, and speculation on a GGUF model equals AR on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_hf_model
from funcspec import LLM, Engine, SamplingParams, load_model
from funcspec.checkpoints import gguf as ggufmod
from funcspec.checkpoints import gguf_write
from funcspec.kernels import quant
from funcspec.nn.llama import forward, init_kv_cache

gguf = pytest.importorskip("gguf")  # a [test] dependency (and the [gguf] extra): always there in CI
T = gguf.GGMLQuantizationType
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5, 6]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_src")
    make_hf_model(path / "hf", num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    return path


def _logits(model, tokens):
    z = torch.zeros(1, dtype=torch.int64)
    return forward(model.cfg, model.params, init_kv_cache(model.cfg, 1, len(tokens)), torch.tensor([tokens]), z, z)[0]


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0", "q4_0"])
def test_a_gguf_file_loads_with_its_tokenizer_and_speculation_equals_ar(hf_dir, kind):
    """GGUF written from an HF Llama (q/k permuted as llama.cpp's converter does) loads back: float files give HF's
    logits, quantized ones keep their blocks and stay close; ngram speculation equals AR on the same file."""
    path = gguf_write.write(hf_dir / "hf", hf_dir / f"m-{kind}.gguf", kind)
    model, ref = load_model(path), load_model(hf_dir / "hf")
    q = model.params["model"]["layers"][0]["self_attn"]["q_proj"]
    assert ("qweight" in q) == kind.startswith("q") and model.tokenizer is not None
    assert model.tokenizer.convert_ids_to_tokens(3) == "<0x00>"  # the file's own vocabulary
    tokens = [1, 5, 9, 13, 2, 7]
    diff = (_logits(model, tokens) - _logits(ref, tokens)).abs().max().item()
    assert diff < {"float32": 1e-5, "bfloat16": 0.05, "q8_0": 0.2, "q4_0": 2.0}[kind]
    ar = [o.outputs[0].token_ids for o in Engine(str(path), max_num_seqs=2,
                                                 enforce_eager=True).generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    assert [o.outputs[0].token_ids for o in Engine(str(path), spec, max_num_seqs=2,
                                                   enforce_eager=True).generate(PROMPTS, GREEDY)] == ar


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_q8_0_and_q4_0_blocks_decode_exactly_as_gguf_dequantizes_them(kind):
    g = np.random.default_rng(0)
    w = g.standard_normal((40, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[kind])  # [40, row bytes]
    q, s, o = ggufmod.blocks(raw, kind, 40, 96)
    p = ggufmod.quantized_linear(q, s, o, 8 if kind == "Q8_0" else 4, kind)
    mine = quant.dequantize(p["qweight"], p["scales"], None, p["format"])
    assert torch.equal(mine, torch.from_numpy(gguf.quants.dequantize(raw, T[kind])))


def _random_q4_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K rows [N, K/256 x 144 bytes] with small positive fp16 d and dmin (any scale/min bits, nibbles)."""
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.float16(g.uniform(0.001, 0.01)).reshape(1).view(np.uint8)
    blocks[..., 2:4] = np.float16(g.uniform(0.0005, 0.005)).reshape(1).view(np.uint8)
    return blocks.reshape(n, -1)


def test_q4_k_blocks_decode_as_gguf_dequantizes_them_within_fp16_scales():
    """Q4_K's d·sc and dmin·m are stored in fp16: within a relative 2^-11 of each scale, so within that of the
    weights' range; values, sub-block order and nibble order exactly as llama.cpp's."""
    raw = _random_q4_k(8, 512)
    q, s, o = ggufmod.blocks(raw, "Q4_K", 8, 512)
    p = ggufmod.quantized_linear(q, s, o, 4, "gguf-q4_k")
    mine = quant.dequantize(p["qweight"], p["scales"], p["offsets"], p["format"])
    want = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K))
    assert mine.shape == want.shape == (8, 512)
    torch.testing.assert_close(mine, want, atol=want.abs().max().item() * 2 ** -10, rtol=0)


def test_q6_k_blocks_decode_as_gguf_dequantizes_them_within_fp16_scales():
    """Q6_K (Q4_K_M files' other type) as 6-bit weights in groups of 16, streamed in 7 bits a weight: its values,
    bit planes and int8 sub-block scales as llama.cpp lays them out, d·sc rounded to fp16."""
    g = np.random.default_rng(1)
    blocks = g.integers(0, 256, (6, 2, 210), dtype=np.uint8)
    blocks[..., 208:210] = np.float16(0.003).reshape(1).view(np.uint8)
    raw = blocks.reshape(6, -1)
    q, s, o = ggufmod.blocks(raw, "Q6_K", 6, 512)
    p = ggufmod.quantized_linear(q, s, o, ggufmod.QUANTIZED["Q6_K"], "gguf-q6_k")
    assert (p["format"].bits, p["format"].group, p["format"].asym) == (6, 16, False)
    assert p["format"].bytes == 32 * 512 * 7 // 8 and p["qweight"].numel() == 32 * 512 * 6 // 8  # N padded to 32
    mine = quant.dequantize(p["qweight"], p["scales"], None, p["format"])
    want = torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K))
    torch.testing.assert_close(mine, want, atol=want.abs().max().item() * 2 ** -10, rtol=0)


def test_q4_k_model_runs_losslessly(tmp_path):
    """A model whose linears are Q4_K blocks (random here: no Q4_K quantizer in gguf-py), the LM head tied to a
    Q4_K token_embd: it loads with its head quantized and ngram speculation equals AR."""
    make_hf_model(tmp_path / "hf", num_hidden_layers=1, hidden_size=256, intermediate_size=512, vocab_size=96,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    ref = load_model(tmp_path / "hf")
    cfg = ref.cfg
    w = gguf.GGUFWriter(str(tmp_path / "q4k.gguf"), "llama")
    for key, value in (("context_length", 256), ("embedding_length", 256), ("block_count", 1),
                       ("feed_forward_length", 512), ("head_count", 4), ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    flat = {"model.embed_tokens.weight": ref.params["model"]["embed_tokens"]["weight"]}
    for name, t in gguf_write.tensors(cfg, {**_flat(ref.params), **flat}).items():
        if t.dim() == 1:
            w.add_tensor(name, t.float().numpy())
        else:
            w.add_tensor(name, _random_q4_k(t.shape[0], t.shape[1], seed=len(name)), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load_model(tmp_path / "q4k.gguf")
    assert model.params["lm_head"]["format"].name == "gguf-q4_k" and model.params["lm_head"]["format"].asym
    assert model.tokenizer is None  # this file has no vocabulary
    ar = [o.outputs[0].token_ids for o in Engine(model, max_num_seqs=2, enforce_eager=True).generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    assert [o.outputs[0].token_ids for o in Engine(model, spec, max_num_seqs=2,
                                                   enforce_eager=True).generate(PROMPTS, GREEDY)] == ar


def _flat(params, prefix=""):
    from funcspec.checkpoints import flatten

    return flatten(params, prefix)


def test_llm_takes_a_gguf_path_and_a_tokenizer_directory(hf_dir):
    path = gguf_write.write(hf_dir / "hf", hf_dir / "m-q8_0.gguf", "q8_0")
    llm = LLM(model=str(path), quantization="gguf", enforce_eager=True, max_num_seqs=2)
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert load_model(path, tokenizer=hf_dir / "hf").tokenizer is None  # the HF dir ships no tokenizer files


def test_q_and_k_rows_go_back_to_hf_order():
    w = torch.arange(16 * 3).reshape(16, 3)
    assert torch.equal(torch.from_numpy(ggufmod.unpermute(gguf_write.rope_permute(w, 2).numpy(), 2)), w)


def test_bad_gguf_files_name_the_problem(hf_dir, tmp_path):
    path = gguf_write.write(hf_dir / "hf", hf_dir / "m-q4_0.gguf", "q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match="cut.gguf: not a readable GGUF file"):
        load_model(cut)
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture 'gemma' is not a decoder funcspec runs"):
        load_model(tmp_path / "gemma.gguf")


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash", "medusa-shared"])
def test_draft_heads_over_a_tied_quantized_gguf_target_are_lossless(tmp_path, method):
    """A GGUF target with tied embeddings projects through its quantized token_embd; heads that share the target's
    LM head (EAGLE-1, DFlash, Medusa version 2) share that quantized head; EAGLE-3 ships its own float one.
    Speculation equals AR on the same file."""
    from safetensors.torch import load_file, save_file

    from funcspec.checkpoints import init_draft_head

    make_hf_model(tmp_path / "hf", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  tie_word_embeddings=True)
    path = gguf_write.write(tmp_path / "hf", tmp_path / "m.gguf", "q4_0")
    target = load_model(path)
    assert "qweight" in target.params["lm_head"]
    head = init_draft_head(method.split("-")[0], tmp_path / "hf", tmp_path / "head",
                           **({"num_layers": 1} if method == "dflash" else {}))
    if method == "medusa-shared":  # FasterDecoding's version 2: no projections of its own
        (f,) = head.glob("*.safetensors")
        save_file({k: v for k, v in load_file(f).items() if not k.endswith(".1.weight")}, f)
    spec = {"method": method.split("-")[0], "model": str(head), "num_speculative_tokens": 3}
    eng = Engine(target, spec, max_num_seqs=2, enforce_eager=True)
    drafter_head = eng.params["draft"].get("lm_head")
    if method != "eagle3":
        assert drafter_head is eng.params["target"]["lm_head"]
    else:
        assert drafter_head["weight"].dtype == torch.float32
    ar = [o.outputs[0].token_ids for o in Engine(target, max_num_seqs=2,
                                                 enforce_eager=True).generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar
