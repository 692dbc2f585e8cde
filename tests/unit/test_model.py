"""Functional Llama/Qwen models against transformers, rollback, and checkpoint errors."""

import json

import pytest
import torch

from conftest import make_hf_model
from funcspec import load_model
from funcspec.checkpoints import flatten
from funcspec.nn import forward, init_kv_cache
from funcspec.pytree import tree_signature

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                              "rope_theta": 50000.0}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qknorm": ("qwen3", {"head_dim": 16}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_hidden_states_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf = make_hf_model(tmp_path, arch, **overrides)
    m = load_model(tmp_path)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    kv = init_kv_cache(m.cfg, 2, 64)
    layers = tuple(range(m.cfg.num_layers + 1))
    logits, hiddens, _ = forward(m.cfg, m.params, kv, ids, torch.tensor([1, 0]), torch.zeros(2, dtype=torch.long),
                                 layers)
    assert logits.shape == (2, 40, 96)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    for got, want in zip(hiddens, ref.hidden_states):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_params_keep_hf_names(tiny_llama):
    m = load_model(tiny_llama)
    names = set(flatten(m.params))
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names


def test_incremental_decode_equals_full_forward(tiny_llama):
    """Prefill then one token at a time gives the logits of one full pass."""
    m = load_model(tiny_llama)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    full, _, _ = forward(m.cfg, m.params, init_kv_cache(m.cfg, 1, 32), ids, torch.tensor([0]), torch.tensor([0]))
    kv = init_kv_cache(m.cfg, 1, 32)
    out, _, kv = forward(m.cfg, m.params, kv, ids[:, :16], torch.tensor([0]), torch.tensor([0]))
    steps = [out]
    for t in range(16, 24):
        out, _, kv = forward(m.cfg, m.params, kv, ids[:, t:t + 1], torch.tensor([0]), torch.tensor([t]))
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_rollback_is_a_length_reset(tiny_llama):
    """Prefill, decode 5, roll back 3, decode again: logits equal a fresh run's."""
    m = load_model(tiny_llama)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 96, (1, 10), generator=g)
    junk = torch.randint(0, 96, (1, 5), generator=g)
    new = torch.randint(0, 96, (1, 4), generator=g)
    s = torch.tensor([0])
    kv = init_kv_cache(m.cfg, 1, 32)
    _, _, kv = forward(m.cfg, m.params, kv, prompt, s, torch.tensor([0]))
    _, _, kv = forward(m.cfg, m.params, kv, junk, s, torch.tensor([10]))  # 5 decoded tokens
    kv.lens[0] = 15 - 3  # roll back 3: keep prompt + 2 of the 5
    rolled, _, _ = forward(m.cfg, m.params, kv, new, s, kv.lens[s])
    fresh_kv = init_kv_cache(m.cfg, 1, 32)
    seq = torch.cat([prompt, junk[:, :2]], 1)
    _, _, fresh_kv = forward(m.cfg, m.params, fresh_kv, seq, s, torch.tensor([0]))
    fresh, _, _ = forward(m.cfg, m.params, fresh_kv, new, s, torch.tensor([12]))
    torch.testing.assert_close(rolled, fresh, atol=1e-6, rtol=0)


def test_forward_preserves_state_structure(tiny_llama):
    m = load_model(tiny_llama)
    kv = init_kv_cache(m.cfg, 3, 16)
    before = tree_signature(kv)
    _, _, kv2 = forward(m.cfg, m.params, kv, torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3]),
                        torch.tensor([0, 2]))
    assert tree_signature(kv2) == before


# ----------------------------------------------------------------- bad input
def test_bad_path_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        load_model(tmp_path / "does_not_exist")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path, tiny_llama):
    cfg = json.loads(open(f"{tiny_llama}/config.json").read())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_truncated_safetensors(tmp_path):
    make_hf_model(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(ValueError, match="model.safetensors: corrupt safetensors file"):
        load_model(tmp_path)


def test_missing_and_misshaped_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.norm.weight"] = torch.zeros(7)
    sd["model.extra.weight"] = torch.zeros(1)
    save_file(sd, str(f))
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "missing keys ['model.layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected keys ['model.extra.weight']" in msg
    assert "model.norm.weight: expected (32,), got (7,)" in msg


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model(tmp_path / "a")
    hf.save_pretrained(str(tmp_path / "b"), max_shard_size="20KB")
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    a, b = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    for (ka, va), (kb, vb) in zip(sorted(flatten(a.params).items()), sorted(flatten(b.params).items())):
        assert ka == kb and torch.equal(va, vb)


def _same_params(a, b) -> bool:
    fa, fb = sorted(flatten(a.params).items()), sorted(flatten(b.params).items())
    return [k for k, _ in fa] == [k for k, _ in fb] and all(torch.equal(x, y) for (_, x), (_, y) in zip(fa, fb))


def _renamed_shards(src, dst, stem: str):
    """``src``'s transformers shards and index copied to ``dst`` under ``stem`` (msmodelslim's naming):
    ``{stem}-0000i-of-0000n.safetensors`` and ``{stem}.safetensors.index.json``."""
    import shutil

    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    names = {f: f.replace("model", stem, 1) for f in set(index["weight_map"].values())}
    for old, new in names.items():
        shutil.copy(src / old, dst / new)
    index["weight_map"] = {k: names[f] for k, f in index["weight_map"].items()}
    (dst / f"{stem}.safetensors.index.json").write_text(json.dumps(index))
    return names


def test_weight_files_are_found_as_vllm_finds_them(tmp_path):
    """Every ``*.safetensors`` file, narrowed to those a ``*.safetensors.index.json`` lists, else every ``*.bin``
    likewise (vLLM's loader): renamed files, msmodelslim's shard names beside a stray copy, and a pickle beside
    training state all load the params of the original ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    hf = make_hf_model(tmp_path / "a")
    want = load_model(tmp_path / "a")
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    config = (tmp_path / "a" / "config.json").read_text()
    for name in ("renamed", "bin"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    save_file(state, str(tmp_path / "renamed" / "weights.safetensors"))
    torch.save(state, tmp_path / "bin" / "model_weights.bin")
    torch.save({"step": 3}, tmp_path / "bin" / "training_args.bin")  # not weights: never read
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    names = _renamed_shards(tmp_path / "sharded", tmp_path / "modelslim", "quant_model_weights")
    assert len(names) > 1
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "modelslim" / "consolidated.safetensors"))  # not indexed
    for name in ("renamed", "bin", "modelslim"):
        assert _same_params(load_model(tmp_path / name), want), name

    (tmp_path / "modelslim" / sorted(names.values())[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{sorted(names.values())[-1]}: shard listed in "
                                                r"quant_model_weights.safetensors.index.json is missing"):
        load_model(tmp_path / "modelslim")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(config)
    with pytest.raises(FileNotFoundError, match=r"empty: no weight file; looked for \*\.safetensors \(narrowed by "
                                                r"\*\.safetensors\.index\.json\), \*\.bin \(narrowed by "
                                                r"\*\.bin\.index\.json\)$"):
        load_model(tmp_path / "empty")


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 64, "hidden_size": 32}, r"head_dim is 0 \(hidden_size=32 // num_attention_heads=64\)"),
    ({"hidden_size": 0}, r"decoder fields \['hidden_size'\] must be positive \(layers: >= 0\), got \[0\]"),
    ({"num_hidden_layers": -1}, r"decoder fields \['num_hidden_layers'\] must be positive \(layers: >= 0\)"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_impossible_sizes_are_refused_naming_the_field(change, message):
    from funcspec.checkpoints.llama import model_config

    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **change}
    with pytest.raises(ValueError, match=message):
        model_config(hf, "x/config.json")
