"""DFlash / DSpark block drafters: lossless decoding, the context cache against a from-scratch
reference, DSpark's Markov and confidence heads, loading, state structure, padding, window, capture."""

import collections

import pytest
import torch

from conftest import make_hf_model
from funcspec import Engine, SamplingParams, rng, sampling
from funcspec.checkpoints import dflash as ckpt
from funcspec.checkpoints import load_model, save_params
from funcspec.nn import dflash as net
from funcspec.nn import forward, init_kv_cache
from funcspec.nn.llama import apply_rope, mlp, rms_norm, rope_tables
from funcspec.proposers import dflash as dflash_proposer
from funcspec.proposers import dspark as dspark_proposer
from funcspec.step import StepContext, VerifyResult
from funcspec.token_tree import Chain
from funcspec.pytree import replace, tree_signature
from funcspec.types import Sampling

PROPOSERS = {"dflash": dflash_proposer, "dspark": dspark_proposer}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """NOTE: these models are tiny; a second intra-op thread only spins (20 ms per linear on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 33], list(range(10, 30)), [44, 9, 71, 8, 3, 90, 12]]


def _spec(method, path, k):
    return {"method": method, "model": path, "num_speculative_tokens": k}


def _save_head(path, target, method, **kw):
    hf, params = ckpt.init_params(target.cfg, seed=1, method=method, target_layer_ids=(0, 1), markov_rank=16, **kw)
    save_params(path, params, hf)
    return str(path)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_model(tiny_llama)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    return {m: _save_head(tmp_path_factory.mktemp(m), target, m) for m in ("dflash", "dspark")}


@pytest.fixture(scope="module")
def ar_outputs(target):
    return [o.outputs[0].token_ids for o in Engine(target, max_num_seqs=4,
                                                   enforce_eager=True).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive(target, heads, ar_outputs, method, k, batch):
    """Batch 4 with 3 prompts also runs a padding row."""
    eng = Engine(target, speculative_config=_spec(method, heads[method], k), max_num_seqs=batch, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar_outputs
    assert eng.stats()["recompiles"] == 0


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_every_state_tensor_declares_its_slot_axis(target, heads, method, check_slot_declarations):
    check_slot_declarations(_run_engine(target, heads, method, 3, [[5, 6, 7]], 4))


def test_dflash_keeps_its_context_through_k0_steps(target, heads, ar_outputs):
    """K = 0 steps (a batch-size table gap) still stage and project the committed context."""
    spec = {**_spec("dflash", heads["dflash"], 3), "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 0]]}
    eng = Engine(target, speculative_config=spec, max_num_seqs=4, enforce_eager=True)
    lengths = [6, 16, 10]  # so the batch shrinks to one request, which drafts again
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    out = [o.outputs[0].token_ids for o in eng.generate(PROMPTS, params)]
    assert out == [ids[:n] for ids, n in zip(ar_outputs, lengths)]
    assert {"B4_K0", "B2_K0", "B1_K3"} <= set(eng.stats()["buckets_used"])
    for slot in range(3):
        _check_cache(eng, "dflash", slot, 3)


# ----------------------------------------------------------------------------- a bigram target and an oracle DSpark


def _bigram(path):
    """A target whose layers are identities (o_proj = down_proj = 0): logits depend on the last token only."""
    hf = make_hf_model(path, seed=3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    hf.save_pretrained(str(path))
    tgt = load_model(path)
    m = tgt.params["model"]
    table = rms_norm(m["embed_tokens"]["weight"], m["norm"]["weight"], tgt.cfg.rms_norm_eps) @ tgt.params["lm_head"][
        "weight"].T  # [V, V]: logits after token x
    return tgt, table


def _markov_oracle(path, tgt, table, noise):
    """A DSpark head with U = 0 (final norm zeroed) and Markov bias W2[:, x] = table[x] + noise."""
    v = tgt.cfg.vocab_size
    hf, params = ckpt.init_params(tgt.cfg, seed=2, method="dspark", target_layer_ids=(0, 1), markov_rank=v)
    g = torch.Generator().manual_seed(0)
    params["norm"]["weight"] = torch.zeros_like(params["norm"]["weight"])
    params["markov_head"]["markov_w1"]["weight"] = torch.eye(v)
    params["markov_head"]["markov_w2"]["weight"] = (table + noise * torch.randn(v, v, generator=g)).T.contiguous()
    save_params(path, params, hf)
    return str(path)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    return _bigram(tmp_path_factory.mktemp("bigram"))


def test_dspark_oracle_markov_head_accepts_every_draft(bigram, tmp_path):
    tgt, table = bigram
    head = _markov_oracle(tmp_path, tgt, table, noise=0.0)
    ar = Engine(tgt, max_num_seqs=2, enforce_eager=True).generate(PROMPTS, GREEDY)
    eng = Engine(tgt, speculative_config=_spec("dspark", head, 3), max_num_seqs=2, enforce_eager=True)
    out = eng.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ar]
    assert eng.stats()["mean_acceptance_length"] == 4.0


def test_dspark_sampled_is_lossless(bigram, tmp_path):
    """Chi-square (alpha 1e-4) of the first two tokens against autoregressive sampling's exact distribution."""
    scipy_stats = pytest.importorskip("scipy.stats")
    tgt, table = bigram
    head = _markov_oracle(tmp_path, tgt, table, noise=0.15)  # q close to, but not, p: accepts and rejects
    temp, top_k, n = 1.0, 4, 1500
    eng = Engine(tgt, speculative_config=_spec("dspark", head, 3), max_num_seqs=16, max_model_len=32,
                 enforce_eager=True)
    for prompt in ([5], [7, 9]):
        params = [SamplingParams(temperature=temp, top_k=top_k, seed=i, max_tokens=2, ignore_eos=True)
                  for i in range(n)]
        counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in eng.generate([prompt] * n, params))
        # The exact joint law of (t1, t2) under autoregressive sampling.
        p1 = sampling.target_probs(_last_logits(tgt, prompt), temp, top_k)[0]
        expected = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = sampling.target_probs(_last_logits(tgt, prompt + [t1]), temp, top_k)[0]
            for t2 in p2.nonzero().flatten().tolist():
                expected[(t1, t2)] = float(p1[t1] * p2[t2]) * n
        assert set(counts) <= set(expected), "a token of zero probability was emitted"
        cells = sorted(expected)
        obs, exp = [counts[c] for c in cells], [expected[c] for c in cells]
        exp = [e * sum(obs) / sum(exp) for e in exp]
        assert scipy_stats.chisquare(obs, exp).pvalue > 1e-4
    assert eng.stats()["mean_acceptance_length"] > 1.3  # drafts do get accepted


def _last_logits(tgt, prompt):
    kv = init_kv_cache(tgt.cfg, 1, 16)
    zero = torch.zeros(1, dtype=torch.int64)
    logits, _, _ = forward(tgt.cfg, tgt.params, kv, torch.tensor([prompt]), zero, zero)
    return logits[:, -1]  # [1, V]


# ----------------------------------------------------------------------------- DSpark heads


def test_markov_head_and_confidence_match_a_loop_reference(target):
    hf, params = ckpt.init_params(target.cfg, seed=4, method="dspark", target_layer_ids=(0, 1), markov_rank=8,
                                 scale=4.0)
    cfg = ckpt.parse_config(hf, target.cfg, "dspark")
    g = torch.Generator().manual_seed(1)
    b, k, v = 3, 5, target.cfg.vocab_size
    base = torch.randn(b, k, v, generator=g)
    anchor = torch.randint(0, v, (b,), generator=g)
    h = torch.randn(b, k, target.cfg.hidden_size, generator=g)
    tokens, corrected, _, prev_emb = net.markov_decode(cfg, params, base, anchor, lambda i, x: (x.argmax(-1), x))
    conf = net.confidence(cfg, params, h, prev_emb)
    w1, w2 = params["markov_head"]["markov_w1"]["weight"], params["markov_head"]["markov_w2"]["weight"]
    proj = params["confidence_head"]["proj"]
    for row in range(b):
        prev = int(anchor[row])
        for i in range(k):
            step = [float(base[row, i, t]) + sum(float(w2[t, j] * w1[prev, j]) for j in range(8)) for t in range(v)]
            assert abs(max(step) - float(corrected[row, i].max())) < 1e-4
            feats = h[row, i].tolist() + w1[prev].tolist()
            z = sum(a * float(c) for a, c in zip(feats, proj["weight"][0])) + float(proj["bias"][0])
            assert abs(float(conf[row, i]) - 1 / (1 + torch.exp(torch.tensor(-z)).item())) < 1e-5
            prev = max(range(v), key=step.__getitem__)
            assert int(tokens[row, i]) == prev


# ----------------------------------------------------------------------------- the context cache vs a reference


def _reference_hidden(cfg, params, raw, block, start):
    """z-lab's forward written plainly: K/V = [k_proj(ctx); k_proj(block)], no cache, no mask.

    raw [L, n·H] target features of the context at positions start..start+L-1; block [T] tokens after it.
    """
    m, t, n = cfg.model, block.shape[0], raw.shape[0]
    ctx = rms_norm(m.ops.linear(raw, params["fc"]), params["hidden_norm"]["weight"], m.rms_norm_eps)
    x = params["embed_tokens"]["weight"][block]
    cos, sin = rope_tables(m, torch.arange(start, start + n + t).view(1, -1), x.dtype)
    for p in params["layers"]:
        a = p["self_attn"]
        hb = rms_norm(x, p["input_layernorm"]["weight"], m.rms_norm_eps)
        both = torch.cat([ctx, hb])
        q = rms_norm(m.ops.linear(hb, a["q_proj"]).view(1, t, m.num_heads, -1), a["q_norm"]["weight"], m.rms_norm_eps)
        k = rms_norm(m.ops.linear(both, a["k_proj"]).view(1, n + t, m.num_kv_heads, -1), a["k_norm"]["weight"],
                     m.rms_norm_eps)
        val = m.ops.linear(both, a["v_proj"]).view(n + t, m.num_kv_heads, -1)
        q, k = apply_rope(q, cos[:, n:], sin[:, n:])[0], apply_rope(k, cos, sin)[0]
        rep = m.num_heads // m.num_kv_heads
        k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)  # [n+t, H, D]
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / m.head_dim ** 0.5, -1)
        x = x + m.ops.linear(torch.einsum("hqk,khd->qhd", att, val).reshape(t, -1), a["o_proj"])
        x = x + mlp(m, p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], m.rms_norm_eps))
    return rms_norm(x, params["norm"]["weight"], m.rms_norm_eps)


def _run_engine(target, heads, method, k, prompts, max_tokens, **engine_kw):
    eng = Engine(target, speculative_config=_spec(method, heads[method], k), max_num_seqs=4, **engine_kw,
                 enforce_eager=True)
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return eng


def _ctx(eng, slots, temperature=0.0):
    slots = torch.tensor(slots)
    st = eng.state
    return StepContext(slots, st.kv.lens[slots], st.history, rng.fold_in(rng.key(7), slots),
                       Sampling.full(slots.shape[0], temperature))


def _committed_features(eng, slot):
    """Target features of slot's committed tokens, from a fresh full forward."""
    n = int(eng.state.kv.lens[slot])
    kv = init_kv_cache(eng.model.cfg, 1, n)
    zero = torch.zeros(1, dtype=torch.int64)
    _, hiddens, _ = forward(eng.model.cfg, eng.model.params, kv, eng.state.history[slot, :n].view(1, -1), zero, zero,
                            eng.proposer.hidden_layers)
    return torch.cat(hiddens, -1)[0], n


def _check_cache(eng, method, slot, k):
    """The cached draft of ``slot`` equals z-lab's from-scratch forward over its committed tokens."""
    raw, n = _committed_features(eng, slot)
    rows = k + 1 if method == "dflash" else k
    pcfg, params = eng.proposer.cfg, eng.params["draft"]
    pending, h, _ = dflash_proposer.draft_block(pcfg, params, eng.state.proposer, _ctx(eng, [slot]), rows)
    block = torch.tensor([int(pending[0])] + [pcfg.net.mask_token_id] * (rows - 1))
    ref = _reference_hidden(pcfg.net, params, raw, block, 0)
    torch.testing.assert_close(h[0], ref, atol=1e-4, rtol=1e-4)
    return ref


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_cached_draft_equals_reference(target, heads, method):
    """After prefill and several commits, the cached context gives z-lab's from-scratch forward."""
    k = 3
    eng = _run_engine(target, heads, method, k, [list(range(3, 23))], 12)
    ref = _check_cache(eng, method, 0, k)
    ctx = _ctx(eng, [0])
    pcfg, params = eng.proposer.cfg, eng.params["draft"]
    proposal, _ = PROPOSERS[method].propose(pcfg, params, eng.state.proposer, ctx, k)
    ref_logits = net.logits(pcfg.net, params, ref[1:] if method == "dflash" else ref)
    if method == "dflash":
        assert proposal.tokens[0].tolist() == ref_logits.argmax(-1).tolist()
        torch.testing.assert_close(proposal.confidence[0], net.max_prob(ref_logits), atol=1e-5, rtol=1e-5)
    assert proposal.tokens.shape == (1, k) and proposal.confidence.shape == (1, k)


def test_draft_window(target, heads):
    """W >= context gives identical drafts; a small W reads only positions >= start and still decodes losslessly."""
    prompt, k = list(range(3, 43)), 3
    eng = _run_engine(target, heads, "dflash", k, [prompt], 4)
    raw, n = _committed_features(eng, 0)
    pcfg, params = eng.proposer.cfg, eng.params["draft"]

    def hidden(window):
        _, h, _ = dflash_proposer.draft_block(replace(pcfg, window=window), params, eng.state.proposer,
                                              _ctx(eng, [0]), k + 1)
        return h[0]

    full = hidden(None)
    assert torch.equal(hidden(n), full) and torch.equal(hidden(10 * n), full)
    start = n - 8  # nn.llama.window_start: the 8 most recent committed positions
    assert start > 0
    small = hidden(8)
    assert not torch.allclose(small, full, atol=1e-3)
    pending = int(eng.state.history[0, n])
    block = torch.tensor([pending] + [pcfg.net.mask_token_id] * k)
    torch.testing.assert_close(small, _reference_hidden(pcfg.net, params, raw[start:], block, start),
                               atol=1e-4, rtol=1e-4)
    windowed = Engine(target, speculative_config=_spec("dflash", heads["dflash"], k), max_num_seqs=2,
                      additional_config={"draft_window_size": 8}, enforce_eager=True)
    ar = Engine(target, max_num_seqs=2, enforce_eager=True).generate([prompt, PROMPTS[1]], GREEDY)
    out = windowed.generate([prompt, PROMPTS[1]], GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ar]


# ----------------------------------------------------------------------------- loading


def test_load_round_trip(target, heads):
    for method in ("dflash", "dspark"):
        hf, params = ckpt.init_params(target.cfg, seed=1, method=method, target_layer_ids=(0, 1), markov_rank=16)
        cfg, loaded = ckpt.load_params(heads[method], target, method)
        assert cfg == ckpt.parse_config(hf, target.cfg, method)
        assert cfg.target_layer_ids == (0, 1) and cfg.mask_token_id == target.cfg.vocab_size - 1
        assert torch.equal(loaded["fc"]["weight"], params["fc"]["weight"])
        assert loaded["embed_tokens"]["weight"] is target.params["model"]["embed_tokens"]["weight"]
        assert dflash_proposer.hidden_layers(dflash_proposer.DFlashProposerConfig(cfg, 3)) == (1, 2)
    dspark_cfg, _ = ckpt.load_params(heads["dspark"], target, "dspark")
    assert (dspark_cfg.markov_rank, dspark_cfg.confidence, dspark_cfg.block_size) == (16, "hidden_markov", 7)
    with pytest.raises(ValueError, match="a dspark checkpoint .*DSpark.*use method 'dspark', not 'dflash'"):
        ckpt.load_params(heads["dspark"], target, "dflash")


def _broken(tmp_path, target, edit):
    hf, params = ckpt.init_params(target.cfg, seed=1, method="dspark", target_layer_ids=(0, 1), markov_rank=16)
    edit(hf, params)
    save_params(tmp_path, params, hf)
    return tmp_path


def test_load_errors_name_the_problem(target, tmp_path_factory):
    def bad(edit, match, method="dspark"):
        with pytest.raises(ValueError, match=match):
            ckpt.load_params(_broken(tmp_path_factory.mktemp("bad"), target, edit), target, method)

    bad(lambda hf, p: p["layers"][0]["self_attn"].pop("k_norm"), r"missing keys \['layers.0.self_attn.k_norm.weight'\]")
    bad(lambda hf, p: p["markov_head"].pop("markov_w2"), r"missing keys \['markov_head.markov_w2.weight'\]")
    bad(lambda hf, p: p["fc"].update(weight=torch.zeros(32, 96)), r"mis-shaped keys \['fc.weight: expected \(32, 64\)")
    bad(lambda hf, p: p["confidence_head"]["proj"].update(weight=torch.zeros(1, 32)),
        r"confidence_head.proj.weight: expected \(1, 48\)")
    bad(lambda hf, p: hf.pop("mask_token_id"), "mask_token_id must be a token id")
    bad(lambda hf, p: hf.update(target_layer_ids=[0, 5]), "target_layer_ids")
    bad(lambda hf, p: hf.update(markov_head_type="rnn"), "markov_head_type 'rnn'")
    bad(lambda hf, p: hf.update(hidden_size=64), "hidden_size/vocab_size")


# ----------------------------------------------------------------------------- state, padding, capture


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_state_structure_is_preserved(target, heads, method):
    eng = _run_engine(target, heads, method, 3, [PROMPTS[0]], 4)
    mod, pcfg, params = PROPOSERS[method], eng.proposer.cfg, eng.params["draft"]
    state = eng.state.proposer
    sig = tree_signature(state)
    tokens = torch.zeros(1, 16, dtype=torch.int64)
    hiddens = tuple(torch.zeros(1, 16, 32) for _ in range(2))
    state = mod.prefill(pcfg, params, state, tokens, 1, 5, hiddens)
    assert tree_signature(state) == sig
    for k in (0, 1, 3):
        ctx = _ctx(eng, [0, 1, 4], temperature=1.0)
        proposal, state = mod.propose(pcfg, params, state, ctx, k)
        assert tree_signature(state) == sig and proposal.tokens.shape == (3, k)
        assert (proposal.probs is None) == (method == "dflash")
        hid = tuple(torch.randn(3, k + 1, 32) for _ in range(2))
        res = VerifyResult(ctx.slots, ctx.lens, torch.zeros(3, k + 1, dtype=torch.int64),
                           torch.ones(3, dtype=torch.int32), hid, torch.arange(k + 1).expand(3, -1), Chain(k))
        state = mod.commit(pcfg, state, res)
        assert tree_signature(state) == sig


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_padding_rows_do_not_change_real_rows(target, heads, method):
    eng = _run_engine(target, heads, method, 3, PROMPTS[:2], 6)
    mod, pcfg, params = PROPOSERS[method], eng.proposer.cfg, eng.params["draft"]
    scratch = eng.num_slots
    alone = [mod.propose(pcfg, params, eng.state.proposer, _ctx(eng, [s], 1.0), 3)[0] for s in (0, 1)]
    padded, _ = mod.propose(pcfg, params, eng.state.proposer, _ctx(eng, [1, scratch, 0, scratch], 1.0), 3)
    for row, slot in ((0, 1), (2, 0)):
        assert torch.equal(padded.tokens[row], alone[slot].tokens[0])
        torch.testing.assert_close(padded.confidence[row], alone[slot].confidence[0])


def test_dspark_propose_captures_once(target, heads):
    eng = _run_engine(target, heads, "dspark", 3, PROMPTS[:2], 6)
    pcfg, params = eng.proposer.cfg, eng.params["draft"]
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    fn = torch.compile(lambda p, s, c: dspark_proposer.propose(pcfg, p, s, c, 3), backend=counter, fullgraph=True,
                       dynamic=False)
    for slots, temperature in (([0, 1], 1.0), ([1, 0], 0.0)):
        ctx = _ctx(eng, slots, temperature)
        compiled, _ = fn(params, eng.state.proposer, ctx)
        eager, _ = dspark_proposer.propose(pcfg, params, eng.state.proposer, ctx, 3)
        assert torch.equal(compiled.tokens, eager.tokens)
        torch.testing.assert_close(compiled.probs, eager.probs)
    assert counter.frame_count == 1
