"""Shared sentinels and the small pytrees that cross module boundaries.

Dimension letters used in shape comments across funcspec:

    B  batch rows in a bucket (padded)      K  draft tokens per row
    V  vocabulary size                      T  tokens per row in one forward
    H  hidden size (or heads, in attention) D  head dimension
    L  layers                               S  real KV slots (slot S is scratch)
    N  draft nodes of a token tree (a tree bucket's K); its depth appears only as
       ``[B, D+1]``, the emitted tokens of a tree step, never beside a head dimension

Glossary: one name per quantity.

    num_speculative_tokens  vLLM's name for max_k, used only where vLLM's dicts are read
    max_k       the largest K an engine (or a proposer) ever drafts
    k, K        drafts per row in one step: the bucket's K; a step verifies K + 1 tokens
    t_max       KV positions per slot: max_model_len + max_k + 1
    context bucket (T in a bucket key ``(B, K, T, mode)``; ``KVRead.length``)
                the KV positions a step's attention reads, at least the longest row + K + 1
    slot        one request's row of the engine state (KV, history, key); slot S is scratch
    row         one row of a bucket's batch; running requests fill slots 0..n-1, so row i is slot i
    mode        greedy | random | filtered (``sampling.Mode``): what a bucket's sampling computes
    τ           mean acceptance length: tokens emitted per row-step (drafts accepted + 1)
"""

from __future__ import annotations

from typing import Optional

import torch

from funcspec.token_tree import Chain, static_parents
from funcspec.pytree import pytree_dataclass, slot_field

PLACEHOLDER = -1
"""Marks a draft position with no proposal, and verifier output after the emitted tokens."""


@pytree_dataclass
class Proposal:
    """What a proposer hands the verifier.

    Attributes:
        tokens: [B, K] int64 draft tokens; ``PLACEHOLDER`` where there is none.
        probs: [B, K, V] float32 draft distribution q, or ``None`` for a
            deterministic draft (q is one-hot at ``tokens``).
        confidence: [B, K] float32 per-token confidence, or ``None``.
        parents: [B, K] int64 parent node of each draft (-1: the pending token;
            ``funcspec.token_tree``). Every proposer sets them, a chain's are
            i - 1 (:meth:`chain`), so one step serves chains and trees;
            ``None`` only in a proposal built by hand for a chain rule.
    """

    tokens: torch.Tensor
    probs: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None
    parents: Optional[torch.Tensor] = None

    @staticmethod
    def chain(tokens: torch.Tensor, probs: Optional[torch.Tensor] = None,
              confidence: Optional[torch.Tensor] = None) -> "Proposal":
        """A chain's proposal: drafts [B, K] whose node i's parent is i - 1 (a graph constant)."""
        b, k = tokens.shape
        return Proposal(tokens, probs, confidence, static_parents(Chain(k), b, tokens.device))


@pytree_dataclass
class Sampling:
    """Per-row sampling parameters, as tensors so one graph serves every setting.

    Attributes:
        temperature: [B] float32; 0 makes the row greedy.
        top_k: [B] int64; 0 disables top-k.
        top_p: [B] float32 in (0, 1]; 1 disables top-p.
    """

    temperature: torch.Tensor = slot_field()
    top_k: torch.Tensor = slot_field()
    top_p: torch.Tensor = slot_field()

    @staticmethod
    def full(batch: int, temperature=1.0, top_k=0, top_p=1.0, device=None) -> "Sampling":
        """The same settings for every row."""
        return Sampling(
            torch.full((batch,), float(temperature), dtype=torch.float32, device=device),
            torch.full((batch,), int(top_k), dtype=torch.int64, device=device),
            torch.full((batch,), float(top_p), dtype=torch.float32, device=device),
        )
