"""Token-tree options: vLLM's ``speculative_token_tree`` and SGLang's EAGLE-2 dynamic tree keys.

- ``speculative_token_tree``: vLLM's static tree, a list of tuples of child ranks
  (or the string of one, read with ``ast.literal_eval`` as vLLM does). It is
  accepted as given, then sorted breadth-first with vLLM's key ``(len(t), t)``.
  ``num_speculative_tokens`` is the number of nodes; when it is missing, the
  tree sets it.
- ``speculative_eagle_topk``, ``speculative_num_steps``,
  ``speculative_num_draft_tokens``: an EAGLE-2 dynamic tree, under SGLang's
  server-argument names (vLLM has no dynamic trees). As in SGLang, the draft
  tokens include the root, so the tree has ``num_draft_tokens - 1`` nodes and
  that is ``num_speculative_tokens``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from funcspec.config.checks import MAX_DRAFT_TOKENS, SPEC, check_int, is_int
from funcspec.token_tree import DynamicTree, TokenTree

DYNAMIC_KEYS = ("speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens")
"""SGLang's EAGLE-2 dynamic-tree options, as ``speculative_config`` keys."""

MAX_TREE_NODES = MAX_DRAFT_TOKENS
"""The most draft nodes a tree may have: the verify block is N + 1 tokens per row (64), as a chain's K + 1."""


def parse_token_tree(value: Any) -> TokenTree:
    """vLLM's ``speculative_token_tree`` (a list of tuples, or its string) as a :class:`TokenTree`.

    Raises ``ValueError`` naming ``speculative_config.speculative_token_tree`` when a
    node is not a non-empty tuple of ranks >= 0, repeats, or misses its parent.
    """
    name = SPEC + "speculative_token_tree"
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"{name} must be a Python list of tuples, got {value!r}") from err
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list of tuples of child ranks, got {value!r}")
    nodes = []
    for node in value:
        if isinstance(node, (str, bytes)) or not isinstance(node, Sequence) or not node:
            raise ValueError(f"{name} nodes must be non-empty tuples of child ranks, got {node!r}")
        if not all(is_int(r) and r >= 0 for r in node):
            raise ValueError(f"{name} child ranks must be integers >= 0, got {node!r}")
        nodes.append(tuple(node))
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"{name} must not repeat a node, got {list(value)!r}")
    present = set(nodes)
    for node in nodes:
        if len(node) > 1 and node[:-1] not in present:
            raise ValueError(f"{name} node {node} needs its parent {node[:-1]} in the tree")
    if len(nodes) > MAX_TREE_NODES:
        raise ValueError(f"{name} may have at most {MAX_TREE_NODES} nodes, got {len(nodes)}")
    return TokenTree(tuple(sorted(nodes, key=lambda t: (len(t), t))))


def parse_dynamic_tree(spec: Mapping) -> Optional[DynamicTree]:
    """The EAGLE-2 dynamic tree of ``spec``'s :data:`DYNAMIC_KEYS` (all three, or none)."""
    given = [k for k in DYNAMIC_KEYS if spec.get(k) is not None]
    if not given:
        return None
    if len(given) != len(DYNAMIC_KEYS):
        missing = [k for k in DYNAMIC_KEYS if k not in given]
        raise ValueError(f"{SPEC}{missing[0]} is required with {SPEC}{given[0]} (an EAGLE-2 dynamic tree)")
    # NOTE: the frontier rule depends on the method; SpecConfig's checks apply it.
    return check_dynamic_tree(DynamicTree(*(spec[k] for k in DYNAMIC_KEYS)), frontiers=False)


def check_dynamic_tree(tree: DynamicTree, frontiers: bool = True) -> DynamicTree:
    """``tree`` if its sizes are valid: its nodes fit among the candidates that ``num_steps`` expansions make,
    and (``frontiers``: a draft network expands it) the frontiers the head runs fit in the N slots a
    step reserves past the committed length. ngram and suffix run no network, so they skip that check."""
    topk = check_int(SPEC + "speculative_eagle_topk", tree.topk, lo=1)
    steps = check_int(SPEC + "speculative_num_steps", tree.num_steps, lo=1)
    pool = topk + (steps - 1) * topk * topk
    name = SPEC + "speculative_num_draft_tokens"
    check_int(name, tree.num_draft_tokens, lo=2, hi=min(pool, MAX_TREE_NODES) + 1,
              where=f" (the root plus at most {pool} candidates of topk={topk}, num_steps={steps})")
    if frontiers and (steps - 1) * topk > tree.num_draft_tokens - 1:
        # NOTE: the head writes frontiers 1..num_steps-1 (topk nodes each) at the cache slots that the
        # verify block reserves (N past the committed length), and reads only those.
        raise ValueError(f"{name} must be >= 1 + (speculative_num_steps - 1) * speculative_eagle_topk = "
                         f"{1 + (steps - 1) * topk}, got {tree.num_draft_tokens}")
    return tree


def tree_max_k(tree: TokenTree | DynamicTree, max_k: Any) -> int:
    """``num_speculative_tokens`` for a tree: its node count, which a given value must equal."""
    if max_k is not None and max_k != tree.size:
        what = "len(speculative_token_tree)" if isinstance(tree, TokenTree) else "speculative_num_draft_tokens - 1"
        raise ValueError(f"{SPEC}num_speculative_tokens must equal {what} = {tree.size} with a token tree, "
                         f"got {max_k!r}")
    return tree.size
