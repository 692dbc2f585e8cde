"""The engine's plan: resolved once, purely, from the parsed arguments (no model, no graph)."""

import dataclasses

import pytest
import torch

from funcspec.config import SpecConfig
from funcspec.kernels import REFERENCE
from funcspec.nn import ModelConfig
from funcspec.plan import EnginePlan, plan_engine
from funcspec.token_tree import truncate

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
    assert p.bucket_plan.ks == (0, 1, 2, 3) and p.tree is None and p.bucket_tree(3) is None
    assert p.verify(3).method == "standard" and p.verify(0).method == "standard"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_k = 4
    assert hash(p) == hash(plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1})))


def test_autoregressive_plan_and_the_default_cache_length():
    p = plan(max_model_len=None)
    assert (p.max_k, p.max_model_len, p.t_max) == (0, 256, 257)  # max_position_embeddings below 2048
    assert p.verify(0) is None and p.bucket_tree(0) is None and p.synthetic_rates is None


def test_a_tree_is_cut_once_per_bucket_and_history_drafters_do_not_expand_frontiers():
    ngram = plan(SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1,
                                       "speculative_token_tree": TREE}))
    assert ngram.max_k == 7 and not ngram.tree_frontiers and ngram.bucket_tree(0) is None
    assert ngram.bucket_tree(4) == truncate(ngram.tree, 4, frontiers=False)


def test_bad_values_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        plan(max_model_len=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        plan(backend="tpu")
