"""The zoo's training pieces: corpus split, resumable loop, and that TTT / block training runs
the heads exactly as drafting does."""

from __future__ import annotations

import json

import pytest
import torch

from funcspec.checkpoints import dflash as dflash_ckpt, eagle as eagle_ckpt, mtp as mtp_ckpt
from funcspec.checkpoints import init_draft_head, load_model
from funcspec.nn import dflash, eagle, llama, mtp
from funcspec.train import data, drafters
from funcspec.train.loop import Schedule, train

from conftest import make_hf_model


def test_split_is_sorted_disjoint_and_about_five_percent():
    train_files, held = data.split_files("train"), data.split_files("heldout")
    assert train_files == sorted(train_files) and held == sorted(held)
    assert not set(train_files) & set(held)
    assert set(train_files) | set(held) == set(data.stdlib_files())
    assert 0.02 < len(held) / len(data.stdlib_files()) < 0.08
    assert all("site-packages" not in p.parts and "test" not in p.parts for p in held + train_files)
    assert data.manifest("heldout")["files"] == len(held)
    with pytest.raises(ValueError, match="split must be"):
        data.split_files("val")


def test_batch_is_a_pure_function_of_seed_and_step():
    stream = torch.arange(10_000).numpy()
    a, b = data.batch(stream, 0, 7, 4, 16), data.batch(stream, 0, 7, 4, 16)
    assert torch.equal(a, b) and a.shape == (4, 16)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous windows
    assert not torch.equal(a, data.batch(stream, 0, 8, 4, 16))


def _toy(tmp, stop_after=None):
    torch.manual_seed(0)
    w, b = {"w": torch.randn(8)}, {"b": torch.zeros(8)}
    target = torch.linspace(-1, 1, 8)

    def loss_fn(step):
        noise = torch.sin(torch.arange(8.0) * (step + 1))  # a step-dependent batch
        loss = ((w["w"] + b["b"] - target - 0.1 * noise) ** 2).sum()
        b["b"].add_(0.01 * torch.sign(w["w"].detach()))  # a buffer the recipe moves itself (a router's bias)
        return loss, {}

    out = train(w, loss_fn, Schedule(steps=6, lr=0.05, warmup=2, log_every=2, save_every=2), tmp,
                stop_after=stop_after, buffers=b)
    return torch.cat([w["w"], b["b"]]), out


def test_resumed_training_equals_a_straight_run(tmp_path):
    straight, _ = _toy(tmp_path / "a")
    _toy(tmp_path / "b", stop_after=3)  # interrupted after step 3, between two checkpoints
    state = torch.load(tmp_path / "b" / "state.pt", weights_only=True)
    assert state["step"] == 3
    resumed, summary = _toy(tmp_path / "b")
    assert torch.equal(straight, resumed)
    rows = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and summary["final_loss"] == rows[-1]["loss"] < rows[0]["loss"]


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """A 4-layer tiny Llama (EAGLE-3 needs aux layers 1..3), loaded by funcspec."""
    path = tmp_path_factory.mktemp("target4")
    make_hf_model(path, num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    return load_model(path)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_ttt_unroll_equals_sequential_drafting(method, target4, tmp_path):
    if method == "eagle3":
        init_draft_head("eagle3", target4, tmp_path, seed=3, aux_layers=[1, 2, 3])
        cfg, params = eagle_ckpt.load_params(tmp_path, target4, version=3)
        net, layers = eagle, cfg.aux_layers
    else:
        init_draft_head("mtp", target4, tmp_path, seed=3)
        cfg, params = mtp_ckpt.load_params(tmp_path, target4)
        net, layers = mtp, (target4.cfg.num_layers,)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (2, 24), generator=g)
    _, hid = drafters.target_pass(target4, x, layers)
    raw = torch.cat(hid, -1)
    a = torch.tensor([[3, 10], [0, 17]])
    outs = drafters.chain_unroll(net, cfg, params, x, raw, a, steps=4)
    assert [o[0].shape for o in outs] == [(2, 22, cfg.draft_vocab_size if method == "eagle3" else 96)] + \
        [(2, 2, outs[0][0].shape[-1])] * 3
    for b in range(2):
        for n in range(2):
            o = int(a[b, n])
            # drafting after a catch-up: target-feature pairs up to o, then the head's own outputs
            kv = llama.init_kv_cache(cfg.model, 1, 24)
            feats = net.target_features(cfg, params, raw[b:b + 1, :o + 1])
            gs, kv = net.forward(cfg, params, kv, x[b:b + 1, 1:o + 2], feats, torch.tensor([0]), torch.tensor([0]))
            torch.testing.assert_close(net.draft_logits(cfg, params, gs[0, -1]), outs[0][0][b, o], rtol=1e-4, atol=1e-4)
            g_prev = gs[:, -1:]
            for j in range(1, 4):
                g_prev, kv = net.forward(cfg, params, kv, x[b:b + 1, o + j + 1:o + j + 2], g_prev,
                                         torch.tensor([0]), torch.tensor([o + j]))
                torch.testing.assert_close(net.draft_logits(cfg, params, g_prev[0, 0]), outs[j][0][b, n],
                                           rtol=1e-4, atol=1e-4)
                assert int(outs[j][1][b, n]) == o + j


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_rows_equal_a_block_drafted_after_its_context(method, target4, tmp_path):
    init_draft_head(method, target4, tmp_path, seed=4, target_layer_ids=[1, 3], block_size=5, mask_token_id=95,
                    markov_rank=8)
    cfg, params = dflash_ckpt.load_params(tmp_path, target4, method)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 95, (2, 20), generator=g)
    _, hid = drafters.target_pass(target4, x, tuple(i + 1 for i in cfg.target_layer_ids))
    raw = torch.cat(hid, -1)
    a = torch.tensor([[1, 9], [4, 14]])
    h = drafters.block_rows(cfg, params, x, raw, a, rows=5)
    assert h.shape == (2, 2, 5, 64)
    for b in range(2):
        for n in range(2):
            o, zero = int(a[b, n]), torch.tensor([0])
            kv = dflash.init_context_kv(cfg, 1, 20, torch.float32, "cpu")
            kv = dflash.write_context(cfg, params, kv, raw[b:b + 1, :o], zero, zero)  # committed: positions < a
            block = torch.tensor([[int(x[b, o])] + [95] * 4])
            ref, _ = dflash.block_forward(cfg, params, kv, block, zero, torch.tensor([o]))
            torch.testing.assert_close(ref[0], h[b, n], rtol=1e-4, atol=1e-4)


def test_greedy_continue_equals_the_engines_greedy_decoding(target4):
    from funcspec import Engine, SamplingParams

    prompts = torch.randint(3, 95, (3, 12), generator=torch.Generator().manual_seed(2))
    rows = data.greedy_continue(target4, prompts, 9)
    assert rows.shape == (3, 21) and torch.equal(rows[:, :12], prompts)
    eng = Engine(target4.path, max_num_seqs=3, max_model_len=32, enforce_eager=True)
    outs = eng.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    assert rows[:, 12:].tolist() == [o.outputs[0].token_ids for o in outs]


def test_greedy_rows_are_cached_per_chunk_and_regenerate_identically(target4, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "GREEDY_PROMPT", 8)
    monkeypatch.setattr(data, "GREEDY_NEW", 4)
    monkeypatch.setattr(data, "GREEDY_CHUNK", 3)
    stream = (torch.arange(500) % 90 + 3).numpy().astype("int32")
    rows = data.greedy_rows(target4, stream, 5, 7, tmp_path)
    assert rows.shape == (7, 12) and rows.dtype.name == "int32"
    files = sorted(tmp_path.glob("greedy-*.npy"))
    assert len(files) == 3  # ceil(7 / 3) chunks, no temporary left behind
    for c in range(3):  # chunk c: the stream windows of (seed, c), continued by the target
        want = data.greedy_continue(target4, data.batch(stream, 5, c, 3, 8), 4)[:7 - 3 * c]
        assert torch.equal(torch.from_numpy(rows[3 * c:3 * c + 3]).long(), want)
    stamp = files[0].stat().st_mtime_ns
    files[1].unlink()  # as if the run stopped before chunk 1 was written
    again = data.greedy_rows(target4, stream, 5, 7, tmp_path)
    assert (again == rows).all() and files[1].exists() and files[0].stat().st_mtime_ns == stamp
    assert not (data.greedy_rows(target4, stream, 6, 3, tmp_path / "other") == rows[:3]).all()


def test_row_batch_is_a_pure_function_of_seed_and_step():
    rows = torch.arange(40).view(10, 4).numpy()
    a = data.row_batch(rows, 0, 3, 5)
    assert torch.equal(a, data.row_batch(rows, 0, 3, 5)) and a.shape == (5, 4) and a.dtype == torch.int64
    assert torch.equal(a[:, 1:] - a[:, :1], torch.tensor([1, 2, 3]).expand(5, 3))  # whole rows
    assert not torch.equal(a, data.row_batch(rows, 0, 4, 5))


def test_block_losses_decay_by_row():
    w = torch.exp(-torch.arange(3.0) / drafters.BLOCK_DECAY)
    assert float(drafters.decayed(torch.ones(2, 3))) == pytest.approx(1.0)
    assert float(drafters.decayed(torch.tensor([[0.0, 0.0, 3.0], [0.0, 0.0, 1.0]]))) == pytest.approx(
        float(2 * w[2] / w.sum()))


def test_a_drafter_run_leaves_the_zoo_whole_until_it_saves(target4, tmp_path, monkeypatch):
    from funcspec.checkpoints import medusa as medusa_ckpt

    monkeypatch.setattr(data, "token_stream", lambda *_: (torch.arange(3000) % 90 + 3).numpy().astype("int32"))
    monkeypatch.setattr(data, "GREEDY_PROMPT", 8)
    monkeypatch.setattr(data, "GREEDY_NEW", 8)
    monkeypatch.setattr(data, "GREEDY_CHUNK", 4)
    monkeypatch.setattr(drafters, "GREEDY_ROWS", 8)
    monkeypatch.setattr(drafters, "BATCH", 2)
    monkeypatch.setattr(drafters, "SEQ", 16)
    out = tmp_path / "models" / "medusa"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"the committed head")
    seen, real_train = [], drafters.train

    def spy(*args, **kwargs):  # what the zoo holds while the head trains
        seen.append((out / "model.safetensors").read_bytes())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(drafters, "train", spy)
    drafters.run("medusa", target4.path, out, tmp_path / "work", steps=2)
    assert seen == [b"the committed head"]
    _, params = medusa_ckpt.load_params(out, target4)  # the trained head, whole
    state = torch.load(tmp_path / "work" / "medusa" / "state.pt", weights_only=True)
    name = "medusa_head.0.1.weight"
    assert torch.equal(params["medusa_head"][0][1]["weight"], state["params"][name].to(torch.bfloat16).float())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_time_budget_shortens_the_schedule_to_what_fits(tmp_path, monkeypatch):
    import types

    from funcspec.train import loop

    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def run(work, steps, budget):
        w = {"w": torch.zeros(4)}

        def loss_fn(step):
            clock[0] += 1.0  # one second a step
            return ((w["w"] - 1.0) ** 2).sum(), {}

        clock[0] = 0.0
        out = train(w, loss_fn, Schedule(steps=steps, lr=0.05, warmup=20, log_every=5, save_every=50), work,
                    time_budget=budget)
        return w["w"], out

    cut, summary = run(tmp_path / "a", 100, 40.0)
    assert summary["steps"] == 40 and summary["planned_steps"] == 100  # 15 s spent, 25 steps of 1 s left
    straight, plain = run(tmp_path / "b", 40, None)
    assert torch.equal(cut, straight) and "planned_steps" not in plain
    _, roomy = run(tmp_path / "c", 30, 1000.0)
    assert roomy["steps"] == 30 and "planned_steps" not in roomy
