"""``suffix``: suffix decoding (arXiv 2411.04975), the one host proposer.

Drafts come from :class:`funcspec.suffix_tree.SuffixDecodingCache` (arctic-inference
compatible, path mode), run on the host between graphs as vLLM's suffix proposer
does: each request's local tree gets its prompt at its first step and its new
output tokens every step; finished responses stay in the global tree. The
drafts reach the bucket graph as its ``[B, K]`` draft input.

With a token tree (``speculative_token_tree`` or the EAGLE-2 dynamic-tree keys)
the cache drafts trees (:meth:`SuffixDecodingCache.speculate`'s ``tree``): a
dynamic tree is arctic's tree mode, the most probable continuations first, with
at most ``topk`` children per node, ``num_steps`` deep and N nodes; a static
tree takes child ranks by frequency. The parents reach the graph beside the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from funcspec.proposers import keep_state, no_prefill
from funcspec.suffix_tree import SuffixDecodingCache
from funcspec.token_tree import Chain, static_parents
from funcspec.types import PLACEHOLDER, Proposal

runs_on_host = True
prefill = no_prefill
commit = keep_state


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's ``suffix_decoding_*`` settings."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    tree: Any = None  # funcspec.token_tree.TokenTree | DynamicTree | None


def build(spec, target, ctx):
    """The suffix proposer's config from the speculative_config's suffix_decoding_* options (no device params)."""
    return SuffixConfig(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                        spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                        spec.tree), None


def hidden_layers(cfg) -> tuple[int, ...]:
    """suffix reads no hidden states."""
    return ()


def init_state(cfg, params, num_slots, max_len):
    """No device state: the suffix trees live on the host."""
    return None


def propose(cfg, params, state, ctx, k: int):
    """In the graph, the host's drafts (and a tree's parents) are simply the proposal."""
    return Proposal(ctx.drafts, parents=ctx.draft_parents), state


class HostDrafter:
    """Runs the suffix cache between graphs; it sees the running requests only as ``drafts``' rows."""

    def __init__(self, cfg: SuffixConfig, ctx):
        self.cfg, self.max_model_len, self.device = cfg, ctx.max_model_len, ctx.device
        self.cache = SuffixDecodingCache(cfg.max_tree_depth, cfg.max_cached_requests)
        self.seen: dict[str, int] = {}

    def _sync(self, req) -> None:
        rid = req.seq_id  # NOTE: the completions of an n > 1 request share a request_id, each has its own tree
        if rid not in self.seen:
            if rid in self.cache.cached_requests:
                self.cache.evict_cached_response(rid)
            self.cache.start_request(rid, req.prompt_ids)
            self.seen[rid] = 0
        new = req.output_ids[self.seen[rid]:]
        if new:
            self.cache.add_active_response(rid, new)
            self.seen[rid] = len(req.output_ids)

    def drafts(self, rows, b: int, k: int, tree):
        """(tokens, parents) [B, K] each for the live rows and the bucket's shape ``tree``: a chain's drafts,
        ``PLACEHOLDER``-padded, with parents i - 1; a token tree's N = K nodes, absent ones ``PLACEHOLDER``
        under the root."""
        out = torch.full((b, k), PLACEHOLDER, dtype=torch.int64)
        if isinstance(tree, Chain):
            parents, tree = static_parents(tree, b, "cpu").contiguous(), None  # the suffix cache speculates a chain
        else:
            parents = torch.full((b, k), -1, dtype=torch.int64)
        depth = self.cfg.max_tree_depth
        for i, req in enumerate(rows):
            self._sync(req)
            context = (req.prompt_ids + req.output_ids)[-depth:]
            # NOTE: a draft at depth d lands at position total_len + d - 1; none may pass max_model_len.
            room = self.max_model_len - req.total_len
            if room <= 0:
                continue
            d = self.cache.speculate(req.seq_id, context, max_spec_tokens=k if tree is not None else min(k, room),
                                     max_spec_factor=self.cfg.max_spec_factor,
                                     min_token_prob=self.cfg.min_token_prob, tree=tree,
                                     max_depth=room if tree is not None else None)
            if not d.token_ids:
                continue
            at = torch.tensor(d.nodes, dtype=torch.int64)  # [n] each token's node (static trees skip absent ones)
            out[i, at] = torch.tensor(d.token_ids, dtype=torch.int64)
            if tree is not None:
                parents[i, at] = torch.tensor([d.nodes[p] if p >= 0 else -1 for p in d.parents], dtype=torch.int64)
        return out.to(self.device), parents.to(self.device)

    def finish(self, req) -> None:
        """Stop tracking a finished request (arctic's ``stop_request``); its output stays cached for later lookups."""
        if self.seen.pop(req.seq_id, None) is not None:
            self.cache.stop_request(req.seq_id)
