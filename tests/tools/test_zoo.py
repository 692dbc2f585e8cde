"""The trained zoo under models/: it loads (in transformers too), its heads use their published
layouts, and every method is greedy-lossless on the trained heads (on eager here; on inductor in
tests/engine/test_logprobs.py's matrix)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from funcspec import Engine, SamplingParams, load_model, zoo
from funcspec.checkpoints import read_weights
from funcspec.nn.llama import forward, init_kv_cache
from funcspec.train.data import heldout_prompts

METHODS = ["ngram", "suffix", "draft_model", "medusa", "mtp", "eagle3", "dflash", "dspark"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return load_model(zoo.model_path("target"))


@pytest.fixture(scope="module")
def prompts(target):
    return heldout_prompts(target.tokenizer, 4, 48)


@pytest.fixture(scope="module")
def ar(target, prompts):
    return [o.outputs[0].token_ids for o in Engine(target, max_num_seqs=4, max_model_len=96,
                                                   enforce_eager=True).generate(prompts, GREEDY)]


def test_manifest_names_every_role():
    from funcspec import train

    assert set(zoo.manifest()["roles"]) == set(train.ROLES)
    for role in zoo.manifest()["roles"]:
        if role in train.GPU_ROLES and not zoo.model_path(role).exists():
            continue  # trained on a GPU (tools/train_zoo_gpu.sh): the zoo names them before they arrive
        assert zoo.trained(role), role
        assert json.loads((zoo.model_path(role) / "train.json").read_text())["steps"] > 0


@pytest.mark.parametrize("role", ["target", "draft_model"])
def test_target_and_draft_model_agree_with_transformers(role, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.model_path(role)
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.tensor(prompts[:2])
    with torch.no_grad():
        want = hf(input_ids=x).logits
    b, t = x.shape
    got, _, _ = forward(ours.cfg, ours.params, init_kv_cache(ours.cfg, b, t), x, torch.arange(b),
                        torch.zeros(b, dtype=torch.int64))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.mask_token) == \
        ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>") and len(tok) == 4096


@pytest.mark.parametrize("role, keys", [
    ("medusa", ["medusa_head.0.0.linear.weight", "medusa_head.3.1.weight"]),
    ("mtp", ["model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.shared_head.head.weight"]),
    ("eagle3", ["fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"]),
    ("dflash", ["fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_norm.weight"]),
    ("dspark", ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"]),
])
def test_heads_are_saved_in_their_published_layouts(role, keys):
    tensors = read_weights(zoo.model_path(role))
    assert set(keys) <= set(tensors)
    if role == "eagle3":
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        ids = torch.arange(d2t.shape[0]) + d2t  # draft id -> target id
        assert d2t.shape == (2048,) and int(t2d.sum()) == 2048 and bool(t2d[ids].all())


@pytest.mark.parametrize("method", METHODS)
def test_greedy_lossless_on_trained_heads(method, target, prompts, ar):
    """K = 3 on 4 slots and on 1; trained heads must also be accepted often (random ones are not)."""
    eng = Engine(target, speculative_config=zoo.speculative_config(method, 3), max_num_seqs=4, max_model_len=96,
                 enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)] == ar
    tau = eng.stats()["mean_acceptance_length"]
    one = Engine(target, speculative_config=zoo.speculative_config(method, 1), max_num_seqs=1, max_model_len=96,
                 enforce_eager=True)
    assert [o.outputs[0].token_ids for o in one.generate(prompts[:1], GREEDY)] == ar[:1]
    assert tau > 1.5, f"{method}: tau {tau:.2f} - the trained head is barely accepted"


def test_make_run_generates_with_the_zoo_drafter_and_prints_acceptance(capsys):
    from funcspec.cli import main

    main(["run-default", "--max-tokens", "16", "--backend", "eager"])  # `make run` itself: inductor, see README
    out = capsys.readouterr().out
    assert "engine ready in " in out and "backend=eager; captured 0 graph(s)" in out
    assert out.count("Generated: ") == 3
    assert '"method": "eagle3"' in out and "mean acceptance length=" in out and "per-position acceptance: [" in out


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_static_tree_on_trained_heads_is_lossless_and_accepts_more(method, target, prompts, ar):
    """vLLM's speculative_token_tree (7 nodes, depth 3) against the chain of 3: the same output, and the
    tree's siblings raise tau (measured on these prompts: eagle3 2.91 -> 3.21, mtp 2.91 -> 3.21)."""
    tree = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
    taus = []
    for spec in (zoo.speculative_config(method, 3), zoo.speculative_config(method, 7, speculative_token_tree=tree)):
        eng = Engine(target, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
        assert [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)] == ar
        taus.append(eng.stats()["mean_acceptance_length"])
        assert len(eng.stats()["per_position_acceptance"]) == 3
    assert taus[1] > taus[0] + 0.1, taus


def test_dynamic_tree_on_trained_eagle3_is_lossless_and_beats_the_chain(target, prompts, ar):
    """EAGLE-2 dynamic tree of N = 16 (topk 3, 5 steps) against the chain at K = 4: the same output and a
    higher tau (measured on these prompts: 3.49 -> 4.43)."""
    taus = []
    dyn = dict(speculative_eagle_topk=3, speculative_num_steps=5, speculative_num_draft_tokens=17)
    for spec in (zoo.speculative_config("eagle3", 4), zoo.speculative_config("eagle3", 16, **dyn)):
        eng = Engine(target, speculative_config=spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
        assert [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)] == ar
        taus.append(eng.stats()["mean_acceptance_length"])
    assert taus[1] > 1.15 * taus[0], taus


def _build_default(out: str) -> None:
    zoo.build_default(Path(out))


def test_concurrent_default_builds_leave_one_complete_checkpoint(tmp_path):
    """Two processes building the default model at once (two test workers, two `make run`s): both succeed,
    the checkpoint is whole, and no private build directory is left behind (the second waits for the first)."""
    out = tmp_path / "default"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_default, args=(str(out),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(x.name for x in tmp_path.iterdir()) == [".default.lock", "default"]  # the builders' lock
    assert load_model(out).cfg.num_layers == 2
