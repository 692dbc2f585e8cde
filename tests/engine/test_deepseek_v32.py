"""DeepSeek-V3.2 targets (MLA whose attention reads only its lightning indexer's top-k positions) equal
transformers with ``index_topk`` smaller than the context, and greedy speculation on them equals greedy AR."""

import pytest
import torch
import transformers

from funcspec import Engine
from funcspec.checkpoints import init_draft_head
from funcspec.checkpoints.llama import load_model, model_config
from funcspec.nn import forward, init_kv_cache
from funcspec.nn.deepseek import LatentCache, latent_bytes_per_token
from funcspec.nn.llama import KVRead

from spec_cases import (GREEDY, _ids, _spec, ar_reference, assert_captured_lossless,
                        assert_decode_equals_hf, assert_generate_equals_hf, random_moe)

TOPK = 6
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            index_n_heads=8, index_head_dim=32, index_topk=TOPK)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def make_v32(path=None, seed: int = 0, **overrides):
    """A tiny random DeepSeek-V3.2 (saved to ``path`` if given): weights scaled up for wide greedy margins, the
    router's correction bias and the indexer's LayerNorm random so that both count."""
    model = random_moe(transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(**{**BASE, **overrides}),
                       seed, positive_bias=True)
    if path is not None:
        model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn"])
def test_logits_prefill_and_decode_equal_transformers(tmp_path, rope):
    """Prefill of 12 tokens, then 6 decode steps, each query attending over its top 6 of up to 18 positions."""
    overrides = {} if rope is None else {"rope_parameters": rope}
    hf = make_v32(tmp_path, **overrides)
    model = load_model(tmp_path)
    assert model.cfg.mla.index_topk == TOPK
    tokens = torch.randint(3, 96, (2, 18), generator=torch.Generator().manual_seed(1))
    kv = init_kv_cache(model.cfg, 2, 32)
    assert isinstance(kv, LatentCache) and kv.index.shape == (3, 3, 1, 32, 32)
    with torch.no_grad():
        want = hf(tokens).logits
        dense = make_v32(index_topk=64, **overrides)(tokens).logits  # the same weights, every position read
    assert (want - dense)[:, TOPK:].abs().amax() > 1.0  # the selection changes the logits: it is tested
    assert_decode_equals_hf(model, hf, tokens, 12, torch.tensor([1, 0]))


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    assert_generate_equals_hf(tmp_path, make_v32(tmp_path), 14)


def test_a_long_prefill_attends_in_chunks_equal_to_one_pass_and_transformers(tmp_path, monkeypatch):
    """A prefill gathers T · index_topk latents; past dsa.GATHER_ELEMENTS it attends a few query rows a pass.
    Here 30 tokens in passes of 7 rows: the same bits as one pass, and transformers' logits. (The tokens are
    chosen: at 40 of them two queries of layer 1 find exact ties at their 6th score, relu's zeros, where
    funcspec keeps the earlier position and torch's top-k in transformers another.)"""
    from funcspec.kernels import Ops
    from funcspec.nn import dsa

    hf = make_v32(tmp_path)
    model = load_model(tmp_path)
    tokens = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    z, slots = torch.zeros(2, dtype=torch.long), torch.arange(2)
    one, _, _ = forward(model.cfg, model.params, init_kv_cache(model.cfg, 2, 48), tokens, slots, z)
    shapes, real = [], Ops.sparse_attention
    monkeypatch.setattr(Ops, "sparse_attention", lambda self, q, keys, *a: shapes.append(tuple(keys.shape)) or
                        real(self, q, keys, *a))
    monkeypatch.setattr(dsa, "GATHER_ELEMENTS", 7 * TOPK * (32 + 8 + 4))  # 7 rows of 6 latents and 4 heads' scores
    chunked, _, _ = forward(model.cfg, model.params, init_kv_cache(model.cfg, 2, 48), tokens, slots, z)
    assert shapes == ([(2, 7, TOPK, 40)] * 4 + [(2, 2, TOPK, 40)]) * 3  # every layer: 30 = 4 · 7 + 2 rows
    assert torch.equal(chunked, one)
    with torch.no_grad():
        torch.testing.assert_close(chunked, hf(tokens).logits, atol=5e-5, rtol=1e-5)


def test_config_reads_the_indexer_and_the_cache_holds_its_keys():
    cfg = model_config({**BASE, "architectures": ["DeepseekV32ForCausalLM"]})
    m = cfg.mla
    assert (m.index_n_heads, m.index_head_dim, m.index_topk, m.q_lora_rank) == (8, 32, TOPK, 24)
    assert latent_bytes_per_token(cfg, 2) == 3 * (32 + 8 + 32) * 2  # latent + rope key + index key, per layer


@pytest.mark.parametrize("fields, message", [
    (dict(q_lora_rank=None), "q_lora_rank must be positive with index_topk"),
    (dict(index_head_dim=4), r"index_head_dim \(4\) must hold the even qk_rope_head_dim \(8\)"),
])
def test_an_indexer_that_cannot_be_built_is_refused_by_field(fields, message):
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        model_config({**BASE, **fields, "architectures": ["DeepseekV32ForCausalLM"]})


# ----------------------------------------------------------------------------- speculation
@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32")
    make_v32(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(v32):
    return ar_reference(v32)


TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "eagle3-tree"])
def test_greedy_speculation_on_v32_equals_ar(v32, reference, tmp_path, method):
    """A chain and token trees: verification blocks select positions as AR does, a tree's nodes among their
    ancestors, and its accepted path's index keys move with its latents."""
    prompts, want = reference
    spec = _spec("ngram", 3) if method == "ngram" else _spec("ngram", 5, speculative_token_tree=TREE)
    if method == "eagle3-tree":
        spec = {"method": "eagle3", "model": str(init_draft_head("eagle3", v32, tmp_path / "eagle3")),
                "num_speculative_tokens": 5, "speculative_token_tree": TREE}
    assert _ids(Engine(v32, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True).generate(
        prompts, GREEDY)) == want


@pytest.mark.parametrize("method", ["ngram", "ngram-tree"])
def test_captured_speculation_on_v32_equals_ar(v32, reference, method, traced_codegen):
    """A chain and a tree block, one graph each, lossless, never recompiled. NOTE: both run Dynamo's graph in
    place of inductor's codegen (``traced_codegen``): V3.2's step (latent attention, its indexer, experts) is
    compiled by real inductor under MTP in tests/engine/test_mtp_hosts.py, and an ngram tree's block by the
    logprobs matrix of tests/engine/test_logprobs.py; eager runs the tree on V3.2 above."""
    prompts, want = reference
    spec = _spec("ngram", 3) if method == "ngram" else _spec("ngram", 5, speculative_token_tree=TREE)
    eng = assert_captured_lossless(v32, spec, prompts, want, warm=4)
    assert eng.stats()["graph_breaks"] == 0 and eng.stats()["mean_acceptance_length"] > 1.2


def test_sparse_attention_gathers_only_the_selected_latents(tmp_path, monkeypatch):
    """Past index_topk positions, attention runs through the Ops hooks (the places Ascend's npu_mla_prolog and
    npu_sparse_flash_attention would take) on exactly index_topk gathered latents a query; within them, densely."""
    from funcspec.kernels import Ops

    make_v32(tmp_path)
    model = load_model(tmp_path)
    seen, real = [], Ops.sparse_attention
    monkeypatch.setattr(Ops, "sparse_attention", lambda self, q, keys, *a: seen.append(keys.shape) or
                        real(self, q, keys, *a))
    tokens = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    kv = init_kv_cache(model.cfg, 1, 16)
    z = torch.zeros(1, dtype=torch.long)
    forward(model.cfg, model.params, kv, tokens[:, :TOPK], z, z, read=KVRead(TOPK))  # reads 6: no selection
    assert seen == []
    forward(model.cfg, model.params, kv, tokens[:, TOPK:], z, torch.full((1,), TOPK))  # reads 16 positions
    assert seen == [(1, 10 - TOPK, TOPK, 32 + 8)] * 3  # every layer: [B, T, index_topk, R + rope]
