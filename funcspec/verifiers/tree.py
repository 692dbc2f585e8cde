"""Tree verification: accept the deepest root path of a token tree that the target agrees with (lossless).

A row's drafts are N nodes with parents (``funcspec.token_tree``): tree index 0
is the pending token, ``i + 1`` is node i, and the target's logits
``[B, N+1, V]`` were computed with tree attention, so index t holds the
target's next-token distribution after t's root path.

The rule, at each accepted node (starting at the root), with p the target's
processed distribution there (``sampling.target_probs``):

    draw y ~ p; accept the first child whose token is y, and go on from it;
    if no child holds y, emit y (the recovered token, or at a leaf the bonus).

This is EAGLE's tree sampler for deterministic top-k siblings (q one-hot at
each, and the drafts are argmax/top-k: ``Proposal.probs is None``) written as
one draw: trying children x1..xm in order, accepting xj with probability
``p(xj)`` under p with the earlier xi zeroed and renormalised, gives xj exactly
when ``y = xj`` (``P(y = xj | y ∉ {x1..x_{j-1}})``), and the token emitted after
m rejections is y conditioned on ``y ∉ {x1..xm}``: the renormalised residual.
Siblings that repeat a token are never accepted twice (only the first can be).
Greedy rows draw ``y = argmax p``, which is greedy tree verification: accept
the child equal to the target's argmax at its parent.

Randomness: y at a node of depth d is drawn with ``keys[:, d]``, the key that
autoregressive decoding draws that position with (``step.row_keys`` at the
committed length + d), by the same ``sampling.sample``. The nodes of one root
path have distinct depths, so its draws are independent; and the emitted tokens
are the ones decoding without speculation emits with the same seed, since each
is y at its position, drawn from the same distribution with the same key.
"""

from __future__ import annotations

import torch

from funcspec import sampling as sampling_lib
from funcspec.token_tree import ancestors, depths, root_path, tree_parents
from funcspec.types import PLACEHOLDER, Sampling
from funcspec.verifiers import common

def target_choices(keys: torch.Tensor, target_logits: torch.Tensor, sampling: Sampling, mode: sampling_lib.Mode,
                   dep: torch.Tensor) -> torch.Tensor:
    """y [B, N+1]: the target's draw at every tree index with its depth's key (argmax under a greedy ``mode``)."""
    node_keys = torch.gather(keys, 1, dep)  # [B, N+1]
    return sampling_lib.sample(node_keys, target_logits, sampling.temperature, sampling.top_k, sampling.top_p, mode)


def accepted_nodes(tok: torch.Tensor, tparents: torch.Tensor, y: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N+1] bool: tree indices whose whole root path is accepted (the root always is)."""
    n1 = tok.shape[1]
    hit = tok == torch.gather(y, 1, tparents)  # [B, N+1]: the token is the draw at its parent
    same = (tparents.unsqueeze(2) == tparents.unsqueeze(1)) & (tok.unsqueeze(2) == tok.unsqueeze(1))  # [B, N+1, N+1]
    earlier = torch.ones(n1, n1, dtype=torch.bool, device=tok.device).tril(-1)  # [N+1, N+1]: s < t
    first = ~(same & earlier).any(-1)  # [B, N+1]: no earlier sibling holds the same token
    ok = hit & first
    root = (torch.arange(n1, device=tok.device) == 0).expand_as(ok)  # [B, N+1]
    acc = root
    for _ in range(depth):  # depth (static) passes reach every accepted node
        acc = root | (ok & torch.gather(acc, 1, tparents))
    return acc


def verify(cfg, vin: common.VerifyInput) -> common.Verdict:
    """Verify a token tree of depth ``cfg.depth`` (static: no node is deeper).

    Reads ``vin.keys`` [B, D+1] (the key of each depth's draw: autoregressive
    decoding's key at that position), ``vin.logits`` [B, N+1, V] (the target
    over [pending, nodes] with tree attention) and the proposal's ``tokens [B, N]``
    (``PLACEHOLDER`` is never accepted) and ``parents [B, N]``, with
    ``probs=None``; greedy buckets (``cfg.greedy``) take argmax only.

    Returns tokens [B, D+1] int64 (the accepted path's drafts, the final token,
    then ``PLACEHOLDER``), num_emitted [B] int32, and path [B, D+1] the tree
    indices of the accepted path (root first; repeated past its end).
    """
    proposal, target_logits, keys, depth = vin.proposal, vin.logits, vin.keys, cfg.depth
    if proposal.parents is None or proposal.probs is not None:
        raise ValueError("a tree proposal needs parents [B, N] and deterministic drafts (probs=None)")
    b, n1, _ = target_logits.shape
    if tuple(proposal.tokens.shape) != (b, n1 - 1) or tuple(proposal.parents.shape) != (b, n1 - 1):
        raise ValueError(f"proposal.tokens and proposal.parents must be [B, N] = [{b}, {n1 - 1}] for "
                         f"target_logits {tuple(target_logits.shape)}, got {tuple(proposal.tokens.shape)} "
                         f"and {tuple(proposal.parents.shape)}")
    if keys is None or tuple(keys.shape) != (b, depth + 1):
        got = None if keys is None else tuple(keys.shape)
        raise ValueError(f"keys must be [B, D+1] = [{b}, {depth + 1}] (decoding's key per depth), got {got}")
    tparents = tree_parents(proposal.parents.long())  # [B, N+1]
    anc = ancestors(tparents, depth)  # [B, N+1, N+1]
    dep = depths(anc)  # [B, N+1]
    mode = sampling_lib.Mode(greedy=cfg.greedy, filters=cfg.filters)
    y = target_choices(keys, target_logits, vin.sampling, mode, dep)  # [B, N+1]
    tok = torch.cat([torch.full_like(proposal.tokens[:, :1], PLACEHOLDER), proposal.tokens.long()], 1)  # [B, N+1]
    acc = accepted_nodes(tok, tparents, y, depth)  # [B, N+1]
    best = torch.where(acc, dep, -1).argmax(-1)  # [B]: the deepest accepted node (one per depth at most)
    rows = torch.arange(b, device=best.device)
    path = root_path(anc, dep, best, depth)  # [B, D+1]
    out, n = common.emit(torch.gather(tok, 1, path[:, 1:]), dep[rows, best], y[rows, best])
    return out, n, path
