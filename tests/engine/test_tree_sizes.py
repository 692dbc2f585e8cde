"""A token tree's node count N per batch size: the truncated trees, the config, the (B, N) bucket plan,
and engines whose greedy output equals autoregressive decoding token for token."""

import pytest
import torch

from funcspec import sampling
from funcspec.capture import BucketPlan
from funcspec.config import SpecConfig
from funcspec.config.tree import check_dynamic_tree
from funcspec.token_tree import DynamicTree, TokenTree, truncate
from heads_cases import PROMPTS, TREE, greedy, spec_engine

TABLE = "speculative_config.num_speculative_tokens_per_batch_size"
DYNAMIC = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}


def test_a_static_tree_cut_to_n_is_its_breadth_first_prefix_with_valid_parents():
    tree = TokenTree(tuple(TREE))  # (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    assert truncate(tree, 4) == TokenTree(((0,), (1,), (2,), (0, 0)))
    assert (truncate(tree, 4).parents, truncate(tree, 4).depth) == ((-1, -1, -1, 0), 2)
    assert truncate(tree, 3).depth == 1 and truncate(tree, 7) == tree
    for n in range(1, 8):
        cut = truncate(tree, n)
        assert cut.paths == tree.paths[:n] and cut.size == n
        for i, (path, parent) in enumerate(zip(cut.paths, cut.parents)):
            assert parent < i and (parent == -1 if len(path) == 1 else cut.paths[parent] == path[:-1])
    for n in (0, 8):
        with pytest.raises(ValueError, match=f"a tree of 7 nodes cannot be truncated to {n} nodes"):
            truncate(tree, n)


def test_a_dynamic_tree_cut_to_n_keeps_topk_and_caps_its_steps():
    tree = DynamicTree(3, 5, 17)  # N = 16
    assert truncate(tree, 16) == tree
    assert truncate(tree, 12) == DynamicTree(3, 5, 13)  # (5 - 1) · 3 = 12 frontier nodes still fit
    assert truncate(tree, 11) == DynamicTree(3, 4, 12)
    assert truncate(tree, 4) == DynamicTree(3, 2, 5)
    assert truncate(tree, 2) == DynamicTree(3, 1, 3)
    for n in range(1, 17):
        assert check_dynamic_tree(truncate(tree, n)).size == n


def spec(**extra):
    return SpecConfig.from_vllm({"method": "eagle3", "model": "draft", **extra}, check_paths=False)


def test_the_batch_size_table_gives_a_tree_its_node_count():
    cfg = spec(speculative_token_tree=str(TREE), num_speculative_tokens_per_batch_size=[[3, 8, 4], [1, 2, 7]])
    assert [cfg.k_for_batch_size(n) for n in (1, 2, 3, 8, 9)] == [7, 7, 4, 4, 4]
    dyn = spec(**DYNAMIC, num_speculative_tokens_per_batch_size=[[1, 1, 0], [2, 4, 3]])
    assert [dyn.k_for_batch_size(n) for n in (1, 2, 4)] == [0, 3, 3]
    with pytest.raises(ValueError, match=TABLE + r" entry \[2, 4, 8\]: with a token tree the value is its "
                                              r"node count N, which must be <= the tree's 7 nodes"):
        spec(speculative_token_tree=str(TREE), num_speculative_tokens_per_batch_size=[[1, 1, 7], [2, 4, 8]])
    with pytest.raises(ValueError, match=TABLE + r" entry \[1, 4, 8\]"):
        spec(**DYNAMIC, num_speculative_tokens_per_batch_size=[[1, 4, 8]])
    with pytest.raises(ValueError, match=TABLE + " entries must be"):
        spec(**DYNAMIC, num_speculative_tokens_per_batch_size=[[1, 4]])


def test_the_plan_holds_each_buckets_n_and_k_zero():
    # n = 1 -> B1 N2; n = 2 -> B2 N0; n = 3, 4 -> B4 N5; n = 5, 6 -> B8 N5; n = 7, 8 -> B8 N7
    plan = BucketPlan.for_engine(8, 7, tree=True, tree_sizes=[2, 0, 5, 5, 5, 5, 7, 7])
    assert plan.buckets == [(1, 0), (1, 2), (2, 0), (4, 0), (4, 5), (8, 0), (8, 5), (8, 7)]
    assert plan.ks == (0, 2, 5, 7)
    assert plan.capture_sizes() == {0: [1, 2, 4, 8], 2: [3], 5: [24, 48], 7: [64]}
    fixed = BucketPlan.for_engine(4, 7, tree=True)  # no table: N = the whole tree everywhere
    assert fixed.buckets == [(1, 0), (1, 7), (2, 0), (2, 7), (4, 0), (4, 7)] and fixed.ks == (0, 7)
    with pytest.raises(ValueError, match="BucketPlan.pairs must be sorted, distinct"):
        BucketPlan((1, 2), (0, 3), pairs=((1, 3), (2, 1)))


def _run(eng, zoo, groups):
    """Greedy outputs of each group of PROMPTS (n prompts run in bucket B(n)) against AR."""
    for idx in groups:
        outs = eng.generate([PROMPTS[i] for i in idx], greedy(24))
        assert [o.outputs[0].token_ids for o in outs] == [zoo.ar[i] for i in idx]


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_engine_with_a_tree_size_per_batch_size_is_greedy_lossless(zoo, tree):
    """1 row drafts 2 nodes, 2 rows none, 3-4 rows 5 nodes; a start-up capture makes exactly the buckets used."""
    keys = {"speculative_token_tree": str(TREE)} if tree == "static" else DYNAMIC
    eng = spec_engine(zoo, "eagle3", k=7,
                      spec={**keys, "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 0], [3, 4, 5]]})
    assert eng.plan.bucket_plan.buckets == [(1, 0), (1, 2), (2, 0), (4, 0), (4, 5)]
    assert sorted({key[:2] for key in eng.startup_graphs()}) == [(1, 2), (2, 0), (4, 5)]
    _run(eng, zoo, [[0], [1, 2], [0, 1, 2, 3], [3]])
    assert eng.stats()["buckets_used"].keys() == {"B1_K2", "B2_K0", "B4_K5"}
    acc = eng.stats()["per_position_acceptance"]
    assert len(acc) == 3 and all(a >= b for a, b in zip(acc, acc[1:]))  # per depth of the whole tree
    with pytest.raises(ValueError, match="k must be a node count 0..7 of this engine's token tree, got 8"):
        eng.bucket(1, 8)
    bucket = eng.bucket(2, 3, mode=sampling.GREEDY)  # any N <= 7 runs, planned or not (scratch rows only)
    out, _ = bucket.fn(*bucket.args)
    # [B, D+1]: the static tree's first 3 nodes are all depth 1; DynamicTree(2, 2, 4) is 2 deep
    assert out.tokens.shape == ((2, 2) if tree == "static" else (2, 3))


def test_tree_sizes_are_checked_when_the_engine_is_built(zoo):
    with pytest.raises(ValueError, match=TABLE + r" entry \[1, 4, 9\]"):
        spec_engine(zoo, "eagle3", k=7, spec={"speculative_token_tree": str(TREE),
                                              "num_speculative_tokens_per_batch_size": [[1, 4, 9]]})


def test_draft_model_tree_size_per_batch_size_is_greedy_lossless(zoo):
    eng = spec_engine(zoo, "draft_model", k=7, spec={"speculative_token_tree": str(TREE),
                                                     "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 6]]})
    _run(eng, zoo, [[2], [0, 1, 2, 3]])
    assert eng.stats()["buckets_used"].keys() == {"B1_K4", "B4_K6"}


def test_tree_size_buckets_run_on_inductor_without_recompiles(zoo, traced_codegen):
    """Buckets (1, 3) and (4, 6) as fullgraphs (Dynamo's graph in place of inductor's codegen, as the
    heads' tree test does): greedy lossless, each compiled once, 0 recompiles after warm-up."""
    eng = spec_engine(zoo, "eagle3", k=7, backend="inductor",
                      compilation_config={"batch_sizes": [1, 4], "capture": "lazy"},
                      spec={"speculative_token_tree": str(TREE), "num_speculative_tokens_per_batch_size": [[1, 1, 3],
                                                                                                           [2, 4, 6]]})
    _run(eng, zoo, [[1], [0, 1, 2, 3]])
    with torch.compiler.set_stance("fail_on_recompile"):
        _run(eng, zoo, [[3], [0, 1, 2, 3]])
    assert sorted(k[:2] for k in eng.graphs) == [(1, 3), (4, 6)]
    assert all(g.stats.compiles == 1 and g.stats.graph_breaks == 0 for g in eng.graphs.values())
    assert eng.stats()["recompiles"] == 0
