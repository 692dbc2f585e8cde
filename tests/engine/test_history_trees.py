"""Token trees from the history: ngram's matched continuations and suffix decoding's suffix trees
(issue #15: "ngram and suffix branch where the history offers several continuations")."""

import pytest
import torch

from funcspec import Engine, SamplingParams, sampling
from funcspec.proposers.ngram import ngram_propose, ngram_tree
from funcspec.suffix_tree import SuffixDecodingCache
from funcspec.token_tree import DynamicTree, TokenTree, chain, truncate
from funcspec.types import PLACEHOLDER

from spec_cases import GREEDY, _ids, _prompts, _spec

# 1 2 3 9 | 1 2 4 5 | 1 2 3 7 | 1 2: the suffix "1 2" continues as 3 9.., 4 5.. and 3 7..
HISTORY = torch.tensor([[1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 1, 2]])
LENS = torch.tensor([14])
STATIC = TokenTree(((0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)))


def test_ngram_tree_branches_where_the_history_continues_differently():
    # match order (all three are 2-grams): ends 1, 5, 9 -> continuations 3 9 1 2 / 4 5 1 2 / 3 7 1 2
    tokens, parents = ngram_tree(HISTORY, LENS, STATIC, 1, 3)
    assert tokens.tolist() == [[3, 4, 9, 5, 7, 1]]  # (0,)=3 (1,)=4 (0,0)=9 (1,0)=5 (0,1)=7 (0,0,0)=1
    assert parents.tolist() == [list(STATIC.parents)]
    # equal support (3 has two matches), shallower first, <= 3 children: {3, 4}, {9, 5, 7}, {1, 1, 1}
    tokens, parents = ngram_tree(HISTORY, LENS, DynamicTree(3, 4, 9), 1, 3)
    assert tokens.tolist() == [[3, 4, 9, 5, 7, 1, 1, 1]]
    assert parents.tolist() == [[-1, -1, 0, 1, 0, 2, 3, 4]]
    # topk = 2 at depth 2 still keeps 9 and 7 under 3; topk = 1 is the chain
    tokens, parents = ngram_tree(HISTORY, LENS, DynamicTree(1, 4, 5), 1, 3)
    assert tokens.tolist() == ngram_propose(HISTORY, LENS, 4, 1, 3)[0].tolist() == [[3, 9, 1, 2]]
    assert parents.tolist() == [[-1, 0, 1, 2]]


def test_ngram_dynamic_tree_follows_the_longest_matches_deep_before_weak_branches():
    a = [9, 1, 2, 3, 4, 5, 6]
    # "9 1 2" twice (continuing 3 4 5 6 0, then 9 or 7); "2" alone once more (continuing 8 8)
    h = torch.tensor([a + [0] + a + [0] + [7, 2, 8, 8] + [9, 1, 2]])
    tokens, parents = ngram_tree(h, torch.tensor([23]), DynamicTree(2, 6, 8), 1, 3)
    assert tokens.tolist() == [[3, 4, 5, 6, 0, 9, 7]] and parents.tolist() == [[-1, 0, 1, 2, 3, 4, 4]]
    # with room for one more node, the weak match's 8 joins at depth 1
    tokens, parents = ngram_tree(h, torch.tensor([23]), DynamicTree(2, 6, 9), 1, 3)
    assert tokens.tolist() == [[3, 4, 5, 6, 0, 9, 7, 8]] and parents.tolist() == [[-1, 0, 1, 2, 3, 4, 4, -1]]


def test_ngram_tree_chain_equals_the_chain_and_marks_what_the_history_lacks():
    h = torch.tensor([[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
    lens = torch.tensor([6, 8])
    for k in (1, 2, 4):
        tokens, parents = ngram_tree(h, lens, chain(k), 1, 2)
        assert tokens.tolist() == ngram_propose(h, lens, k, 1, 2)[0].tolist()
    # row 0 continues 7 8 5 6 (then its own end); row 1 has no match at all
    tokens, _ = ngram_tree(h, lens, STATIC, 1, 2)
    assert tokens.tolist() == [[7, PLACEHOLDER, 8, PLACEHOLDER, PLACEHOLDER, 5], [PLACEHOLDER] * 6]
    # max_model_len: nothing lands at position >= 8 (row 0 has room for two tokens: depths 1 and 2)
    tokens, _ = ngram_tree(h, lens, STATIC, 1, 2, max_model_len=8)
    assert tokens[0].tolist() == [7, PLACEHOLDER, 8, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]


def _suffix_cache(*seqs):
    cache = SuffixDecodingCache(max_tree_depth=8)
    cache.start_request("r", seqs[0])
    for s in seqs[1:]:
        cache.add_active_response("r", s)
    return cache


def test_suffix_tree_modes():
    seq = HISTORY[0].tolist()
    cache = _suffix_cache(seq)

    def draft(n, **kw):
        return cache.speculate("r", seq, max_spec_tokens=n, max_spec_factor=4.0, **kw)

    # "1 2" (4 times, the last one open) goes on with 3 (twice) or 4; "1 2 3" with 9 or 7
    path = draft(4, min_token_prob=0.0)
    assert path.token_ids == [3, 9, 1, 2] and path.parents == [-1, 0, 1, 2] and path.nodes == [0, 1, 2, 3]
    # arctic's tree mode, most probable first: 3 (1/2), then 4, 9, 7 (1/4 each, first pushed first)
    tree = draft(4, min_token_prob=0.0, use_tree_spec=True)
    assert tree.token_ids == [3, 4, 9, 7] and tree.parents == [-1, -1, 0, 0]
    assert tree.probs == [0.5, 0.25, 0.25, 0.25]
    # a dynamic tree caps the children per node (topk = 1 is path mode) and the depth
    one = draft(4, min_token_prob=0.0, tree=DynamicTree(1, 4, 5))
    assert (one.token_ids, one.parents) == (path.token_ids, path.parents)
    shallow = draft(8, min_token_prob=0.0, tree=DynamicTree(3, 2, 9))
    assert shallow.token_ids == [3, 4, 9, 7, 5] and shallow.parents == [-1, -1, 0, 0, 1]
    # static ranks by count: (0,)=3 (1,)=4 (0,0)=9 (1,0)=5 (0,1)=7 (0,0,0)=1
    st = draft(6, min_token_prob=0.0, tree=STATIC)
    assert st.nodes == [0, 1, 2, 3, 4, 5] and st.token_ids == [3, 4, 9, 5, 7, 1]
    assert st.parents == [-1, -1, 0, 1, 0, 2]
    # min_token_prob drops the rare branches: 4 (1/4) goes, and with it its child (1, 0)
    st = draft(6, min_token_prob=0.5, tree=STATIC)
    assert st.nodes == [0] and st.token_ids == [3]
    with pytest.raises(ValueError, match="tree must be a TokenTree, a DynamicTree or None"):
        draft(4, tree=(0,))


TREES = {"static": {"speculative_token_tree": str(list(STATIC.paths)), "num_speculative_tokens": 6},
         "dynamic": {"speculative_eagle_topk": 3, "speculative_num_steps": 4, "speculative_num_draft_tokens": 9}}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts = _prompts(12)
    return prompts, _ids(Engine(tiny_llama, max_num_seqs=4, max_model_len=96,
                                enforce_eager=True).generate(prompts, GREEDY))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("shape", sorted(TREES))
def test_history_tree_greedy_equals_autoregressive(tiny_llama, reference, method, shape):
    prompts, want = reference
    spec = {**_spec(method, None), **TREES[shape]}
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    st = eng.stats()
    assert st["mean_acceptance_length"] > 1.0 and st["per_position_acceptance"][0] > 0


@pytest.mark.parametrize("method, shape, codegen", [("ngram", "dynamic", "inductor"), ("suffix", "static", "traced")])
def test_history_tree_runs_on_inductor_without_recompiles(tiny_llama, reference, method, shape, codegen, request):
    """One bucket (4, N) serves every step greedy-losslessly with 0 recompiles after warm-up.

    NOTE: "traced" swaps inductor's codegen for the Dynamo graph (the fullgraph trace and its
    guards are what recompiles); ngram's tree gets a real inductor compile."""
    if codegen == "traced":
        request.getfixturevalue("traced_codegen")
    prompts, want = reference
    spec = {**_spec(method, None), **TREES[shape]}
    eng = Engine(tiny_llama, speculative_config=spec, backend="inductor", max_num_seqs=4,
                 compilation_config={"batch_sizes": [4], "capture": "lazy"},
                 max_model_len=96)
    n = eng.spec.tree.size
    assert _ids(eng.generate(prompts[:4], GREEDY)) == want[:4]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _ids(eng.generate(prompts[4:], GREEDY)) == want[4:]
    assert [key[:2] for key in eng.graphs] == [(4, n)] and eng.stats()["recompiles"] == 0
    (graph,) = eng.graphs.values()
    assert graph.stats.graph_breaks == 0 and graph.stats.compiles == (0 if graph.stats.loaded else 1)  # or loaded



def test_ngram_tree_size_per_batch_size(tiny_llama, reference):
    """num_speculative_tokens_per_batch_size with an ngram tree: N = 8 nodes for one request, 3 for more
    (the dynamic tree cut to its best 3); greedy output equals AR in both buckets."""
    prompts, want = reference
    spec = {**_spec("ngram", None), "speculative_eagle_topk": 2, "speculative_num_steps": 8,
            "speculative_num_draft_tokens": 9, "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 4, 3]]}
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts[:1], GREEDY)) == want[:1]
    assert _ids(eng.generate(prompts[1:], GREEDY)) == want[1:]
    assert {"B1_K8", "B4_K3"} <= set(eng.stats()["buckets_used"])
    # ngram expands no frontiers: the tree cut to 3 nodes may stay 3 deep (a head's cut is 3 // 2 + 1 = 2)
    assert eng.runner.step_config(3, 96, sampling.GREEDY).tree == DynamicTree(2, 3, 4)
    assert truncate(DynamicTree(2, 8, 9), 3) == DynamicTree(2, 2, 4)
