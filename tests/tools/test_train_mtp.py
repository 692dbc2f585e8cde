"""The zoo's mtp_target: a DeepSeek-V3 trained with its own MTP module. The recipe trains (the MTP loss falls on
a fixed batch), the router biases move against the load, and the checkpoint holds the module under
DeepSeek-V3's published names and shapes while transformers loads the trunk."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from funcspec.checkpoints import read_weights
from funcspec.train import data, mtp_target, run_role
from funcspec.train.loop import Schedule
from funcspec.zoo import MODELS

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=64,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
"""Two layers: layer 0 dense, layer 1 MoE, and the MTP block at index 2 (MoE)."""
STEPS = 30


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """mtp_target trained for STEPS steps on one fixed batch (every step's batch is the same) of a small
    stream, logging every 5 steps, with the zoo's tokenizer."""
    tmp = tmp_path_factory.mktemp("mtp")
    mp = pytest.MonkeyPatch()
    stream = (torch.arange(4000) * 7 % 500 + 4).numpy().astype("int32")
    fixed = data.batch(stream, 0, 0, 2, 32)
    mp.setattr(data, "token_stream", lambda *_: stream)
    mp.setattr(data, "batch", lambda *_: fixed)
    mp.setattr(mtp_target, "MTP_SIZES", {**mtp_target.MTP_SIZES, **TINY})
    mp.setattr(mtp_target, "MTP_SHARD", "100KB")
    mp.setattr(mtp_target, "MTP_SCHEDULE", Schedule(steps=STEPS, lr=1e-2, warmup=2, log_every=5))
    (tmp / "models" / "target").mkdir(parents=True)
    for f in data.TOKENIZER_FILES:  # the zoo's tokenizer, where mtp_target reads it
        if (MODELS / "target" / f).exists():
            shutil.copy(MODELS / "target" / f, tmp / "models" / "target" / f)
    try:
        facts = run_role("mtp_target", tmp / "models", tmp / "work", device="cpu")
    finally:
        mp.undo()
    rows = [json.loads(line) for line in (tmp / "work" / "mtp_target" / "log.jsonl").read_text().splitlines()]
    return tmp / "models" / "mtp_target", facts, rows, fixed


def test_the_mtp_loss_is_logged_and_falls_on_a_fixed_batch(trained):
    out, facts, rows, _ = trained
    assert facts["steps"] == STEPS and facts["device"] == "cpu" and json.loads((out / "train.json").read_text()) == facts
    assert [r["step"] for r in rows] == list(range(5, STEPS + 1, 5))
    assert {"ce", "mtp", "agree", "load_min"} <= set(rows[0])
    assert rows[-1]["mtp"] < rows[0]["mtp"] - 1.0 and rows[-1]["ce"] < rows[0]["ce"] - 1.0
    assert facts["mtp_lambda"] == 0.3 and facts["final_loss"] == rows[-1]["loss"]
    assert facts["fixed_batch"]["mtp"] < rows[0]["mtp"]


def test_the_checkpoint_holds_the_mtp_module_under_deepseeks_names(trained):
    out, facts, _, _ = trained
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["num_nextn_predict_layers"] == 1
    assert (hf["num_hidden_layers"], hf["first_k_dense_replace"], hf["n_shared_experts"], hf["n_group"]) == (2, 1, 1, 1)
    assert not hf["tie_word_embeddings"] and hf["dtype"] == "bfloat16"
    t = read_weights(out)
    h, v, e = 32, hf["vocab_size"], 4
    assert v == 4096 and len(list(out.glob("*.safetensors"))) > 1
    own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
           "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h), "embed_tokens.weight": (v, h)}
    block = {k[len("model.layers.1."):]: s.shape for k, s in t.items() if k.startswith("model.layers.1.")}
    mtp = {k[len("model.layers.2."):]: s.shape for k, s in t.items() if k.startswith("model.layers.2.")}
    assert mtp == {**block, **own} and len(t) == facts["checkpoint"]["keys"] == facts["checkpoint"]["trunk_keys"] + len(mtp)
    # the block as the trunk's MoE layers are stored: one tensor a projection and expert; MLA's latent projections
    assert {f"mlp.experts.{i}.{p}.weight" for i in range(e) for p in ("gate_proj", "up_proj", "down_proj")} < set(mtp)
    assert mtp["self_attn.kv_a_proj_with_mqa.weight"] == (16 + 8, h) and mtp["self_attn.q_a_proj.weight"] == (16, h)
    assert mtp["mlp.shared_experts.gate_proj.weight"] == (16, h) and mtp["mlp.gate.weight"] == (e, h)
    # the shared embedding and head, copied; routers in float32, their biases moved by the balancing rule
    assert torch.equal(t["model.layers.2.shared_head.head.weight"], t["lm_head.weight"])
    assert torch.equal(t["model.layers.2.embed_tokens.weight"], t["model.embed_tokens.weight"])
    for i in (1, 2):
        bias = t[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().max() > 0
    assert t["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert len(facts["expert_load"]) == 2 and all(sum(r) == pytest.approx(1.0, abs=1e-3) for r in facts["expert_load"])


def test_transformers_loads_the_trunk_and_the_module_reloads_as_trained(trained):
    from transformers import AutoModelForCausalLM

    out, facts, _, fixed = trained
    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and not info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    assert mtp_target.check(out) == facts["checkpoint"]
    ref = mtp_target.load(out)  # the trunk and the module as shipped (its own head and embedding copies)
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=fixed).logits, hf.eval()(input_ids=fixed).logits)
        got = mtp_target.losses(ref, fixed)
    for k in ("ce", "mtp"):  # the trained model's own numbers (float32, before the bfloat16 save)
        assert float(got[k]) == pytest.approx(facts["fixed_batch"][k], abs=0.05)


def test_the_mtp_input_at_position_0_ignores_its_token_and_every_output_is_causal():
    torch.manual_seed(0)
    model = mtp_target.build({**mtp_target.MTP_SIZES, **TINY}, 96, 0, 1, 2).eval()
    tokens, h = torch.randint(0, 96, (2, 8)), torch.randn(2, 8, 32)
    other = tokens.clone()
    other[:, 0] = (tokens[:, 0] + 1) % 96
    later = tokens.clone()
    later[:, 5:] = (tokens[:, 5:] + 1) % 96
    with torch.no_grad():
        g = mtp_target.mtp_hidden(model, tokens, h)
        torch.testing.assert_close(mtp_target.mtp_hidden(model, other, h), g, rtol=0, atol=0)  # masked, as vLLM
        g2 = mtp_target.mtp_hidden(model, later, h)
    torch.testing.assert_close(g2[:, :5], g[:, :5], rtol=0, atol=0)
    assert not torch.allclose(g2[:, 5:], g[:, 5:])
    assert mtp_target.mtp_logits(model, g).shape == (2, 8, 96)


def test_the_bias_rises_for_underloaded_experts_and_falls_for_overloaded_ones():
    torch.manual_seed(0)
    model = mtp_target.build({**mtp_target.MTP_SIZES, **TINY}, 96, 0, 1, 2)
    gates = mtp_target.routers(model)
    assert len(gates) == 2  # layer 1 and the MTP block; layer 0 is dense
    picks = [torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]]), torch.tensor([[3, 2], [3, 2]])]
    load = mtp_target.loads(picks, 4)
    torch.testing.assert_close(load, torch.tensor([[0.5, 0.375, 0.125, 0.0], [0.0, 0.0, 0.5, 0.5]]))
    mtp_target.update_bias(gates, load, 0.001)
    assert gates[0].e_score_correction_bias.tolist() == pytest.approx([-0.001, -0.001, 0.001, 0.001])
    assert gates[1].e_score_correction_bias.tolist() == pytest.approx([0.001, 0.001, -0.001, -0.001])



def test_funcspec_drafts_with_the_trained_module_and_stays_lossless(trained):
    """The checkpoint as it ships (bfloat16 shards, the module's own embedding and head copies) serves method mtp
    with K from its num_nextn_predict_layers: greedy speculation equals greedy AR, and the trained module's drafts
    are accepted (it learned the batch it was trained on)."""
    from funcspec import Engine, SamplingParams

    out, _, _, fixed = trained
    prompts = [row[:12].tolist() for row in fixed]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ar = Engine(str(out), max_num_seqs=2, max_model_len=64, enforce_eager=True).generate(prompts, greedy)
    ar = [o.outputs[0].token_ids for o in ar]
    eng = Engine(str(out), {"method": "mtp"}, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    assert eng.spec.num_speculative_tokens == 1
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, greedy)] == ar
    assert eng.stats()["per_position_acceptance"][0] > 0.5
