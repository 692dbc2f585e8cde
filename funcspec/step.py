"""The speculative step: one pure function per (B, K) bucket (ARCHITECTURE.md, "Contract").

    propose (in-graph proposer, or drafts fed in by a host proposer)
    -> target forward over [B, K+1] tokens
    -> verify
    -> commit: advance lengths, append emitted tokens to the history

K = 0 is plain autoregressive decoding through the same function. With a token
tree (``StepConfig.tree``, the engine's tree cut to the bucket's N nodes) K is
its node count N: the target runs over
the N + 1 tree indices with tree attention, the tree verifier returns the
accepted root path as ``[B, D+1]`` tokens, and that path's KV entries and
target hidden states are moved into place (``commit_path``) before lengths advance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from funcspec import dynamic, rng, sampling, verifiers
from funcspec.nn import KVCache, ModelConfig, forward
from funcspec.nn.llama import FULL_READ, KVRead, TreeMask, commit_path
from funcspec.token_tree import ancestors, depths, tree_parents
from funcspec.tree import pytree_dataclass, replace, slot_field, static_field
from funcspec.types import PLACEHOLDER, Proposal, Sampling
from funcspec.verifiers import tree as tree_verifier


DRAFT_STREAM = -1  # fold_in data of the proposer's key; verifiers use non-negative sub-streams


@pytree_dataclass
class EngineState:
    """Everything a step reads and writes; slot ``S`` is the scratch slot.

    Attributes:
        kv: target KV cache, ``kv.lens [S+1]`` committed tokens per slot.
        history: [S+1, T_hist] int64 tokens per slot: prompt, then output.
            ``history[s, lens[s]]`` is the pending token (emitted, not yet in the KV).
        keys: [S+1] int64 per-request RNG key.
        sampling: per-slot sampling parameters, each [S+1].
        proposer: the proposer's own state pytree (``None`` if it keeps none).
    """

    kv: KVCache
    history: torch.Tensor = slot_field()
    keys: torch.Tensor = slot_field()
    sampling: Sampling
    proposer: Any = None


@pytree_dataclass
class StepInputs:
    """Per-step graph inputs.

    Attributes:
        slots: [B] int64 slot per row; padding rows use the scratch slot S.
        drafts: [B, K] int64 drafts from a host proposer, else ``None``.
        draft_parents: [B, K] int64 parents of a host proposer's token-tree
            drafts (``funcspec.token_tree``), else ``None``.
        budget_k: int64 [] per-request verify budget (confidence-based
            verify length), else ``None``. A tensor, so a new budget never recompiles.
        synthetic_cond: [K] float32 conditional acceptance rates of the
            synthetic verifier, else ``None``. A tensor, so new rates never recompile.
    """

    slots: torch.Tensor
    drafts: Optional[torch.Tensor] = None
    draft_parents: Optional[torch.Tensor] = None
    budget_k: Optional[torch.Tensor] = None
    synthetic_cond: Optional[torch.Tensor] = None


@pytree_dataclass
class StepOutput:
    """What the host reads back, in one copy.

    Attributes:
        tokens: [B, K+1] int64 (tree buckets: [B, D+1]), ``PLACEHOLDER`` after the emitted ones.
        num_emitted: [B] int32.
        num_drafts: [B] int64 drafts that were verified (not ``PLACEHOLDER``).
        confidence: [B, K] float32 draft confidences (confidence-based verify
            length only), else ``None``.
        logprobs: a logprobs bucket's :class:`TokenLogprobs` of ``tokens``, else ``None``.
    """

    tokens: torch.Tensor
    num_emitted: torch.Tensor
    num_drafts: torch.Tensor
    confidence: Optional[torch.Tensor] = None
    logprobs: Optional["TokenLogprobs"] = None


@pytree_dataclass
class TokenLogprobs:
    """The target's raw log-probabilities at each emitted token (``sampling.token_logprobs``).

    Attributes:
        logprob: [B, E] float32 of the emitted token (E = K+1, or D+1 for a tree).
        rank: [B, E] int64, 1-based rank of the emitted token in the target's distribution.
        top_logprobs: [B, E, M] float32, the M = ``sampling.MAX_LOGPROBS`` largest, descending.
        top_ids: [B, E, M] int64 their token ids.
    """

    logprob: torch.Tensor
    rank: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


@pytree_dataclass
class StepContext:
    """What an in-graph proposer may read.

    Attributes:
        slots: [B] slot per row.
        lens: [B] committed lengths; the pending token sits at ``history[slot, lens]``.
        history: [S+1, T_hist] the engine's token history.
        key: [B] the rows' draft keys (independent of the verifier's).
        sampling: the rows' sampling parameters.
        drafts: [B, K] host drafts, or ``None``.
        draft_parents: [B, K] the host drafts' tree parents, or ``None``.
        read: static: how attention reads the proposer's own caches (the bucket's
            context length; rows are slots).
        mode: static: the bucket's ``sampling.Mode`` (under ``GREEDY`` drafts
            are argmax and carry no q).
        tree: static: the token tree this bucket drafts (``TokenTree`` or
            ``DynamicTree``), or ``None`` for a chain.
    """

    slots: torch.Tensor
    lens: torch.Tensor
    history: torch.Tensor
    key: torch.Tensor
    sampling: Sampling
    drafts: Optional[torch.Tensor] = None
    draft_parents: Optional[torch.Tensor] = None
    read: KVRead = static_field(default=FULL_READ)
    mode: sampling.Mode = static_field(default=sampling.FILTERED)
    tree: Any = static_field(default=None)


@pytree_dataclass
class VerifyResult:
    """What the proposer's ``commit`` sees after verification."""

    slots: torch.Tensor  # [B]
    lens: torch.Tensor  # [B] lengths before this step
    tokens: torch.Tensor  # [B, K+1] (tree: [B, D+1], the accepted path)
    num_emitted: torch.Tensor  # [B]
    hiddens: tuple  # target hidden states [B, K+1, H] of the proposer's layers (tree: along the path)
    path: Optional[torch.Tensor] = None  # [B, D+1] tree indices of the accepted path (tree steps only)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static description of one bucket's step (hashable, never traced)."""

    model: ModelConfig
    k: int
    proposer: Any = None  # funcspec.proposers.BoundProposer (module + static cfg), None without speculation
    verify: Any = None  # funcspec.verifiers.VerifyConfig
    hidden_layers: tuple[int, ...] = ()
    dynamic_min_k: Optional[int] = None  # min_verify_tokens when the verify length is confidence-based
    read: KVRead = FULL_READ  # the context bucket: cache positions read, rows are slots
    mode: sampling.Mode = sampling.FILTERED  # what the rows' sampling needs (greedy / random / filtered)
    tree: Any = None  # funcspec.token_tree.TokenTree | DynamicTree of K nodes (the engine's, cut to K) when K > 0


def row_sampling(state: EngineState, slots: torch.Tensor) -> Sampling:
    """The sampling parameters of each row [B]."""
    s = state.sampling
    return Sampling(s.temperature[slots], s.top_k[slots], s.top_p[slots])


def row_keys(state: EngineState, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per-row keys [B, ...] for drawing the token after position ``pos`` [B, ...].

    NOTE: keys depend on (request seed, position) only, so a request's draws
    do not depend on which other requests share its batch, nor on whether a
    position is drawn alone (decoding) or inside a verified block (speculation).
    """
    keys = state.keys[slots]  # [B]
    return rng.fold_in(keys.view(keys.shape + (1,) * (pos.dim() - 1)), pos)


def mask_beyond(drafts: torch.Tensor, verify_len: torch.Tensor) -> torch.Tensor:
    """Drafts [B, K] with positions >= verify_len[b] replaced by ``PLACEHOLDER``."""
    k = torch.arange(drafts.shape[1], device=drafts.device)
    return torch.where(k.view(1, -1) < verify_len.view(-1, 1), drafts, PLACEHOLDER)


def verify_prefix(sc: StepConfig, state: EngineState, proposal: Proposal, slots, budget_k) -> torch.Tensor:
    """Drafts [B, K] cut to each row's confidence-allocated verify length (vLLM-Ascend's
    DynamicSpecScheduler); the cut positions become ``PLACEHOLDER``, which every verifier
    rejects, so verification stays lossless."""
    real = slots < state.kv.lens.shape[0] - 1  # [B]
    verify_len = dynamic.allocate(dynamic.survival(proposal.confidence), budget_k, sc.dynamic_min_k, real)
    return mask_beyond(proposal.tokens, verify_len)


def commit_lengths(kv: KVCache, history: torch.Tensor, slots, lens, tokens, n) -> None:
    """Advance lengths by ``n`` and append the emitted tokens to the history.

    Donates: kv.lens, history. Padding rows (scratch slot) keep length 0, so
    their writes stay at the front of the scratch slot.
    """
    scratch = kv.lens.shape[0] - 1
    real = slots < scratch
    kv.lens.index_put_((slots,), torch.where(real, lens + n.to(lens.dtype), 0))
    cols = lens.unsqueeze(1) + 1 + torch.arange(tokens.shape[1], device=tokens.device)  # [B, K+1]
    history.index_put_((slots.unsqueeze(1).expand_as(cols), cols), tokens)


def tree_mask(parents: torch.Tensor, lens: torch.Tensor, depth: int) -> TreeMask:
    """The target's tree attention over [pending, nodes] for node parents [B, N] at committed lengths [B]."""
    anc = ancestors(tree_parents(parents), depth)  # [B, N+1, N+1]
    return TreeMask(lens.unsqueeze(1) + depths(anc), lens, anc)


def spec_step(sc: StepConfig, params: dict, state: EngineState, inputs: StepInputs):
    """One decoding step for a (B, K) bucket.

    Returns ``(StepOutput, new_state)``; ``new_state`` has the same tree
    structure, shapes and dtypes as ``state``.

    Donates: state.kv, state.history, state.proposer.
    """
    slots = inputs.slots  # [B]
    lens = state.kv.lens[slots]  # [B]
    pending = state.history[slots, lens]  # [B]
    key = row_keys(state, slots, lens)  # [B]
    samp = row_sampling(state, slots)
    pstate = state.proposer
    if sc.proposer is not None:
        # NOTE: proposers run even at K = 0 (a K-table gap), so stateful ones
        # (a draft KV) keep up with every committed token.
        draft_key = rng.fold_in(key, DRAFT_STREAM)  # [B]
        ctx = StepContext(slots, lens, state.history, draft_key, samp, inputs.drafts, inputs.draft_parents,
                          sc.read, sc.mode, sc.tree if sc.k > 0 else None)
        proposal, pstate = sc.proposer.propose(params["draft"], pstate, ctx, sc.k)
        if sc.dynamic_min_k is not None and sc.k > 0:
            proposal = replace(proposal, tokens=verify_prefix(sc, state, proposal, slots, inputs.budget_k))
        # NOTE: PLACEHOLDER cannot be embedded; feed token 0 there. The
        # verifier rejects PLACEHOLDER, so that position's logits are unused.
        tokens = torch.cat([pending.unsqueeze(1), proposal.tokens.clamp(min=0)], dim=1)  # [B, K+1]
    else:
        tokens = pending.unsqueeze(1)  # [B, 1]
    tree = sc.tree if sc.k > 0 else None
    mask = tree_mask(proposal.parents, lens, tree.depth) if tree is not None else None
    logits, hiddens, kv = forward(sc.model, params["target"], state.kv, tokens, slots, lens, sc.hidden_layers,
                                  sc.read, tree=mask)  # [B, K+1, V] float32
    path = None
    # NOTE: the keys decoding without speculation draws positions lens.. with: drawing the target's tokens
    # with them makes a seeded sampled request emit the same tokens with and without speculation.
    position_keys = row_keys(state, slots, lens.unsqueeze(1) + torch.arange(logits.shape[1], device=lens.device))
    if tree is not None:
        out, n, path = tree_verifier.verify(position_keys[:, : tree.depth + 1], logits, proposal, samp, sc.mode,
                                            tree.depth)  # [B, D+1], [B], [B, D+1]
        commit_path(kv, slots, lens, path)
        hiddens = tuple(torch.gather(h, 1, path.unsqueeze(-1).expand(-1, -1, h.shape[-1])) for h in hiddens)
    elif sc.k > 0:
        out, n = verifiers.verify(sc.verify, key, logits, proposal, samp, sc.mode.greedy,
                                  inputs.synthetic_cond, position_keys)  # [B, K+1], [B]
    else:
        out = sampling.sample(key, logits[:, 0], samp.temperature, samp.top_k, samp.top_p, sc.mode).unsqueeze(1)
        n = torch.ones_like(slots, dtype=torch.int32)
    commit_lengths(kv, state.history, slots, lens, out, n)
    if sc.proposer is not None:
        pstate = sc.proposer.commit(pstate, VerifyResult(slots, lens, out, n, hiddens, path))
        num_drafts = (proposal.tokens >= 0).sum(1)  # [B]
    else:
        num_drafts = torch.zeros_like(slots)
    new_state = EngineState(kv, state.history, state.keys, state.sampling, pstate)
    confidence = proposal.confidence if sc.dynamic_min_k is not None and sc.k > 0 else None
    lps = emitted_logprobs(logits, out, path) if sc.mode.logprobs else None
    return StepOutput(out, n, num_drafts, confidence, lps), new_state


def emitted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, path: Optional[torch.Tensor]) -> TokenLogprobs:
    """Logprobs of the emitted ``tokens [B, E]`` from the verify logits [B, K+1, V].

    Token j of a chain was drawn from position j's logits; a tree's from the
    logits of node ``path[:, j]`` on its accepted root path.
    """
    if path is not None:
        logits = torch.gather(logits, 1, path.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, D+1, V]
    return TokenLogprobs(*sampling.token_logprobs(logits[:, : tokens.shape[1]], tokens, sampling.MAX_LOGPROBS))
