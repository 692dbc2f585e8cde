"""Speculative decoding through the engine: greedy lossless for every host/in-graph proposer,
sampled lossless with a sampling draft model, dynamic K, captured graphs without recompiles.

Each method's compiled graph is checked on real inductor once, in tests/engine/test_logprobs.py's inductor
matrix (tokens and logprobs of a greedy and a sampled row, then again under fail_on_recompile); here the
eager tests cover every K and batch bucket."""

import numpy as np
import pytest
import torch
from scipy import stats

from funcspec import Engine, SamplingParams

from spec_cases import GREEDY, _ids, _prompts, _spec


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Autoregressive greedy outputs of 30 prompts (the ground truth)."""
    prompts = _prompts(30)
    return prompts, _ids(Engine(tiny_llama, max_num_seqs=8, max_model_len=96,
                                enforce_eager=True).generate(prompts, GREEDY))


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_eager(tiny_llama, tiny_draft, reference, method, k):
    prompts, want = reference
    eng = Engine(tiny_llama, speculative_config=_spec(method, k, tiny_draft), max_num_seqs=8, max_model_len=96,
                 enforce_eager=True)
    for n in (1, 3, 8):  # buckets 1, 4 and 8
        assert _ids(eng.generate(prompts[:n], GREEDY)) == want[:n]
    slots4 = Engine(tiny_llama, speculative_config=_spec(method, k, tiny_draft), max_num_seqs=4, max_model_len=96,
                    enforce_eager=True)
    assert _ids(slots4.generate(prompts, GREEDY)) == want  # 30 requests through 4 slots
    st = slots4.stats()
    assert st["mean_acceptance_length"] > 1.0, "repetitive prompts must accept some drafts"
    assert len(st["per_position_acceptance"]) == k and st["per_position_acceptance"][0] > 0


def test_k_table_changes_k_mid_run_without_recompiles(tiny_llama, reference, traced_codegen):
    """vLLM's num_speculative_tokens_per_batch_size: K=3 for 1-2 requests, K=1 for 3+, on inductor. NOTE: Dynamo's
    graphs stand in for inductor's codegen (``traced_codegen``): which graphs run, and that none recompiles, is
    Dynamo's; ngram's step is compiled by real inductor in tests/engine/test_logprobs.py."""
    prompts, want = reference
    spec = _spec("ngram", 3, num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 4, 1]])
    eng = Engine(tiny_llama, speculative_config=spec, backend="inductor", max_num_seqs=4,
                 compilation_config={"batch_sizes": [4], "capture": "lazy"},
                 max_model_len=96)
    assert _ids(eng.generate(prompts[:6], GREEDY)) == want[:6]  # captures K=1 and K=3
    used = set(eng.stats()["buckets_used"])
    assert used == {"B4_K1", "B4_K3"}
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _ids(eng.generate(prompts[6:14], GREEDY)) == want[6:14]
    assert eng.stats()["recompiles"] == 0


def test_acceptance_is_zero_beyond_active_k(tiny_llama, reference):
    """With a K table capping K at 1 for every batch size, positions 2.. of K_max = 3 never accept."""
    prompts, want = reference
    spec = _spec("ngram", 3, num_speculative_tokens_per_batch_size=[[1, 8, 1]])
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts[:8], GREEDY)) == want[:8]
    acc = eng.stats()["per_position_acceptance"]
    assert acc[0] > 0 and acc[1] == 0 and acc[2] == 0
    assert set(eng.stats()["buckets_used"]) <= {"B1_K1", "B2_K1", "B4_K1"}


def test_k_zero_rows_of_the_table_decode_autoregressively(tiny_llama, tiny_draft, reference):
    """K = 0 means no drafting; the draft model still keeps its KV in step."""
    prompts, want = reference
    spec = _spec("draft_model", 2, tiny_draft, num_speculative_tokens_per_batch_size=[[1, 1, 2], [2, 8, 0]])
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(7)]
    assert _ids(eng.generate(prompts[:7], params)) == [w[:4 + 2 * i] for i, w in enumerate(want[:7])]
    assert {"B4_K0", "B1_K2"} <= set(eng.stats()["buckets_used"])


def test_request_metrics(tiny_llama, reference):
    prompts, _ = reference
    eng = Engine(tiny_llama, speculative_config=_spec("ngram", 3), max_num_seqs=4, max_model_len=96,
                 enforce_eager=True)
    out = eng.generate(prompts[:4], GREEDY)
    for o in out:
        m = o.metrics
        assert m["num_accepted_tokens"] <= m["num_draft_tokens"] <= 3 * m["steps"]
        assert m["acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["steps"])


def _first_two(eng_kwargs, tiny_llama, n_seeds, prompt):
    eng = Engine(tiny_llama, max_num_seqs=16, max_model_len=16, **eng_kwargs, enforce_eager=True)
    params = [SamplingParams(temperature=1.0, top_k=6, seed=s, max_tokens=2, ignore_eos=True) for s in range(n_seeds)]
    outs = eng.generate([prompt] * n_seeds, params)
    return [tuple(o.outputs[0].token_ids) for o in outs], eng


def _same_law_pvalue(xs: list, ys: list) -> float:
    """Chi-square p-value that two samples of outcomes share one law (homogeneity test)."""
    cells = sorted(set(xs) | set(ys))
    a = np.array([xs.count(c) for c in cells])
    b = np.array([ys.count(c) for c in cells])
    keep = (a + b) >= 10  # pool sparse cells so the chi-square approximation holds
    table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
    return stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue


def test_sampled_lossless_draft_model(tiny_llama, tiny_draft):
    """Joint law of the first two tokens: speculative (sampled drafts, standard verify) vs autoregressive."""
    n, prompt = 3000, [7, 8, 9]
    spec_pairs, eng = _first_two({"speculative_config": _spec("draft_model", 2, tiny_draft)}, tiny_llama,
                                 n, prompt)
    ar_pairs, _ = _first_two({}, tiny_llama, n, prompt)
    assert eng.stats()["mean_acceptance_length"] > 1.0
    assert _same_law_pvalue(spec_pairs, ar_pairs) > 1e-4


def test_dynamic_verify_length_is_lossless(tiny_llama, tmp_path, reference):
    """Confidence-based verify length (dspark): budget-driven K buckets, output equals AR."""
    from funcspec.checkpoints import init_draft_head

    prompts, want = reference
    head = init_draft_head("dspark", tiny_llama, tmp_path / "dspark", markov_rank=8)
    spec = {"method": "dspark", "model": str(head), "num_speculative_tokens": 4}
    extra = {"dynamic_spec_config": {"method": "dspark", "method_params": {
        "initial_verify_budget_per_req": 2, "budget_update_interval": 2, "budget_threshold": 0.3}}}
    eng = Engine(tiny_llama, speculative_config=spec, additional_config=extra, max_num_seqs=4, max_model_len=96,
                 enforce_eager=True)
    assert _ids(eng.generate(prompts[:8], GREEDY)) == want[:8]
    ks = {int(b.split("_K")[1]) for b in eng.stats()["buckets_used"]}
    assert ks and max(ks) <= 4 and min(ks) >= 1


def test_draft_model_tree_greedy_lossless(tiny_llama, tiny_draft, reference):
    """draft_model drafts vLLM's speculative_token_tree (its KV moved along the accepted path): greedy == AR."""
    prompts, want = reference
    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"
    eng = Engine(tiny_llama, speculative_config=_spec("draft_model", 5, tiny_draft, speculative_token_tree=tree),
                 max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    assert len(eng.stats()["per_position_acceptance"]) == 3 and eng.stats()["mean_acceptance_length"] > 1.0
    dyn = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 7}
    eng = Engine(tiny_llama, speculative_config=_spec("draft_model", None, tiny_draft, **dyn),
                 max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(prompts, GREEDY)) == want
    assert len(eng.stats()["per_position_acceptance"]) == 3 and eng.stats()["mean_acceptance_length"] > 1.0


DRAFT_MODEL_TREES = {"static": {"speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"},
                     "dynamic": {"speculative_eagle_topk": 2, "speculative_num_steps": 3,
                                 "speculative_num_draft_tokens": 8}}


@pytest.mark.parametrize("shape", sorted(DRAFT_MODEL_TREES))
def test_draft_model_tree_moves_its_kv_along_the_accepted_path(tiny_llama, shape):
    """After tree steps, the draft's cache holds its KV of the committed tokens at their positions: what
    one fresh draft forward over them writes (a draft that drafts what the target says: the target itself).
    A dynamic tree's frontiers are written at other slots than its nodes: this fails without moving them."""
    from funcspec.nn import forward, init_kv_cache

    eng = Engine(tiny_llama, speculative_config=_spec("draft_model", None, tiny_llama, **DRAFT_MODEL_TREES[shape]),
                 max_num_seqs=1, max_model_len=96, enforce_eager=True)
    prompt = _prompts(1)[0]
    seq = prompt + eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # deep paths were accepted (static: (0,), (0, 0), (0, 0, 0) sit at tree slots 1, 3, 5, not at depths
    # 1, 2, 3; dynamic: the flat tiny model keeps breadth first, so depth 3 is reached less often)
    assert eng.stats()["per_position_acceptance"][2] > (0.5 if shape == "static" else 0.1)
    n = len(seq) - 2  # positions the last step's first pass and path moves left final
    m = eng.proposer.cfg.model
    ref = init_kv_cache(m, 1, 128)
    forward(m, eng.params["draft"], ref, torch.tensor([seq[:n]]), torch.tensor([0]), torch.tensor([0]))
    got = eng.state.proposer.kv
    torch.testing.assert_close(got.k[:, 0, :, :n], ref.k[:, 0, :, :n], atol=1e-4, rtol=0)
    torch.testing.assert_close(got.v[:, 0, :, :n], ref.v[:, 0, :, :n], atol=1e-4, rtol=0)



def test_draft_model_dynamic_tree_leaves_each_run_node_kv_at_its_node_slot(tiny_llama, tiny_draft):
    """After a dynamic-tree proposal, every node with children (the draft ran it as a frontier node) holds,
    at its node slot n + 1 + i, the KV that a fresh draft forward over the prompt and its root path writes.
    Frontiers are written at other slots (frontier d at (d-1)·topk + j); without the move this fails."""
    from funcspec import rng, sampling
    from funcspec.nn import forward, init_kv_cache
    from funcspec.proposers import draft_model
    from funcspec.step import StepContext
    from funcspec.types import Sampling

    dyn = {"speculative_eagle_topk": 3, "speculative_num_steps": 3, "speculative_num_draft_tokens": 15}
    eng = Engine(tiny_llama, speculative_config=_spec("draft_model", None, tiny_draft, **dyn), max_num_seqs=1,
                 max_model_len=96, enforce_eager=True)
    h, params, tree = eng.proposer, eng.params["draft"], eng.spec.tree
    prompt = [5, 17, 42, 8, 61, 23, 9]
    p = len(prompt)
    state = h.prefill(h.init_state(1, 128), torch.tensor([prompt]), 0, p, ())
    history = torch.zeros(2, 128, dtype=torch.int64)
    history[0, :p] = torch.tensor(prompt)
    slots, lens = torch.tensor([0]), torch.tensor([p - 1])  # the last prompt token is the pending one
    ctx = StepContext(slots, lens, history, rng.key(0).view(1), Sampling.full(1, 0.0), mode=sampling.GREEDY,
                      tree=tree)
    prop, state = draft_model.propose(h.cfg, params, state, ctx, tree.size)
    tokens, parents = prop.tokens[0].tolist(), prop.parents[0].tolist()
    m, checked = h.cfg.model, 0
    for i in range(tree.size):
        if i not in parents:
            continue  # a leaf: the draft never ran it
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        ref = init_kv_cache(m, 1, 128)
        forward(m, params, ref, torch.tensor([prompt + path]), slots, torch.tensor([0]))
        at, want = p + i, p - 1 + len(path)  # node slot; the node's position (pending at p - 1, depth len(path))
        torch.testing.assert_close(state.kv.k[:, 0, :, at], ref.k[:, 0, :, want], atol=1e-4, rtol=0)
        torch.testing.assert_close(state.kv.v[:, 0, :, at], ref.v[:, 0, :, want], atol=1e-4, rtol=0)
        checked += 1
    assert checked >= 4  # the three depth-1 nodes and at least one depth-2 frontier node

def test_sampled_tree_lossless_draft_model(tiny_llama):
    """Joint law of the first two tokens through a token tree (the target as its own top-k drafter, so
    first, second and third siblings are all accepted at times) vs autoregressive sampling."""
    n, prompt = 3000, [7, 8, 9]
    tree = "[(0,), (1,), (2,), (0, 0), (1, 0)]"
    spec_pairs, eng = _first_two({"speculative_config": _spec("draft_model", 5, tiny_llama,
                                                               speculative_token_tree=tree)}, tiny_llama, n, prompt)
    ar_pairs, _ = _first_two({}, tiny_llama, n, prompt)
    assert eng.stats()["per_position_acceptance"][0] > 0.5
    assert _same_law_pvalue(spec_pairs, ar_pairs) > 1e-4


def test_draft_model_state_declares_its_slot_axes(tiny_llama, tiny_draft, check_slot_declarations):
    eng = Engine(tiny_llama, speculative_config=_spec("draft_model", 2, tiny_draft), max_num_seqs=2, max_model_len=96,
                 enforce_eager=True)
    check_slot_declarations(eng)
