"""The engine's plan: resolved once, purely, from the parsed arguments (no model, no graph)."""

import dataclasses
import json

import pytest
import torch

from funcspec import sampling
from funcspec.args import EngineArgs
from funcspec.config import SpecConfig
from funcspec.kernels import REFERENCE, Ops
from funcspec.nn import ModelConfig
from funcspec.plan import EnginePlan, graph_modes, plan_engine, startup_modes, verify_rule
from funcspec.token_tree import Chain, TokenTree, chain, truncate
from funcspec.verifiers import VerifyConfig

CFG = ModelConfig("llama", 96, 32, 64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=256)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def plan(spec=None, **kw) -> EnginePlan:
    args = dict(backend="eager", device="cpu", dtype=torch.float32, max_batch_size=4, max_model_len=100,
                batch_buckets=None, context_buckets=None, capture="startup")
    return plan_engine(spec, CFG, REFERENCE, **{**args, **kw})


def test_a_chain_plan_holds_k_the_cache_length_the_buckets_and_the_rule_per_k():
    p = plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}))
    assert (p.max_k, p.max_model_len, p.t_max, p.num_slots, p.backend) == (3, 100, 104, 4, "eager")
    assert not p.startup  # eager captures nothing
    assert p.bucket_plan.ks == (0, 1, 2, 3) and p.tree is None
    assert [p.bucket_tree(k) for k in (0, 3)] == [Chain(0), Chain(3)]  # a chain bucket's shape
    assert p.verify(3) == VerifyConfig("standard") and p.verify(0) == VerifyConfig("standard")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_k = 4
    assert hash(p) == hash(plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1})))


def test_verify_rule_depends_on_the_spec_and_the_mode_only():
    spec = SpecConfig("echo", 3, rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.5, 0.2])
    cfg = verify_rule(spec, 2)
    assert cfg.method == "synthetic" and cfg.synthetic_rates == (0.9, 0.5)
    assert verify_rule(SpecConfig("ngram", 3), 3) == VerifyConfig("standard")
    # K = 0 (and no speculation) is decoding: the standard rule; a token tree's bucket: the tree rule
    assert verify_rule(spec, 0) == verify_rule(None, 0) == VerifyConfig()
    tree = TokenTree(((0,), (1,), (0, 0)))
    assert verify_rule(spec, 3, tree) == VerifyConfig("tree", depth=2)
    assert verify_rule(spec, 3, Chain(3)) == verify_rule(spec, 3)
    # the mode completes the rule: greedy rows, and top-k/top-p off
    assert verify_rule(spec, 2, mode=sampling.GREEDY) == VerifyConfig(
        "synthetic", synthetic_rates=(0.9, 0.5), filters=False, greedy=True)
    assert verify_rule(None, 0, mode=sampling.RANDOM) == VerifyConfig(filters=False)


def test_the_plan_holds_each_buckets_shape_and_complete_rule_as_tables():
    spec = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1,
                                 "speculative_token_tree": TREE})
    p = plan(spec)
    assert sorted(p.shapes) == list(range(8)) and p.shapes[0] == Chain(0)
    assert all(p.shapes[k] == truncate(p.tree, k, frontiers=False) for k in range(1, 8))
    assert sorted(p.verify_rules) == sorted((k, m) for k in range(8) for m in sampling.MODES)
    for (k, name), rule in p.verify_rules.items():
        mode = sampling.MODES[name]
        assert rule == verify_rule(spec, k, p.shapes[k], mode) and p.verify(k, mode) is rule
        assert (rule.filters, rule.greedy) == (mode.filters, mode.greedy)
    assert p.verify(3) is p.verify(3, sampling.FILTERED)  # read, never rebuilt
    with pytest.raises(ValueError, match=r"k must be in 0\.\.7 .*got 8"):
        p.bucket_tree(8)
    with pytest.raises(ValueError, match=r"k must be in 0\.\.7 .*got 8"):
        p.verify(8)


def test_graph_modes_is_the_table_of_the_graph_each_mode_runs_in():
    names = {name: mode.name for name, mode in graph_modes(True).items()}
    # after a start-up capture: greedy and filtered run in their own graphs, random in filtered's (top-k and
    # top-p off draw the same), and every logprobs mode in the general mode's with logprobs
    assert names == {"greedy": "greedy", "random": "filtered", "filtered": "filtered",
                     "greedy_logprobs": "filtered_logprobs", "random_logprobs": "filtered_logprobs",
                     "filtered_logprobs": "filtered_logprobs"}
    assert graph_modes(False) == sampling.MODES  # captured on first use: each mode its own graph
    assert [m.name for m in startup_modes()] == ["greedy", "filtered"]
    assert [m.name for m in startup_modes(True)] == ["greedy", "filtered", "filtered_logprobs"]
    # every graph a start-up capture leaves a mode to is one it compiles (with capture_logprobs)
    assert set(graph_modes(True).values()) == set(startup_modes(True))
    assert plan(backend="inductor", device="cpu").graph_modes == graph_modes(True)
    assert plan(capture="lazy").graph_modes == graph_modes(False) == plan().graph_modes  # eager: lazy


def test_max_k_is_derived_once_by_the_spec():
    assert SpecConfig("ngram", 3).max_k == 3 and plan(SpecConfig("ngram", 3)).max_k == 3
    hidden = SpecConfig.from_vllm({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}}})
    assert hidden.max_k == 0 and hidden.k_for_batch_size(3) == 0  # it does not speculate: K = 0


def test_autoregressive_plan_and_the_default_cache_length():
    p = plan(max_model_len=None)
    assert (p.max_k, p.max_model_len, p.t_max) == (0, 256, 257)  # max_position_embeddings below 2048
    # decoding is the block of no drafts: its one token is the standard rule's keyed draw
    assert p.verify(0) == VerifyConfig("standard") and p.bucket_tree(0) == Chain(0) and p.synthetic_rates is None


def test_a_tree_is_cut_once_per_bucket_and_history_drafters_do_not_expand_frontiers():
    ngram = plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1,
                                       "speculative_token_tree": TREE}))
    assert ngram.max_k == 7 and not ngram.tree_frontiers and ngram.bucket_tree(0) == Chain(0)
    assert ngram.bucket_tree(4) == truncate(ngram.tree, 4, frontiers=False)
    # a configured tree of chain shape stays a tree: drafted and verified as the user asked
    as_chain = plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                          "speculative_token_tree": "[(0,), (0, 0)]"}))
    assert as_chain.bucket_tree(2) == chain(2) != Chain(2) and as_chain.verify(2) == VerifyConfig("tree", depth=2)
    # a tree bucket is verified by the tree rule at its cut's depth; K = 0 by the standard rule
    assert ngram.verify(4) == VerifyConfig("tree", depth=ngram.bucket_tree(4).depth)
    assert ngram.verify(0) == VerifyConfig("standard")


def test_bad_values_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        EngineArgs(model="m", max_model_len=1)  # checked once, with the arguments: plan_engine takes it as given
    with pytest.raises(ValueError, match="backend must be one of"):
        plan(backend="tpu")


# ------------------------------------------------------------------ serialisation: what TP followers receive
DYN_TREE = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}
SERIALISED = {
    "no speculation": (None, {}),
    "chain": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 1]]}, {}),
    "static tree": ({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1,
                     "speculative_token_tree": TREE,
                     "num_speculative_tokens_per_batch_size": [[1, 2, 7], [3, 4, 3]]}, {}),
    "dynamic tree": ({"method": "eagle", "model": "head", **DYN_TREE}, {}),
    "dynamic spec": ({"method": "dspark", "model": "head", "num_speculative_tokens": 5},
                     {"dynamic_spec_config": {"method": "dspark", "method_params": {"budget_threshold": 0.7}},
                      "rejection_sampler_config": {"enable_entropy_verify": True, "posterior_alpha": 0.25}}),
    "synthetic": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.3}, {}),
}


def plain(value) -> bool:
    """Whether ``value`` is JSON's data model: dicts with str keys, lists, str, int, float, bool, None."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(plain, value))
    return value is None or isinstance(value, (str, int, float, bool))


@pytest.mark.parametrize("name", SERIALISED)
def test_a_plan_round_trips_through_plain_data_and_json(name):
    spec, additional = SERIALISED[name]
    p = plan(SpecConfig.from_vllm(spec, additional, check_paths=False), backend="inductor", context_buckets=None)
    d = p.to_dict()
    assert plain(d), d
    assert EnginePlan.from_dict(d) == p and hash(EnginePlan.from_dict(d)) == hash(p)
    again = EnginePlan.from_dict(json.loads(json.dumps(d)))
    assert again == p and again.to_dict() == d
    assert again.bucket_plan.buckets == p.bucket_plan.buckets and again.bucket_tree(p.max_k) == p.bucket_tree(p.max_k)


def test_the_serialised_plan_names_every_field_and_nested_config_as_plain_values():
    spec, additional = SERIALISED["dynamic spec"]
    d = plan(SpecConfig.from_vllm(spec, additional, check_paths=False)).to_dict()
    assert (d["max_k"], d["max_model_len"], d["t_max"], d["num_slots"], d["backend"]) == (5, 100, 106, 4, "eager")
    assert d["bucket_plan"]["ks"] == [0, 1, 2, 3, 4, 5] and d["bucket_plan"]["batch_buckets"] == [1, 2, 4]
    assert d["spec"]["dynamic_spec"] == {"method": "dspark", "initial_verify_budget_per_req": 5,
                                         "budget_update_interval": 16, "budget_threshold": 0.7,
                                         "min_verify_tokens": 1}
    assert d["spec"]["rejection_sampler"]["posterior_alpha"] == 0.25
    tree = plan(SpecConfig.from_vllm(SERIALISED["static tree"][0])).to_dict()
    assert tree["spec"]["speculative_token_tree"] == {"paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    assert tree["bucket_plan"]["pairs"] == [[1, 0], [1, 7], [2, 0], [2, 7], [4, 0], [4, 3]]
    dyn = plan(SpecConfig.from_vllm(SERIALISED["dynamic tree"][0], check_paths=False)).to_dict()
    assert dyn["spec"]["dynamic_tree"] == {"topk": 2, "num_steps": 3, "num_draft_tokens": 8}


def test_a_serialised_plan_with_a_field_missing_unknown_or_invalid_is_refused_naming_it():
    d = plan(SpecConfig.from_vllm(SERIALISED["dynamic spec"][0], SERIALISED["dynamic spec"][1],
                                  check_paths=False)).to_dict()
    with pytest.raises(ValueError, match=r"EnginePlan\.t_max is missing"):
        EnginePlan.from_dict({k: v for k, v in d.items() if k != "t_max"})
    with pytest.raises(ValueError, match=r"EnginePlan has no field 'k_max'"):
        EnginePlan.from_dict({**d, "k_max": 3})
    with pytest.raises(ValueError, match=r"EnginePlan\.spec\.dynamic_spec has no field 'budget'"):
        EnginePlan.from_dict({**d, "spec": {**d["spec"], "dynamic_spec": {**d["spec"]["dynamic_spec"], "budget": 1}}})
    with pytest.raises(ValueError, match=r"EnginePlan\.bucket_plan must be a dict of its fields, got list"):
        EnginePlan.from_dict({**d, "bucket_plan": [1, 2]})
    with pytest.raises(ValueError, match=r"BucketPlan\.ks must be sorted and distinct, got \[2, 1\]"):
        EnginePlan.from_dict({**d, "bucket_plan": {**d["bucket_plan"], "ks": [2, 1]}})


@pytest.mark.parametrize("ops, dtype, symbolic", [
    (Ops(stream=True), torch.float32, True),  # the streaming kernel never compares the row count
    (Ops(stream=True), torch.bfloat16, True),
    (Ops(half_gemm=True), torch.bfloat16, True),  # F.linear itself
    (Ops(blas_skinny=True), torch.float32, True),
    (REFERENCE, torch.float32, False),  # AVX2: the plain paths pick by row count
    (Ops(onednn_bf16=True, half_gemm=True), torch.bfloat16, False),  # oneDNN picks by row count
    (Ops(stream=True), torch.float16, False),
])
def test_a_symbolic_batch_only_where_no_product_picks_its_path_by_the_row_count(ops, dtype, symbolic):
    """A comparison with a symbolic row count specialises the graph (under mark_dynamic: a constraint
    violation at capture), so the plan keeps one graph per batch bucket where a product compares it."""
    assert ops.rows_free(dtype) is symbolic
    p = plan_engine(None, CFG, ops, backend="inductor", device="cpu", dtype=dtype, max_batch_size=4,
                    max_model_len=100, batch_buckets=None, context_buckets=None, capture="lazy")
    assert p.bucket_plan.symbolic_batch is symbolic
    assert [p.bucket_plan.graph_batch(b) for b in (1, 2, 4)] == ([1, 0, 0] if symbolic else [1, 2, 4])


def test_max_model_len_above_the_models_maximum_is_refused_naming_both(monkeypatch):
    """vLLM's rule: a max_model_len above max_position_embeddings (times a linear RoPE factor) is refused unless
    FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN), which only warns."""
    monkeypatch.delenv("FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert plan(max_model_len=256).max_model_len == 256  # the maximum itself
    with pytest.raises(ValueError, match=r"^max_model_len=257 is above this model's maximum context of 256 tokens "
                                         r"\(max_position_embeddings in its config.json\).*"
                                         r"set FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN=1 to run it anyway$"):
        plan(max_model_len=257)
    stretched = dataclasses.replace(CFG, rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    assert plan_engine(None, stretched, REFERENCE, backend="eager", device="cpu", dtype=torch.float32,
                       max_batch_size=1, max_model_len=512, batch_buckets=None, context_buckets=None,
                       capture="startup").max_model_len == 512
    monkeypatch.setenv("FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.warns(UserWarning, match="allowed by FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN=1"):
        assert plan(max_model_len=300).max_model_len == 300
