"""Pieces shared by every verification rule (see the glossary in ``__init__``).

A rule computes how many drafts it accepts per row; everything else is here:
input checks, the processed target ``p`` and draft ``q``, the acceptance
uniforms, the final (recovered or bonus) token and the ``[B, K+1]`` output.

Random sub-streams of the per-row key ``key [B]`` (``rng.fold_in(key, s)``):

    STREAM_ACCEPT = 0   uniforms u [B, K], one per draft position
    STREAM_FINAL  = 1   exponentials E [B, V] for the race that draws the one
                        final token of the row: recovered or bonus

A row emits exactly one non-draft token, so a single race per row suffices.
Greedy verification draws nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from funcspec import rng
from funcspec.sampling import target_probs
from funcspec.pytree import pytree_dataclass
from funcspec.types import PLACEHOLDER, Proposal, Sampling

STREAM_ACCEPT = 0
STREAM_FINAL = 1


@pytree_dataclass
class VerifyInput:
    """What every rule verifies: one bucket's proposal and the target's logits over it.

    Attributes:
        key: [B] int64 the rows' verify keys (the sub-streams above).
        logits: [B, N+1, V] the target over [pending, drafts]; a chain's N is K.
        proposal: ``tokens [B, N]``, ``parents [B, N]`` (a chain's are i - 1),
            ``probs [B, N, V]`` or ``None`` (deterministic drafts).
        sampling: the rows' sampling parameters, each [B].
        keys: [B, D+1] the key autoregressive decoding draws each position of
            the block with (``step.row_keys``; D = K for a chain), or ``None``
            outside an engine: the standard rule then couples its randomness
            through uniforms, and the tree rule refuses.
        rates: [K] float32 conditional acceptance rates of the synthetic rule (a
            runtime tensor, so new rates never recompile), or ``None``: the
            config's ``synthetic_rates``.
    """

    key: torch.Tensor
    logits: torch.Tensor
    proposal: Proposal
    sampling: Sampling
    keys: Optional[torch.Tensor] = None
    rates: Optional[torch.Tensor] = None


class Inputs(NamedTuple):
    """What every rule reads, prepared once.

    Attributes:
        drafts: [B, K] int64 draft tokens, ``PLACEHOLDER`` where there is none.
        valid: [B, K] bool, the draft is not ``PLACEHOLDER``.
        supported: [B, K] bool, ``valid`` and ``q(draft) > 0``.
        p: [B, K+1, V] float32 processed target distribution (``target_probs``).
        q: [B, K, V] float32 draft distribution, zero rows at ``PLACEHOLDER``; or
            ``None`` when every row's q is one-hot at its draft (deterministic drafts).
        onehot: [B] bool, rows whose q is one-hot at the draft whatever ``q`` holds
            (greedy rows).
        ratio: [B, K] float32 ``p(draft) / q(draft)``, 0 where not ``supported``.
    """

    drafts: torch.Tensor
    valid: torch.Tensor
    supported: torch.Tensor
    p: torch.Tensor
    q: Optional[torch.Tensor]
    onehot: torch.Tensor
    ratio: torch.Tensor


def _shape_error(name: str, want: str, got: torch.Tensor) -> ValueError:
    return ValueError(f"{name} must be {want}, got shape {tuple(got.shape)}")


def check_inputs(key: Optional[torch.Tensor], target_logits: torch.Tensor, drafts: torch.Tensor,
                 probs: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the argument whose shape or dtype is inconsistent.

    Shapes are static, so this costs nothing inside a captured graph.
    """
    if target_logits.dim() != 3 or not target_logits.is_floating_point():
        raise _shape_error("target_logits", "a float [B, K+1, V] tensor", target_logits)
    b, t, v = target_logits.shape
    if drafts.dim() != 2 or drafts.is_floating_point() or tuple(drafts.shape) != (b, t - 1):
        raise _shape_error("draft_tokens (proposal.tokens)", f"an integer [B, K] = [{b}, {t - 1}] tensor "
                           f"matching target_logits {tuple(target_logits.shape)}", drafts)
    if probs is not None and tuple(probs.shape) != (b, t - 1, v):
        raise _shape_error("draft_probs (proposal.probs)", f"[B, K, V] = [{b}, {t - 1}, {v}] or None", probs)
    if key is not None and tuple(key.shape) != (b,):
        raise _shape_error("key", f"a [B] = [{b}] key tensor (one stream per row)", key)


def is_greedy(sampling: Sampling, batch: int) -> torch.Tensor:
    """[B] bool: rows with temperature 0, the same test ``target_probs`` uses."""
    return (torch.as_tensor(sampling.temperature).reshape(-1) <= 0).expand(batch)


def prepare(target_logits: torch.Tensor, proposal: Proposal, sampling: Sampling,
            key: Optional[torch.Tensor], filters: bool = True) -> Inputs:
    """Check the inputs and build :class:`Inputs` (``p`` only through ``target_probs``).

    ``probs=None`` means a deterministic draft: q is one-hot at the draft, and is
    never materialised (:func:`minus_q` applies it). Greedy rows also use the
    one-hot q, so that every rule reduces to exactly greedy verification there,
    whatever ``probs`` holds.
    """
    check_inputs(key, target_logits, proposal.tokens, proposal.probs)
    batch = target_logits.shape[0]
    drafts = proposal.tokens.long()  # [B, K]
    valid = drafts != PLACEHOLDER  # [B, K]
    onehot = is_greedy(sampling, batch)  # [B]
    p = target_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, filters)  # [B, K+1, V]
    index = drafts.clamp(min=0).unsqueeze(-1)  # [B, K, 1]
    p_draft = torch.gather(p[:, :-1], -1, index).squeeze(-1)  # [B, K]
    q_draft = valid.float()  # [B, K]: one-hot q at the draft
    q = None
    if proposal.probs is not None:
        # A missing draft has no distribution: its recovered token must come from p.
        q = proposal.probs.float().masked_fill(~valid.unsqueeze(-1), 0.0)  # [B, K, V]
        q_draft = torch.where(onehot.unsqueeze(1), q_draft, torch.gather(q, -1, index).squeeze(-1))
    supported = valid & (q_draft > 0)  # [B, K]
    # NOTE: q is clamped to the smallest normal float32 so that p/q stays
    # finite (a subnormal q could give inf, and 0 * inf = nan in the
    # cumulative products of the block rules).
    ratio = p_draft / q_draft.clamp(min=torch.finfo(torch.float32).tiny)  # [B, K]
    ratio = torch.where(supported, ratio, 0.0)
    return Inputs(drafts, valid, supported, p, q, onehot, ratio)


def minus_q(inp: Inputs, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``max(0, x - q_pos)`` [B, N, V] for x [B, N, V] >= 0 and draft positions pos [B, N].

    ``q_pos`` is the draft distribution at position ``pos[b, n]``, and 0 where
    ``pos >= K`` (after the last draft). A one-hot q only lowers x at the draft
    token, so those rows cost a gather and a scatter, not a [B, N, V] one-hot.
    """
    k = inp.drafts.shape[1]
    if k == 0:
        return x
    inside = pos < k  # [B, N]
    at = pos.clamp(max=k - 1)  # [B, N]
    hit = (inside & torch.gather(inp.valid, 1, at)).unsqueeze(-1)  # [B, N, 1]: the one-hot has mass 1
    idx = torch.gather(inp.drafts, 1, at).clamp(min=0).unsqueeze(-1)  # [B, N, 1]
    lowered = torch.clamp(torch.gather(x, -1, idx) - hit.float(), min=0.0)  # [B, N, 1]
    out = x.scatter(-1, idx, lowered)  # [B, N, V]
    if inp.q is None:
        return out
    q = torch.gather(inp.q, 1, at.unsqueeze(-1).expand(-1, -1, x.shape[-1])) * inside.unsqueeze(-1)  # [B, N, V]
    return torch.where(inp.onehot.view(-1, 1, 1), out, torch.clamp(x - q, min=0.0))


def acceptance_uniforms(key: torch.Tensor, k: int) -> torch.Tensor:
    """u [B, K] in (0, 1) from stream ``STREAM_ACCEPT`` of the row keys [B]."""
    return rng.uniform(rng.fold_in(key, STREAM_ACCEPT), k)


def num_leading(accept: torch.Tensor) -> torch.Tensor:
    """[B] int64: how many leading entries of ``accept [B, K]`` are True."""
    k = accept.shape[1]
    if k == 0:
        return accept.sum(dim=1)
    # NOTE: the first rejected position as a min-reduction rather than a
    # cumprod scan, which inductor compiles more slowly on CPU.
    pos = torch.arange(k, device=accept.device)  # [K]
    return torch.where(accept, k, pos).amin(dim=1)


def num_through_last(mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: one past the last True entry of ``mask [B, K]``, or 0 if none."""
    return mask.shape[1] - num_leading(~mask.flip(1))


def cumulative_ratio(ratio: torch.Tensor) -> torch.Tensor:
    """``π_i = min(1, π_{i-1} · ratio_i)`` with ``π_0 = 1``, for ratio [B, K] -> [B, K].

    Not a clamped ``cumprod``: the clamp applies to the running product, so a
    ratio above 1 can restore mass lost earlier (Sun et al.; vLLM-Ascend's kernel).
    """
    running = ratio.new_ones(ratio.shape[0])  # [B]
    out = []
    for i in range(ratio.shape[1]):  # K is static and small (K+1 <= 16): unrolled
        running = torch.clamp(running * ratio[:, i], max=1.0)
        out.append(running)
    return torch.stack(out, dim=1) if out else ratio


def residual(inp: Inputs, p_row: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Unnormalised ``max(0, weight·p - q_pos)`` [B, V]; falls back to ``p`` where it has no mass.

    NOTE: the residual is empty only where ``weight·p <= q`` everywhere, which
    the rules reach with probability 0 except through float rounding or on
    one-hot rows; ``p`` keeps the emitted token inside the target's support.
    """
    res = minus_q(inp, (weight.unsqueeze(-1) * p_row).unsqueeze(1), pos.unsqueeze(1)).squeeze(1)  # [B, V]
    return torch.where((res > 0).any(dim=-1, keepdim=True), res, p_row)


def final_token(key: torch.Tensor, inp: Inputs, num_accepted: torch.Tensor,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The token [B] after the accepted drafts: recovered if ``num_accepted < K``, else bonus.

    Drawn by the exponential race over ``max(0, w·p_a - q_a)`` at position
    ``a = num_accepted``, where ``w = weight[:, a]`` (1 if ``weight`` [B, K+1]
    is None) and ``q_K = 0``, so the bonus is a plain draw from ``p_K``.
    """
    batch, k = inp.drafts.shape
    rows = torch.arange(batch, device=num_accepted.device)  # [B]
    p_row = inp.p[rows, num_accepted]  # [B, V]
    w = torch.ones_like(p_row[:, 0]) if weight is None else weight[rows, num_accepted]  # [B]
    w = torch.where(num_accepted < k, w, 1.0)
    return rng.categorical(rng.fold_in(key, STREAM_FINAL), residual(inp, p_row, num_accepted, w))


def emit(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble tokens [B, K+1] (accepted drafts, final token, then ``PLACEHOLDER``) and num_emitted [B] int32."""
    batch, k = drafts.shape
    pos = torch.arange(k + 1, device=drafts.device)  # [K+1]
    padded = torch.cat([drafts, drafts.new_full((batch, 1), PLACEHOLDER)], dim=1)  # [B, K+1]
    a = num_accepted.unsqueeze(1)  # [B, 1]
    tokens = torch.where(pos < a, padded, torch.where(pos == a, final.unsqueeze(1), PLACEHOLDER))  # [B, K+1]
    return tokens, (num_accepted + 1).to(torch.int32)


Verdict = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""What every rule returns: tokens [B, D+1] int64 (the accepted drafts, the final token, then
``PLACEHOLDER``), num_emitted [B] int32, and path [B, D+1] int64, the tree indices of the
accepted root path (0 is the pending token; entries past num_emitted are unused)."""


def along_chain(tokens: torch.Tensor, num_emitted: torch.Tensor) -> Verdict:
    """A chain rule's verdict: the accepted path of a chain is its first positions, ``path = 0..K``."""
    path = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # [B, K+1]
    return tokens, num_emitted, path


def match(drafts: torch.Tensor, choices: torch.Tensor) -> Verdict:
    """Accept drafts [B, K] while they equal the target's own choices [B, K+1] (its argmax, or its keyed
    draws); emit the choice at the first mismatch, or the bonus choice K. ``PLACEHOLDER`` never matches."""
    drafts = drafts.long()
    num_accepted = num_leading(drafts == choices[:, :-1])  # [B]
    final = torch.gather(choices, 1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return along_chain(*emit(drafts, num_accepted, final))


def finish(key: torch.Tensor, inp: Inputs, num_accepted: torch.Tensor,
           weight: Optional[torch.Tensor] = None) -> Verdict:
    """Draw the final token after ``num_accepted [B]`` drafts and assemble the verdict."""
    return along_chain(*emit(inp.drafts, num_accepted, final_token(key, inp, num_accepted, weight)))


def first_rejection(key: torch.Tensor, inp: Inputs, accept: torch.Tensor) -> Verdict:
    """Token-by-token rules: accept drafts up to the first False in ``accept [B, K]``."""
    return finish(key, inp, num_leading(accept))
