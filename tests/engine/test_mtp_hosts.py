"""MTP modules as MoE checkpoints ship them: GLM-4.5's, DeepSeek-V3's and V3.2's ``model.layers.{L}`` (a GQA, MLA
or MLA + sparse attention block with a MoE, its experts stored one by one) read from the target's own files, their
drafts equal to vLLM's ``glm4_moe_mtp`` / ``deepseek_mtp`` module, greedy speculation equal to greedy AR at
K = 1, 2, 3 (eager and inductor), K defaulting to ``num_nextn_predict_layers``, and the hosts funcspec cannot run
refused with what they need.

transformers drops the MTP layer (``_keys_to_ignore_on_load_unexpected``), so the tests write its keys themselves,
under the published names; its block is transformers' own decoder layer of the host at index L, and the reference
runs that module as vLLM's ``*MultiTokenPredictorLayer.forward`` does.
"""

import copy
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import published as pub
from conftest import make_hf_model
from funcspec import LLM, Engine
from funcspec.checkpoints import layouts, load_model, mtp
from funcspec.nn.deepseek import LatentCache
from spec_cases import GREEDY, _ids, _prompts, assert_captured_lossless
from test_deepseek import make_deepseek
from test_deepseek_v32 import make_v32
from test_moe import make_moe

PROMPTS = _prompts(8, seed=5)


def _unstacked(prefix: str, state: dict) -> dict:
    """A transformers MoE layer's state dict as published: its fused experts (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) one linear per expert, every key under ``prefix``."""
    out = {}
    for key, value in state.items():
        if key == "mlp.experts.gate_up_proj":
            i = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :i]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, i:]
        elif key == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[prefix + key] = value
    return out


HOSTS = {  # host -> (how to save a tiny random target, transformers' decoder layer of its family)
    "glm4_moe": (lambda path: make_moe(path, "glm4_moe"),
                 transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer),
    "deepseek_v3": (lambda path: make_deepseek(path, "v3"),
                    transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer),
    # index_topk 6, under the contexts' length: the MTP layer's own indexer picks what its attention reads
    "deepseek_v32": (lambda path: make_v32(path),
                     transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32DecoderLayer),
}


def mtp_layer(hf_model, layer_cls, seed: int = 1):
    """A random MTP layer for ``hf_model``: ``(published tensors, the block as transformers' decoder layer
    ``layer_cls`` at index L)``. Weights are scaled as the target's (wide greedy margins), the router's correction
    bias random (it changes the experts chosen)."""
    config = hf_model.config
    n, h, v = config.num_hidden_layers, config.hidden_size, config.vocab_size
    if getattr(config, "mlp_layer_types", None):  # V3.2 lists its layers' kinds; vLLM's layer L is sparse
        config = copy.deepcopy(config)
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
    torch.manual_seed(seed)
    block = layer_cls(config, layer_idx=n).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02).mul_(3.0 / 0.02 / h ** 0.5) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        block.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.5)
    g = torch.Generator().manual_seed(seed)
    pre = f"model.layers.{n}."
    tensors = {pre + "enorm.weight": pub.norm_weight(g, h), pre + "hnorm.weight": pub.norm_weight(g, h),
               pre + "eh_proj.weight": pub.rand(g, h, 2 * h, scale=3.0),
               pre + "shared_head.norm.weight": pub.norm_weight(g, h),
               pre + "shared_head.head.weight": pub.rand(g, v, h, scale=4.0)}
    tensors.update(_unstacked(pre, {k: t.detach() for k, t in block.state_dict().items()}))
    return tensors, block


def vllm_mtp_step(hf_model, p, block, pre):
    """vLLM ``glm4_moe_mtp.py`` / ``deepseek_mtp.py`` ``*MultiTokenPredictorLayer.forward`` over the whole sequence
    (no cache): the embedding zeroed at position 0, eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)]), the host's
    block (its residual added), logits through shared_head (norm, then head); the block's output is fed back."""
    embed = hf_model.model.embed_tokens.weight.detach()
    eps = hf_model.config.rms_norm_eps

    def step(us, xs):
        emb = embed[torch.tensor(xs)].clone()
        emb[0] = 0.0  # position 0
        e = pub.rms(emb, p[pre + "enorm.weight"], eps)
        hn = pub.rms(torch.stack(list(us)), p[pre + "hnorm.weight"], eps)
        x = pub.lin(torch.cat([e, hn], -1), p, pre + "eh_proj")[None]  # [1, T, H]
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            y = block(x, attention_mask=mask, position_ids=pos,
                      position_embeddings=hf_model.model.rotary_emb(x, pos))[0]  # [T, H]
        logits = pub.rms(y, p[pre + "shared_head.norm.weight"], eps) @ p[pre + "shared_head.head.weight"].T
        return y, int(torch.argmax(logits[-1]))

    return step


@pytest.fixture(scope="module", params=sorted(HOSTS))
def host(request, tmp_path_factory):
    """A tiny random host with its MTP layer in its own ``model.safetensors``, as GLM-4.5 and DeepSeek-V3 ship it:
    GLM-4.5 (GQA, partial rotary, QK-norm), DeepSeek-V3 (MLA, YaRN) or V3.2 (MLA over its indexer's top-k); each
    with a dense first layer and a group-limited sigmoid router with correction bias and a shared expert."""
    save, layer_cls = HOSTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save(path)
    hf.config._attn_implementation = "eager"
    tensors, block = mtp_layer(hf, layer_cls)
    save_file({**load_file(str(path / "model.safetensors")), **{k: v.contiguous() for k, v in tensors.items()}},
              str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    if request.param == "deepseek_v32":  # transformers' V3.2 config leaves it out; DeepSeek's config.json has it
        config["num_nextn_predict_layers"] = 1
        (path / "config.json").write_text(json.dumps(config))
    assert config["num_nextn_predict_layers"] == 1  # as transformers writes it for GLM-4.5 and DeepSeek-V3
    ar = _ids(Engine(str(path), max_num_seqs=4, max_model_len=96, enforce_eager=True).generate(PROMPTS, GREEDY))
    n = hf.config.num_hidden_layers
    step = vllm_mtp_step(hf, tensors, block, f"model.layers.{n}.")

    def reference(seq, k):  # the target's normed last state feeds the first step, as vLLM's models return it
        states, _, _ = pub.target_states(hf, seq[:-1])
        return pub.chain_drafts(step, states[n], seq[1:], k)

    return dict(name=request.param, path=str(path), hf=hf, tensors=tensors, ar=ar, reference=reference)


def test_mtp_layer_loads_from_the_targets_own_files(host):
    """The layer is found in the target's checkpoint (layout mtp-deepseek, the target's keys skipped), its block is
    a MoE layer of the host's attention (a latent draft cache for MLA), and its experts are the published ones
    stacked."""
    target = load_model(host["path"])
    assert len(target.params["model"]["layers"]) == 3  # the target leaves layer L to its proposer
    assert layouts.detect(host["path"])[0].name == "mtp-deepseek"
    cfg, params = mtp.load_params(host["path"], target)
    assert cfg.model.moe.sparse_layers == (0,) and cfg.hidden_layer == 3 and not cfg.norm_output
    mla = host["name"].startswith("deepseek")
    assert cfg.model.mla == target.cfg.mla and (cfg.model.mla.kv_lora_rank > 0) == mla
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    kv = Engine(host["path"], spec, max_num_seqs=1, max_model_len=32, enforce_eager=True).state.proposer.kv
    assert isinstance(kv, LatentCache) == mla
    assert (kv.index is not None) == (host["name"] == "deepseek_v32") if mla else True  # its own indexer keys
    gate_up = params["mlp"]["experts"]["gate_up_proj"]["weight"]  # [E, 2I, H]
    assert gate_up.shape == (8, 64, 64)
    t = {k[len("model.layers.3."):]: v for k, v in host["tensors"].items()}
    mlp = params["mlp"]
    assert torch.equal(gate_up[5, 32:], t["mlp.experts.5.up_proj.weight"])
    assert torch.equal(mlp["experts"]["down_proj"]["weight"][7], t["mlp.experts.7.down_proj.weight"])
    assert torch.equal(mlp["gate"]["e_score_correction_bias"], t["mlp.gate.e_score_correction_bias"])
    assert torch.equal(params["head"]["weight"], t["shared_head.head.weight"])
    assert params["embed_tokens"]["weight"] is target.params["model"]["embed_tokens"]["weight"]  # shared


def test_mtp_drafts_equal_vllms_module(host):
    """Every step's K = 3 drafts, over two slots and every acceptance count (the synthetic verifier commits 1..4
    tokens a step), equal vLLM's MTP module recomputed from scratch on the same context."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.8, 0.6, 0.4]}
    eng = Engine(host["path"], speculative_config=spec, max_num_seqs=2, max_model_len=96, enforce_eager=True)
    rec = pub.record_drafts(eng, rows=2)
    eng.generate(PROMPTS[:3], GREEDY)
    for context, drafts in rec:
        assert drafts == host["reference"](context, 3), context
    assert len(rec) >= 8


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_speculation_equals_greedy_ar(host, k):
    eng = Engine(host["path"], {"method": "mtp", "num_speculative_tokens": k}, max_num_seqs=4, max_model_len=96,
                 enforce_eager=True)
    assert _ids(eng.generate(PROMPTS, GREEDY)) == host["ar"]
    assert len(eng.stats()["per_position_acceptance"]) == k


def test_mtp_token_tree_equals_greedy_ar(host):
    """A token tree drafted by the MTP layer (tree attention over its own draft cache, GQA or latent) and
    verified in one block: greedy AR's tokens."""
    spec = {"method": "mtp", "num_speculative_tokens": 5,
            "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"}
    eng = Engine(host["path"], spec, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert _ids(eng.generate(PROMPTS, GREEDY)) == host["ar"]


@pytest.mark.slow
def test_mtp_captured_steps_are_lossless_and_never_recompile(host, request):
    """K = 2 (the guide's): the layer reused once inside the captured step (eager covers K = 1, 2, 3).

    NOTE: GLM-4.5's MTP (GQA) and V3.2's (latent attention over its own indexer's top-k) compile by real
    inductor; DeepSeek-V3's runs Dynamo's graph in place of inductor's codegen (``traced_codegen``: the fullgraph,
    its guards, no recompile), as its target's step compiles for real in tests/engine/test_deepseek.py and its
    latent MTP layer in V3.2's case here."""
    if host["name"] == "deepseek_v3":
        request.getfixturevalue("traced_codegen")
    eng = assert_captured_lossless(host["path"], {"method": "mtp", "num_speculative_tokens": 2}, PROMPTS, host["ar"],
                                   warm=4)
    assert eng.stats()["graph_breaks"] == 0


def test_k_defaults_to_num_nextn_predict_layers(host, tmp_path):
    """Without num_speculative_tokens, K is the checkpoint's num_nextn_predict_layers (vLLM's rule); an explicit K
    wins. A checkpoint with two MTP layers drafts K = 2 with the first, reused, and skips the second (vLLM's
    proposer runs its first layer at every step)."""
    llm = LLM(host["path"], speculative_config={"method": "mtp"}, enforce_eager=True, max_num_seqs=4, max_model_len=96)
    assert llm.engine.spec.num_speculative_tokens == 1
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)] \
        == host["ar"]
    two = tmp_path / "two"
    shutil.copytree(host["path"], two)
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    tensors = load_file(str(two / "model.safetensors"))
    second = {k.replace("model.layers.3.", "model.layers.4."): torch.zeros_like(v) for k, v in tensors.items()
              if k.startswith("model.layers.3.")}
    save_file({**tensors, **second}, str(two / "model.safetensors"))
    eng = Engine(str(two), {"method": "mtp"}, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    assert eng.spec.num_speculative_tokens == 2
    assert _ids(eng.generate(PROMPTS, GREEDY)) == host["ar"]
    one = Engine(host["path"], {"method": "mtp", "num_speculative_tokens": 2}, max_num_seqs=4, max_model_len=96,
                 enforce_eager=True)
    one.generate(PROMPTS, GREEDY)
    assert eng.stats()["per_position_acceptance"] == one.stats()["per_position_acceptance"]  # the second layer unread
    assert Engine(str(two), {"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=4,
                  max_model_len=96, enforce_eager=True).spec.num_speculative_tokens == 3


# ----------------------------------------------------------------------------- refusals
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 96,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "full_attention_interval": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
              "num_nextn_predict_layers": 1}


def test_a_hybrid_linear_attention_host_is_refused_naming_what_it_needs(tmp_path):
    """A Qwen3-Next-shaped checkpoint with its MTP layer, served with method mtp as vLLM's guide serves it: a
    ValueError naming the architecture and its hybrid Gated DeltaNet layers, never a KeyError; the same from its
    MTP module read against another target."""
    path = pub.save(tmp_path / "qwen3_next", QWEN3_NEXT,
                    {"model.embed_tokens.weight": torch.zeros(96, 32), "mtp.fc.weight": torch.zeros(32, 64),
                     "model.layers.4.eh_proj.weight": torch.zeros(32, 64)})
    why = r"Qwen3NextForCausalLM needs hybrid linear attention \(Gated DeltaNet layers"
    with pytest.raises(ValueError, match=why):
        Engine(str(path), {"method": "mtp"}, enforce_eager=True)
    with pytest.raises(ValueError, match=why):
        LLM(str(path), speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"architectures \['Qwen3NextForCausalLM'\] needs hybrid linear attention "
                                         r".*: its MTP module runs inside that model's layers"):
        make_hf_model(tmp_path / "llama")
        mtp.load_params(path, load_model(tmp_path / "llama"))
