"""The feature-chain runtime that ``eagle``, ``eagle3`` and ``mtp`` share (not a method itself).

A feature-chain head reads (feature f_t, token x_{t+1}) at position t and
outputs a feature g_t whose logits guess x_{t+2}; drafting feeds g back as the
next feature. Positions are the target's. At propose time::

    committed  x_0 .. x_{n-1}   (n = lens: target KV, target features f_0 .. f_{n-1})
    pending    x_n = history[slot, n]   sampled from f_{n-1}, not yet run by the target

    catch-up   positions n-m .. n-1: (f_t, x_{t+1}) with the target's features
               -> g_{n-1} -> drafts[:, 0] (a guess of x_{n+1})
    step i>=1  position n+i-1: (g, drafts[:, i-1]) -> drafts[:, i]

Catch-up: the last verify ran the target over positions ℓ..ℓ+K and committed
m = num_emitted of them (ℓ + m = n). ``commit`` keeps those K+1 features and m
per slot; the next ``propose`` runs the head over max_k+1 positions from
ℓ = n - m, with tokens read from the history. That rewrites the draft KV the
previous draft steps left there (built from draft features) with real ones.
Entries at positions >= n are garbage that a later pass rewrites before any
query reads them: attention is causal on positions. This is vLLM's first
draft pass (verified tokens shifted left by one, rejected ones as padding),
kept at a static [B, max_k+1] shape.

Token trees (``ChainConfig.tree``): after the catch-up the head drafts the tree
level by level (:mod:`funcspec.proposers.tree_draft`, static or EAGLE-2
dynamic), with tree attention over its own drafts; a chain-shaped tree drafts
exactly what the chain loop does. A bucket of N nodes drafts the tree cut to N
(``StepContext.tree``, cut once per bucket by ``EnginePlan.bucket_tree``). The verified block is then the accepted
root path (at most D + 1 positions of the whole tree), so the catch-up covers D + 1
positions, not max_k + 1.

Each method's module loads its head and builds a :class:`ChainConfig` with
:func:`chain_config`; the protocol functions below are then the method's own.
Draft KV window (``additional_config.draft_window_size`` W): every draft query
reads positions >= ``nn.llama.window_start(n, W)`` = max(n - W, 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from funcspec.nn import init_kv_cache
from funcspec.nn.llama import KVCache, ModelConfig, activation_ref, window_start
from funcspec.proposers import tree_draft
from funcspec.token_tree import Chain, DynamicTree, TokenTree
from funcspec.pytree import pytree_dataclass, slot_field
from funcspec.types import Proposal


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """Static config of a feature-chain proposer.

    Attributes:
        head: the head network's static config.
        features: ``(head, params, feats [.., F]) -> [.., H]``, the target features as head input.
        forward: ``(head, params, kv, tokens [B, T], h [B, T, H], slots, starts, window, read, tree=None)
            -> (g [B, T, H], kv)``; ``tree``: a ``nn.llama.TreeMask`` over the head's own tree drafts.
        draft: ``(head, params, g [B, H]) -> [B]`` greedy target-vocabulary ids.
        draft_top: ``(head, params, g [.., H], k) -> (ids [.., k], log-probabilities [.., k])``, the k
            best target ids (tree children, best first) and their EAGLE-2 scores.
        model: the head's decoder dims (its KV cache's shape).
        max_k: the largest K of any bucket.
        hidden_layers: the target hidden states it reads (concatenated: F = len · H_target).
        feat_dim: F.
        window: the draft KV window W, or ``None``.
        tree: the engine's token tree (static or EAGLE-2 dynamic), or ``None`` (a chain); a step of
            K = N drafts it cut to N nodes, and its depth sizes the catch-up block.
    """

    head: Any
    features: Callable
    forward: Callable
    draft: Callable
    draft_top: Callable
    model: ModelConfig
    max_k: int
    hidden_layers: tuple[int, ...]
    feat_dim: int
    window: Optional[int] = None
    tree: Optional[TokenTree | DynamicTree] = None

    @property
    def block(self) -> int:
        """Positions of the largest verified block: max_k + 1, or a tree's depth + 1."""
        return self.max_k + 1 if self.tree is None else self.tree.depth + 1


@pytree_dataclass
class ChainState:
    """Per-slot state of a feature-chain proposer.

    Attributes:
        kv: the head's KV cache, as its block's family declares it (``funcspec.nn.init_kv_cache``: GQA's
            [L_d, S+1, H_kv, T_max, D], an MLA block's latent); its ``lens`` is unused.
        feats: [S+1, block, F] target features of each slot's last verified block.
        count: [S+1] int64 how many positions of that block were committed (num_emitted).
    """

    kv: KVCache
    feats: torch.Tensor = slot_field()
    count: torch.Tensor = slot_field()


def chain_config(head, module, spec, target, hidden_layers) -> ChainConfig:
    """A :class:`ChainConfig` for ``head`` (with a ``.model``) whose network functions live in ``module``."""
    return ChainConfig(head, module.target_features, module.forward, module.draft_tokens, module.draft_top,
                       head.model, spec.num_speculative_tokens, tuple(hidden_layers),
                       len(hidden_layers) * target.cfg.hidden_size, spec.draft_window_size,
                       spec.tree)


def hidden_layers(cfg: ChainConfig) -> tuple[int, ...]:
    """The target hidden states the head reads (concatenated as its features)."""
    return cfg.hidden_layers


def init_state(cfg: ChainConfig, params, num_slots: int, max_len: int) -> ChainState:
    """Zeroed head KV cache (the block family's own, from ``funcspec.nn.init_kv_cache``), staged features
    [S+1, block, F] and staged counts."""
    ref = activation_ref(params)
    return ChainState(
        init_kv_cache(cfg.model, num_slots, max_len, ref.dtype, ref.device),
        torch.zeros(num_slots + 1, cfg.block, cfg.feat_dim, dtype=ref.dtype, device=ref.device),
        torch.zeros(num_slots + 1, dtype=torch.int64, device=ref.device),
    )


def prefill(cfg: ChainConfig, params, state: ChainState, tokens, slot: int, n: int, hiddens) -> ChainState:
    """Run the head over the prompt's pairs (f_t, x_{t+1}); keep f_{n-1} for the first catch-up.

    tokens [1, T] (the padded prompt), hiddens: the target's states [1, T, H] of
    ``hidden_layers``. Pairs from position n-1 on are garbage (x_n is not
    sampled yet); the first catch-up rewrites n-1. Donates: state.
    """
    feats = torch.cat(hiddens, -1)  # [1, T, F]
    nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)  # [1, T] x_{t+1}
    slots = torch.tensor([slot], device=tokens.device)
    h = cfg.features(cfg.head, params, feats)  # [1, T, H]
    _, kv = cfg.forward(cfg.head, params, state.kv, nxt, h, slots, torch.zeros_like(slots))
    state.feats[slot, 0] = feats[0, n - 1]
    state.count[slot] = 1
    return ChainState(kv, state.feats, state.count)


def propose(cfg: ChainConfig, params, state: ChainState, ctx, k: int):
    """Catch up on the last verified block, then K greedy draft steps; returns tokens [B, K].

    With a tree, the K = N drafts are the nodes of the tree cut to N, and the proposal carries their parents.
    Donates: state.kv.
    """
    slots, lens = ctx.slots, ctx.lens  # [B], [B]
    b = slots.shape[0]
    rows = torch.arange(b, device=slots.device)
    # NOTE: clamps keep padding rows (scratch slot, lens 0) in bounds; real rows never need them.
    start = (lens - state.count[slots]).clamp(min=0)  # [B] first position of the last verified block
    pos = start.unsqueeze(1) + torch.arange(cfg.block, device=slots.device)  # [B, block]
    tokens = ctx.history[slots.unsqueeze(1), pos + 1].clamp(min=0)  # [B, block] x_{t+1}
    h = cfg.features(cfg.head, params, state.feats[slots])  # [B, block, H]
    window = window_start(lens, cfg.window)  # [B] or None
    g, kv = cfg.forward(cfg.head, params, state.kv, tokens, h, slots, start, window, ctx.read)  # [B, block, H]
    g = g[rows, (lens - 1 - start).clamp(0, cfg.block - 1)]  # [B, H] at position lens-1
    if not isinstance(ctx.tree, Chain):  # the bucket's tree: the engine's cut to N = K nodes
        draft = tree_draft.draft_static if isinstance(ctx.tree, TokenTree) else tree_draft.draft_dynamic
        # NOTE: the head re-runs the verified block next step, so where its tree KV was written does not matter.
        drafts, parents, kv, _ = draft(cfg, ctx.tree, params, kv, g, slots, lens, window, ctx.read)
        return Proposal(drafts, parents=parents), ChainState(kv, state.feats, state.count)
    drafts = []
    for i in range(k):
        drafts.append(cfg.draft(cfg.head, params, g))  # [B]
        if i + 1 < k:
            g, kv = cfg.forward(cfg.head, params, kv, drafts[-1].unsqueeze(1), g.unsqueeze(1), slots, lens + i,
                                window, ctx.read)
            g = g[:, 0]
    out = torch.stack(drafts, 1) if drafts else torch.zeros(b, 0, dtype=torch.int64, device=slots.device)
    return Proposal.chain(out), ChainState(kv, state.feats, state.count)


def commit(cfg: ChainConfig, state: ChainState, result) -> ChainState:
    """Keep the verified block's target features [B, K+1, F] (tree: the accepted path's) and num_emitted per slot.

    Donates: state.feats, state.count.
    """
    feats = torch.cat(result.hiddens, -1)  # [B, K+1, F]
    cols = torch.arange(feats.shape[1], device=feats.device)  # [K+1]
    state.feats.index_put_((result.slots.unsqueeze(1), cols.unsqueeze(0)), feats.to(state.feats.dtype))
    state.count.index_put_((result.slots,), result.num_emitted.to(torch.int64))
    return ChainState(state.kv, state.feats, state.count)
