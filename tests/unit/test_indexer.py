"""DeepSeek-V3.2's lightning indexer (funcspec.nn.indexer) against transformers' DeepseekV32Indexer.

Random weights and inputs; the context is longer than ``index_topk`` so the
selection matters. The selection must equal HF's exactly (the positions HF's
top-k picks, under its causal mask) and the scores agree to fp32 rounding.
"""

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

from funcspec.kernels import REFERENCE
from funcspec.nn import indexer
from funcspec.nn.llama import MLAConfig, rope_tables

HIDDEN, Q_LORA, ROPE, HEADS, DIM = 48, 24, 8, 4, 16


@dataclasses.dataclass(frozen=True)
class _Cfg:  # what the indexer reads of a ModelConfig
    mla: MLAConfig
    ops: object = REFERENCE


def _hf_config(topk: int):
    return transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=Q_LORA, kv_lora_rank=16, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=8, v_head_dim=8, index_n_heads=HEADS, index_head_dim=DIM, index_topk=topk,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, max_position_embeddings=256)


def _hf_indexer(topk: int, seed: int = 0):
    torch.manual_seed(seed)
    config = _hf_config(topk)
    module = hf_v32.DeepseekV32Indexer(config, 0).eval()
    with torch.no_grad():  # LayerNorm starts at (1, 0): randomise it so its params count
        module.k_norm.weight.normal_(1.0, 0.3)
        module.k_norm.bias.normal_(0.0, 0.3)
    return config, module


def _params(module) -> dict:
    sd = module.state_dict()
    return {name: {"weight": sd[f"{name}.weight"]} for name in ("wq_b", "wk", "weights_proj")} | {
        "k_norm": {"weight": sd["k_norm.weight"], "bias": sd["k_norm.bias"]}}


def _inputs(b: int, t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, HIDDEN, generator=g), torch.randn(b, t, Q_LORA, generator=g)


def _hf_tables(config, pos):
    """HF's rotary tables [B, T, R] at positions pos [B, T] (what its attention hands the indexer)."""
    rotary = hf_v32.DeepseekV32RotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), pos)


def _hf_selection(module, config, x, q_low):
    """HF's causal selection [B, T, T] bool, and its index scores [B, T, T] (masked -inf) from its own math."""
    b, t, _ = x.shape
    pos = torch.arange(t).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    idx = module(x, q_low, _hf_tables(config, pos), causal, pos)
    chosen = torch.zeros(b, t, t, dtype=torch.bool).scatter(-1, idx.long(), True)
    return chosen & causal


def _cfg(topk: int = 8) -> _Cfg:
    return _Cfg(MLAConfig(q_lora_rank=Q_LORA, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=ROPE,
                          v_head_dim=8, index_n_heads=HEADS, index_head_dim=DIM, index_topk=topk))


def _ours_tables(pos):
    cfg = type("RoPE", (), {"rotary_dim": 0, "head_dim": ROPE, "rope_theta": 10000.0, "rope_scaling": ()})
    return rope_tables(cfg, pos, torch.float32)


def test_rope_tables_equal_hf():
    config, _ = _hf_indexer(8)
    pos = torch.arange(40).view(1, -1)
    cos, sin = _ours_tables(pos)
    hf_cos, hf_sin = _hf_tables(config, pos)
    torch.testing.assert_close(cos.squeeze(2), hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin.squeeze(2), hf_sin, rtol=0, atol=0)


@pytest.mark.parametrize("topk", [8, 13])
def test_prefill_selection_equals_hf(topk):
    config, module = _hf_indexer(topk)
    p, cfg = _params(module), _cfg(topk)
    x, q_low = _inputs(2, 40)
    pos = torch.arange(40).expand(2, 40)
    cos, sin = _ours_tables(pos)
    keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)  # [B, 1, T, D]
    causal = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 40, 40)
    with torch.no_grad():
        ours = indexer.select(cfg, p, x, q_low, cos, sin, keys, causal)
        expected = _hf_selection(module, config, x, q_low)
    assert ours.shape == (2, 40, 40)
    assert torch.equal(ours, expected)
    counts = ours.sum(-1)  # query t sees t + 1 positions and keeps min(t + 1, topk) of them
    assert torch.equal(counts, (torch.arange(40) + 1).clamp(max=topk).expand(2, 40))


def test_scores_equal_hf_math():
    """The index scores, term by term as HF's forward computes them (its module returns only indices)."""
    config, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg()
    x, q_low = _inputs(1, 24)
    pos = torch.arange(24).view(1, -1)
    cos, sin = _ours_tables(pos)
    with torch.no_grad():
        keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)
        ours = indexer.scores(cfg, p, x, q_low, cos, sin, keys)
        hf_cos, hf_sin = _hf_tables(config, pos)
        q = module.wq_b(q_low).view(1, 24, HEADS, DIM)
        k = module.k_norm(module.wk(x)).unsqueeze(2)
        q_rot, k_rot = hf_v32.apply_rotary_pos_emb(q[..., :ROPE], k[..., :ROPE], hf_cos, hf_sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., ROPE:]], -1), torch.cat([k_rot, k[..., ROPE:]], -1).squeeze(2)
        s = torch.relu(q @ k.transpose(-1, -2).unsqueeze(1) * DIM ** -0.5)
        expected = ((module.weights_proj(x) * HEADS ** -0.5).unsqueeze(-2) @ s).squeeze(-2)
    assert ours.shape == (1, 24, 24) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert (expected.abs() > 1e-3).float().mean() > 0.9  # the test compares real scores, not relu's zeros


def test_decode_reads_a_padded_bucket():
    """Queries at the end of a context, over a read length past the live tokens (stale keys beyond them):
    the selection equals HF's rows for those queries, and never reaches an unseen position."""
    config, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg()
    x, q_low = _inputs(2, 40)
    pos = torch.arange(40).expand(2, 40)
    cos, sin = _ours_tables(pos)
    with torch.no_grad():
        expected = _hf_selection(module, config, x, q_low)[:, -3:]  # [B, 3, 40]
        keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)
        stale = torch.randn(2, 1, 24, DIM) * 100  # large scores where nothing may be read
        keys = torch.cat([keys, stale], dim=2)  # [B, 1, 64, D]
        last = slice(37, 40)
        visible = torch.arange(64).view(1, 1, -1) <= pos[:, last].unsqueeze(-1)  # [B, 3, 64]
        ours = indexer.select(cfg, p, x[:, last], q_low[:, last], cos[:, last], sin[:, last], keys, visible)
    assert ours.shape == (2, 3, 64)
    assert not ours[..., 40:].any()
    assert torch.equal(ours[..., :40], expected)
    assert torch.equal(ours.sum(-1), torch.full((2, 3), 8))


def test_short_context_keeps_every_visible_position():
    """A read length of at most index_topk: the selection is the visibility itself, nothing scored."""
    _, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg(16)
    x, q_low = _inputs(1, 12)
    cos, sin = _ours_tables(torch.arange(12).view(1, -1))
    keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)
    visible = torch.rand(1, 12, 12, generator=torch.Generator().manual_seed(3)) > 0.5
    assert indexer.select(cfg, p, x, q_low, cos, sin, keys, visible) is visible


def test_top_positions_mark_unseen_fill():
    s = torch.tensor([[[5.0, 1.0, 9.0, 3.0]]])
    visible = torch.tensor([[[True, True, False, False]]])
    idx, seen = indexer.top_positions(s, visible, 3)
    assert idx[0, 0, :2].tolist() == [0, 1]
    assert seen[0, 0].tolist() == [True, True, False]


def test_index_keys_shape_and_weights_proj_dtype():
    """Keys are one head per token; a bf16 model's fp32 ``weights_proj`` (HF keeps it in fp32) reads x in fp32."""
    _, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg()
    x, q_low = _inputs(2, 5)
    cos, sin = _ours_tables(torch.arange(5).expand(2, 5))
    assert indexer.index_keys(cfg, p, x, cos, sin).shape == (2, 5, 1, DIM)
    low = {k: {n: t.bfloat16() for n, t in v.items()} for k, v in p.items() if k != "weights_proj"}
    low["weights_proj"] = p["weights_proj"]
    w = indexer.head_weights(cfg, low, x.bfloat16())
    assert w.dtype == torch.float32 and w.shape == (2, 5, HEADS)
    torch.testing.assert_close(w, module.weights_proj(x.bfloat16().float()) * HEADS ** -0.5)


def _latent_attention(q, latents, visible):
    from funcspec.nn.llama import attend
    return attend(REFERENCE, q, latents, latents[..., :12], visible, 0.3)


def test_sparse_read_attends_to_the_selected_latents_alone():
    """A decode/verify block gathers each query's selected latents: attention over them equals attention over
    the whole read under the selection's mask; queries of one block never see each other's choice."""
    _, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg()
    x, q_low = _inputs(2, 40)
    pos = torch.arange(40).expand(2, 40)
    cos, sin = _ours_tables(pos)
    keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)  # [B, 1, 40, D]
    g = torch.Generator().manual_seed(4)
    latents, q = torch.randn(2, 1, 40, 20, generator=g), torch.randn(2, 40, 3, 20, generator=g)
    causal = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 40, 40)
    with torch.no_grad():
        mask = indexer.select(cfg, p, x, q_low, cos, sin, keys, causal)
        q2, rows, seen = indexer.sparse_read(cfg, p, x, q_low, cos, sin, keys, q, latents, causal)
        want = _latent_attention(q, latents, mask)  # [B, T, H·12]
        got = _latent_attention(q2, rows, seen).view(2, 40, -1)
        last = slice(36, 40)  # a decode block of 4 queries alone
        q3, rows3, seen3 = indexer.sparse_read(cfg, p, x[:, last], q_low[:, last], cos[:, last], sin[:, last], keys,
                                               q[:, last], latents, causal[:, last])
        block = _latent_attention(q3, rows3, seen3).view(2, 4, -1)
    assert (q2.shape, rows.shape, seen.shape) == ((80, 1, 3, 20), (80, 1, 8, 20), (80, 1, 8))
    assert torch.equal(seen.view(2, 40, 8).sum(-1), (torch.arange(40) + 1).clamp(max=8).expand(2, 40))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block, got[:, last], rtol=0, atol=0)


def test_sparse_read_masks_a_long_prefill_and_keeps_a_short_read():
    from funcspec.nn.llama import MATH_TOKENS_MAX
    _, module = _hf_indexer(8)
    p, cfg = _params(module), _cfg()
    t = MATH_TOKENS_MAX + 1
    x, q_low = _inputs(1, t)
    cos, sin = _ours_tables(torch.arange(t).view(1, -1))
    keys = indexer.index_keys(cfg, p, x, cos, sin).transpose(1, 2)
    q, latents = torch.randn(1, t, 2, 20), torch.randn(1, 1, t, 20)
    causal = torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0)
    with torch.no_grad():
        q2, rows, mask = indexer.sparse_read(cfg, p, x, q_low, cos, sin, keys, q, latents, causal)
        assert q2 is q and rows is latents
        assert torch.equal(mask, indexer.select(cfg, p, x, q_low, cos, sin, keys, causal))
        short = indexer.sparse_read(cfg, p, x[:, :8], q_low[:, :8], cos[:, :8], sin[:, :8], keys[:, :, :8],
                                    q[:, :8], latents[:, :, :8], causal[:, :8, :8])
    assert short[0] is not None and short[1].shape == (1, 1, 8, 20) and torch.equal(short[2], causal[:, :8, :8])
