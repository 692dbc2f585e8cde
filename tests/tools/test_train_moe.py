"""The MoE pair of the zoo: the Qwen3-MoE recipe writes a checkpoint funcspec runs as transformers does, the
EAGLE-3 head distils from it, ``--device`` reaches the recipes, and a prepared corpus folder trains them where
the stdlib is absent (as on the GPU machine)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from funcspec import Engine, SamplingParams
from funcspec.checkpoints import load_model
from funcspec.train import data, drafters, main, run_role, target
from funcspec.zoo import MODELS

TINY = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            intermediate_size=64, max_position_embeddings=256, initializer_range=0.2)  # wide greedy margins
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SOURCES = ("abc.py", "bisect.py", "colorsys.py", "keyword.py")


@pytest.fixture
def tiny_recipes(monkeypatch):
    """Tiny batches and shapes for both recipes, and shards small enough that the target has several."""
    monkeypatch.setattr(target, "MOE_SIZES", TINY)
    monkeypatch.setattr(target, "MOE_SHARD", "200KB")
    monkeypatch.setattr(target, "BATCH", 2)
    monkeypatch.setattr(target, "SEQ", 32)
    monkeypatch.setattr(drafters, "BATCH", 2)
    monkeypatch.setattr(drafters, "SEQ", 32)
    monkeypatch.setattr(drafters, "ORIGINS", 4)


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A corpus folder prepared from a four-file 'stdlib', then that stdlib replaced by an empty directory."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in SOURCES:
        shutil.copy(data.stdlib_root() / name, lib / name)
    monkeypatch.setattr(data, "stdlib_root", lambda: lib)
    monkeypatch.setattr(data, "CORPUS_CACHE", None)
    want = {s: data.manifest(s) for s in ("train", "heldout")}
    folder = data.prepare_cache(MODELS / "target", tmp_path / "work-here", tmp_path / "gpu")
    stream = data.token_stream(load_model(MODELS / "target").tokenizer, "train", tmp_path / "work-here" / "tokens")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(data, "stdlib_root", lambda: empty)
    return folder, want, stream


def test_a_prepared_folder_stands_in_for_the_stdlib(prepared, tmp_path, monkeypatch):
    folder, want, stream = prepared
    assert sorted(p.name for p in (folder / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert data.manifest("train") != want["train"]  # the empty stdlib
    data.use_corpus_cache(folder)
    tok = load_model(MODELS / "target").tokenizer
    assert data.tokenizer_dir(MODELS / "target") == folder / "tokenizer"
    assert {s: data.manifest(s) for s in ("train", "heldout")} == want
    assert (data.token_stream(tok, "train", tmp_path / "elsewhere") == stream).all()
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(RuntimeError, match="holds no source files"):
        data.split_files("train")
    data.use_corpus_cache(None)


def test_each_layers_balance_loss_is_transformers_on_that_layer_alone():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(3, 40, 8, generator=torch.Generator().manual_seed(0))
    for r in logits:
        want = load_balancing_loss_func((r,), num_experts=8, top_k=2)
        torch.testing.assert_close(target.balance_loss(r, 2), want)
    even = torch.zeros(16, 4)
    even[torch.arange(16), torch.arange(16) % 4] = 5.0  # each expert first for a quarter of the tokens
    assert float(target.balance_loss(even, 1)) == pytest.approx(1.0, abs=1e-3)


def test_moe_recipe_writes_a_checkpoint_funcspec_runs_as_transformers(tiny_recipes, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(data, "token_stream", lambda *_: (torch.arange(4000) * 7 % 4000 + 4).numpy().astype("int32"))
    (tmp_path / "models" / "target").mkdir(parents=True)
    for f in data.TOKENIZER_FILES:  # the zoo's tokenizer, where moe_target reads it
        if (MODELS / "target" / f).exists():
            shutil.copy(MODELS / "target" / f, tmp_path / "models" / "target" / f)
    facts = run_role("moe_target", tmp_path / "models", tmp_path / "work", steps=2, device="cpu")
    out = tmp_path / "models" / "moe_target"
    assert facts["steps"] == 2 and facts["device"] == "cpu" and json.loads((out / "train.json").read_text()) == facts
    assert len(facts["expert_load"]) == 4 and all(sum(r) == pytest.approx(1.0, abs=1e-3) for r in facts["expert_load"])
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    assert (out / "tokenizer.json").read_bytes() == (MODELS / "target" / "tokenizer.json").read_bytes()
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["dtype"] == "bfloat16" and hf_cfg["router_aux_loss_coef"] > 0
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7, 300]]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, min_new_tokens=10)[0, len(p):].tolist()
            for p in prompts]
    outs = Engine(str(out), max_num_seqs=2, max_model_len=64, enforce_eager=True).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_the_moe_pair_trains_from_a_prepared_folder_on_the_device_given(prepared, tiny_recipes, tmp_path,
                                                                       monkeypatch):
    folder, want, _ = prepared
    devices = []
    real = drafters.load_model
    monkeypatch.setattr(drafters, "load_model",
                        lambda path, device: devices.append(device) or real(path, device=device))
    models = tmp_path / "models"
    main(["moe_target", "moe_eagle3", "--steps", "2", "--device", "cpu", "--corpus-cache", str(folder),
          "--models", str(models), "--work", str(tmp_path / "work")])
    data.use_corpus_cache(None)
    assert devices == ["cpu"]
    for role in ("moe_target", "moe_eagle3"):
        facts = json.loads((models / role / "train.json").read_text())
        assert facts["steps"] == 2 and facts["device"] == "cpu" and facts["corpus"] == want["train"]
    assert json.loads((models / "moe_eagle3" / "train.json").read_text())["distilled_from"] == "moe_target"
    spec = {"method": "eagle3", "model": str(models / "moe_eagle3"), "num_speculative_tokens": 2}
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7, 300]]
    ar = Engine(str(models / "moe_target"), max_num_seqs=2, max_model_len=64,
                enforce_eager=True).generate(prompts, GREEDY)
    sd = Engine(str(models / "moe_target"), spec, max_num_seqs=2, max_model_len=64,
                enforce_eager=True).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in sd] == [o.outputs[0].token_ids for o in ar]

