"""DeepSeek-V3.2's lightning indexer (funcspec.nn.dsa, funcspec.kernels.indexer) against transformers'.

The selection is checked as positions: for every query, the set of cached
positions attention may read equals transformers' top-k of the same sequence
(which, with its causal mask, selects for row s what a decode step at s
selects), while funcspec reads a static context bucket with stale entries past
each row's length, in blocks of the sizes prefill, AR and verification use.
"""

from __future__ import annotations

import pytest
import torch

from funcspec.kernels import REFERENCE, indexer
from funcspec.nn import dsa
from funcspec.nn.deepseek import LatentCache
from funcspec.nn.llama import KVRead, MLAConfig, TreeMask, commit_path, visible_keys, write_kv

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402


def tiny_mla(**indexer) -> MLAConfig:
    """The MLA config of the tiny models below, its indexer fields overridden by ``indexer``."""
    base = dict(index_n_heads=8, index_head_dim=32, index_topk=5)
    return MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     **(base | indexer))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5}


def hf_config(mla: MLAConfig, rope=None):
    cfg = transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=mla.index_n_heads,
        index_head_dim=mla.index_head_dim, index_topk=mla.index_topk, max_position_embeddings=256,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    return cfg


def nested(state: dict) -> dict:
    """An HF state dict nested on its dots (funcspec's params)."""
    out: dict = {}
    for name, value in state.items():
        *path, leaf = name.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def make_indexer(mla: MLAConfig, rope=None, seed: int = 0):
    """transformers' indexer with random weights (LayerNorm's too), its params, and its rotary embedding."""
    cfg = hf_config(mla, rope)
    torch.manual_seed(seed)
    module = hf_v32.DeepseekV32Indexer(cfg, 0).eval()
    with torch.no_grad():
        module.k_norm.weight.uniform_(0.5, 1.5)
        module.k_norm.bias.normal_(0, 0.1)
    return module, nested(module.state_dict()), hf_v32.DeepseekV32RotaryEmbedding(cfg), cfg


def hf_selection(module, rotary, x, q_resid) -> torch.Tensor:
    """[B, N, N] bool: the positions transformers lets each query of the sequences x read."""
    b, n, _ = x.shape
    pos = torch.arange(n).expand(b, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(b, n, n)
    with torch.no_grad():
        idx = module(x, q_resid, rotary(x, pos), causal, pos)  # [B, N, min(topk, N)]
    mask = torch.zeros(b, n, n, dtype=torch.bool).scatter(-1, idx.long(), True)
    return mask & causal


def index_cache(mla: MLAConfig, slots: int, max_len: int, dtype=torch.float32) -> torch.Tensor:
    """One layer's index keys [1, S+1, 1, T_max, Di], as ``LatentCache.index`` holds them."""
    return torch.zeros(1, slots + 1, 1, max_len, mla.index_head_dim, dtype=dtype)


def tables(rotary, x, pos):
    cos, sin = rotary(x, pos)  # [B, T, R]
    return cos.unsqueeze(2), sin.unsqueeze(2)


def run_blocks(mla, params, rotary, x, q_resid, blocks, slots, max_len=48, stale=True, aligned=False):
    """funcspec's selections, block by block, rows at their own starts: {(row, position): [T_read] bool}.

    blocks: (starts [B], T, read length[, rows]) per step, ``rows`` the rows that take part (the others are
    padding, on the scratch slot, as the engine pads); x, q_resid [B, N, ...]: the rows' whole sequences.
    """
    gen = torch.Generator().manual_seed(7)
    scratch = int(slots.max()) + 1
    cache = index_cache(mla, scratch, max_len, x.dtype)
    if stale:  # entries past every row's length that no query may see
        cache.normal_(generator=gen)
    got = {}
    for starts, t, length, *rows in blocks:
        rows = rows[0] if rows else range(len(starts))
        step_slots = torch.tensor([int(slots[b]) if b in rows else scratch for b in range(len(starts))])
        pos = starts.unsqueeze(1) + torch.arange(t)  # [B, T]
        xb = torch.stack([x[b, pos[b]] for b in range(len(starts))])  # [B, T, H]
        qb = torch.stack([q_resid[b, pos[b]] for b in range(len(starts))])  # [B, T, Q]
        cos, sin = tables(rotary, xb, pos)
        write_kv(cache, 0, step_slots, pos, dsa.index_key(REFERENCE, params, xb, cos, sin))
        visible = visible_keys(pos, length)
        sel = dsa.sparse_visible(REFERENCE, mla, params, cache[0], xb, qb, step_slots, cos, sin, visible,
                                 KVRead(length, aligned))
        for b in rows:
            for i in range(t):
                got[(b, int(pos[b, i]))] = sel[b, i]
    return got


def compare(got: dict, want: torch.Tensor) -> int:
    """Assert every selection equals transformers'; the number of queries whose selection left some out."""
    cut = 0
    for (b, p), sel in got.items():
        ref = want[b, p]
        assert sel.shape[0] > p and not ref[sel.shape[0]:].any()  # the read holds every position p sees
        ref = torch.cat([ref, torch.zeros(sel.shape[0], dtype=torch.bool)])[: sel.shape[0]]
        assert torch.equal(sel, ref), (b, p, sel.nonzero().flatten().tolist(), ref.nonzero().flatten().tolist())
        cut += int(sel.sum()) < p + 1
    return cut


@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn"])
def test_selection_matches_transformers_across_blocks_and_buckets(rope):
    """Prefill, AR and verify-sized blocks in static buckets select what transformers selects, and the top-k
    is smaller than the context, so that the selection cuts."""
    mla = tiny_mla()
    module, params, rotary, cfg = make_indexer(mla, rope)
    n = 40
    x = torch.randn(2, n, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    q_resid = torch.randn(2, n, cfg.q_lora_rank, generator=torch.Generator().manual_seed(2))
    want = hf_selection(module, rotary, x, q_resid)

    # row 1 prefills 3 tokens more than row 0 (row 0 pads that block); buckets 4 (<= topk: nothing
    # scored), 16, 32, 48
    blocks = [(torch.tensor([0, 0]), 3, 4), (torch.tensor([0, 3]), 3, 8, [1]), (torch.tensor([3, 6]), 7, 16),
              (torch.tensor([10, 13]), 3, 16)]
    blocks += [(torch.tensor([s, s + 3]), 1, 32 if s + 4 <= 32 else 48) for s in range(13, 22)]
    blocks += [(torch.tensor([s, s + 3]), 4, 32 if s + 7 <= 32 else 48) for s in range(22, 34, 4)]
    got = run_blocks(mla, params, rotary, x, q_resid, blocks, torch.tensor([2, 0]))
    assert len(got) == 3 + 6 + 2 * (7 + 3 + 9 + 12)
    assert compare(got, want) > 40


def test_aligned_reads_select_alike():
    """Rows read in place (row b is slot b) select as gathered rows do."""
    mla = tiny_mla(index_topk=3)
    module, params, rotary, cfg = make_indexer(mla, seed=3)
    x = torch.randn(2, 20, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    q_resid = torch.randn(2, 20, cfg.q_lora_rank, generator=torch.Generator().manual_seed(5))
    blocks = [(torch.tensor([0, 0]), 6, 8)] + [(torch.tensor([s, s]), 2, 16) for s in range(6, 14, 2)]
    got = run_blocks(mla, params, rotary, x, q_resid, blocks, torch.tensor([0, 1]), aligned=True)
    assert compare(got, hf_selection(module, rotary, x, q_resid)) > 10


def test_bf16_matches_transformers_bf16():
    """In bf16 (weights_proj in fp32, as transformers keeps it) the selection is still transformers'."""
    mla = tiny_mla(index_n_heads=16, index_topk=6)
    module, params, rotary, cfg = make_indexer(mla, seed=6)
    module = module.to(torch.bfloat16)
    module.weights_proj.float()
    params = nested(module.state_dict())
    x = torch.randn(1, 32, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    q_resid = torch.randn(1, 32, cfg.q_lora_rank, generator=torch.Generator().manual_seed(8)).bfloat16()
    blocks = [(torch.tensor([0]), 12, 16)] + [(torch.tensor([s]), 1, 32) for s in range(12, 32)]
    got = run_blocks(mla, params, rotary, x, q_resid, blocks, torch.tensor([0]))
    assert compare(got, hf_selection(module, rotary, x, q_resid)) > 20


def test_ties_go_to_the_earlier_position_whatever_the_bucket():
    """Equal scores (a query whose heads all relu to zero) are broken by position, so a read of 8 and of 64
    positions, eager or with -0.0 for 0.0, select the same set."""
    s = torch.tensor([[[0.0, -0.0, 2.0, 0.0, -1.0, 2.0, 0.0, -0.0]]])
    visible = torch.ones(1, 1, 8, dtype=torch.bool)
    idx, valid = indexer.top_positions(s, visible, 4)
    assert sorted(idx.flatten().tolist()) == [0, 1, 2, 5] and valid.all()
    wide = torch.cat([s, torch.randn(1, 1, 56)], -1)
    wide_visible = torch.cat([visible, torch.zeros(1, 1, 56, dtype=torch.bool)], -1)
    idx_w, valid_w = indexer.top_positions(wide.masked_fill(~wide_visible, float("-inf")), wide_visible, 4)
    assert sorted(idx_w.flatten().tolist()) == [0, 1, 2, 5] and valid_w.all()
    keys = indexer.order_keys(torch.tensor([-3.0, -1.0, -0.0, 0.0, 1e-30, 5.0, float("-inf")]))
    assert keys.argsort().tolist() == [6, 0, 1, 3, 2, 4, 5]  # by value; 0.0 and -0.0 by position


def test_a_row_that_sees_fewer_than_topk_marks_the_rest_invalid():
    s = torch.tensor([[[1.0, 3.0, float("-inf"), float("-inf")]]])
    visible = torch.tensor([[[True, True, False, False]]])
    idx, valid = indexer.top_positions(s, visible, 3)
    assert idx.shape == (1, 1, 3) and valid.tolist() == [[[True, True, False]]]
    assert dsa.selected(idx, valid, 4).tolist() == [[[True, True, False, False]]]


def test_chunked_scores_equal_one_pass(monkeypatch):
    """A long block (a prefill) scored in chunks of query rows gives the one-pass scores."""
    gen = torch.Generator().manual_seed(9)
    q, keys = torch.randn(2, 13, 4, 16, generator=gen), torch.randn(2, 20, 16, generator=gen)
    w, visible = torch.randn(2, 13, 4, generator=gen), torch.rand(2, 13, 20, generator=gen) > 0.3
    whole = indexer.scores(q, keys, w, visible, 0.25)
    monkeypatch.setattr(indexer, "SCORE_ELEMENTS", 4 * 20 * 3)  # 3 rows a pass
    torch.testing.assert_close(indexer.scores(q, keys, w, visible, 0.25), whole, rtol=0, atol=0)
    assert REFERENCE.lightning_indexer(q, keys, w, visible, 5, 0.25)[0].shape == (2, 13, 5)


def test_tree_nodes_select_as_their_chain_and_commit_moves_the_keys():
    """Under a token tree a node selects, among the context and its ancestors, what the same tokens decoded as
    a chain select; committing the accepted path moves its index keys where the chain wrote them."""
    mla = tiny_mla(index_topk=4)
    _, params, rotary, cfg = make_indexer(mla, seed=10)
    gen = torch.Generator().manual_seed(11)
    ctx, x_ctx, q_ctx = 10, torch.randn(1, 10, cfg.hidden_size, generator=gen), torch.randn(1, 10, 24, generator=gen)
    x_tree, q_tree = torch.randn(1, 3, cfg.hidden_size, generator=gen), torch.randn(1, 3, 24, generator=gen)
    slots, read = torch.tensor([0]), KVRead(16)

    def prefill():
        cache = index_cache(mla, 1, 16)
        pos = torch.arange(ctx).unsqueeze(0)
        cos, sin = tables(rotary, x_ctx, pos)
        write_kv(cache, 0, slots, pos, dsa.index_key(REFERENCE, params, x_ctx, cos, sin))
        return cache

    def step(cache, x, q, pos, rope_pos, tree=None):
        cos, sin = tables(rotary, x, rope_pos)
        write_kv(cache, 0, slots, pos, dsa.index_key(REFERENCE, params, x, cos, sin))
        visible = visible_keys(pos, read.length, tree=tree)
        return dsa.sparse_visible(REFERENCE, mla, params, cache[0], x, q, slots, cos, sin, visible, read)

    # tree: node 0 (depth 0), nodes 1 and 2 its children (depth 1), written at ctx + 0, 1, 2
    tree = TreeMask(positions=torch.tensor([[ctx, ctx + 1, ctx + 1]]), base=torch.tensor([ctx]),
                    ancestors=torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]]))
    t_cache = prefill()
    t_sel = step(t_cache, x_tree, q_tree, ctx + torch.arange(3).unsqueeze(0), tree.positions, tree)
    # the chain 0 -> 2: node 2 at ctx + 1
    c_cache = prefill()
    keep = torch.tensor([0, 2])
    pos = ctx + torch.arange(2).unsqueeze(0)
    c_sel = step(c_cache, x_tree[:, keep], q_tree[:, keep], pos, pos)
    assert torch.equal(t_sel[0, 0], c_sel[0, 0])
    moved = t_sel[0, 2].clone()
    moved[ctx + 1], moved[ctx + 2] = moved[ctx + 2], False  # the chain's node 2 sits at ctx + 1
    assert torch.equal(moved, c_sel[0, 1]) and int(c_sel[0, 1].sum()) == mla.index_topk
    commit_path(LatentCache(torch.zeros_like(t_cache), t_cache, None), slots, torch.tensor([ctx]),
                torch.tensor([[0, 2]]))
    torch.testing.assert_close(t_cache[..., : ctx + 2, :], c_cache[..., : ctx + 2, :], rtol=0, atol=0)


def test_compiled_selection_equals_eager_without_recompiles():
    """One captured graph per bucket: positions and lengths are tensors, so every step of a bucket reuses it."""
    mla = tiny_mla(index_topk=4)
    _, params, rotary, cfg = make_indexer(mla, seed=12)
    gen = torch.Generator().manual_seed(13)
    read, slots = KVRead(24), torch.tensor([1, 0])

    def step(cache, x, q, pos, cos, sin):
        write_kv(cache, 0, slots, pos, dsa.index_key(REFERENCE, params, x, cos, sin))
        return dsa.sparse_visible(REFERENCE, mla, params, cache[0], x, q, slots, cos, sin,
                                  visible_keys(pos, read.length), read)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager_cache = index_cache(mla, 2, 24)
    eager_cache.normal_(generator=gen)
    compiled_cache = eager_cache.clone()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for start in (10, 13, 17):
            x, q = torch.randn(2, 3, cfg.hidden_size, generator=gen), torch.randn(2, 3, 24, generator=gen)
            pos = torch.tensor([[start], [start - 4]]) + torch.arange(3)
            cos, sin = tables(rotary, x, pos)
            want = step(eager_cache, x, q, pos, cos, sin)
            got = compiled(compiled_cache, x, q, pos, cos, sin)
            assert torch.equal(got, want) and int(got[0, -1].sum()) == 4
    torch.testing.assert_close(compiled_cache, eager_cache)  # inductor fuses the norm and RoPE: not bitwise


@pytest.mark.parametrize("fields, message", [
    (dict(q_lora_rank=0), "q_lora_rank must be positive"),
    (dict(index_n_heads=0), "index_n_heads must be a positive int"),
    (dict(index_head_dim=4), r"index_head_dim \(4\) must hold the even qk_rope_head_dim \(8\)"),
    (dict(index_topk=-1), "index_topk must be a positive int"),
])
def test_bad_indexer_configs_are_refused_by_field(fields, message):
    base = dict(q_lora_rank=24, index_n_heads=8, index_head_dim=32, index_topk=5, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match=message):
        dsa.check_config(**(base | fields))
    dsa.check_config(**(base | dict(q_lora_rank=0, index_topk=0)))  # no indexer: nothing to check
