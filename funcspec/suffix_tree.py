"""Suffix decoding (arXiv 2411.04975): the host-side cache of suffix trees (a data structure, not a proposer).

A pure-Python equivalent of ``arctic_inference.suffix_decoding.SuffixDecodingCache``
(arctic-inference 0.3.0), in path mode and in tree mode (``use_tree_spec``), plus
funcspec's token-tree shapes (``tree=``). It keeps two kinds of tree:

- a *local* tree per active request, over its prompt plus the tokens generated so far;
- one *global* tree over the responses (not prompts) of past and active requests,
  keyed by request id and evicted FIFO beyond ``max_cached_requests``.

Both trees propose a draft for the last tokens of the context and the higher score wins.

Glossary:
  suffix   the tokens of a sequence from some start position, truncated to
           ``max_tree_depth`` tokens; every suffix of every stored sequence is a path
           from the root.
  count    how many stored suffixes pass through or end at a node.
  order    a node's children by non-increasing count; the head is what path mode follows.
  draft    what one speculation returns: a chain (path mode) or a token tree whose
           nodes come parents first (tree modes).

NOTE: arctic stores a path-compressed tree; this one is an uncompressed trie. Both give
the same counts per token position, and a compressed node's inner tokens are exactly the
trie nodes whose only child has the same count, so the drafts agree token for token.
NOTE: probabilities, scores and the draft-length cap are computed in float32, as arctic's
C++ does, so that ties and ``min_token_prob`` cut-offs land exactly where arctic's do.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import struct
from collections.abc import Hashable, KeysView, Sequence
from dataclasses import dataclass, field

from funcspec.token_tree import DynamicTree, TokenTree



def _f32(x: float) -> float:
    """Round to the nearest float32. A double op then this rounding equals the float32 op."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _neg_count(node: _Node) -> int:
    return -node.count


def _as_list(tokens) -> list[int]:
    """Tokens from a list, numpy array or torch tensor, as Python ints (host proposer: host data)."""
    return [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]  # SYNC


@dataclass
class SuffixDraft:
    """One speculation.

    Attributes:
      token_ids: the drafted tokens, ``[n]``.
      parents: index of each token's parent in ``token_ids``, -1 under the matched
        context; a chain in path mode, so ``parents[i] == i - 1``.
      probs: each token's estimated probability, ``[n]``, non-increasing.
      score: ``sum(probs)`` in float32.
      match_len: length of the context suffix that the draft continues.
      nodes: with a static ``TokenTree``, the tree node each token fills
        (absent nodes are skipped); otherwise ``0 .. n-1``.
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    nodes: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, prob: float, node: int | None = None) -> int:
        """Append one drafted token; returns its index."""
        self.nodes.append(len(self.token_ids) if node is None else node)
        self.parents.append(parent)
        self.token_ids.append(token)
        self.probs.append(prob)
        self.score = _f32(self.score + prob)
        return len(self.token_ids) - 1


class _Node:
    __slots__ = ("token", "count", "parent", "children", "order")

    def __init__(self, token: int, parent: _Node | None):
        self.token = token
        self.count = 0 if parent is None else 1
        self.parent = parent
        self.children: dict[int, _Node] = {}
        # NOTE: ties in count are broken by arctic's sibling-list rules (see _increment and
        # _decrement), which depend on history, so the order is kept explicitly.
        self.order: list[_Node] = []

    def index(self) -> int:
        """Position in the parent's order; a binary search narrows it to equal counts."""
        sib = self.parent.order  # type: ignore[union-attr]  # never the root
        return sib.index(self, bisect.bisect_left(sib, -self.count, key=_neg_count))


def _increment(node: _Node) -> None:
    # Arctic moves a node whose count catches up with a previous sibling in front of the
    # previous sibling's count group: it becomes the head of its new count group if it
    # was the head of its old one, and the tail otherwise.
    sib, i = node.parent.order, node.index()  # type: ignore[union-attr]  # never the root
    if i > 0 and sib[i - 1].count <= node.count + 1:
        j = bisect.bisect_left(sib, -sib[i - 1].count, key=_neg_count)
        sib.insert(j, sib.pop(i))
    node.count += 1


def _decrement(node: _Node) -> None:
    # Arctic moves a node that falls below equal-count siblings behind all of them.
    sib, i = node.parent.order, node.index()  # type: ignore[union-attr]  # never the root
    if i + 1 < len(sib) and sib[i + 1].count == node.count:
        j = bisect.bisect_left(sib, -(node.count - 1), key=_neg_count)
        sib.insert(j - 1, sib.pop(i))
    node.count -= 1


class _SuffixTree:
    """A depth-limited suffix trie over several sequences, each extended token by token."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(0, None)
        self.seqs: dict[Hashable, list[int]] = {}
        # The end nodes of each sequence's last `max_depth` suffixes: the only ones a new
        # token can extend.
        self.active: dict[Hashable, list[_Node]] = {}

    def extend(self, key: Hashable, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(key, [])
        for token in tokens:
            seq.append(token)
            ends = self.active.get(key, [])
            if len(ends) == self.max_depth:  # the oldest suffix is full: it stops growing
                ends = ends[1:]
            self.root.count += 1
            self.active[key] = [self._step(node, token) for node in ends + [self.root]]

    def _step(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node(token, node)
            node.order.append(child)
        else:
            _increment(child)
        return child

    def remove(self, key: Hashable) -> None:
        seq = self.seqs.pop(key, [])
        self.active.pop(key, None)
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]
                if child.count == 1:  # only this suffix used it: drop the subtree
                    del node.children[token]
                    del node.order[child.index()]
                    break
                _decrement(child)
                node = child

    def _match(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for token in pattern:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float, expand=None) -> SuffixDraft:
        """The best draft over the context's matched suffixes; ``expand(node, max_tokens, min_prob)``
        drafts from one match (default: path mode)."""
        expand = expand or self._path
        best = SuffixDraft()
        factor, offset, min_prob = _f32(max_spec_factor), _f32(max_spec_offset), _f32(min_token_prob)
        # NOTE: arctic stops at len(context) - 1, so the whole context is never matched.
        for match_len in range(1, len(context)):
            node = self._match(context[-match_len:])
            if node is None:  # a longer suffix cannot match where a shorter one did not
                break
            cap = int(_f32(_f32(match_len * factor) + offset) + 1e-6)
            draft = expand(node, max(0, min(max_spec_tokens, cap)), min_prob)
            if draft.score >= best.score:  # ties go to the longer match
                best, draft.match_len = draft, match_len
        return best

    @staticmethod
    def _path(node: _Node, max_tokens: int, min_prob: float) -> SuffixDraft:
        """Follow the most frequent child while the running probability stays >= min_prob."""
        draft, prob = SuffixDraft(), 1.0
        while len(draft.token_ids) < max_tokens and node.order:
            child = node.order[0]
            prob = _f32(prob * _f32(child.count / node.count))
            if prob < min_prob:
                break
            draft.add(child.token, len(draft.token_ids) - 1, prob)
            node = child
        return draft

    @staticmethod
    def _best_first(node: _Node, max_tokens: int, min_prob: float, topk: int | None = None,
                    max_depth: int | None = None) -> SuffixDraft:
        """Arctic's tree mode: draft the most probable trie node next, ``max_tokens`` times.

        A node's probability is its parent's times ``count / parent count``; children
        below ``min_prob`` are never drafted. ``topk`` keeps each node's most frequent
        children only, ``max_depth`` the nodes that deep (funcspec's ``DynamicTree``).
        A child is never more probable than its parent, so parents come first.
        NOTE: equal probabilities pop first-pushed first; arctic's C++ heap leaves that order open.
        """
        heap: list[tuple[float, int, _Node, int, int]] = []
        draft, seq = SuffixDraft(), itertools.count()

        def push(parent: _Node, prob: float, index: int, depth: int) -> None:
            if max_depth is not None and depth >= max_depth:
                return
            for child in parent.order[:topk]:
                p = _f32(_f32(prob * child.count) / parent.count)  # arctic: float * int / float
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(seq), child, index, depth + 1))

        push(node, 1.0, -1, 0)
        while heap and len(draft.token_ids) < max_tokens:
            neg, _, child, parent, depth = heapq.heappop(heap)
            push(child, -neg, draft.add(child.token, parent, -neg), depth)
        return draft

    @staticmethod
    def _ranked(node: _Node, max_tokens: int, min_prob: float, tree: TokenTree,
                max_depth: int | None = None) -> SuffixDraft:
        """A static tree's nodes: node ``(r1, .., rd)`` follows the r1-th most frequent child, then
        the r2-th, ...; path mode generalised (``(0, .., 0)`` is its chain). A node is absent when
        the trie has no such child, its probability is below ``min_prob``, its parent is absent,
        it is deeper than ``max_depth``, or its index reaches ``max_tokens``."""
        at: dict[int, tuple[_Node, float, int]] = {}
        draft = SuffixDraft()
        for i, (path, parent) in enumerate(zip(tree.paths, tree.parents)):
            if i >= max_tokens:
                break
            if (parent >= 0 and parent not in at) or (max_depth is not None and len(path) > max_depth):
                continue
            base, prob, index = (node, 1.0, -1) if parent < 0 else at[parent]
            if path[-1] >= len(base.order):
                continue
            child = base.order[path[-1]]
            p = _f32(prob * _f32(child.count / base.count))  # as path mode rounds
            if p >= min_prob:
                at[i] = (child, p, draft.add(child.token, index, p, node=i))
        return draft


class SuffixDecodingCache:
    """Local trees of active requests plus a global tree of cached responses.

    Engine lifecycle per request: ``start_request`` with the prompt, then each step
    ``add_active_response`` with the new tokens and ``speculate`` on the last tokens,
    and ``stop_request`` at the end. The response stays in the global tree afterwards.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000):
        """``max_cached_requests``: 0 disables the global tree, -1 leaves it unbounded."""
        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
        self._max_tree_depth = max_tree_depth
        self._max_cached_requests = max_cached_requests
        self._global = _SuffixTree(max_tree_depth)
        self._local: dict[Hashable, _SuffixTree] = {}
        # Request ids whose responses are in the global tree, oldest first (FIFO eviction).
        self._cached: dict[Hashable, None] = {}

    @property
    def max_tree_depth(self) -> int:
        """The deepest suffix kept in the trees."""
        return self._max_tree_depth

    @property
    def max_cached_requests(self) -> int:
        """How many finished requests the global tree keeps."""
        return self._max_cached_requests

    @property
    def active_requests(self) -> KeysView:
        """Requests started and not yet stopped."""
        return self._local.keys()

    @property
    def cached_requests(self) -> KeysView:
        """Requests whose responses are in the global tree, oldest first."""
        return self._cached.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids) -> None:
        """Build the request's local tree from its prompt and reserve a global slot.

        A cached response under the same id is evicted first; the oldest other cached
        responses are evicted while more than ``max_cached_requests`` remain.
        """
        if req_id in self._local:
            raise ValueError(f"Request '{req_id}' is already active")
        self._local[req_id] = _SuffixTree(self._max_tree_depth)
        self._local[req_id].extend(req_id, _as_list(prompt_token_ids))
        if self._max_cached_requests == 0:
            return
        if req_id in self._cached:
            self.evict_cached_response(req_id)
        self._cached[req_id] = None
        while 0 < self._max_cached_requests < len(self._cached):
            self.evict_cached_response(next(iter(self._cached)))

    def stop_request(self, req_id: Hashable) -> None:
        """Drop the local tree; the response stays cached until evicted."""
        self._check_active(req_id)
        del self._local[req_id]

    def add_active_response(self, req_id: Hashable, token_ids) -> None:
        """Append generated tokens to the local tree and, while cached, the global one."""
        self._check_active(req_id)
        tokens = _as_list(token_ids)
        self._local[req_id].extend(req_id, tokens)
        if req_id in self._cached:  # it may have been evicted while still active
            self._global.extend(req_id, tokens)

    def evict_cached_response(self, req_id: Hashable) -> None:
        """Remove a response from the global tree; the id can then be reused."""
        if req_id not in self._cached:
            raise ValueError(f"Request '{req_id}' is not cached")
        del self._cached[req_id]
        self._global.remove(req_id)

    def speculate(self, req_id: Hashable, context, max_spec_tokens: int | None = None,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                  min_token_prob: float = 0.1, use_tree_spec: bool = False,
                  tree: TokenTree | DynamicTree | None = None, max_depth: int | None = None) -> SuffixDraft:
        """Draft a continuation of ``context`` (the request's latest tokens).

        Only the last ``max_tree_depth`` context tokens are used. For each suffix length
        ``m`` that the tree holds, at most ``min(max_spec_tokens, m * max_spec_factor +
        max_spec_offset)`` tokens are drafted; the best-scoring ``m`` wins, the longer on
        ties. The local tree wins ties with the global tree.

        Modes: path mode follows the most frequent child. ``use_tree_spec``
        (arctic's tree mode) drafts a token tree, the most probable trie node
        first. ``tree`` (funcspec's shapes, which imply tree mode): a
        ``DynamicTree`` caps tree mode at ``topk`` children per node and
        ``num_steps`` depth; a static ``TokenTree`` fills its nodes by child
        rank (:meth:`_SuffixTree._ranked`; ``SuffixDraft.nodes`` says where).
        ``max_depth`` (any mode but path) drops deeper nodes.
        """
        self._check_active(req_id)
        if max_spec_tokens is None:
            max_spec_tokens = self._max_tree_depth
        context = _as_list(context)[-self._max_tree_depth:]
        expand = None
        if isinstance(tree, TokenTree):
            expand = functools.partial(_SuffixTree._ranked, tree=tree, max_depth=max_depth)
        elif isinstance(tree, DynamicTree):
            depth = tree.num_steps if max_depth is None else min(max_depth, tree.num_steps)
            expand = functools.partial(_SuffixTree._best_first, topk=tree.topk, max_depth=depth)
        elif tree is not None:
            raise ValueError(f"tree must be a TokenTree, a DynamicTree or None, got {type(tree).__name__}")
        elif use_tree_spec:
            expand = functools.partial(_SuffixTree._best_first, max_depth=max_depth)
        args = (context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, expand)
        local, shared = self._local[req_id].speculate(*args), self._global.speculate(*args)
        return local if local.score >= shared.score else shared

    def _check_active(self, req_id: Hashable) -> None:
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
