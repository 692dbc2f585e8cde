"""N-gram (prompt-lookup) drafting as static-shape tensor ops over the token history.

Semantics follow vLLM's ``NgramProposer`` (``_find_longest_matched_ngram_and_propose_tokens``,
which runs KMP on the reversed history). For one row with valid tokens ``x[0:N]``:

1. Find the longest n in [n_min, n_max] such that the suffix ``x[N-n:N]`` also occurs at
   some earlier start ``s < N-n`` (occurrences may overlap the suffix; the suffix itself
   does not count).
2. Among the occurrences of that longest n-gram, take the one with the smallest start.
3. Draft ``x[s+n : s+n+m]`` with ``m = min(K, N - (s+n), max_model_len - N)``: the
   continuation is read from the valid history only, so it may run into the suffix region
   and may be shorter than K.
4. Rows with ``N < n_min``, no match, or ``m <= 0`` draft nothing.

With a token tree (:func:`ngram_tree`), the continuations of the best several
matches are merged into a trie, so the drafts branch where the history goes on
in more than one way; the chain above is the tree's rank-0 path.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from funcspec.constants import constant
from funcspec.proposers import keep_state, no_prefill
from funcspec.token_tree import Chain, TokenTree, static_parents
from funcspec.types import PLACEHOLDER, Proposal


def _check_window(n_min: int, n_max: int) -> None:
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n_min/n_max: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")


def match_runs(history: torch.Tensor, n_tok: torch.Tensor, n_max: int) -> torch.Tensor:
    """run [B, T]: how many tokens ending at each position e equal the row's last ones, capped at ``n_max``.

    ``run[b, e]`` counts ``x[e] == suf[0], x[e-1] == suf[1], ...`` before the first
    mismatch (``suf[t] = x[N-1-t]``), and is 0 at every e that is not an *earlier*
    occurrence (e > N-2, which also masks the garbage tail). See :func:`ngram_propose`.
    """
    B, T = history.shape
    pos = torch.arange(T, device=history.device)  # [T]
    # suf[:, t] is the t-th token counting back from the row's last valid one.
    back = (n_tok[:, None] - 1 - torch.arange(n_max, device=history.device)).clamp(0, T - 1)  # [B, n_max]
    suf = history.gather(1, back)  # [B, n_max]

    # NOTE: a Python loop over the (static) n-gram length keeps memory at O(B*T) instead
    # of materialising [B, n_max, T]; the unrolled compares are elementwise, so inductor
    # can fuse them.
    alive = torch.ones(B, T, dtype=torch.bool, device=history.device)  # [B, T]
    run = torch.zeros(B, T, dtype=torch.int64, device=history.device)  # [B, T]
    for t in range(min(n_max, T)):
        shifted = F.pad(history[:, : T - t], (t, 0), value=PLACEHOLDER)  # [B, T]: x[e - t]
        # alive[b, e]: x[e - t'] == suf[t'] for every t' <= t (and e - t is a real index).
        alive = alive & (shifted == suf[:, t : t + 1]) & (pos >= t)
        run = run + alive.long()
    earlier = pos[None, :] <= n_tok[:, None] - 2  # [B, T]
    return torch.where(earlier, run, 0)


def ngram_propose(
    history: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    n_min: int,
    n_max: int,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose up to ``k`` draft tokens per row by n-gram lookup in the row's own history.

    Algorithm, vectorised over rows and candidate positions: let ``suf[t] = x[N-1-t]`` be
    the row's tokens read backwards from its last one. For every end position ``e``,
    ``run(e)`` counts how many of ``x[e], x[e-1], ...`` equal ``suf[0], suf[1], ...``
    before the first mismatch, capped at ``n_max`` (built by ``n_max`` shifted compares
    ANDed together). An n-gram equal to the suffix ends at ``e`` iff ``run(e) >= n``, and it
    is an *earlier* occurrence iff ``e <= N-2``. So the longest match length is
    ``L = max_{e <= N-2} run(e)``, the earliest occurrence of it ends at the smallest
    ``e`` with ``run(e) >= L``, and the draft starts at ``e + 1``. This is exactly what
    vLLM's KMP computes (see the module docstring), without its data-dependent loop.

    Args:
        history: [B, T] int64 prompt + generated tokens; entries at index >= lens[b]
            are garbage and never read into the result.
        lens: [B] int64 number of valid tokens per row (0 <= lens[b] <= T).
        k: number of draft positions K (static).
        n_min: shortest n-gram that may match, >= 1 (vLLM ``prompt_lookup_min``).
        n_max: longest n-gram that is tried, >= n_min (vLLM ``prompt_lookup_max``).
        max_model_len: if given, no draft lands at position >= max_model_len, so a row
            drafts at most ``max_model_len - lens[b]`` tokens.

    Returns:
        drafts: [B, K] int64, ``PLACEHOLDER`` after the first ``num_valid[b]`` entries.
        num_valid: [B] int64 number of real drafts per row.
    """
    _check_window(n_min, n_max)
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    B, T = history.shape
    pos = torch.arange(T, device=history.device)  # [T]
    n_tok = lens.clamp(0, T)  # [B]
    run = match_runs(history, n_tok, n_max)  # [B, T]
    earlier = pos[None, :] <= n_tok[:, None] - 2  # [B, T]
    longest = run.amax(dim=1)  # [B]
    # NOTE: earliest hit via a masked min over positions rather than argmax, so ties are
    # broken the same way in eager and in every backend.
    hit = run >= longest[:, None]  # [B, T]
    first_end = torch.where(hit & earlier, pos, T).amin(dim=1)  # [B]
    start = first_end + 1  # [B] first drafted position

    num_valid = (n_tok - start).clamp(max=k)  # [B] continuation stops at the valid end
    if max_model_len is not None:
        num_valid = torch.minimum(num_valid, max_model_len - n_tok)  # [B]
    num_valid = torch.where(longest >= n_min, num_valid.clamp(min=0), 0)  # [B]

    offs = torch.arange(k, device=history.device)  # [K]
    idx = (start[:, None] + offs).clamp(max=T - 1)  # [B, K]
    drafts = history.gather(1, idx)  # [B, K]
    drafts = torch.where(offs < num_valid[:, None], drafts, PLACEHOLDER)  # [B, K]
    return drafts, num_valid


MATCHES_PER_NODE = 4
"""A tree of N nodes is built from the best ``min(T, 4·N)`` matches: many matches repeat one continuation."""


def ngram_trie(history: torch.Tensor, lens: torch.Tensor, m: int, depth: int, n_min: int, n_max: int,
               max_model_len: int | None = None):
    """The continuations of each row's ``m`` best earlier matches, merged into a trie.

    Matches are ranked as vLLM ranks them, longer first (``run``, capped at
    ``n_max``, at least ``n_min``), then the earlier end; match 0 is the one
    :func:`ngram_propose` continues. Each match continues for up to ``depth``
    tokens from the valid history (and below ``max_model_len``). Trie node
    (j, d), the d-th continuation token of match j, is *canonical* when no
    better match has the same tokens through depth d; siblings (canonical
    nodes sharing the path through d-1) are ranked by their best match, so
    rank 0 at every depth follows match 0 (the chain).

    Returns:
        cont: [B, M, D] int64 continuation tokens (``PLACEHOLDER`` where invalid).
        node: [B, M, D] bool: (j, d) is a canonical trie node.
        canon: [B, M, D] int64: the best match with j's tokens through depth d
            (node (j, d)'s parent is (canon[j, d-1], d-1); depth 0's is the root).
        rank: [B, M, D] int64: node (j, d)'s rank among its siblings.
        support: [B, M, D] int64: how many matches go through node (j, d), those
            of the longest n-gram counted ``m + 1`` times (they are what vLLM trusts).
    """
    B, T = history.shape
    dev = history.device
    pos = torch.arange(T, device=dev)  # [T]
    n_tok = lens.clamp(0, T)  # [B]
    run = match_runs(history, n_tok, n_max)  # [B, T]
    # NOTE: distinct scores (one per end position) make topk's order exact, with no ties to break.
    score = torch.where(run >= n_min, run * (T + 1) + (T - pos), -1)  # [B, T]
    best, end = torch.topk(score, m, dim=1)  # [B, M] best first
    offs = torch.arange(depth, device=dev)  # [D]
    at = end.unsqueeze(-1) + 1 + offs  # [B, M, D] history positions of each continuation
    valid = (best >= 0).unsqueeze(-1) & (at < n_tok.view(B, 1, 1))  # [B, M, D]
    if max_model_len is not None:
        valid = valid & (offs < (max_model_len - n_tok).view(B, 1, 1))  # the d-th draft lands at n_tok + d
    cont = history.gather(1, at.clamp(max=T - 1).view(B, m * depth)).view(B, m, depth)
    cont = torch.where(valid, cont, PLACEHOLDER)  # [B, M, D]

    # same[b, j, i, d]: matches j and i agree (and are valid) on depths 0..d.
    agree = (cont.unsqueeze(2) == cont.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)  # [B, M, M, D]
    same = agree.long().cumprod(-1).bool()  # [B, M, M, D]
    canon = same.long().argmax(2)  # [B, M, D]: the first i that agrees with j through d
    ids = torch.arange(m, device=dev).view(1, m, 1)
    node = valid & (canon == ids)  # [B, M, D]
    # share[b, j, i, d]: j and i have the same parent path (depth 0: the root, shared by all).
    share = torch.cat([torch.ones_like(same[..., :1]), same[..., :-1]], -1)  # [B, M, M, D]
    better = torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1).view(1, m, m, 1)  # [1, M, M, 1]: i < j
    rank = (share & node.unsqueeze(1) & better).sum(2)  # [B, M, D]
    longest = run.amax(1, keepdim=True)  # [B, 1]
    weight = torch.where(torch.gather(run, 1, end) == longest, m + 1, 1)  # [B, M]
    support = (same.long() * weight.view(B, 1, m, 1)).sum(2)  # [B, M, D]
    return cont, node, canon, rank, support


def ngram_tree(history: torch.Tensor, lens: torch.Tensor, tree, n_min: int, n_max: int,
               max_model_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree of n-gram drafts: where the history continues a matched suffix in
    several ways, the tree branches (``funcspec.token_tree`` layout).

    - a static ``TokenTree``: node ``(r1, .., rd)`` takes the rd-th distinct
      token after the path (r1 .. r(d-1)), ranked by :func:`ngram_trie`'s
      match order; ``(0, .., 0)`` is :func:`ngram_propose`'s chain.
    - a ``DynamicTree``: the N trie nodes that most matches go through
      (matches of the longest n-gram first), at most ``topk`` children per
      node and ``num_steps`` deep; a chain at ``topk = 1``.

    Nodes that the history does not offer are ``PLACEHOLDER`` (never accepted).

    Returns:
        tokens: [B, N] int64 drafts.
        parents: [B, N] int64 parent node (-1: the pending token).
    """
    _check_window(n_min, n_max)
    B, T = history.shape
    n, d = tree.size, tree.depth
    m = min(T, MATCHES_PER_NODE * n)
    cont, node, canon, rank, support = ngram_trie(history, lens, m, d, n_min, n_max, max_model_len)  # [B, M, D]
    if isinstance(tree, TokenTree):
        return _static_nodes(tree, cont, node, canon, rank)
    return _most_supported(tree, cont, node, canon, rank, support)


def _static_nodes(tree: TokenTree, cont, node, canon, rank):
    """A static tree's nodes from the trie: node i holds the match whose rank path is ``tree.paths[i]``."""
    B, m, d = cont.shape
    dev = cont.device
    # path[b, j, e]: the rank of match j's ancestor at depth e (its own rank at its canonical depths).
    path = torch.gather(rank.transpose(1, 2), 2, canon.transpose(1, 2)).transpose(1, 2)  # [B, M, D]
    want = constant([p + (-1,) * (d - len(p)) for p in tree.paths], device=dev)  # [N, D]
    last = constant([len(p) - 1 for p in tree.paths], device=dev)  # [N] each node's depth index
    upto = torch.arange(d, device=dev).view(1, d) <= last.view(-1, 1)  # [N, D]
    on_path = ((path.unsqueeze(1) == want.view(1, -1, 1, d)) | ~upto.view(1, -1, 1, d)).all(-1)  # [B, N, M]
    at_depth = node.gather(2, last.view(1, 1, -1).expand(B, m, -1)).transpose(1, 2)  # [B, N, M]
    hit = on_path & at_depth  # [B, N, M]: at most one match per node (canonical nodes are unique)
    tok = cont.gather(2, last.view(1, 1, -1).expand(B, m, -1)).transpose(1, 2)  # [B, N, M]
    tokens = torch.where(hit, tok, PLACEHOLDER).amax(-1)  # [B, N]
    return tokens, static_parents(tree, B, dev)


def _most_supported(tree, cont, node, canon, rank, support):
    """A dynamic tree's nodes: the N trie nodes that the most matches go through (``topk`` children per
    node at most), ties to the shallower node, then the better match. A child never has more support
    than its parent, so the order puts parents first; where every match agrees the tree is the chain."""
    B, m, d = cont.shape
    dev = cont.device
    levels = [node[:, :, 0] & (rank[:, :, 0] < tree.topk)]  # [B, M] per depth
    for e in range(1, d):
        # NOTE: a node whose parent was cut goes too, so the kept set stays a tree.
        up = levels[-1].gather(1, canon[:, :, e - 1])  # [B, M]
        levels.append(node[:, :, e] & (rank[:, :, e] < tree.topk) & up)
    keep = torch.stack(levels, 1).view(B, d * m)  # [B, D·M] flat index e·M + j
    flat = torch.arange(d * m, device=dev)
    # NOTE: one integer key, distinct per node (the flat index breaks ties), so topk's order is exact.
    sup = support.transpose(1, 2).reshape(B, d * m)  # [B, D·M]
    key = torch.where(keep, sup * (d * m) + (d * m - 1 - flat), -1)  # [B, D·M]
    best, chosen = torch.topk(key, tree.size, dim=1)  # [B, N] best first: parents first
    real = best >= 0  # [B, N]
    tokens = torch.where(real, cont.transpose(1, 2).reshape(B, d * m).gather(1, chosen), PLACEHOLDER)  # [B, N]
    depth, j = chosen // m, chosen % m  # [B, N]
    up = canon.transpose(1, 2).reshape(B, d * m).gather(1, (depth - 1).clamp(min=0) * m + j)  # [B, N]
    parent_flat = torch.where(depth > 0, (depth - 1) * m + up, -1)  # [B, N]
    where = parent_flat.unsqueeze(-1) == chosen.unsqueeze(1)  # [B, N, N]: the parent among the chosen
    parents = torch.where(real & (depth > 0), where.long().argmax(-1), -1)  # [B, N]
    return tokens, parents


# ---------------------------------------------------------------- protocol

runs_on_host = False
prefill = no_prefill
commit = keep_state


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Static n-gram settings: ``prompt_lookup_min``/``max`` and the length cap."""

    n_min: int
    n_max: int
    max_model_len: int


def build(spec, target, ctx):
    """The static config; n-gram has no params."""
    return NgramConfig(spec.prompt_lookup_min, spec.prompt_lookup_max, ctx.max_model_len), None


def hidden_layers(cfg) -> tuple[int, ...]:
    """ngram reads no hidden states."""
    return ()


def init_state(cfg, params, num_slots, max_len):
    """N-gram reads the engine's token history and keeps no state."""
    return None


def propose(cfg: NgramConfig, params, state, ctx, k: int):
    """Drafts [B, K] from each row's history (prompt, output and the pending token);
    a token tree of K nodes when the bucket drafts one (``ctx.tree``)."""
    # NOTE: only the bucket's context is searched: every row's tokens lie below it.
    history = ctx.history[:, : ctx.read.length][ctx.slots]  # [B, T]
    if not isinstance(ctx.tree, Chain):
        tokens, parents = ngram_tree(history, ctx.lens + 1, ctx.tree, cfg.n_min, cfg.n_max, cfg.max_model_len)
        return Proposal(tokens, parents=parents), state
    drafts, _ = ngram_propose(history, ctx.lens + 1, k, cfg.n_min, cfg.n_max, cfg.max_model_len)
    return Proposal.chain(drafts), state
