"""Neural draft heads (Medusa, EAGLE-1, EAGLE-3, MTP): lossless greedy decoding, draft alignment
against a from-scratch recompute, checkpoint round trips, state structure, padding, draft window, capture."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from heads_cases import HEADS, K_MAX, METHODS, PROMPTS, TREE, greedy, spec_engine
from safetensors.torch import save_file

from funcspec import Engine, SamplingParams, sampling
from funcspec.capture.backends import INDUCTOR_OPTIONS
from funcspec.checkpoints import eagle, flatten, layouts, medusa, mtp, read_weights
from funcspec.nn import medusa as medusa_net
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.pytree import clone_state, tree_signature
from funcspec.step import StepContext, VerifyResult
from funcspec.token_tree import Chain
from funcspec.types import Sampling


def record_drafts(eng):
    """Wrap the engine's proposer so every propose call appends (slots, lens, drafts) to the returned list."""
    rec, mod = [], eng.proposer.module
    wrapped = types.ModuleType(mod.__name__ + "_recorded")
    wrapped.__dict__.update(vars(mod))

    def propose(cfg, params, state, ctx, k):
        proposal, new = mod.propose(cfg, params, state, ctx, k)
        rec.append((ctx.slots.tolist(), ctx.lens.tolist(), proposal.tokens.tolist()))
        return proposal, new

    wrapped.propose = propose
    eng.proposer = eng.runner.proposer = dataclasses.replace(eng.proposer, module=wrapped)
    return rec


# ----------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_autoregressive(zoo, method, k):
    eng = spec_engine(zoo, method, k)
    out = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, greedy(24))]
    assert out == zoo.ar
    st = eng.stats()
    assert len(st["per_position_acceptance"]) == k and st["mean_acceptance_length"] >= 1.0
    assert eng.generate(PROMPTS[3:], greedy(12))[0].outputs[0].token_ids == zoo.ar[3][:12]  # batch of 1


def reference_drafts(eng, seq: list[int], k: int) -> list[int]:
    """Drafts after committed seq[:-1] and pending seq[-1], recomputed from scratch (fresh caches,
    target features from one full target pass): what the proposer's incremental state must reproduce."""
    handle, params, tgt = eng.proposer, eng.params["draft"], eng.model
    n = len(seq) - 1
    x = torch.tensor([seq])
    zero, slot = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _, hid, _ = forward(tgt.cfg, tgt.params, init_kv_cache(tgt.cfg, 1, n), x[:, :n], slot, zero,
                        handle.hidden_layers)
    feats = torch.cat(hid, -1)  # [1, n, F]
    cfg = handle.cfg
    if isinstance(cfg.head, medusa_net.MedusaConfig):
        return [int(medusa_net.head_logits(cfg.head, params, feats[:, -1], i).argmax()) for i in range(k)]
    kv = init_kv_cache(cfg.model, 1, n + k)
    g, kv = cfg.forward(cfg.head, params, kv, x[:, 1:], cfg.features(cfg.head, params, feats), slot, zero)
    g, drafts = g[:, -1], []
    for i in range(k):
        drafts.append(cfg.draft(cfg.head, params, g))
        g, kv = cfg.forward(cfg.head, params, kv, drafts[-1].view(1, 1), g.unsqueeze(1), slot, zero + n + i)
        g = g[:, 0]
    return [int(d) for d in drafts]


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_drafts_match_full_recompute(zoo, method):
    """Every step's drafts equal a from-scratch recompute, over two slots and every acceptance count.

    Random heads are almost never accepted, so the synthetic verifier (lossy,
    accepts by rate) makes each step commit 1..K+1 tokens: the catch-up after
    partial and full acceptance is what this checks.
    """
    synthetic = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8, 0.6, 0.4]}
    eng = spec_engine(zoo, method, max_num_seqs=2, spec=synthetic)
    rec = record_drafts(eng)
    outs = eng.generate(PROMPTS[1:3], greedy(16))
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS[1:3], outs)]
    checked = 0
    for slots, lens, drafts in rec:
        for slot, n, d in zip(slots, lens, drafts):
            if slot < 2:
                assert d == reference_drafts(eng, seqs[slot][:n + 1], K_MAX), (slot, n)
                checked += 1
    assert checked >= 8
    assert set(eng.stats()["per_position_acceptance"]) != {0.0}  # some drafts were accepted


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_checkpoint_round_trip_and_bad_keys(zoo, method, tmp_path):
    mod, kw = HEADS[method]
    hf, params = mod.init_params(zoo.target.cfg, seed=1, **kw)
    def load(path):
        return mod.load_params(path, zoo.target, **kw)

    _, loaded = load(zoo.paths[method])
    written, got = flatten(params), flatten(loaded)
    ours = {p: n for n, p in layouts.read_head(zoo.paths[method], mod.__name__.split(".")[-1], method).names.items()}
    for name, t in written.items():  # written under the published names, loaded under funcspec's
        assert torch.equal(got[ours[name]], t.to(got[ours[name]].dtype)), name
    shared = set(got) - set(ours.values())  # the target's tensors, by reference
    target_ids = {id(t) for t in flatten(zoo.target.params).values()}
    assert all(id(got[name]) in target_ids for name in shared) and (method == "medusa" or shared)

    flat = read_weights(Path(zoo.paths[method]))
    victim = sorted(k for k, v in flat.items() if v.dim() == 2)[0]
    for label, tensors in [("missing", {k: v for k, v in flat.items() if k != victim}),
                           ("mis-shaped", {**flat, victim: flat[victim][:, :-1].contiguous()})]:
        bad = tmp_path / label
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(hf))
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=label) as err:
            load(bad)
        assert victim in str(err.value)


def test_bad_head_configs(zoo):
    with pytest.raises(ValueError, match="medusa_num_heads"):  # K larger than the number of heads
        Engine(zoo.target, {"method": "medusa", "model": zoo.paths["medusa"], "num_speculative_tokens": 5},
               enforce_eager=True)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        eagle.load_params(zoo.paths["eagle3"], zoo.target, version=3, aux_layers=(0, 1, 4))
    with pytest.raises(ValueError, match="no MTP module"):
        Engine(zoo.target, {"method": "mtp", "num_speculative_tokens": 1}, enforce_eager=True)


# ----------------------------------------------------------------------------- state, padding


def _ctx(state, slots, k=K_MAX):
    """A greedy step context of rows ``slots`` in a chain bucket of K = ``k``."""
    slots = torch.tensor(slots)
    b = slots.shape[0]
    return StepContext(slots, state.kv.lens[slots], state.history, torch.zeros(b, dtype=torch.int64),
                       Sampling.full(b, 0.0), tree=Chain(k))


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_every_state_tensor_declares_its_slot_axis(zoo, method, check_slot_declarations):
    check_slot_declarations(spec_engine(zoo, method, max_num_seqs=2))


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_state_structure_and_padding_invariance(zoo, method):
    eng = spec_engine(zoo, method, max_num_seqs=2)
    eng.generate(PROMPTS[:2], greedy(7))  # slots 0 and 1 now hold decoded requests
    h, params, s = eng.proposer, eng.params["draft"], eng.num_slots

    def run(slots):
        state = clone_state(eng.state)
        sig = tree_signature(state.proposer)
        proposal, new = h.module.propose(h.cfg, params, state.proposer, _ctx(state, slots), K_MAX)
        assert tree_signature(new) == sig
        return proposal.tokens, new

    alone, _ = run([1])
    padded, new = run([1, s, s])
    both, _ = run([0, 1])
    assert torch.equal(padded[:1], alone) and torch.equal(both[1:], alone)
    hid = tuple(torch.ones(3, K_MAX + 1, eng.model.cfg.hidden_size) for _ in h.hidden_layers)  # [B, K+1, H] each
    result = VerifyResult(torch.tensor([1, s, s]), torch.tensor([9, 0, 0]), torch.zeros(3, K_MAX + 1, dtype=torch.int64),
                          torch.tensor([2, 1, 4], dtype=torch.int32), hid, torch.arange(K_MAX + 1).expand(3, -1),
                          Chain(K_MAX))
    assert tree_signature(h.module.commit(h.cfg, new, result)) == tree_signature(new)


# ----------------------------------------------------------------------------- draft window


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_draft_window_changes_drafts_never_the_output(zoo, method):
    def run(window):
        extra = None if window is None else {"draft_window_size": window}
        eng = spec_engine(zoo, method, max_num_seqs=2, additional_config=extra)
        rec = record_drafts(eng)
        out = [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:2], greedy(24))]
        return out, rec

    out, full = run(None)
    assert run(1000) == (out, full)  # W >= every context: the same drafts
    small_out, small = run(2)
    assert out == small_out == zoo.ar[:2] and small != full


def test_draft_window_does_not_depend_on_k(zoo):
    """The window starts at lens - W whatever the bucket's K (nn.llama.window_start), so a chain head's
    drafts at K = 2 are its first two at K = 3: a row's drafts do not follow the batch-size K table."""
    eng = spec_engine(zoo, "eagle3", max_num_seqs=2, additional_config={"draft_window_size": 3})
    eng.generate(PROMPTS[:2], greedy(9))
    h, params = eng.proposer, eng.params["draft"]
    drafts = {}
    for k in (2, 3):
        state = clone_state(eng.state)
        drafts[k] = h.propose(params, state.proposer, _ctx(state, [0, 1], k), k)[0].tokens
    assert torch.equal(drafts[3][:, :2], drafts[2])


# ----------------------------------------------------------------------------- capture


def test_propose_compiles_fullgraph(zoo):
    eng = spec_engine(zoo, "eagle3", max_num_seqs=2, additional_config={"draft_window_size": 8})
    eng.generate(PROMPTS[:2], greedy(5))
    h, params = eng.proposer, eng.params["draft"]

    def step(params, pstate, ctx):  # NOTE: K = 2 keeps the cold compile short; it still has a feedback step
        return h.module.propose(h.cfg, params, pstate, ctx, 2)

    compiled = torch.compile(step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)  # the engine's options
    outs = []
    for fn in (step, compiled):
        state = clone_state(eng.state)
        proposal, new = fn(params, state.proposer, _ctx(state, [0, 1], 2))
        outs.append((proposal.tokens, new.kv.k))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp", "dflash", "dspark"])
def test_whole_step_captures_as_one_graph(zoo, method, traced_codegen, tmp_path):
    """Each head's K-step draft loop traces into the bucket's single fullgraph step, never recompiles,
    and stays lossless. Inductor's C++ codegen is swapped for the traced graph: the graph-capture
    property is Dynamo's, and six cold compiles would not fit CI's budget (see spec tests for real
    inductor runs)."""
    from funcspec.checkpoints import init_draft_head

    if method in ("dflash", "dspark"):
        head = init_draft_head(method, zoo.target, tmp_path / method, markov_rank=8)
        eng = Engine(zoo.target, {"method": method, "model": str(head), "num_speculative_tokens": 2},
                     backend="inductor", max_num_seqs=4,
                     compilation_config={"batch_sizes": [4], "capture": "lazy"}, max_model_len=96)
    else:
        eng = spec_engine(zoo, method, 2, backend="inductor",
                          compilation_config={"batch_sizes": [4], "capture": "lazy"})
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:2], greedy(24))] == zoo.ar[:2]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, greedy(24))] == zoo.ar
    (key, graph), = eng.graphs.items()  # one bucket: (4, 2) at one context length, greedy
    assert key[:2] == (4, 2) and key[3] == "greedy"
    g = graph.stats
    assert g.compiles == 1 and g.graph_breaks == 0 and eng.stats()["recompiles"] == 0


# ----------------------------------------------------------------------------- token trees



@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_tree_greedy_equals_autoregressive(zoo, method):
    """A static vLLM tree (7 nodes, depth 3): greedy output equals AR token for token, batch 4 and 1."""
    eng = spec_engine(zoo, method, k=len(TREE), spec={"speculative_token_tree": str(TREE)})
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, greedy(24))] == zoo.ar
    st = eng.stats()
    assert len(st["per_position_acceptance"]) == 3 and st["mean_acceptance_length"] >= 1.0
    assert st["buckets_used"].keys() == {"B4_K7"}
    assert eng.generate(PROMPTS[3:], greedy(12))[0].outputs[0].token_ids == zoo.ar[3][:12]


def test_chain_shaped_tree_drafts_what_the_chain_drafts(zoo):
    """speculative_token_tree = a chain of 3 accepts exactly what K = 3 accepts (same drafts, same paths)."""
    chain = spec_engine(zoo, "eagle3", k=3)
    tree = spec_engine(zoo, "eagle3", k=3, spec={"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"})
    outs = [[o.outputs[0].token_ids for o in e.generate(PROMPTS, greedy(24))] for e in (chain, tree)]
    assert outs[0] == outs[1] == zoo.ar
    assert chain.stats()["per_position_acceptance"] == tree.stats()["per_position_acceptance"]
    assert chain.stats()["steps"] == tree.stats()["steps"]


DYNAMIC = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}


@pytest.mark.parametrize("tree", [DYNAMIC, TREE], ids=["dynamic", "static"])
def test_tree_step_keeps_state_structure_and_runs_on_inductor_without_recompiles(zoo, tree, traced_codegen):
    """Bucket (B, N) = (4, 7), static and dynamic (both depth 3): the step keeps the state's
    structure, emits [B, D+1] tokens, and one
    fullgraph serves every step greedy-losslessly with 0 recompiles after warm-up.

    NOTE: inductor's codegen is swapped for the Dynamo graph (as the test above does): the graph, its guards and
    its recompiles are Dynamo's. EAGLE-3's static tree is compiled by real inductor in
    tests/engine/test_logprobs.py's inductor matrix (tokens and logprobs equal AR's there)."""
    spec = {"speculative_token_tree": str(tree)} if tree is TREE else tree
    eng = spec_engine(zoo, "eagle3", k=7, spec=spec, backend="inductor",
                      compilation_config={"batch_sizes": [4], "capture": "lazy"})
    assert eng.plan.bucket_plan.ks == (0, 7) and eng.plan.bucket_plan.capture_sizes()[7] == [32]
    bucket = eng.bucket(4, 7, mode=sampling.GREEDY)
    sig = tree_signature(bucket.args[1])
    out, new = bucket.fn(*bucket.args)
    assert tree_signature(new) == sig and out.tokens.shape == (4, 4) and out.num_emitted.shape == (4,)
    assert_one_lossless_graph(eng, zoo)


def assert_one_lossless_graph(eng, zoo) -> None:
    """Greedy output equal to AR, then again under fail_on_recompile: one (4, 7) graph, compiled once (or loaded
    from the compiled-step store), no graph break, no recompile."""
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:2], greedy(24))] == zoo.ar[:2]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, greedy(24))] == zoo.ar
    (key, graph), = eng.graphs.items()
    assert key[:2] == (4, 7) and graph.stats.graph_breaks == 0
    assert graph.stats.compiles == (0 if graph.stats.loaded else 1)
    assert eng.stats()["recompiles"] == 0


@pytest.mark.parametrize("method, tree", [("eagle", TREE), ("mtp", DYNAMIC), ("draft_model", TREE),
                                          ("draft_model", DYNAMIC)])
def test_every_tree_method_runs_on_inductor_without_recompiles(zoo, method, tree, traced_codegen):
    """The other tree methods (eagle3's test is above; ngram and suffix: test_history_trees.py): one
    fullgraph (4, 7) bucket, greedy output equal to AR, 0 recompiles after warm-up (traced codegen)."""
    spec = {"speculative_token_tree": str(tree)} if tree is TREE else tree
    eng = spec_engine(zoo, method, k=7, spec=spec, backend="inductor",
                      compilation_config={"batch_sizes": [4], "capture": "lazy"})
    assert_one_lossless_graph(eng, zoo)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_dynamic_tree_greedy_equals_autoregressive(zoo, method):
    """EAGLE-2 dynamic trees (SGLang's topk / num_steps / num_draft_tokens): greedy output equals AR."""
    dyn = {"speculative_eagle_topk": 3, "speculative_num_steps": 3, "speculative_num_draft_tokens": 9}
    eng = spec_engine(zoo, method, k=8, spec=dyn)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, greedy(24))] == zoo.ar
    assert len(eng.stats()["per_position_acceptance"]) == 3 and eng.stats()["buckets_used"].keys() == {"B4_K8"}
    assert eng.generate(PROMPTS[3:], greedy(12))[0].outputs[0].token_ids == zoo.ar[3][:12]


def test_dynamic_tree_of_topk_one_drafts_what_the_chain_drafts(zoo):
    chain = spec_engine(zoo, "eagle3", k=3)
    dyn = spec_engine(zoo, "eagle3", k=3, spec={"speculative_eagle_topk": 1, "speculative_num_steps": 3,
                                                "speculative_num_draft_tokens": 4})
    outs = [[o.outputs[0].token_ids for o in e.generate(PROMPTS, greedy(24))] for e in (chain, dyn)]
    assert outs[0] == outs[1] == zoo.ar
    assert chain.stats()["per_position_acceptance"] == dyn.stats()["per_position_acceptance"]


def test_sampled_tree_decoding_is_deterministic_per_seed(zoo):
    """Sampled rows through a tree: the same seeds give the same tokens, other seeds other tokens."""
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=s) for s in (1, 2)]

    def run(seeds):
        eng = spec_engine(zoo, "eagle3", k=8, spec={"speculative_eagle_topk": 3, "speculative_num_steps": 3,
                                                    "speculative_num_draft_tokens": 9})
        outs = eng.generate(PROMPTS[:2], [params[s] for s in seeds])
        return [o.outputs[0].token_ids for o in outs]

    assert run([0, 1]) == run([0, 1]) and run([1, 0])[0] != run([0, 1])[0]
