"""Token trees: the shape of every proposal, a chain, a static tree (vLLM's ``speculative_token_tree``)
or a dynamic one (EAGLE-2).

Every bucket's drafts form a tree: a chain of K (:class:`Chain`) is the tree
whose node i's parent is i - 1, and its proposals carry those parents too. A
proposal has N draft nodes laid out breadth-first after the pending
token (the root). The verify block is N + 1 *tree indices*: 0 is the root,
``i + 1`` is node i. Node i's parent is ``parents[i]`` (-1: the root), always an
earlier node, so one pass in index order sees parents before children.

    tree index   0        1 .. N
    token        pending  drafts[:, 0 .. N-1]
    cache slot   L        L + 1 .. L + N       (L: committed length; distinct slots)
    RoPE         L        L + depth            (depth of the root is 0)

Static trees are Python structure (:class:`TokenTree`, part of a bucket's key);
dynamic trees (:class:`DynamicTree`) fix only the sizes, and their parents
arrive as tensors. The tensor helpers below serve both: everything past the
proposer reads ``parents [B, N]`` tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec.constants import constant


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A static draft tree (hashable: part of a bucket's key).

    Attributes:
        paths: each node as its path of child ranks from the root, breadth-first
            (vLLM's order, key ``(len(t), t)``): ``(0,)`` is the drafter's top-1
            after the pending token, ``(1,)`` its top-2, ``(0, 1)`` the top-2 child of ``(0,)``.
    """

    paths: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """N, the number of draft nodes."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """D, the longest root path; the verifier emits at most D + 1 tokens."""
        return max(len(p) for p in self.paths)

    @property
    def parents(self) -> tuple[int, ...]:
        """Node i's parent node, -1 for the root."""
        index = {p: i for i, p in enumerate(self.paths)}
        return tuple(index.get(p[:-1], -1) for p in self.paths)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Node i's child rank: which of its parent's top-k draft tokens it holds."""
        return tuple(p[-1] for p in self.paths)

    def level(self, d: int) -> range:
        """The nodes at depth d >= 1: contiguous, since the order is breadth-first."""
        return range(sum(len(p) < d for p in self.paths), sum(len(p) <= d for p in self.paths))


def chain(k: int) -> TokenTree:
    """The chain of K as a static tree, ``[(0,), (0, 0), ...]``: what vLLM builds without a tree."""
    return TokenTree(tuple((0,) * (i + 1) for i in range(k)))


@dataclasses.dataclass(frozen=True)
class Chain:
    """K drafts in a line, node i's parent i - 1: the shape of every bucket that drafts no token tree.

    A chain is a tree, and its proposals carry those parents like any other;
    but its block is verified with causal attention, by any rule, and its
    accepted path is already where the cache wants it. A configured tree of
    chain shape (:func:`chain`) stays a :class:`TokenTree`: it is drafted and
    verified as the user asked.
    """

    size: int

    @property
    def depth(self) -> int:
        """D = K: the verifier emits at most K + 1 tokens."""
        return self.size

    @property
    def parents(self) -> tuple[int, ...]:
        """Node i's parent, i - 1 (-1: the pending token)."""
        return tuple(range(-1, self.size - 1))


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """An EAGLE-2 dynamic tree (SGLang's ``speculative_eagle_topk``, ``speculative_num_steps``,
    ``speculative_num_draft_tokens``).

    At each of ``num_steps`` depths the ``topk`` frontier nodes of highest
    cumulative draft log-probability are expanded by their ``topk`` most likely
    children; the best ``num_draft_tokens - 1`` of all candidates are kept
    (SGLang counts the root among the draft tokens: a chain of K is
    ``topk=1, num_steps=K, num_draft_tokens=K+1``).
    """

    topk: int
    num_steps: int
    num_draft_tokens: int

    @property
    def size(self) -> int:
        """N, the number of draft nodes."""
        return self.num_draft_tokens - 1

    @property
    def depth(self) -> int:
        """D: a kept node is at most ``num_steps`` deep."""
        return self.num_steps


Shape = Chain | TokenTree | DynamicTree
"""What a bucket of N drafts proposes and verifies (``EnginePlan.bucket_tree``), resolved once per bucket."""


def truncate(tree: TokenTree | DynamicTree, n: int, frontiers: bool = True) -> TokenTree | DynamicTree:
    """The tree a step drafts when it may verify only ``n`` nodes (1 <= n <= ``tree.size``).

    - static: the first n nodes in breadth-first order. A prefix of that order is
      a tree, since every parent precedes its children.
    - dynamic: the best n nodes (``num_draft_tokens = n + 1``) of the same ``topk``,
      with ``num_steps`` capped at ``n // topk + 1``: the head writes
      ``(num_steps - 1) · topk`` frontier nodes into the n slots a step reserves.

    The whole size gives the tree itself. ``frontiers=False`` (ngram and suffix,
    which run no network over frontiers) caps ``num_steps`` at n instead: no
    path of n nodes is deeper.

    Pure Python on static values: inside a captured step it runs once, at trace time.
    """
    if not 1 <= n <= tree.size:
        raise ValueError(f"a tree of {tree.size} nodes cannot be truncated to {n} nodes")
    if n == tree.size:
        return tree
    if isinstance(tree, TokenTree):
        return TokenTree(tree.paths[:n])
    cap = n // tree.topk + 1 if frontiers else n
    return DynamicTree(tree.topk, min(tree.num_steps, cap), n + 1)


def tree_parents(parents: torch.Tensor) -> torch.Tensor:
    """Tree-index parents [B, N+1] from node parents [B, N] (-1: root); the root is its own parent."""
    root = torch.zeros_like(parents[:, :1])  # [B, 1]
    return torch.cat([root, parents + 1], dim=1)  # [B, N+1]


def ancestors(tparents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N+1, N+1] bool: ``[b, t, s]`` iff s is t or an ancestor of t, for tree-index parents [B, N+1].

    ``depth`` (static) passes of ``anc[t] = {t} ∪ anc[parent(t)]``: after d passes
    every node of depth <= d is exact, and no node is deeper than ``depth``.
    """
    b, t = tparents.shape
    eye = torch.eye(t, dtype=torch.bool, device=tparents.device).expand(b, t, t)  # [B, N+1, N+1]
    anc = eye
    for _ in range(depth):
        anc = eye | torch.gather(anc, 1, tparents.unsqueeze(-1).expand(b, t, t))
    return anc


def depths(anc: torch.Tensor) -> torch.Tensor:
    """[B, N+1] int64 depth of each tree index (root 0) from its ancestor matrix."""
    return anc.sum(-1) - 1


def root_path(anc: torch.Tensor, dep: torch.Tensor, node: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, D+1] tree indices of the path root -> ``node [B]``; past the node's depth it repeats ``node``."""
    rows = torch.arange(node.shape[0], device=node.device)
    on_path = anc[rows, node]  # [B, N+1]
    level = torch.arange(depth + 1, device=node.device).view(1, -1, 1)  # [1, D+1, 1]
    at = on_path.unsqueeze(1) & (dep.unsqueeze(1) == level)  # [B, D+1, N+1]
    return torch.where(at.any(-1), at.int().argmax(-1), node.unsqueeze(1))


def static_parents(tree: TokenTree | Chain, batch: int, device) -> torch.Tensor:
    """A static tree's (or a chain's) node parents as a [B, N] int64 tensor (a graph constant)."""
    return constant(tree.parents, torch.int64, device).expand(batch, tree.size)
