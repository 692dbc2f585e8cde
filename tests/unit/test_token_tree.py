"""Token trees: vLLM's ``speculative_token_tree`` and EAGLE-2 dynamic tree options, and the tree tensors."""

import pytest
import torch

from funcspec import token_tree
from funcspec.config import SpecConfig
from funcspec.token_tree import DynamicTree, TokenTree

VLLM_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def spec(**extra):
    return SpecConfig.from_vllm({"method": "eagle3", "model": "draft", **extra}, check_paths=False)


def test_vllm_tree_string_is_parsed_sorted_and_sets_k():
    cfg = spec(speculative_token_tree="[(0, 0), (1,), (0,)]")
    assert cfg.speculative_token_tree == TokenTree(((0,), (1,), (0, 0)))
    assert cfg.tree is cfg.speculative_token_tree and cfg.num_speculative_tokens == 3
    tree = spec(speculative_token_tree=VLLM_TREE, num_speculative_tokens=7).tree
    assert tree.parents == (-1, -1, -1, 0, 0, 1, 3)
    assert tree.ranks == (0, 1, 2, 0, 1, 0, 0)
    assert (tree.size, tree.depth) == (7, 3)
    assert [tuple(tree.level(d)) for d in (1, 2, 3)] == [(0, 1, 2), (3, 4, 5), (6,)]
    # A list of tuples (or lists) is accepted as it is.
    assert spec(speculative_token_tree=[[0], [0, 0]]).tree == token_tree.chain(2)


@pytest.mark.parametrize("value, match", [
    ("[(0,), (0, 1, 0)]", r"speculative_token_tree node \(0, 1, 0\) needs its parent \(0, 1\)"),
    ("[(0,), (0,)]", "speculative_token_tree must not repeat a node"),
    ("[(0,), ()]", "speculative_token_tree nodes must be non-empty tuples"),
    ("[(0,), (-1,)]", "speculative_token_tree child ranks must be integers >= 0"),
    ("[]", "speculative_token_tree must be a non-empty list"),
    ("(0,", "speculative_token_tree must be a Python list of tuples"),
])
def test_bad_vllm_trees_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        spec(speculative_token_tree=value)


def test_tree_k_and_combinations_are_checked():
    with pytest.raises(ValueError, match=r"num_speculative_tokens must equal len\(speculative_token_tree\) = 2"):
        spec(speculative_token_tree="[(0,), (1,)]", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="speculative_token_tree is not supported with method 'echo'"):
        SpecConfig.from_vllm({"method": "echo", "speculative_token_tree": "[(0,)]"})
    with pytest.raises(ValueError, match="tree rule only, not 'block'"):
        spec(speculative_token_tree="[(0,)]", rejection_sample_method="block")
    # a batch-size table gives the node count per batch size (tests/engine/test_tree_sizes.py)
    assert spec(speculative_token_tree="[(0,), (1,)]", num_speculative_tokens_per_batch_size=[[1, 4, 1]]
                ).k_for_batch_size(4) == 1


def test_dynamic_tree_uses_sglang_names():
    cfg = spec(speculative_eagle_topk=4, speculative_num_steps=4, speculative_num_draft_tokens=17)
    assert cfg.dynamic_tree == DynamicTree(4, 4, 17) and cfg.tree is cfg.dynamic_tree
    assert cfg.num_speculative_tokens == 16 and (cfg.tree.size, cfg.tree.depth) == (16, 4)
    with pytest.raises(ValueError, match="speculative_num_steps is required with"):
        spec(speculative_eagle_topk=4)
    with pytest.raises(ValueError, match=r"speculative_num_draft_tokens must be <= 4 \(the root plus at most 3"):
        spec(speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=5)
    with pytest.raises(ValueError, match=r"speculative_num_draft_tokens must be >= 1 \+ \(speculative_num_steps - 1\)"):
        spec(speculative_eagle_topk=8, speculative_num_steps=4, speculative_num_draft_tokens=17)
    # ngram and suffix expand no network frontiers, so a deep, narrow tree is fine for them
    deep = {"speculative_eagle_topk": 4, "speculative_num_steps": 8, "speculative_num_draft_tokens": 16}
    for method in ("ngram", "suffix"):
        assert SpecConfig.from_vllm({"method": method, **deep}).tree == DynamicTree(4, 8, 16)
    with pytest.raises(ValueError, match="speculative_token_tree cannot be combined"):
        spec(speculative_token_tree="[(0,)]", speculative_eagle_topk=1, speculative_num_steps=1,
             speculative_num_draft_tokens=2)


def test_ancestors_depths_and_root_path():
    tree = spec(speculative_token_tree=VLLM_TREE).tree
    tp = token_tree.tree_parents(token_tree.static_parents(tree, 2, "cpu"))  # [2, 8]
    anc = token_tree.ancestors(tp, tree.depth)
    assert anc.shape == (2, 8, 8)
    # Tree index 7 is node 6 = (0, 0, 0): ancestors root, (0,), (0, 0) and itself.
    assert anc[0, 7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    assert anc[1, 6].nonzero().flatten().tolist() == [0, 2, 6]  # (1, 0) under (1,)
    dep = token_tree.depths(anc)
    assert dep[0].tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    path = token_tree.root_path(anc, dep, torch.tensor([7, 5]), tree.depth)
    assert path.tolist() == [[0, 1, 4, 7], [0, 1, 5, 5]]


# ----------------------------------------------------------------------------- tree attention

def tree_forward(m, kv, tokens, lens, parents, depth):
    """The target over [pending, nodes] as a tree: writes at lens + t, RoPE at lens + depth."""
    from funcspec.nn.llama import TreeMask, forward

    tp = token_tree.tree_parents(parents)
    anc = token_tree.ancestors(tp, depth)
    mask = TreeMask(lens.unsqueeze(1) + token_tree.depths(anc), lens, anc)
    return forward(m.cfg, m.params, kv, tokens, torch.arange(len(lens)), lens, tree=mask)[0]


def test_tree_attention_equals_each_root_path_as_a_chain(tiny_llama):
    """Each node's logits are those of its root path decoded as a plain sequence (the masked reference)."""
    from funcspec import load_model
    from funcspec.nn import forward, init_kv_cache

    m = load_model(tiny_llama)
    tree = spec(speculative_token_tree=VLLM_TREE).tree
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (2, 9), generator=gen)
    nodes = torch.randint(0, 96, (2, tree.size + 1), generator=gen)  # [B, N+1]: pending, then the nodes
    kv = init_kv_cache(m.cfg, 2, 32)
    forward(m.cfg, m.params, kv, prompt, torch.arange(2), torch.zeros(2, dtype=torch.int64))
    lens = torch.tensor([9, 9])
    parents = token_tree.static_parents(tree, 2, "cpu")
    logits = tree_forward(m, kv, nodes, lens, parents, tree.depth)  # [B, N+1, V]
    anc = token_tree.ancestors(token_tree.tree_parents(parents), tree.depth)
    for t in range(tree.size + 1):
        path = anc[0, t].nonzero().flatten()
        ref, _, _ = forward(m.cfg, m.params, init_kv_cache(m.cfg, 2, 32), torch.cat([prompt, nodes[:, path]], 1),
                            torch.arange(2), torch.zeros(2, dtype=torch.int64))
        torch.testing.assert_close(logits[:, t], ref[:, -1], atol=1e-5, rtol=0)


def test_chain_shaped_tree_equals_the_chain_forward(tiny_llama):
    from funcspec import load_model
    from funcspec.nn import forward, init_kv_cache

    m = load_model(tiny_llama)
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([9, 6])
    caches = [init_kv_cache(m.cfg, 2, 32) for _ in range(2)]
    for kv in caches:
        forward(m.cfg, m.params, kv, ids[:, :9], torch.arange(2), torch.zeros(2, dtype=torch.int64))
    block = ids[:, 9:]  # [B, K+1]
    chain, _, _ = forward(m.cfg, m.params, caches[0], block, torch.arange(2), lens)
    tree = token_tree.chain(4)
    tree_logits = tree_forward(m, caches[1], block, lens, token_tree.static_parents(tree, 2, "cpu"), tree.depth)
    assert torch.equal(chain, tree_logits)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


# ----------------------------------------------------------------------------- verification

def one_hot_logits(argmax_rows, vocab=50):
    """[1, len, V] logits whose argmax at position t is ``argmax_rows[t]``."""
    out = torch.zeros(1, len(argmax_rows), vocab)
    out[0, torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 5.0
    return out


def verify_tree(keys, logits, proposal, samp, mode, depth):
    """The tree rule through the one verifier interface, in a bucket of sampling ``mode``."""
    from funcspec import verifiers

    cfg = verifiers.VerifyConfig("tree", depth=depth, greedy=mode.greedy, filters=mode.filters)
    return verifiers.verify(cfg, verifiers.VerifyInput(keys[:, 0], logits, proposal, samp, keys))


def test_greedy_tree_accepts_the_deepest_agreeing_path():
    from funcspec import sampling
    from funcspec.types import PLACEHOLDER, Proposal, Sampling

    tree = spec(speculative_token_tree=VLLM_TREE).tree  # nodes (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    drafts = torch.tensor([[10, 11, 12, 20, 21, 22, 30]])
    parents = token_tree.static_parents(tree, 1, "cpu")
    # root's argmax is node (1,)'s token; at (1,) (tree index 2) it is (1,0)'s token; then 42.
    logits = one_hot_logits([11, 20, 22, 0, 0, 0, 42, 0])
    for mode in (sampling.GREEDY, sampling.FILTERED):  # temperature 0 rows are greedy in every mode
        out, n, path = verify_tree(torch.full((1, tree.depth + 1), 7), logits, Proposal(drafts, parents=parents),
                                   Sampling.full(1, temperature=0.0), mode, tree.depth)
        assert out.tolist() == [[11, 22, 42, PLACEHOLDER]] and n.tolist() == [3]
        assert path.tolist() == [[0, 2, 6, 6]]
    # nothing agrees: the root's argmax alone; a PLACEHOLDER draft is never accepted
    out, n, _ = verify_tree(torch.full((1, tree.depth + 1), 7), one_hot_logits([13] * 8),
                            Proposal(torch.tensor([[PLACEHOLDER] * 7]), parents=parents),
                            Sampling.full(1, temperature=0.0), sampling.GREEDY, tree.depth)
    assert out.tolist() == [[13, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]] and n.tolist() == [1]


def tree_joint_pvalue():
    """Chi-square p-value of the joint of the first two emitted tokens (N = 30000) against the target's.

    The target is a two-step Markov chain: p0 at the root, then P1[x] after token x
    (P2 below), so node logits depend on the node's token and depth, as a real
    target's would on its root path. Sibling drafts are drawn independently from a
    small vocabulary, so they often share a token. When a step emits one token,
    the second is what the next step would draw: a fresh draw from P1[first].
    """
    from chi_square import chi2_pvalue

    from funcspec import rng, sampling
    from funcspec.types import Proposal, Sampling

    n, vocab, temp, top_k = 30000, 6, 0.9, 5
    gen = torch.Generator().manual_seed(5)
    l0, l1, l2 = torch.randn(vocab) * 1.5, torch.randn(vocab, vocab) * 1.5, torch.randn(vocab, vocab) * 1.5
    tree = spec(speculative_token_tree=VLLM_TREE).tree
    parents = token_tree.static_parents(tree, n, "cpu")
    q = torch.softmax(l0 + torch.randn(vocab, generator=gen), -1)
    drafts = torch.multinomial(q, n * tree.size, replacement=True, generator=gen).view(n, tree.size)
    dep = torch.tensor([len(p) for p in tree.paths])
    node_logits = torch.where((dep == 1).view(1, -1, 1), l1[drafts], l2[drafts])  # [n, N, V]
    logits = torch.cat([l0.expand(n, 1, vocab), node_logits], 1)  # [n, N+1, V]
    keys = rng.split(rng.key(11), n * (tree.depth + 1)).view(n, tree.depth + 1)  # [n, D+1]: a key per depth
    out, num, _ = verify_tree(keys, logits, Proposal(drafts, parents=parents),
                              Sampling.full(n, temperature=temp, top_k=top_k), sampling.FILTERED, tree.depth)
    first = out[:, 0]
    p0 = sampling.target_probs(l0.view(1, 1, -1), temp, top_k)[0, 0]  # [V]
    p1 = sampling.target_probs(l1.unsqueeze(0), temp, top_k)[0]  # [V, V]
    fresh = torch.multinomial(p1[first], 1, generator=gen).squeeze(1)
    second = torch.where(num >= 2, out[:, 1], fresh)
    assert (num >= 2).float().mean() > 0.3 and (num >= 3).any()
    shared = (drafts[:, :3].unsqueeze(2) == drafts[:, :3].unsqueeze(1)).sum((1, 2)) > 3
    assert shared.float().mean() > 0.3  # many rows have depth-1 siblings that share a token
    assert (p1 == 0).any()  # top-k zeros that the drafts do propose
    joint = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    return chi2_pvalue(joint, p0.unsqueeze(1) * p1)


def test_sampled_tree_verification_is_lossless_with_shared_sibling_tokens():
    """Chi-square on the joint of the first two emitted tokens (N = 30000, alpha = 1e-4)."""
    assert tree_joint_pvalue() > 1e-4


def test_chi_square_rejects_a_tree_verifier_with_the_wrong_residual(monkeypatch):
    """The same statistic detects a rule that, when no child is accepted, emits a fresh draw from p
    instead of the draw that missed every child (p instead of the residual without the children)."""
    from funcspec.verifiers import common
    from funcspec.verifiers import tree as tree_verifier

    draws, emit, box = tree_verifier.target_choices, common.emit, {}

    def choices(key, logits, sampling, mode, dep):
        box["fresh"] = draws(key + 1, logits, sampling, mode, dep)[:, 0]  # [B] an independent draw at the root
        return draws(key, logits, sampling, mode, dep)

    def emit_fresh(drafts, num_accepted, final):
        return emit(drafts, num_accepted, torch.where(num_accepted == 0, box["fresh"], final))

    monkeypatch.setattr(tree_verifier, "target_choices", choices)
    monkeypatch.setattr(tree_verifier.common, "emit", emit_fresh)
    assert tree_joint_pvalue() < 1e-4


def test_commit_path_moves_the_accepted_nodes_kv_into_place():
    """Entries written at lens + tree index move to lens + depth along the path; others stay."""
    from funcspec.nn import ModelConfig, init_kv_cache
    from funcspec.nn.llama import commit_path

    cfg = ModelConfig("llama", 8, 4, 8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2)
    kv = init_kv_cache(cfg, 2, 16)
    pos = torch.arange(16, dtype=torch.float32).view(1, 1, 1, -1, 1)
    kv.k.copy_(pos.expand_as(kv.k) + 100 * torch.arange(3).view(1, -1, 1, 1, 1))  # slot s, position t: 100 s + t
    kv.v.copy_(-kv.k)
    before = kv.k.clone()
    slots, lens = torch.tensor([1, 0]), torch.tensor([5, 3])
    commit_path(kv, slots, lens, torch.tensor([[0, 2, 6, 7], [0, 3, 3, 3]]))  # [B, D+1]
    assert kv.k[1, 1, 0, 5:9, 0].tolist() == [105, 107, 111, 112]  # slot 1: tree indices 0, 2, 6, 7 from 5
    assert kv.k[0, 0, 0, 3:7, 0].tolist() == [3, 6, 6, 6]  # slot 0: path 0, 3 (past its end it repeats)
    assert torch.equal(kv.v, -kv.k)
    assert torch.equal(kv.k[:, 2], before[:, 2]) and torch.equal(kv.k[:, 1, :, :5], before[:, 1, :, :5])
