"""Mixture-of-experts targets: Qwen2-MoE, Qwen3-MoE, Mixtral and GLM-4.5 equal transformers, the one router's
selections, bad configs, and greedy speculation equal to greedy AR on a MoE target for every kind of drafter."""

import dataclasses

import pytest
import torch
import transformers

from funcspec import LLM, Engine, SamplingParams
from funcspec.checkpoints import init_draft_head
from funcspec.checkpoints.llama import hf_config_dict, load_model, model_config
from funcspec.checkpoints.tp import check_size, shard_experts
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.nn.moe import MoEConfig, local_experts, route
from funcspec.parallel import TPGroup

from spec_cases import GREEDY, _ids, _prompts, _spec, ar_reference, assert_captured_lossless, random_moe

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
FAMILIES = {
    # every layer sparse but layer 1 (mlp_only_layers), renormalised top-2
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                       norm_topk_prob=True, mlp_only_layers=[1])),
    # sparse every 2nd layer, raw top-k weights, a sigmoid-gated shared expert
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    # group-limited top-2 among 2 of 4 groups, a correction bias, scaling, one dense layer, partial rotary, QK-norm
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                 dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                      first_k_dense_replace=1, head_dim=16, routed_scaling_factor=2.5, use_qk_norm=True,
                      attention_bias=True, n_shared_experts=1)),
}


def make_moe(path, family: str, seed: int = 0, **overrides):
    """Save a tiny random MoE of ``family`` to ``path``; return the HF model. Weights are scaled up (wide greedy
    margins) and GLM's correction bias is random, so it changes which experts are chosen."""
    config_cls, model_cls, extra = FAMILIES[family]
    model = random_moe(model_cls, config_cls(**{**BASE, **extra, **overrides}), seed)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_moe(path, "qwen3_moe")
    return str(path)


@pytest.fixture(scope="module")
def reference(qwen3_moe):
    """Autoregressive greedy outputs of 12 repetitive prompts on the Qwen3-MoE target."""
    return ar_reference(qwen3_moe)


# ----------------------------------------------------------------------------- HF-exact
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_tokens_equal_transformers(tmp_path, family):
    hf = make_moe(tmp_path, family)
    model = load_model(tmp_path)
    tokens = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    kv = init_kv_cache(model.cfg, 2, 16)
    logits, _, _ = forward(model.cfg, model.params, kv, tokens, torch.arange(2), torch.zeros(2, dtype=torch.long))
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)
    prompt = tokens[0].tolist()
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    out = LLM(str(tmp_path), enforce_eager=True, max_model_len=64).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == hf_ids[0, len(prompt):].tolist()


def test_each_family_reads_its_sparse_layers_and_router(tmp_path):
    """The configs' own rules decide which layers are sparse and how their router scores."""
    cfgs = {f: model_config({**BASE, **FAMILIES[f][2], "architectures": [FAMILIES[f][1].__name__]})
            for f in FAMILIES}
    assert [cfgs[f].moe.sparse_layers for f in sorted(FAMILIES)] == [(1, 2), (0, 1, 2), (1,), (0, 2)]
    glm = cfgs["glm4_moe"]
    assert (glm.moe.scoring, glm.moe.n_group, glm.moe.topk_group, glm.moe.group_score, glm.moe.correction_bias,
            glm.moe.routed_scaling_factor, glm.moe.shared_intermediate_size) == ("sigmoid", 4, 2, "top2", True, 2.5,
                                                                                  32)
    assert (glm.rotary_dim, glm.qk_norm, glm.attention_bias) == (8, True, True)  # partial_rotary_factor 0.5 of 16
    assert cfgs["qwen2_moe"].moe.shared_gate and cfgs["qwen2_moe"].attention_bias
    assert cfgs["mixtral"].moe.norm_topk_prob and cfgs["mixtral"].moe.intermediate_size == 32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_config_round_trips(family):
    """``hf_config_dict`` writes what parses back to the same config (a sparse step and dense layers included)."""
    extra = {"decoder_sparse_step": 2, "mlp_only_layers": [3]} if family == "qwen3_moe" else {}
    hf = {**BASE, **FAMILIES[family][2], **extra, "num_hidden_layers": 4,
          "architectures": [FAMILIES[family][1].__name__]}
    cfg = model_config(hf)
    back = model_config(hf_config_dict(cfg, bos_token_id=1, eos_token_id=2))
    assert back == cfg
    if family == "qwen3_moe":
        assert cfg.moe.sparse_layers == (1,)


# ----------------------------------------------------------------------------- the router
def test_softmax_router_picks_the_top_k_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).log()  # softmax probabilities 0, .5, 1/6, 1/3
    ids, w = route(MoEConfig(4, 2, 8, scoring="softmax", norm_topk_prob=True), logits)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(w, torch.tensor([[0.6, 0.4]]))
    _, raw = route(MoEConfig(4, 2, 8, scoring="softmax", routed_scaling_factor=2.0), logits)
    torch.testing.assert_close(raw, torch.tensor([[1.0, 2 / 3]]))


def test_group_limited_router_chooses_only_from_the_best_groups():
    """Groups {0,1} {2,3} {4,5}: by their best two (top2) the middle group wins, by their best one (max) the
    first; the experts then come from the chosen group only, even where another group holds a better one."""
    s = torch.tensor([[0.9, 0.0, 0.6, 0.6, 0.1, 0.1]])
    logits = torch.log(s / (1 - s))  # sigmoid(logits) == s
    top2 = MoEConfig(6, 2, 8, scoring="sigmoid", n_group=3, topk_group=1, group_score="top2")
    assert route(top2, logits)[0].tolist() == [[2, 3]]
    top1 = MoEConfig(6, 2, 8, scoring="sigmoid", n_group=3, topk_group=1, group_score="max")
    assert route(top1, logits)[0].tolist() == [[0, 1]]


def test_correction_bias_steers_the_choice_but_not_the_weights():
    s = torch.tensor([[0.8, 0.6, 0.5, 0.1]])
    logits = torch.log(s / (1 - s))
    m = MoEConfig(4, 2, 8, scoring="sigmoid", norm_topk_prob=False)
    ids, w = route(m, logits, torch.tensor([0.0, -1.0, 0.0, 0.0]))
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.8, 0.5]]))  # the scores, not the biased ones


@pytest.mark.parametrize(("family", "field", "value", "match"), [
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok must be in \\[1, 8\\]"),
    ("glm4_moe", "topk_group", 5, "topk_group must be in \\[1, n_group=4\\]"),
    ("glm4_moe", "n_group", 3, "n_group=3 must divide the 8 routed experts"),
    ("glm4_moe", "num_experts_per_tok", 5, "num_experts_per_tok=5 exceeds the 4 experts"),
    ("qwen3_moe", "moe_intermediate_size", None, "moe_intermediate_size must be an integer"),
    ("qwen2_moe", "decoder_sparse_step", 0, "decoder_sparse_step must be positive"),
    ("qwen3_moe", "mlp_only_layers", "0", "mlp_only_layers must be a list of layer indices, got '0'"),
    ("glm4_moe", "routed_scaling_factor", -1.0, "routed_scaling_factor must be positive, got -1.0"),
])
def test_bad_moe_config_names_the_field(family, field, value, match):
    hf = {**BASE, **FAMILIES[family][2], field: value, "architectures": [FAMILIES[family][1].__name__]}
    with pytest.raises(ValueError, match=match):
        model_config(hf)


def test_unsupported_combinations_are_refused_naming_the_argument(qwen3_moe):
    hf = {**BASE, **FAMILIES["qwen3_moe"][2], "num_key_value_heads": 4, "num_experts": 6,
          "architectures": ["Qwen3MoeForCausalLM"]}
    cfg = model_config(hf)
    check_size(cfg, 4)  # each expert's 32 intermediate features split in four
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the target's num_experts=6"):
        check_size(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=True)), 4)
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool, got 'yes'"):
        Engine(qwen3_moe, enable_expert_parallel="yes", enforce_eager=True)


# ----------------------------------------------------------------------------- tensor and expert parallelism
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_its_experts_and_the_shards_make_the_whole(expert_parallel):
    """Expert parallelism: rank r holds experts [4r, 4r + 4) whole; otherwise a half of every expert's gate rows,
    up rows and down columns. Either way the ranks' shards put back together are the layer."""
    gate_up, down = torch.randn(8, 2 * 6, 5), torch.randn(8, 5, 6)  # E = 8, I = 6, H = 5
    shards = [shard_experts({"gate_up_proj": {"weight": gate_up}, "down_proj": {"weight": down}},
                            TPGroup(2, r), expert_parallel) for r in range(2)]
    gu = [s["gate_up_proj"]["weight"] for s in shards]
    dn = [s["down_proj"]["weight"] for s in shards]
    if expert_parallel:
        assert gu[0].shape == (4, 12, 5) and torch.equal(torch.cat(gu), gate_up) and torch.equal(torch.cat(dn), down)
    else:
        halves = [g.view(8, 2, 3, 5) for g in gu]  # [E, gate|up, I/2, H]
        assert torch.equal(torch.cat(halves, dim=2).reshape(8, 12, 5), gate_up)
        assert torch.equal(torch.cat(dn, dim=2), down)


def test_a_rank_runs_only_the_slots_routed_to_its_experts():
    ids, w = torch.tensor([[0, 5], [4, 3]]), torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    local, weights = local_experts(ids, w, 4, TPGroup(2, 1))  # rank 1 holds experts 4..7
    assert local.tolist() == [[-1, 1], [0, -1]] and weights.tolist() == [[0.0, 0.25], [1.0, 0.0]]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "expert_parallel"), [("glm4_moe", False), ("glm4_moe", True),
                                                         ("qwen2_moe", True)])
def test_two_ranks_emit_one_ranks_greedy_tokens(tmp_path, family, expert_parallel):
    """TP = 2 (each expert sliced) and EP = 2 (experts split whole), attention tensor-parallel and the shared
    expert an MLP split in two: both ranks' engine emits the tokens of one rank."""
    make_moe(tmp_path, family)
    args = dict(max_num_seqs=2, max_model_len=64, backend="eager")
    prompts = _prompts(2, seed=3)
    want = _ids(Engine(str(tmp_path), **args).generate(prompts, GREEDY))
    if family == "qwen2_moe":  # as the guide passes it: LLM(..., tensor_parallel_size=2, enable_expert_parallel=True)
        llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, max_num_seqs=2,
                  max_model_len=64, enforce_eager=True)
        eng, got = llm.engine, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    else:
        eng = Engine(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **args)
        got = eng.generate(prompts, GREEDY)
    try:
        assert _ids(got) == want
        sparse = eng.model.cfg.moe.sparse_layers[-1]
        experts = eng.params["target"]["model"]["layers"][sparse]["mlp"]["experts"]["gate_up_proj"]["weight"]
        assert experts.shape == ((4, 64, 64) if expert_parallel else (8, 32, 64))
    finally:
        eng.close()


# ----------------------------------------------------------------------------- speculation on a MoE target
@pytest.fixture(scope="module")
def heads(qwen3_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_heads")
    return {m: str(init_draft_head(m, qwen3_moe, root / m)) for m in ("eagle3", "dflash")}


def _config(method, heads, tiny_draft, k=3, **extra):
    if method in heads:
        return {"method": method, "model": heads[method], "num_speculative_tokens": k, **extra}
    return _spec(method, k, tiny_draft, **extra)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle3", "dflash"])
def test_greedy_speculation_equals_ar_on_a_moe_target(qwen3_moe, tiny_draft, heads, reference, method):
    prompts, want = reference
    eng = Engine(qwen3_moe, speculative_config=_config(method, heads, tiny_draft), max_num_seqs=4,
                 max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want


def test_tree_speculation_equals_ar_on_a_moe_target(qwen3_moe, tiny_draft, heads, reference):
    prompts, want = reference
    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"
    eng = Engine(qwen3_moe, speculative_config=_config("eagle3", heads, tiny_draft, 5, speculative_token_tree=tree),
                 max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want


@pytest.mark.parametrize("method, codegen", [("ngram", "traced"), ("eagle3", "inductor")])
def test_captured_moe_steps_are_lossless_and_never_recompile(qwen3_moe, tiny_draft, heads, reference, method, codegen,
                                                            request):
    """One (4, K) graph on the MoE target, lossless, never recompiled. NOTE: the target's forward is compiled by
    real inductor once (under EAGLE-3); ngram's step runs Dynamo's graph in place of inductor's codegen
    (``traced_codegen``: the fullgraph and its guards), as a second cold compile of that forward would check
    nothing more of the MoE layers."""
    if codegen == "traced":
        request.getfixturevalue("traced_codegen")
    eng = assert_captured_lossless(qwen3_moe, _config(method, heads, tiny_draft), *reference, warm=4)
    assert eng.stats()["graph_breaks"] == 0


# ----------------------------------------------------------------------------- quantized on load
@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_reference(request, qwen3_moe):
    """The Qwen3-MoE target quantized on load: its AR greedy outputs of the 12 prompts."""
    prompts = _prompts(12)
    eng = Engine(qwen3_moe, quantization=request.param, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    return request.param, eng, prompts, _ids(eng.generate(prompts, GREEDY))


def test_quantizing_a_moe_on_load_quantizes_the_experts_and_keeps_the_router_float(quantized_reference):
    scheme, eng, _, _ = quantized_reference
    layer = eng.params["target"]["model"]["layers"][0]["mlp"]
    gate_up, down = layer["experts"]["gate_up_proj"], layer["experts"]["down_proj"]
    assert "weight" not in gate_up and gate_up["format"].name == scheme and down["format"].name == scheme
    assert gate_up["qweight"].shape[:2] == (8, 2)  # 8 experts, each gate's one block of 32 units then its up's
    assert (gate_up["format"].out_features, gate_up["format"].in_features) == (32, 64)
    assert layer["gate"]["weight"].dtype == torch.float32 and "qweight" not in layer["gate"]
    dense = eng.params["target"]["model"]["layers"][1]["mlp"]  # mlp_only_layers=[1]
    assert dense["gate_proj"]["format"].name == scheme


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_speculation_equals_ar_on_a_quantized_moe_target(qwen3_moe, tiny_draft, heads, quantized_reference,
                                                                method):
    scheme, _, prompts, want = quantized_reference
    eng = Engine(qwen3_moe, quantization=scheme, speculative_config=_config(method, heads, tiny_draft),
                 max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want


def test_captured_quantized_moe_steps_are_lossless(qwen3_moe, tiny_draft, heads, quantized_reference, request):
    """NOTE: the quantized experts are one custom op whatever the format, so int4's step compiles by real inductor
    and int8's runs Dynamo's graph in place of inductor's codegen (``traced_codegen``)."""
    scheme, _, prompts, want = quantized_reference
    if scheme == "int8":
        request.getfixturevalue("traced_codegen")
    eng = assert_captured_lossless(qwen3_moe, _config("eagle3", heads, tiny_draft), prompts, want, warm=4,
                                   quantization=scheme)
    assert eng.stats()["graph_breaks"] == 0


# ----------------------------------------------------------------------------- CUDA (skipped where there is none)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")


@needs_cuda
def test_cuda_grouped_gemms_replay_in_one_cuda_graph_for_every_routing():
    """moe.grouped on CUDA equals the reference within bf16 rounding, and one captured CUDA graph replays it for
    new routings written into its static inputs (the expert ids are data, not shapes)."""
    from funcspec.kernels import moe as kmoe

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, t, k = 16, 128, 64, 5, 4
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()

    def routing():
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])  # [T, k]
        return torch.randn(t, h, device="cuda", generator=g).bfloat16(), ids, torch.rand(t, k, device="cuda",
                                                                                           generator=g)

    x, ids, w = routing()
    torch.testing.assert_close(kmoe.grouped(x, ids, w, gate_up, down), kmoe.reference(x, ids, w, gate_up, down),
                               atol=3e-2, rtol=2 ** -7)
    for _ in range(2):  # warm-up on a side stream, as CUDA graph capture asks
        kmoe.grouped(x, ids, w, gate_up, down)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kmoe.grouped(x, ids, w, gate_up, down)
    for _ in range(3):
        x2, ids2, w2 = routing()
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
        graph.replay()
        assert torch.equal(out, kmoe.grouped(x2, ids2, w2, gate_up, down))


@needs_cuda
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_cudagraph_speculation_on_a_moe_target_equals_ar(qwen3_moe, tiny_draft, heads, method):
    """A bf16 Qwen3-MoE on CUDA takes torch._grouped_mm; captured greedy speculation equals eager greedy AR."""
    from conftest import OpLog

    kw = dict(max_num_seqs=4, max_model_len=96, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts(12)
    ar = Engine(qwen3_moe, backend="eager", **kw)
    assert ar.model.cfg.ops.routed_experts == "grouped_mm"
    with OpLog() as log:
        want = _ids(ar.generate(prompts, GREEDY))
    assert "_grouped_mm" in log.names
    eng = Engine(qwen3_moe, backend="cudagraph", speculative_config=_config(method, heads, tiny_draft), **kw)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    assert eng.stats()["recompiles"] == 0
