"""DeepSeek-V3.2 targets: sparse attention (the lightning indexer and its key cache) equals transformers
through prefill and latent decode, and greedy speculation on it equals greedy AR.

The prompts are longer than ``index_topk`` (8), so each query attends to a
subset of what it sees, and the indexer's choice changes the logits.
"""

import dataclasses

import pytest
import torch
import transformers

from funcspec import LLM, Engine, SamplingParams
from funcspec.checkpoints.llama import hf_config_dict, load_model, model_config
from funcspec.nn import forward, init_kv_cache
from funcspec.nn.deepseek import LatentCache, latent_bytes_per_token
from funcspec.tree import slot_leaves

from spec_cases import _ids, _prompts, _spec, assert_captured_lossless

TOPK = 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
              q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              index_n_heads=8, index_head_dim=16, index_topk=TOPK)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def make_v32(path, seed: int = 0, **overrides):
    """Save a tiny random DeepseekV32ForCausalLM to ``path``; return the HF model (weights scaled up for wide
    greedy margins, a random correction bias, a random indexer key norm)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV32Config(**{**CONFIG, **overrides})
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
        for name, m in model.named_modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape).abs() * 0.5)
            if name.endswith("indexer.k_norm"):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    return model


def _steps(cfg, params, tokens, prefill: int, max_len: int = 64):
    """funcspec's logits of tokens [B, T]: a prefill of ``prefill`` tokens, then one token a step."""
    kv = init_kv_cache(cfg, tokens.shape[0], max_len)
    slots = torch.arange(tokens.shape[0])
    got, _, kv = forward(cfg, params, kv, tokens[:, :prefill], slots, torch.zeros(tokens.shape[0], dtype=torch.long))
    steps = [got]
    for t in range(prefill, tokens.shape[1]):
        step, _, kv = forward(cfg, params, kv, tokens[:, t:t + 1], slots, torch.full((tokens.shape[0],), t))
        steps.append(step)
    return torch.cat(steps, 1), kv


@pytest.mark.parametrize(("rope", "prefill"), [("default", 40), ("yarn", 40), ("default", 140)])
def test_logits_prefill_and_decode_equal_transformers(tmp_path, rope, prefill):
    """A prefill, then 8 decode steps over a cache of 16 positions more: each query attends to its 8 best.
    Blocks up to MATH_TOKENS_MAX tokens (decode, the 40-token prefill) gather the selected latents; the
    140-token prefill masks its read."""
    hf = make_v32(tmp_path, **({"rope_parameters": YARN} if rope == "yarn" else {}))
    model = load_model(tmp_path)
    assert (model.cfg.arch, model.cfg.mla.index_topk, model.cfg.mla.index_n_heads) == ("deepseek_v32", TOPK, 8)
    tokens = torch.randint(3, 96, (2, prefill + 8), generator=torch.Generator().manual_seed(1))
    got, kv = _steps(model.cfg, model.params, tokens, prefill, prefill + 24)
    assert isinstance(kv, LatentCache) and kv.index.shape == (3, 3, 1, prefill + 24, 16)
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    # the selection matters: attending to every visible position gives other logits past the first TOPK
    dense = dataclasses.replace(model.cfg, mla=dataclasses.replace(model.cfg.mla, index_topk=1 << 20))
    full, _ = _steps(dense, model.params, tokens, prefill, prefill + 24)
    torch.testing.assert_close(full[:, :TOPK], want[:, :TOPK], atol=5e-5, rtol=1e-5)
    assert (full[:, TOPK:] - want[:, TOPK:]).abs().amax() > 0.1


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    hf = make_v32(tmp_path)
    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        hf.generation_config.eos_token_id = None  # the engine ignores EOS too (min_new_tokens would mask it)
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    out = LLM(str(tmp_path), enforce_eager=True, max_model_len=64).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == hf_ids[0, len(prompt):].tolist()


def test_config_reads_the_indexer_and_round_trips():
    cfg = model_config({**CONFIG, "architectures": ["DeepseekV32ForCausalLM"]})
    m = cfg.mla
    assert (m.q_lora_rank, m.index_n_heads, m.index_head_dim, m.index_topk) == (24, 8, 16, TOPK)
    assert model_config(hf_config_dict(cfg, bos_token_id=1, eos_token_id=2)) == cfg


def test_v32_without_q_lora_rank_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="q_lora_rank"):
        model_config({**CONFIG, "q_lora_rank": None, "architectures": ["DeepseekV32ForCausalLM"]})


def test_indexer_keys_are_a_declared_slot_leaf_and_count_in_bytes_per_token():
    cfg = model_config({**CONFIG, "architectures": ["DeepseekV32ForCausalLM"]})
    kv = init_kv_cache(cfg, 2, 16)
    assert kv.index.shape == (3, 3, 1, 16, 16)
    assert [(tuple(t.shape), axis) for t, axis in slot_leaves(kv)] == [((3, 3, 1, 16, 40), 1), ((3, 3, 1, 16, 16), 1),
                                                                      ((3,), 0)]
    assert kv.entries() == (kv.latent, kv.index)
    assert latent_bytes_per_token(cfg, 2) == 3 * (32 + 8 + 16) * 2


# ----------------------------------------------------------------------------- speculation
def _long_prompts(n: int) -> list[list[int]]:
    """Repetitive prompts (ngram finds matches) of 20 to 38 tokens: longer than index_topk."""
    return [(p * 12)[: 20 + (i * 7) % 19] for i, p in enumerate(_prompts(n))]


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v32")
    make_v32(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(v32):
    prompts = _long_prompts(12)
    return prompts, _ids(Engine(v32, max_batch_size=4, max_model_len=96).generate(prompts, GREEDY))


TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"


def test_the_prompts_exercise_the_selection(tmp_path, reference):
    """The same weights attending to every visible position emit other tokens: the speculation tests below
    compare steps whose indexer chose."""
    make_v32(tmp_path, index_topk=4096)
    prompts, want = reference
    dense = _ids(Engine(str(tmp_path), max_batch_size=4, max_model_len=96).generate(prompts, GREEDY))
    assert sum(a != b for a, b in zip(dense, want)) >= 6


@pytest.mark.parametrize("method", ["ngram", "ngram-tree"])
def test_greedy_speculation_on_v32_equals_ar(v32, reference, method):
    """A chain, and a token tree (its nodes' indexer keys moved along the accepted path with the latents)."""
    prompts, want = reference
    spec = _spec("ngram", 3) if method == "ngram" else _spec("ngram", 5, speculative_token_tree=TREE)
    eng = Engine(v32, speculative_config=spec, max_batch_size=4, max_model_len=96)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    assert eng.stats["mean_acceptance_length"] > 1.5  # the drafts were accepted: verify blocks did the work


@pytest.mark.parametrize("method", ["ngram", "ngram-tree"])
def test_captured_speculation_on_v32_equals_ar(v32, reference, method):
    spec = _spec("ngram", 3) if method == "ngram" else _spec("ngram", 5, speculative_token_tree=TREE)
    eng = assert_captured_lossless(v32, spec, *reference, warm=4)
    assert eng.stats["graph_breaks"] == 0
