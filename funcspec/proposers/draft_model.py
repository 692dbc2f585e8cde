"""``draft_model``: a separate small LM drafts K tokens autoregressively, inside the bucket graph.

The draft keeps its own KV cache (same slots and positions as the target) in
the state pytree. Drafts are sampled from the draft's distribution q, processed
with the row's own temperature / top-k / top-p, and q is returned so that
standard rejection sampling stays lossless; a greedy bucket drafts argmax
tokens and returns no q (deterministic drafts).

Draft KV window (``additional_config.draft_window_size`` W): every draft query
of a step reads positions >= ``nn.llama.window_start(n, W)`` = max(n - W, 0),
the rule every head shares.

Token trees (a K = N step drafts the bucket's ``StepContext.tree``: the engine's
tree cut to N nodes by ``EnginePlan.bucket_tree``): the draft runs over the tree level by level, static
(vLLM's) or EAGLE-2 dynamic (``tree_draft``, with its logits as the "feature"
each node passes to its children), and takes each node's top-k as children in
every sampling mode (deterministic drafts, as the tree verifier needs). Its
nodes' KV ends at the target's tree slots ``n + 1 + node``: a static tree writes
them there; a dynamic tree writes its frontiers at other slots, and moves the
kept ones there after the cut. ``commit`` then moves the accepted path's draft
KV into place, as the step does for the target. The path's deepest node may be
a leaf the draft never ran: the next first pass re-feeds it (see :func:`propose`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from funcspec import rng, sampling
from funcspec.checkpoints import load_model
from funcspec.checkpoints.tp import check_quantized, check_size, shard_config, shard_params
from funcspec.nn import KVCache, ModelConfig, forward, init_kv_cache
from funcspec.nn.llama import commit_path, move_entries, window_start
from funcspec.proposers import tree_draft
from funcspec.token_tree import Chain, TokenTree
from funcspec.pytree import pytree_dataclass
from funcspec.types import Proposal

runs_on_host = False


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
    """The draft network's static config."""

    model: ModelConfig
    window: Optional[int] = None  # additional_config.draft_window_size W


@pytree_dataclass
class DraftState:
    """kv: the draft's cache, [L_d, S+1, H_kv, T_max, D]; its lengths mirror the target's."""

    kv: KVCache


def build(spec, target, ctx):
    """Load ``speculative_config["model"]`` in the target's dtype; it must share the target's vocabulary."""
    if not spec.model:
        raise ValueError("speculative_config.model: method 'draft_model' needs a draft checkpoint path")
    draft = load_model(spec.model, dtype=target.params["model"]["embed_tokens"]["weight"].dtype, device=ctx.device)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(
            f"speculative_config.model: draft vocab_size {draft.cfg.vocab_size} != target vocab_size "
            f"{target.cfg.vocab_size}"
        )
    return DraftModelConfig(dataclasses.replace(draft.cfg, ops=target.cfg.ops), spec.draft_window_size), draft.params


def check_shard(cfg: DraftModelConfig, params, size: int, quantization=None) -> None:
    """Refuse a ``draft_tensor_parallel_size`` the draft model (quantized to ``quantization`` on load) cannot be
    split by."""
    field = "speculative_config.draft_tensor_parallel_size"
    check_size(cfg.model, size, "draft model", field)
    check_quantized(params, size, quantization, field)


def shard(cfg: DraftModelConfig, params, tp, quantization=None):
    """The draft model split across the target's tensor-parallel ranks like the target (its own all-reduces)."""
    return dataclasses.replace(cfg, model=shard_config(cfg.model, tp)), shard_params(params, tp, quantization)


def hidden_layers(cfg) -> tuple[int, ...]:
    """A draft model reads no target hidden states."""
    return ()


def init_state(cfg: DraftModelConfig, params, num_slots: int, max_len: int) -> DraftState:
    """The draft model's own zeroed KV cache for ``num_slots`` slots."""
    dtype = params["model"]["embed_tokens"]["weight"].dtype
    device = params["model"]["embed_tokens"]["weight"].device
    return DraftState(init_kv_cache(cfg.model, num_slots, max_len, dtype, device))


def prefill(cfg: DraftModelConfig, params, state: DraftState, tokens, slot: int, n: int, hiddens) -> DraftState:
    """Run the draft over the padded prompt tokens [1, T] of a new request. Donates: state.kv."""
    slots = torch.tensor([slot], device=tokens.device)
    _, _, kv = forward(cfg.model, params, state.kv, tokens, slots, torch.zeros_like(slots))
    return DraftState(kv)


def propose(cfg: DraftModelConfig, params, state: DraftState, ctx, k: int):
    """K autoregressive draft steps; returns tokens [B, K] and q [B, K, V].

    Donates: state.kv.
    """
    # NOTE: the first pass re-feeds the last committed token with the pending
    # one. When every draft was accepted last step, that committed token (the
    # last draft) was never run through the draft, so its KV is missing; when
    # it was, rewriting it recomputes the same K/V. Static shapes either way.
    start = (ctx.lens - 1).clamp(min=0)  # [B]
    cols = start.unsqueeze(1) + torch.arange(2, device=start.device)  # [B, 2]
    x = ctx.history[ctx.slots.unsqueeze(1), cols]  # [B, 2]
    window = window_start(ctx.lens, cfg.window)  # [B] or None: one start for every draft of this step
    logits, _, kv = forward(cfg.model, params, state.kv, x, ctx.slots, start, read=ctx.read, window=window)
    logits = logits[:, -1]  # [B, V]
    if not isinstance(ctx.tree, Chain):  # the bucket's tree: the engine's cut to N = K nodes
        # NOTE: lens + 1: the pending token sits at lens in the draft's cache, so its nodes start one later.
        drafter = tree_draft.Drafter(cfg.model, _tree_forward, _top_children)
        tree, base = ctx.tree, ctx.lens + 1  # [B]: node i's slot is base + i
        draft = tree_draft.draft_static if isinstance(tree, TokenTree) else tree_draft.draft_dynamic
        drafts, parents, kv, written = draft(drafter, tree, params, kv, logits, ctx.slots, base, window, ctx.read)
        if not isinstance(tree, TokenTree):
            # NOTE: each kept frontier node's KV to its node slot; leaves copy their own slot (no-op moves).
            node = torch.arange(tree.size, device=base.device)  # [N]
            src = base.unsqueeze(1) + torch.where(written >= 0, written, node)  # [B, N]
            move_entries(kv, ctx.slots, src, base.unsqueeze(1) + node)
        return Proposal(drafts, parents=parents), DraftState(kv)
    s = ctx.sampling
    tokens, probs = [], []
    for i in range(k):
        # [B], [B, V] (None when every row is greedy: the drafts are then deterministic)
        tok, q = sampling.draw(rng.fold_in(ctx.key, i), logits, s.temperature, s.top_k, s.top_p, ctx.mode)
        tokens.append(tok)
        probs.append(q)
        if i + 1 < k:
            step_logits, _, kv = forward(cfg.model, params, kv, tok.unsqueeze(1), ctx.slots, ctx.lens + 1 + i,
                                         read=ctx.read, window=window)
            logits = step_logits[:, 0]
    b, v = ctx.slots.shape[0], cfg.model.vocab_size
    if k == 0:
        return Proposal.chain(torch.zeros(b, 0, dtype=torch.int64, device=x.device),
                              None if ctx.mode.greedy else torch.zeros(b, 0, v, device=x.device)), DraftState(kv)
    return Proposal.chain(torch.stack(tokens, 1), None if ctx.mode.greedy else torch.stack(probs, 1)), DraftState(kv)


def _tree_forward(model, params, kv, tokens, feats, slots, starts, window, read, tree):
    """The draft over tree nodes tokens [B, T]; its logits [B, T, V] are what each node hands its children."""
    logits, _, kv = forward(model, params, kv, tokens, slots, starts, read=read, window=window, tree=tree)
    return logits, kv


def _top_children(model, params, logits, k: int):
    """The k most likely children [.., k] and their log-probabilities, from a node's logits [.., V]."""
    top = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    return top.indices, top.values


def commit(cfg: DraftModelConfig, state: DraftState, result) -> DraftState:
    """After a tree step, move the accepted path's draft KV into place; a chain's is already there.

    Donates: state.kv.
    """
    if not isinstance(result.tree, Chain):
        commit_path(state.kv, result.slots, result.lens, result.path)
    return state
