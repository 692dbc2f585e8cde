"""Token-tree drafting for the feature-chain heads (``chain.py``; not a method itself).

Both functions draft a given tree (the engine's, cut to the bucket's N nodes by
``token_tree.truncate``), start from the head's feature g [B, H] at the root (the
pending token's pair, after the catch-up; for a draft model, the pending token's
logits) and return ``(tokens [B, N], parents [B, N], kv, written [B, N])``
in the layout of ``funcspec.token_tree``; ``written`` is the head cache slot
(offset from ``n``) where each node's own KV was written, -1 for nodes the
head never ran (leaves), so that a draft model can move the accepted path's KV. A head call over tree nodes feeds each
node's token with its parent's feature, RoPE at ``n - 1 + depth`` (the chain's
position for that depth) and tree attention over the context and the node's
ancestors, which the head wrote at their own cache slots earlier in this step.

- :func:`draft_static`: vLLM's ``speculative_token_tree``, level by level; node i
  takes rank ``ranks[i]`` of its parent's drafts, and the level's nodes sit at
  head cache slots ``n + i``.
- :func:`draft_dynamic`: EAGLE-2 (Li et al. 2024). At each of ``num_steps``
  depths the ``topk`` frontier nodes are expanded by their ``topk`` best
  children, scored by cumulative draft log-probability; the ``topk`` best
  children form the next frontier. The ``num_draft_tokens - 1`` best of all
  candidates form the tree. Frontier d sits at head slots ``n + (d-1)·topk + j``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from funcspec.constants import constant
from funcspec.nn.llama import TreeMask
from funcspec.token_tree import ancestors, static_parents, tree_parents

@dataclasses.dataclass(frozen=True)
class Drafter:
    """What tree drafting calls (``chain.ChainConfig`` has the same fields); the tree is an argument.

    Attributes:
        head: the network's static config.
        forward: ``(head, params, kv, tokens [B, T], feats [B, T, F], slots, starts, window, read, tree=TreeMask)
            -> (out [B, T, F], kv)``: each node's output, handed to its children as ``feats``.
        draft_top: ``(head, params, out [.., F], k) -> (tokens [.., k], log-probabilities [.., k])``.
    """

    head: Any
    forward: Callable
    draft_top: Callable


DEPTH_PENALTY = 1e-3
"""Subtracted per depth from a candidate's score when the tree is cut (see :func:`draft_dynamic`)."""


def _run_level(cfg, params, kv, tokens, feats, slots, lens, first, depth: int, anc, window, read):
    """The head over one level's nodes tokens [B, T] with their parents' features feats [B, T, H],
    written at head slots ``lens + first + t``; -> (g [B, T, H], kv). Donates: kv."""
    positions = (lens - 1 + depth).unsqueeze(1).expand_as(tokens)  # [B, T]: the chain's RoPE at this depth
    mask = TreeMask(positions, lens, anc)
    return cfg.forward(cfg.head, params, kv, tokens, feats, slots, lens + first, window, read, tree=mask)


def draft_static(cfg, tree, params, kv, g, slots, lens, window, read):
    """Draft ``tree`` (a ``TokenTree``) from the root feature g [B, H]. Donates: kv."""
    parents = static_parents(tree, g.shape[0], g.device)  # [B, N]
    anc = ancestors(tree_parents(parents), tree.depth)[:, 1:, 1:]  # [B, N, N] among the nodes
    feats, prev = g.unsqueeze(1), range(-1, 0)  # [B, 1, H]: the root is level 0
    drafts = []
    for d in range(1, tree.depth + 1):
        level = tree.level(d)
        local = [tree.parents[i] - prev.start for i in level]  # each node's parent within the previous level
        ranks = [tree.ranks[i] for i in level]
        top, _ = cfg.draft_top(cfg.head, params, feats, max(ranks) + 1)  # [B, n_{d-1}, r]
        local, ranks = constant(local, device=g.device), constant(ranks, device=g.device)  # type: ignore[assignment]  # [n_d] each, as tensors
        drafts.append(top[:, local, ranks])  # [B, n_d]
        if d < tree.depth:
            feats, kv = _run_level(cfg, params, kv, drafts[-1], feats[:, local], slots, lens, level.start, d,
                                   anc[:, level.start:level.stop], window, read)  # [B, n_d, H]
        prev = level
    ran = [i if len(p) < tree.depth else -1 for i, p in enumerate(tree.paths)]  # the last level never runs
    written = constant(ran, device=g.device).expand(g.shape[0], tree.size)  # [B, N]
    return torch.cat(drafts, 1), parents, kv, written


def draft_dynamic(cfg, tree, params, kv, g, slots, lens, window, read):
    """Draft an EAGLE-2 tree (``tree``, a ``DynamicTree``) from the root feature g [B, H]. Donates: kv.

    NOTE: the cut ranks ``score - DEPTH_PENALTY·depth``: a child's score never
    exceeds its parent's, but ties (a draft probability of exactly 1 in fp32)
    could keep a child without its parent; the penalty breaks them towards the parent.
    """
    tr = tree
    k, b, dev = tr.topk, g.shape[0], g.device
    tok, score = cfg.draft_top(cfg.head, params, g, k)  # [B, k] depth 1
    pool_tok, pool_score, pool_parent = [tok], [score - DEPTH_PENALTY], [torch.full_like(tok, -1)]
    front, feats = torch.arange(k, device=dev).expand(b, k), g.unsqueeze(1).expand(b, k, g.shape[-1])  # [B, k]
    anc = torch.eye(k, (tr.num_steps - 1) * k, dtype=torch.bool, device=dev).expand(b, k, -1)  # [B, k, (S-1)k]
    size, ran = k, []  # ran: the pool indices of each frontier the head ran, [B, k] per depth
    for d in range(1, tr.num_steps):
        ran.append(front)
        gf, kv = _run_level(cfg, params, kv, tok, feats, slots, lens, (d - 1) * k, d, anc, window, read)  # [B, k, H]
        child, lp = cfg.draft_top(cfg.head, params, gf, k)  # [B, k, k]
        cand = (score.unsqueeze(-1) + lp).reshape(b, k * k)  # [B, k²] cumulative log-probabilities
        pool_tok.append(child.reshape(b, k * k))
        pool_score.append(cand - DEPTH_PENALTY * (d + 1))
        pool_parent.append(front.unsqueeze(-1).expand(b, k, k).reshape(b, k * k))
        best = torch.topk(cand, k, dim=-1).indices  # [B, k] the next frontier among the candidates
        src = best // k  # [B, k] its parents within this frontier
        tok, score, front = torch.gather(pool_tok[-1], 1, best), torch.gather(cand, 1, best), size + best
        feats = torch.gather(gf, 1, src.unsqueeze(-1).expand(-1, -1, gf.shape[-1]))  # [B, k, H]
        if d + 1 < tr.num_steps:
            own = torch.eye(k, (tr.num_steps - 1) * k, dtype=torch.bool, device=dev).roll(d * k, 1)  # [k, (S-1)k]
            anc = torch.gather(anc, 1, src.unsqueeze(-1).expand(-1, -1, anc.shape[-1])) | own
        size += k * k
    keep = torch.topk(torch.cat(pool_score, 1), tr.size, dim=-1).indices.sort(dim=-1).values  # [B, N]
    # NOTE: the pool is ordered by depth, so sorted pool indices put every parent before its children.
    parent = torch.gather(torch.cat(pool_parent, 1), 1, keep)  # [B, N] pool indices
    at = (parent.unsqueeze(-1) == keep.unsqueeze(1))  # [B, N, N]: where each parent sits among the kept
    parents = torch.where(parent < 0, -1, at.int().argmax(-1))
    written = -torch.ones_like(keep)  # [B, N]
    if ran:
        # frontier d's node j sits at head slot (d-1)·k + j (see _run_level's ``first``)
        hit = keep.unsqueeze(-1) == torch.cat(ran, 1).unsqueeze(1)  # [B, N, (S-1)k]
        written = torch.where(hit.any(-1), hit.int().argmax(-1), -1)
    return torch.gather(torch.cat(pool_tok, 1), 1, keep), parents, kv, written
