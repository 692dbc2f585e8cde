"""DeepSeek-V2 / V3 targets (multi-head latent attention over a latent cache, DeepSeekMoE, YaRN) equal
transformers, and greedy speculation on them equals greedy AR."""

import pytest
import torch
import transformers

from funcspec import Engine
from funcspec.checkpoints import init_draft_head
from funcspec.checkpoints.llama import hf_config_dict, load_model, model_config
from funcspec.nn import init_kv_cache
from funcspec.nn.deepseek import LatentCache, expanded_bytes_per_token, latent_bytes_per_token

from spec_cases import (GREEDY, _ids, _prompts, _spec, ar_reference, assert_captured_lossless,
                        assert_decode_equals_hf, assert_generate_equals_hf, random_moe)

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
FAMILIES = {
    # V2-Lite: one q_proj (no q_lora_rank), softmax router, raw top-k weights, YaRN with mscale
    "v2_lite": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                dict(q_lora_rank=None, topk_method="greedy", rope_parameters=YARN)),
    # V2: group-limited greedy (the best expert of each group), q_lora_rank
    "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
           dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                routed_scaling_factor=1.5)),
    # V3: q_lora_rank, sigmoid router with a correction bias, groups by their best two, interleaved RoPE, YaRN
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
           dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN)),
}


def make_deepseek(path, family: str, seed: int = 0, **overrides):
    """Save a tiny random DeepSeek of ``family`` to ``path``; return the HF model (weights scaled up for wide
    greedy margins, V3's correction bias random so that it changes the experts chosen)."""
    config_cls, model_cls, extra = FAMILIES[family]
    model = random_moe(model_cls, config_cls(**{**BASE, **extra, **overrides}), seed, positive_bias=True)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_prefill_and_decode_equal_transformers(tmp_path, family):
    """Prefill of 9 tokens, then 4 single-token decode steps that read only the latent cache."""
    hf = make_deepseek(tmp_path, family)
    model = load_model(tmp_path)
    kv = init_kv_cache(model.cfg, 2, 32)
    assert isinstance(kv, LatentCache) and kv.latent.shape == (3, 3, 1, 32, 32 + 8) and kv.index is None
    tokens = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_decode_equals_hf(model, hf, tokens, 9, torch.arange(2))


@pytest.mark.parametrize("family", ["v2_lite", "v3"])
def test_long_prefill_expands_the_latent_and_equals_transformers(tmp_path, family, monkeypatch):
    """A prefill longer than MATH_TOKENS_MAX attends over expanded per-head keys and values (not in latent space),
    then decoding continues from the latent it cached."""
    from funcspec.nn import deepseek

    hf = make_deepseek(tmp_path, family)
    model = load_model(tmp_path)
    paths = []
    for name in ("expanded_out", "mla_out"):
        real = getattr(deepseek, name)
        monkeypatch.setattr(deepseek, name, lambda *a, _r=real, _n=name, **k: paths.append(_n) or _r(*a, **k))
    tokens = torch.randint(3, 96, (1, 140), generator=torch.Generator().manual_seed(4))
    assert_decode_equals_hf(model, hf, tokens, 136, torch.zeros(1, dtype=torch.long), atol=1e-4)
    assert paths == ["expanded_out"] * 3 + ["mla_out"] * 3 * 4  # 3 layers: the prefill, then 4 decode steps


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers_generate(tmp_path, family):
    assert_generate_equals_hf(tmp_path, make_deepseek(tmp_path, family), 12)


def test_config_reads_mla_moe_and_yarn():
    cfgs = {f: model_config({**BASE, **FAMILIES[f][2], "architectures": [FAMILIES[f][1].__name__]})
            for f in FAMILIES}
    lite, v2, v3 = cfgs["v2_lite"], cfgs["v2"], cfgs["v3"]
    assert (lite.mla.q_lora_rank, lite.mla.kv_lora_rank, lite.head_dim, lite.moe.n_group) == (0, 32, 8, 1)
    assert (v2.moe.scoring, v2.moe.group_score, v2.moe.n_group, v2.moe.norm_topk_prob) == ("softmax", "max", 4, False)
    assert (v3.moe.scoring, v3.moe.group_score, v3.moe.correction_bias) == ("sigmoid", "top2", True)
    assert v3.moe.sparse_layers == (1, 2) and v3.moe.shared_intermediate_size == 32
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1
    assert v3.mla.softmax_scale == pytest.approx(24 ** -0.5 * mscale ** 2)
    for f, cfg in cfgs.items():
        assert model_config(hf_config_dict(cfg, bos_token_id=1, eos_token_id=2)) == cfg, f


@pytest.mark.parametrize(("arch", "part"), [("Qwen3NextForCausalLM", "hybrid linear attention"),
                                           ("DeepseekV4ForCausalLM", "compressed sparse attention")])
def test_architectures_not_built_are_refused_naming_what_is_missing(tmp_path, arch, part):
    (tmp_path / "config.json").write_text(f'{{"architectures": ["{arch}"], "hidden_size": 64}}')
    with pytest.raises(ValueError, match=f"{arch} needs .*{part}.*which funcspec does not build yet"):
        Engine(str(tmp_path), enforce_eager=True)


def test_num_key_value_heads_is_ignored_under_latent_attention():
    """transformers' DeepSeek-V3 config keeps its default num_key_value_heads=128 on a 4-head model."""
    hf = {**BASE, **FAMILIES["v3"][2], "num_key_value_heads": 128, "architectures": ["DeepseekV3ForCausalLM"]}
    assert model_config(hf).num_kv_heads == 4


def test_latent_cache_bytes_per_token():
    """The cache holds R + rope values a token a layer; the expanded cache would hold H (nope + rope + v)."""
    cfg = model_config({**BASE, **FAMILIES["v3"][2], "architectures": ["DeepseekV3ForCausalLM"]})
    assert latent_bytes_per_token(cfg, 2) == 3 * (32 + 8) * 2
    assert expanded_bytes_per_token(cfg, 2) == 3 * 4 * (16 + 8 + 16) * 2


# ----------------------------------------------------------------------------- speculation
@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_deepseek(path, "v3")
    return str(path)


@pytest.fixture(scope="module")
def reference(v3):
    return ar_reference(v3)


@pytest.fixture(scope="module")
def eagle3(v3, tmp_path_factory):
    return str(init_draft_head("eagle3", v3, tmp_path_factory.mktemp("ds_heads") / "eagle3"))


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3", "eagle3-tree"])
def test_greedy_speculation_on_deepseek_equals_ar(v3, eagle3, reference, method):
    """Chains and a token tree (verified in one block, its accepted path moved in the latent cache)."""
    prompts, want = reference
    spec = _spec(method, 3) if method in ("ngram", "suffix") else \
        {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 3}
    if method == "eagle3-tree":
        spec.update(num_speculative_tokens=5, speculative_token_tree="[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]")
    assert _ids(Engine(v3, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True).generate(
        prompts, GREEDY)) == want


def test_captured_speculation_on_deepseek_equals_ar(v3, reference):
    """One (4, 3) graph compiled by inductor: latent attention and the routed experts, lossless, never
    recompiled (the MTP layers' compiled steps: tests/engine/test_mtp_hosts.py)."""
    prompts, want = reference
    assert_captured_lossless(v3, _spec("ngram", 3), prompts, want, warm=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")
@pytest.mark.parametrize("method", ["ngram", "eagle3-tree"])
def test_cudagraph_speculation_on_deepseek_equals_ar_on_cuda(v3, eagle3, method):
    """A bf16 DeepSeek-V3 on CUDA: latent attention and its tree commits replay in CUDA graphs, and captured
    greedy speculation equals eager greedy AR."""
    kw = dict(max_num_seqs=4, max_model_len=96, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts(12)
    want = _ids(Engine(v3, backend="eager", **kw).generate(prompts, GREEDY))
    spec = _spec("ngram", 3) if method == "ngram" else {
        "method": "eagle3", "model": eagle3, "num_speculative_tokens": 5,
        "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"}
    eng = Engine(v3, backend="cudagraph", speculative_config=spec, **kw)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    assert eng.stats()["recompiles"] == 0


def test_bf16_speculation_on_deepseek_equals_bf16_ar(v3):
    """In bf16 the sigmoid router still scores in fp32 (its weight cast as transformers does)."""
    prompts = _prompts(4)
    kw = dict(max_num_seqs=4, max_model_len=96, dtype=torch.bfloat16)
    want = _ids(Engine(v3, **kw, enforce_eager=True).generate(prompts, GREEDY))
    assert _ids(Engine(v3, speculative_config=_spec("ngram", 3), **kw,
                       enforce_eager=True).generate(prompts, GREEDY)) == want
