"""Functional Llama / Qwen2 / Qwen3 decoder.

``params`` is the HF state dict nested on its dots (``params["model"]["layers"][i]
["self_attn"]["q_proj"]["weight"]``), so HF names survive round trips. The
forward is a pure function over ``[B, T]`` tokens, each row with its own KV
slot and start position; it writes K/V for those tokens into the donated
cache and returns logits and, on request, hidden states of chosen layers.

Families differ only by config flags: Qwen2 adds q/k/v biases
(``attention_bias``), Qwen3 adds per-head RMSNorm on q and k (``qk_norm``),
GLM-4.5 rotates only the first ``rotary_dim`` of each head, and the
mixture-of-experts families (Qwen2/Qwen3-MoE, Mixtral, GLM-4.5) replace the MLP
of their sparse layers with :func:`funcspec.nn.moe.sparse_block` (``moe``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from funcspec.kernels import REFERENCE, Ops, QuantFormat
from funcspec.kernels.cpu import huge_empty
from funcspec.nn import moe
from funcspec.nn.moe import DENSE, MoEConfig
from funcspec.parallel import SINGLE, TPGroup, all_reduce
from funcspec.pytree import pytree_dataclass, slot_field


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3/V3.2; :mod:`funcspec.nn.deepseek`); ``kv_lora_rank == 0``:
    the model has none (GQA).

    Attributes:
        q_lora_rank: the query's low-rank width (``q_a_proj``), 0 when q is one ``q_proj`` (V2-Lite).
        kv_lora_rank: R, the latent each token caches (with its ``qk_rope_head_dim`` rotated key).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head query/key parts without and with RoPE, value.
        softmax_scale: the scores' scale, ``(nope + rope) ** -0.5`` times YaRN's ``mscale_all_dim`` factor squared.
        rope_interleave: RoPE rotates adjacent pairs (DeepSeek's layout) rather than the two halves.
        index_n_heads, index_head_dim, index_topk: V3.2's lightning indexer (``index_topk == 0``: none).
    """

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float = 1.0
    rope_interleave: bool = True
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0


GQA = MLAConfig()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static decoder configuration (``arch``: llama | qwen2 | qwen3 | qwen2_moe | qwen3_moe | mixtral | glm4_moe |
    deepseek_v2 | deepseek_v3 | deepseek_v32).

    Parsed from an HF ``config.json`` by :func:`funcspec.checkpoints.llama.model_config`.
    Under tensor parallelism (``tp.size > 1``) ``num_heads``, ``num_kv_heads``
    and ``intermediate_size`` are this rank's share
    (:func:`funcspec.checkpoints.tp.shard_config`), so the KV cache holds only
    the rank's heads. ``ops`` are the kernels its products and attention take
    (:func:`funcspec.kernels.resolve`, set when the engine is built). ``rotary_dim``:
    the leading dims of each head that RoPE rotates (0: all of them). ``moe``: the
    sparse layers' experts and router (:class:`funcspec.nn.moe.MoEConfig`; dense by default). ``mla``: the
    DeepSeek families' latent attention (:class:`MLAConfig`; ``head_dim`` is then its rotated part).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) items; () means default RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    tp: TPGroup = SINGLE
    ops: Ops = REFERENCE
    rotary_dim: int = 0
    moe: MoEConfig = DENSE
    mla: MLAConfig = GQA


@pytree_dataclass
class KVCache:
    """Static-shape KV cache for all slots. Slot ``S`` is the scratch slot.

    Attributes:
        k: [L, S+1, H_kv, T_max, D] keys.
        v: [L, S+1, H_kv, T_max, D] values.
        lens: [S+1] int64 committed tokens per slot. Rollback resets it.
    """

    k: torch.Tensor = slot_field(axis=1)
    v: torch.Tensor = slot_field(axis=1)
    lens: torch.Tensor = slot_field()

    def entries(self) -> tuple[torch.Tensor, ...]:
        """The per-position leaves [L, S+1, H, T_max, D] that rollback and tree commits move."""
        return self.k, self.v


def init_kv_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype=torch.float32, device=None) -> KVCache:
    """An empty cache with ``num_slots`` real slots plus the scratch slot."""
    shape = (cfg.num_layers, num_slots + 1, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(zeros(shape, dtype, device), zeros(shape, dtype, device),
                   torch.zeros(num_slots + 1, dtype=torch.int64, device=device))


def zeros(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A zeroed cache leaf: on the CPU in huge pages (each step reads the live cache once)."""
    if device is None or torch.device(device).type == "cpu":
        return huge_empty(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [D/2], with Llama-3 or linear scaling (as HF computes them), or GGUF's explicit
    per-frequency factors (``rope_freqs``: llama.cpp divides each frequency by its factor). Over the
    ``rotary_dim`` rotated dims of a head (all of them by default)."""
    d = cfg.rotary_dim or cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = dict(cfg.rope_scaling)
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    if kind == "factors":
        return inv / torch.tensor(s["factors"], dtype=torch.float32, device=device)
    if kind == "yarn":
        return yarn_inv_freq(inv, d, cfg.rope_theta, s)
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


def yarn_inv_freq(inv: torch.Tensor, d: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN's frequencies [d/2] (as HF computes them): interpolated by ``factor`` below the ``beta_slow`` rotation
    count over the original context, kept above ``beta_fast``, a linear ramp between."""
    old = s["original_max_position_embeddings"]

    def dim_of(rotations):  # the dim whose wavelength makes ``rotations`` turns over the original context
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv.device) - lo) / (hi - lo if hi > lo else 0.001))
    keep = 1 - ramp.clamp(0, 1)  # [d/2]: 1 where the frequency is kept (extrapolated)
    return inv / s["factor"] * (1 - keep) + inv * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (1 without interpolation)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's ``attention_factor`` (1 for every other RoPE)."""
    s = dict(cfg.rope_scaling)
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, H, D]; cos/sin [B, T, 1, R]: the first R dims rotate, the rest pass (partial
    rotary, R < D)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    # NOTE: rotate_half(x) = cat(-x2, x1) as a roll and a sign: the same values, but pointwise, so inductor fuses
    # it into the product's epilogue instead of writing the halves to a buffer of their own.
    rolled = torch.roll(x, r // 2, dims=-1)  # [..., D]: x2, x1
    first = torch.arange(r, device=x.device) < r // 2  # [D]
    return x * cos + torch.where(first, -rolled, rolled) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as HF does, then cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def row_parallel(cfg: ModelConfig, x: torch.Tensor, p: dict) -> torch.Tensor:
    """The linear of a row-parallel layer (``o_proj``, ``down_proj``): x and W hold this rank's input slice.

    Each rank's product is a partial sum; the all-reduce adds them up, and the
    bias is added once, after it (not once per rank).
    """
    if cfg.tp.size == 1:
        return cfg.ops.linear(x, p)
    y = all_reduce(cfg.ops.linear(x, p, bias=False), cfg.tp)
    return y if p.get("bias") is None else y + p["bias"]


def write_kv(cache: torch.Tensor, layer: int, slots: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [B, T, H_kv, D] into cache [L, S+1, H_kv, T_max, D] at (layer, slot, :, pos).

    Donates: cache.
    """
    # NOTE: one full-tensor index_put_: writing through a view
    # (cache[layer]) or with scatter_ makes inductor copy the whole cache.
    h = torch.arange(x.shape[2], device=x.device).view(1, 1, -1)  # [1, 1, H_kv]
    l_idx = torch.full((1, 1, 1), layer, dtype=torch.int64, device=x.device)
    cache.index_put_((l_idx, slots.view(-1, 1, 1), h, pos.unsqueeze(-1)), x)


def commit_path(kv: KVCache, slots: torch.Tensor, lens: torch.Tensor, path: torch.Tensor) -> None:
    """Move a token tree's accepted path in the cache: entries written at ``lens + tree index`` go to ``lens + depth``.

    path [B, D+1]: the path's tree indices (``verifiers.tree``; tree index 0 is
    the pending token at ``lens``), for the target's cache and any draft cache
    laid out the same way. Entries past the emitted length land beyond the new
    length, where nothing reads them; the rest of the tree is rolled back by the
    length alone. Donates: kv.k, kv.v.
    """
    depth = torch.arange(path.shape[1], device=path.device)  # [D+1]
    move_entries(kv, slots, lens.unsqueeze(1) + path, lens.unsqueeze(1) + depth)


def move_entries(kv: KVCache, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy cache positions src [B, M] to dst [B, M] of each row's slot, in every layer and head.

    All sources are read before any destination is written, so they may overlap;
    destinations must be distinct per row. Donates: every leaf of ``kv.entries()``.
    """
    dev = src.device
    src, dst = src.unsqueeze(0).unsqueeze(2), dst.unsqueeze(0).unsqueeze(2)  # [1, B, 1, M]
    for cache in kv.entries():  # each [L, S+1, H, T_max, D]
        n_layers, _, n_heads = cache.shape[:3]
        idx = (torch.arange(n_layers, device=dev).view(-1, 1, 1, 1), slots.view(1, -1, 1, 1),
               torch.arange(n_heads, device=dev).view(1, 1, -1, 1))
        # NOTE: gathered first (a copy), then one full-tensor index_put_.
        cache.index_put_((*idx, dst), cache[(*idx, src)])


@dataclasses.dataclass(frozen=True)
class KVRead:
    """How attention reads a KV cache (static: part of a bucket's key).

    Attributes:
        length: read positions ``[0, length)`` of each slot; ``None`` reads all
            ``T_max``. The host picks the smallest context bucket that holds every
            row's live tokens, so a step costs the live KV, not the capacity.
        aligned: row ``b`` of the batch is slot ``b`` (padding rows excepted), so
            the cache is read in place as the view ``cache[layer, :B, :, :length]``.
            Otherwise (prefill, arbitrary slots) the rows' slots are gathered.
    """

    length: Optional[int] = None
    aligned: bool = False


FULL_READ = KVRead()
"""Gather every row's whole slot: the reference read, used by prefill."""


def window_start(lens: torch.Tensor, window: Optional[int]) -> Optional[torch.Tensor]:
    """First cache position [B] a draft query may read under the draft KV window W, or ``None`` without one.

    The one draft-window rule of every head: ``max(lens - W, 0)``. A draft reads the
    W most recent committed positions ``[lens - W, lens)`` plus whatever it writes
    itself this step (its block, or its chain), so the first draft always sees W
    tokens. NOTE: no look-ahead by K: the start depends on the row's committed
    length only, so a row's drafts do not depend on the bucket's K (which follows
    the batch size); and no alignment: vLLM-Ascend rounds down to its paged-KV
    block, but this cache is contiguous per slot, so the window is exact.
    """
    if window is None:
        return None
    return (lens - window).clamp(min=0)


def read_cache(cache: torch.Tensor, layer: int, slots: torch.Tensor, read: KVRead) -> torch.Tensor:
    """Keys or values [B, H_kv, T_read, D] of each row's slot, from cache [L, S+1, H_kv, T_max, D]."""
    t = cache.shape[3] if read.length is None else read.length
    if read.aligned:
        # NOTE: a view, no copy: padding rows read a free slot's stale entries,
        # which only their own (discarded) outputs see.
        return cache[layer, : slots.shape[0], :, :t]
    return cache[layer, :, :, :t][slots]


MATH_READ_MIN = 2048
"""CPU reads of at least this many positions use :func:`_gemm_attention` instead of SDPA's CPU flash kernel.

Long reads are faster as GEMMs, short ones in SDPA (figures: graphs/results/notes/code-notes.md). Both give
each query row the same bits whatever the number of rows, so AR and verification
still agree."""


MATH_TOKENS_MAX = 128
"""The decode attention kernel (:mod:`funcspec.kernels.attention`, on CPUs that build it) and
otherwise the GEMM attention serve blocks of up to this many tokens: every decode and verify step
(a tree verifies at most 65), never a long prefill, which keeps SDPA's flash kernel."""


def _gemm_attention(qg: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                    scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T · scale) v for qg [B, H_kv, Q, D] over keys [B, H_kv, T, D] and vals [B, H_kv, T, Dv] where
    mask [B, 1, Q, T]; the scale defaults to 1/sqrt(D)."""
    scale = qg.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, H_kv, Q, T] fp32
    # NOTE: a finite floor, not -inf: a row that sees nothing (never a real one) stays finite.
    p = s.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(-1)
    return torch.matmul(p.to(vals.dtype), vals)  # [B, H_kv, Q, Dv]


def attend(ops: Ops, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, visible: torch.Tensor,
           scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q [B, T, H, D] over keys [B, H_kv, T_read, D], vals [B, H_kv, T_read, Dv] where visible
    [B, T, T_read]; -> [B, T, H·Dv]. ``scale``: the scores' (default 1/sqrt(D)).

    The one attention of the target and every head (latent attention is its one-KV-head case, whose values
    are a prefix of its keys).
    NOTE: decode and verify blocks (up to :data:`MATH_TOKENS_MAX` tokens) take
    the CPU decode kernel where ``ops`` has it (:mod:`funcspec.kernels.attention`):
    it reads the cache in place and skips what a query cannot see, several
    times faster than SDPA (graphs/results/notes/code-notes.md). Otherwise GQA is folded into the query
    length: the G = H / H_kv query heads that share a KV head become G·T
    queries of that head. SDPA then runs one plain
    multi-head attention over the cache as it lies, with no repeated or copied
    keys, and the G·T queries make a GEMM where T = 1 would be a GEMV.
    """
    b, t, h, d = q.shape
    hkv, tr, dv = keys.shape[1], keys.shape[2], vals.shape[-1]
    g = h // hkv
    keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    if scale is None and t <= MATH_TOKENS_MAX and ops.attends(q, keys, vals):
        return ops.attend(q, keys, vals, visible)  # [B, T, H·D]
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # [B, H_kv, G·T, D]
    mask = visible.unsqueeze(1).expand(b, g, t, tr).reshape(b, 1, g * t, tr)  # [B, 1, G·T, T_read]
    # static: the device, the bucket's read length and the token count. A decode or verify step (any K,
    # any tree) takes the same path as AR in its bucket; a long prefill keeps the flash kernel, whose
    # [G·T, T_read] scores never materialise.
    if keys.device.type == "cpu" and tr >= MATH_READ_MIN and t <= MATH_TOKENS_MAX:
        out = _gemm_attention(qg, keys, vals, mask, scale)  # [B, H_kv, G·T, Dv]
    else:
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)  # [B, H_kv, G·T, Dv]
    return out.view(b, hkv, g, t, dv).permute(0, 3, 1, 2, 4).reshape(b, t, h * dv)


@pytree_dataclass
class TreeMask:
    """Tree attention for T queries (``funcspec.token_tree``): each sees the context and its own ancestors.

    The queries are still written at consecutive cache positions (``starts + t``,
    distinct per node); only RoPE and visibility follow the tree.

    Attributes:
        positions: [B, T] int64 RoPE positions (committed length + depth).
        base: [B] int64 first cache position of the tree: every query sees the context ``j < base``.
        ancestors: [B, T, M] bool: query t also sees cache position ``base + m`` (its ancestors and itself).
    """

    positions: torch.Tensor
    base: torch.Tensor
    ancestors: torch.Tensor


def visible_keys(pos: torch.Tensor, t_read: int, window=None, tree: Optional[TreeMask] = None) -> torch.Tensor:
    """[B, T, T_read] bool: which cache positions each query at cache position pos [B, T] reads.

    Causal on cache positions, or under ``tree`` the context plus the query's
    ancestors; a chain-shaped tree gives exactly the causal mask. ``window``: an
    int64 [B] first readable position per row (draft KV window).
    """
    j = torch.arange(t_read, device=pos.device).view(1, 1, -1)  # [1, 1, T_read]
    if tree is None:
        visible = j <= pos.unsqueeze(-1)  # [B, T, T_read]
    else:
        b, t, m = tree.ancestors.shape
        off = j - tree.base.view(-1, 1, 1)  # [B, 1, T_read]: offset into the tree
        hit = torch.gather(tree.ancestors, 2, off.clamp(0, m - 1).expand(b, t, t_read))  # [B, T, T_read]
        visible = (off < 0) | ((off < m) & hit)
    if window is not None:
        visible = visible & (j >= window.view(-1, 1, 1))
    return visible


def attention(cfg: ModelConfig, p: dict, kv: KVCache, layer: int, x, slots, pos, cos, sin, window=None,
              read: KVRead = FULL_READ, tree: Optional[TreeMask] = None):
    """Self-attention for x [B, T, H] written at cache positions pos [B, T]; returns [B, T, H].

    Keys are this slot's cache up to each query's own position (causal), so
    stale entries past a rolled-back length are never read; under ``tree``, the
    context and the query's ancestors (:func:`visible_keys`). ``window``, if
    given, is an int64 [B] first readable position per row (draft KV window).
    """
    q, k, v = attention_qkv(cfg, p, x, cos, sin)
    write_kv(kv.k, layer, slots, pos, k.to(kv.k.dtype))
    write_kv(kv.v, layer, slots, pos, v.to(kv.v.dtype))
    return attention_out(cfg, p, kv.k[layer], kv.v[layer], q, slots, pos, window, read, tree)


def attention_qkv(cfg: ModelConfig, p: dict, x, cos, sin):
    """q [B, T, H, D] and k, v [B, T, H_kv, D] of x [B, T, H], with RoPE (and Qwen3's q/k norms) applied."""
    q, k, v = cfg.ops.linears(x, [p["q_proj"], p["k_proj"], p["v_proj"]], p.get("qkv_proj"))
    q = q.unflatten(-1, (cfg.num_heads, cfg.head_dim))  # [B, T, H, D]
    k = k.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))  # [B, T, H_kv, D]
    v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))  # [B, T, H_kv, D]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"]["weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"]["weight"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_out(cfg: ModelConfig, p: dict, k_cache, v_cache, q, slots, pos, window=None,
                  read: KVRead = FULL_READ, tree: Optional[TreeMask] = None, visible: Optional[torch.Tensor] = None):
    """o_proj(attention of q [B, T, H, D] over one layer's caches [S+1, H_kv, T_max, D], already written); [B, T, H].
    ``visible`` [B, T, T_read]: the mask :func:`visible_keys` gives, when the caller has it already."""
    kv = KVCache(k_cache.unsqueeze(0), v_cache.unsqueeze(0), None)  # type: ignore[arg-type]  # lens unread; the layer's [1, S+1, H_kv, T_max, D]
    keys, vals = read_cache(kv.k, 0, slots, read), read_cache(kv.v, 0, slots, read)  # [B, H_kv, T_read, D]
    if visible is None:
        visible = visible_keys(pos, keys.shape[2], window, tree)  # [B, T, T_read]
    return row_parallel(cfg, attend(cfg.ops, q, keys, vals, visible), p["o_proj"])


def mlp(cfg: ModelConfig, p: dict, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward (gate/up column-parallel, down row-parallel under ``cfg.tp``)."""
    gate, up = cfg.ops.linears(x, [p["gate_proj"], p["up_proj"]], p.get("gate_up_proj"))
    return row_parallel(cfg, F.silu(gate) * up, p["down_proj"])


def feed_forward(cfg: ModelConfig, p: dict, x: torch.Tensor) -> torch.Tensor:
    """A layer's feed-forward over x [B, T, H]: a MoE where its params hold experts (a static property of the
    pytree, so dense and sparse layers are two compiled regions), else the dense :func:`mlp`."""
    if "experts" in p:
        return moe.sparse_block(cfg.moe, cfg.ops, p, x, lambda q, y: mlp(cfg, q, y), cfg.tp)
    return mlp(cfg, p, x)


def decoder_layer(cfg, p, kv, layer, x, slots, pos, cos, sin, window=None, read: KVRead = FULL_READ,
                  attn_in: Optional[torch.Tensor] = None, tree: Optional[TreeMask] = None):
    """One pre-norm decoder block over the residual stream x [B, T, H].

    ``attn_in`` replaces the attention's input ``input_layernorm(x)``: EAGLE
    heads feed it other features ([B, T, 2H] for EAGLE-3's midlayer).
    ``tree``: tree attention (:class:`TreeMask`) instead of causal.
    """
    if attn_in is None:
        attn_in = rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps)
    h = x + attention(cfg, p["self_attn"], kv, layer, attn_in, slots, pos, cos, sin, window, read, tree)
    return h + feed_forward(cfg, p["mlp"], rms_norm(h, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps))


def stacked_layer(cfg, p, kv, layer, x, slots, pos, cos, sin, window=None, read: KVRead = FULL_READ,
                  tree: Optional[TreeMask] = None, visible: Optional[torch.Tensor] = None):
    """:func:`decoder_layer` ``layer`` of a stack whose layers share one shape; compiled once per stack.
    ``visible``: the attention mask (:func:`shared_visible`), else built from pos, window and tree.

    NOTE: under ``torch.compile`` a layer is two calls of ``nested_compile_region``
    functions, :func:`_qkv_region` (norm, q/k/v, RoPE) and :func:`_out_region`
    (attention, o_proj, MLP), with the cache writes between them in the step's
    own graph: inductor lowers and compiles one layer and calls it L times,
    instead of compiling L copies, which cuts a cold compile by half or more.
    The writes stay outside the regions because a region that mutates its cache
    views is functionalised: from a few hundred cache positions on, inductor
    cloned the layer's whole K and V caches into the region and copied them
    back, every layer of every step (figures: graphs/results/notes/code-notes.md).
    The out region only reads the views ``kv.k[layer]``, ``kv.v[layer]``.
    Eager (and device graphs captured from eager) calls the layer directly.
    """
    if not torch.compiler.is_compiling():
        return decoder_layer(cfg, p, kv, layer, x, slots, pos, cos, sin, window, read, tree=tree)
    statics = (_constants(cfg), _constants(read))
    if visible is None:
        visible = shared_visible(kv, pos, window, read, tree)
    p = _formats_as_constants(p)
    q, k, v = _qkv_region(statics, p, x, cos, sin).split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=2)
    write_kv(kv.k, layer, slots, pos, k.to(kv.k.dtype))
    write_kv(kv.v, layer, slots, pos, v.to(kv.v.dtype))
    return _out_region(statics, p, kv.k[layer], kv.v[layer], q, x, slots, visible)


def shared_visible(kv: KVCache, pos: torch.Tensor, window, read: KVRead, tree: Optional[TreeMask]):
    """The mask [B, T, T_read] every layer's attention reads (:func:`visible_keys`), built once a step when compiled
    (a region that builds it is one more kernel and buffer per layer); ``None`` eager, where each layer builds its
    own."""
    if not torch.compiler.is_compiling():
        return None
    return visible_keys(pos, kv.k.shape[3] if read.length is None else read.length, window, tree)


def _formats_as_constants(p):
    """A layer's params with each quantized linear's ``format`` (a frozen dataclass) as the tuple of its values,
    for the same reason as the static config (:func:`_qkv_region`); :func:`_formats_back` undoes it."""
    if not isinstance(p, dict):
        return p
    return {k: _constants(v) if k == "format" else _formats_as_constants(v) for k, v in p.items()}


def _formats_back(p):
    if not isinstance(p, dict):
        return p
    return {k: QuantFormat(*v) if k == "format" else _formats_back(v) for k, v in p.items()}


def _constants(config):
    """A frozen dataclass as nested tuples of its field values (what Dynamo can fingerprint)."""
    if dataclasses.is_dataclass(config):
        return tuple(_constants(getattr(config, f.name)) for f in dataclasses.fields(config))
    return config


def _field_classes(cls) -> dict:
    """{dataclass: per field, the dataclass it holds (its default is one) or ``None``}, for cls and what it nests."""
    nested = tuple(type(f.default) if dataclasses.is_dataclass(f.default) else None for f in dataclasses.fields(cls))
    out = {cls: nested}
    for sub in filter(None, nested):
        out |= _field_classes(sub)
    return out


def _from_constants(cls, values: tuple):
    """Inverse of :func:`_constants`.

    NOTE: reads the field classes from a table built at import, because Dynamo
    cannot run ``dataclasses.fields`` inside a compile region.
    """
    return cls(*(v if sub is None else _from_constants(sub, v) for sub, v in zip(_REGION_FIELDS[cls], values)))


_REGION_FIELDS = _field_classes(ModelConfig) | _field_classes(KVRead)


@torch.compiler.nested_compile_region
def _qkv_region(statics: tuple, p, x, cos, sin):
    """A layer's q [B, T, H, D], k, v [B, T, H_kv, D] from its input x [B, T, H] (see :func:`stacked_layer`).

    NOTE: the static config comes in as tuples of Python constants: Dynamo
    reuses a region only when it can fingerprint every argument, and a
    dataclass argument made it trace a fresh copy per call site (then inline it,
    its cache writes becoming copies of the whole stack's cache); so the attention's mask comes in as a tensor
    (``visible``), and quantized linears' formats as tuples, too.
    """
    cfg, p = _from_constants(ModelConfig, statics[0]), _formats_back(p)
    h = rms_norm(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps)
    q, k, v = attention_qkv(cfg, p["self_attn"], h, cos, sin)
    # NOTE: one output tensor: with q, k, v as three outputs (v a view of the fused product) the compiled
    # step read wrong values (torch 2.13 CPU: greedy tokens went to 0 after the first)
    return torch.cat([q, k, v], dim=2)  # [B, T, H + 2 H_kv, D]


@torch.compiler.nested_compile_region
def _out_region(statics: tuple, p, k_cache, v_cache, q, x, slots, visible):
    """The rest of a layer once its caches [S+1, H_kv, T_max, D] hold this step's k, v: x + attention over
    ``visible`` [B, T, T_read], + MLP."""
    cfg, read = _from_constants(ModelConfig, statics[0]), _from_constants(KVRead, statics[1])
    p = _formats_back(p)
    h = x + attention_out(cfg, p["self_attn"], k_cache, v_cache, q, slots, None, read=read, visible=visible)
    return h + feed_forward(cfg, p["mlp"], rms_norm(h, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps))


def activation_ref(params) -> torch.Tensor:
    """A float tensor of ``params`` (the first, in pytree order) that is not a quantized linear's scale or offset:
    its dtype and device are the activations'. Scales are fp16 whatever the model runs in."""
    def floats(node):
        if isinstance(node, dict):
            quantized = "qweight" in node
            return [x for k, v in node.items() if not (quantized and k in ("scales", "offsets")) for x in floats(v)]
        if isinstance(node, (list, tuple)):
            return [x for v in node for x in floats(v)]
        return [node] if isinstance(node, torch.Tensor) and node.is_floating_point() else []

    found = floats(params)
    if not found:
        raise ValueError("params hold no float tensor outside quantized linears: the activation dtype is unknown")
    return found[0]


def rope_tables(cfg: ModelConfig, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, 1, D] for positions pos [B, T]."""
    freqs = pos.unsqueeze(-1).float() * rope_inv_freq(cfg, pos.device)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, D]
    a = rope_attention_factor(cfg)
    if a != 1.0:
        return (emb.cos() * a).to(dtype), (emb.sin() * a).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def capture_index(layer: int, num_layers: int) -> int:
    """:func:`forward`'s hidden index of vLLM's auxiliary capture id ``layer`` (the residual stream entering
    that layer, for a target of ``num_layers``): the same index, except that id L (after the last layer,
    before the final norm; HF has no such index) is ``L + 1``, since funcspec's ``L`` is the normed state."""
    return num_layers + 1 if layer == num_layers else layer


def lm_head(cfg: ModelConfig, params: dict) -> dict:
    """The output projection's params: ``weight`` [V, H] (the embedding when tied; ``prepare_params`` gives a
    tied model an ``lm_head`` entry holding it, with its packed copy)."""
    if "lm_head" in params:
        return params["lm_head"]
    return {"weight": params["model"]["embed_tokens"]["weight"]}


def forward(cfg: ModelConfig, params: dict, kv: KVCache, tokens: torch.Tensor, slots: torch.Tensor,
            starts: torch.Tensor, hidden_layers: tuple[int, ...] = (), read: KVRead = FULL_READ,
            window: Optional[torch.Tensor] = None, tree: Optional[TreeMask] = None, layer=None):
    """Run the decoder over tokens [B, T] written at cache positions ``starts[b] + t``.

    Args:
        tokens: [B, T] int64.
        slots: [B] int64 KV slot per row (padding rows use the scratch slot S).
        starts: [B] int64 first position per row.
        hidden_layers: static HF ``hidden_states`` indices to return: ``i < L`` is
            the input of layer ``i`` (0 = embeddings), ``L`` the final normed state,
            ``L + 1`` the last layer's output before the final norm (:func:`capture_index`).
        read: how attention reads the cache (static; see :class:`KVRead`).
        window: [B] int64 first readable position per row (a draft model's KV
            window, :func:`window_start`), or ``None``.
        tree: a token tree's attention (:class:`TreeMask`): RoPE at its
            positions, each token seeing the context and its ancestors; ``None``
            is causal, RoPE at the cache positions.
        layer: the family's block, ``layer(cfg, p, kv, i, x, slots, pos, cos, sin, window, read, tree=tree)``
            (default :func:`stacked_layer`; the DeepSeek families pass theirs).

    Returns:
        logits [B, T, V] float32, hiddens (tuple of [B, T, H]), kv.

    Donates: kv.k, kv.v (``kv.lens`` is untouched; the caller commits lengths).
    """
    m = params["model"]
    pos = starts.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
    x = m["embed_tokens"]["weight"][tokens]  # [B, T, H]
    cos, sin = rope_tables(cfg, pos if tree is None else tree.positions, x.dtype)
    hiddens = {}
    layer = layer or functools.partial(stacked_layer, visible=shared_visible(kv, pos, window, read, tree))
    for i, p in enumerate(m["layers"]):
        if i in hidden_layers:
            hiddens[i] = x
        x = layer(cfg, p, kv, i, x, slots, pos, cos, sin, window, read, tree=tree)
    hiddens[cfg.num_layers + 1] = x
    x = rms_norm(x, m["norm"]["weight"], cfg.rms_norm_eps)
    hiddens[cfg.num_layers] = x
    logits = cfg.ops.linear(x, lm_head(cfg, params)).float()  # [B, T, V]
    return logits, tuple(hiddens[i] for i in hidden_layers), kv
