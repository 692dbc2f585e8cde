"""The speculative step: one pure function per (B, K) bucket (ARCHITECTURE.md, "Contract").

    propose (in-graph proposer, or drafts fed in by a host proposer): K drafts and their parents
    -> target forward over [B, K+1] tokens (tree attention when the bucket drafts a token tree)
    -> verify: (tokens, num_emitted, path)
    -> keep the accepted path's KV and hidden states, commit: advance lengths, append the emitted tokens

Every bucket has one shape, resolved once (``StepConfig.tree``, a ``token_tree.Shape``):
the ``Chain`` of K, whose node i's parent is i - 1, or the engine's token tree cut
to the bucket's N nodes. The step reads it in two places only: the attention
(causal for a chain) and the accepted path (a chain's is already in place; a
tree's KV entries and hidden states are moved there, ``commit_path``). K = 0 is
plain autoregressive decoding through the same function: a block of no drafts,
whose one token the standard rule draws with decoding's key.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from funcspec import dynamic, rng, verifiers
from funcspec.logprobs import TokenLogprobs, token_logprobs
from funcspec.nn import KVCache, ModelConfig, forward
from funcspec.nn.llama import FULL_READ, KVRead, TreeMask, commit_path
from funcspec.token_tree import Chain, Shape, ancestors, depths, tree_parents
from funcspec.pytree import pytree_dataclass, replace, slot_field, static_field
from funcspec.sampling import FILTERED, Mode
from funcspec.types import PLACEHOLDER, Proposal, Sampling

if TYPE_CHECKING:
    from funcspec.proposers import BoundProposer


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
        draft_parents: [B, K] int64 the host drafts' parents (``funcspec.token_tree``;
            a chain's are i - 1), else ``None``.
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
        logprobs: a logprobs bucket's ``logprobs.TokenLogprobs`` of ``tokens``, else ``None``.
    """

    tokens: torch.Tensor
    num_emitted: torch.Tensor
    num_drafts: torch.Tensor
    confidence: Optional[torch.Tensor] = None
    logprobs: Optional[TokenLogprobs] = None


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
        draft_parents: [B, K] the host drafts' parents, or ``None``.
        read: static: how attention reads the proposer's own caches (the bucket's
            context length; rows are slots).
        mode: static: the bucket's ``sampling.Mode`` (under ``GREEDY`` drafts
            are argmax and carry no q).
        tree: static: the shape this bucket drafts (``token_tree.Shape``): the
            ``Chain`` of K, or a ``TokenTree`` / ``DynamicTree`` of K nodes.
    """

    slots: torch.Tensor
    lens: torch.Tensor
    history: torch.Tensor
    key: torch.Tensor
    sampling: Sampling
    drafts: Optional[torch.Tensor] = None
    draft_parents: Optional[torch.Tensor] = None
    read: KVRead = static_field(default=FULL_READ)
    mode: Mode = static_field(default=FILTERED)
    tree: Optional[Shape] = static_field(default=None)


@pytree_dataclass
class VerifyResult:
    """What the proposer's ``commit`` sees after verification."""

    slots: torch.Tensor  # [B]
    lens: torch.Tensor  # [B] lengths before this step
    tokens: torch.Tensor  # [B, D+1] the emitted tokens (a chain's D is K)
    num_emitted: torch.Tensor  # [B]
    hiddens: tuple  # target hidden states [B, D+1, H] of the proposer's layers, along the accepted path
    path: torch.Tensor  # [B, D+1] tree indices of the accepted path (a chain's: 0..K)
    tree: Optional[Shape] = static_field(default=None)  # the bucket's shape (a chain's path needs no move)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static description of one bucket's step (hashable, never traced)."""

    model: ModelConfig
    k: int
    proposer: Optional["BoundProposer"] = None  # equal by (module, cfg); None without speculation
    verify: verifiers.VerifyConfig = verifiers.VerifyConfig()  # the bucket's rule (K = 0: standard)
    hidden_layers: tuple[int, ...] = ()
    dynamic_min_k: Optional[int] = None  # min_verify_tokens when the verify length is confidence-based
    read: KVRead = FULL_READ  # the context bucket: cache positions read, rows are slots
    mode: Mode = FILTERED  # what the rows' sampling needs (greedy / random / filtered)
    tree: Shape = Chain(0)  # the bucket's shape: the Chain of K, or the engine's tree cut to K nodes


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
    assert sc.dynamic_min_k is not None, "verify_prefix runs only for dynamic speculation"  # static config
    if proposal.confidence is None:  # static: raised while tracing
        raise ValueError("the proposal carries no confidence, which dynamic speculation (dynamic_min_k) needs "
                         "to allocate verify lengths")
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


def attention(shape: Shape, parents: torch.Tensor, lens: torch.Tensor) -> Optional[TreeMask]:
    """How the target attends over a block of ``shape``: causally for a chain (its ancestors are the
    earlier positions), with the tree mask for a token tree."""
    return None if isinstance(shape, Chain) else tree_mask(parents, lens, shape.depth)


def along_path(shape: Shape, x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """x [B, N+1, ...] at the tree indices of the accepted path [B, D+1]: a chain's path is 0..K, so a
    chain's x is already in path order."""
    if isinstance(shape, Chain):
        return x
    return torch.gather(x, 1, path.view(path.shape + (1,) * (x.dim() - 2)).expand(path.shape + x.shape[2:]))


def keep_path(shape: Shape, kv: KVCache, slots, lens, path: torch.Tensor) -> None:
    """Move the accepted path's KV entries to positions lens.. (a chain's already sit there). Donates: kv."""
    if not isinstance(shape, Chain):
        commit_path(kv, slots, lens, path)


def propose(sc: StepConfig, params: dict, state: EngineState, inputs: StepInputs, key: torch.Tensor,
            samp: Sampling) -> tuple[Proposal, Any]:
    """The bucket's K drafts with their parents, and the proposer's new state; without a proposer, the
    empty chain (K = 0). Donates: state.proposer."""
    slots = inputs.slots  # [B]
    if sc.proposer is None:
        none = slots.new_zeros(slots.shape[0], 0)  # [B, 0]
        return Proposal(none, parents=none), state.proposer
    # NOTE: proposers run even at K = 0 (a K-table gap), so stateful ones
    # (a draft KV) keep up with every committed token.
    lens = state.kv.lens[slots]  # [B]
    ctx = StepContext(slots, lens, state.history, rng.fold_in(key, DRAFT_STREAM), samp, inputs.drafts,
                      inputs.draft_parents, sc.read, sc.mode, sc.tree)
    proposal, pstate = sc.proposer.propose(params["draft"], state.proposer, ctx, sc.k)
    if proposal.parents is None:  # static: raised while tracing
        raise ValueError(f"{sc.proposer.module.__name__}.propose returned drafts without parents: every "
                         f"proposal carries them (a chain's are i - 1, token_tree.static_parents(Chain(k), ...))")
    if sc.dynamic_min_k is not None and sc.k > 0:
        proposal = replace(proposal, tokens=verify_prefix(sc, state, proposal, slots, inputs.budget_k))
    return proposal, pstate


def spec_step(sc: StepConfig, params: dict, state: EngineState, inputs: StepInputs):
    """One decoding step for a (B, K) bucket.

    Returns ``(StepOutput, new_state)``; ``new_state`` has the same tree
    structure, shapes and dtypes as ``state``.

    Donates: state.kv, state.history, state.proposer.
    """
    slots = inputs.slots  # [B]
    lens = state.kv.lens[slots]  # [B]
    pending = state.history[slots, lens]  # [B]
    samp = row_sampling(state, slots)
    # NOTE: the keys decoding without speculation draws positions lens.. with: drawing the target's tokens
    # with them makes a seeded sampled request emit the same tokens with and without speculation.
    keys = row_keys(state, slots, lens.unsqueeze(1) + torch.arange(sc.tree.depth + 1, device=lens.device))  # [B, D+1]
    proposal, pstate = propose(sc, params, state, inputs, keys[:, 0], samp)
    assert proposal.parents is not None, "propose() raised for a proposal without parents"  # static: traced once
    # NOTE: PLACEHOLDER cannot be embedded; feed token 0 there. The
    # verifier rejects PLACEHOLDER, so that position's logits are unused.
    tokens = torch.cat([pending.unsqueeze(1), proposal.tokens.clamp(min=0)], dim=1)  # [B, K+1]
    logits, hiddens, kv = forward(sc.model, params["target"], state.kv, tokens, slots, lens, sc.hidden_layers,
                                  sc.read, tree=attention(sc.tree, proposal.parents, lens))  # [B, K+1, V] float32
    vin = verifiers.VerifyInput(keys[:, 0], logits, proposal, samp, keys, inputs.synthetic_cond)
    out, n, path = verifiers.verify(sc.verify, vin)  # [B, D+1], [B], [B, D+1]
    keep_path(sc.tree, kv, slots, lens, path)
    commit_lengths(kv, state.history, slots, lens, out, n)
    if sc.proposer is not None:
        hiddens = tuple(along_path(sc.tree, h, path) for h in hiddens)  # [B, D+1, H] each
        pstate = sc.proposer.commit(pstate, VerifyResult(slots, lens, out, n, hiddens, path, sc.tree))
    new_state = EngineState(kv, state.history, state.keys, state.sampling, pstate)
    num_drafts = (proposal.tokens >= 0).sum(1)  # [B]
    confidence = proposal.confidence if sc.dynamic_min_k is not None and sc.k > 0 else None
    lps = emitted_logprobs(along_path(sc.tree, logits, path), out) if sc.mode.logprobs else None
    return StepOutput(out, n, num_drafts, confidence, lps), new_state


def emitted_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> TokenLogprobs:
    """Logprobs of the emitted ``tokens [B, D+1]`` from the verify logits along the accepted path
    [B, D+1, V]: token j was drawn from the logits of the path's j-th tree index."""
    return token_logprobs(logits[:, : tokens.shape[1]], tokens)
