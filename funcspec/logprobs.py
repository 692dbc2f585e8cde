"""Logprobs, from the graph to vLLM's dicts: what a step computes, how a row reads it, what a request gets.

    in the graph   token_logprobs(logits [B, E, V], tokens [B, E]) -> TokenLogprobs (top MAX_LOGPROBS)
    to the host    in the step's (or the prefill's) one copy, ``runner.readback``, as lists
    per row        rows(lists) -> one HostRow per row: (logprob [E], rank [E], top [E][M], ids [E][M])
    per request    dicts(tokens, row, k, decode) -> vLLM's {token id: Logprob} per position

A step computes them in ``_logprobs`` modes only (``sampling.Mode.logprobs``);
a prefill for the first token of each completion and the prompt tokens of a
request that asked. The host keeps each request's own ``k`` of the top entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from funcspec.outputs import Logprob
from funcspec.pytree import pytree_dataclass

MAX_LOGPROBS = 20
"""The most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default ``max_logprobs``).
A logprobs bucket always computes this many top entries (a static shape); the host keeps each row's own k."""

HostRow = tuple[list[float], list[int], list[list[float]], list[list[int]]]
"""One row's logprobs on the host: ``(logprob [E], rank [E], top_logprobs [E][M], top_ids [E][M])``."""


@pytree_dataclass
class TokenLogprobs:
    """The target's raw log-probabilities at each emitted token (:func:`token_logprobs`).

    Attributes:
        logprob: [B, E] float32 of the emitted token (a step's E is K+1, or D+1 for a tree).
        rank: [B, E] int64, 1-based rank of the emitted token in the target's distribution.
        top_logprobs: [B, E, M] float32, the M = :data:`MAX_LOGPROBS` largest, descending.
        top_ids: [B, E, M] int64 their token ids.
    """

    logprob: torch.Tensor
    rank: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int = MAX_LOGPROBS) -> TokenLogprobs:
    """The target's log-probabilities of ``tokens`` and the top ``num_top``, from raw logits.

    Args:
        logits: [B, E, V] raw target logits at the positions that emitted ``tokens``.
        tokens: [B, E] int64 emitted tokens (``PLACEHOLDER`` entries give garbage the host drops).
        num_top: static count of top entries (clamped to V).

    NOTE: these are vLLM's default ``logprobs_mode="raw_logprobs"``: the log-softmax
    of the raw logits, before temperature, top-k and top-p, whatever the row samples
    with. A row's values depend on its own logits only, so a token verified inside a
    K+1 block gets the bits it gets when decoded alone. ``rank`` is 1 + the number of
    other tokens at least as likely (vLLM's count).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, E, V]
    lp = torch.gather(logp, -1, tokens.clamp(min=0).unsqueeze(-1))  # [B, E, 1]
    rank = (logp >= lp).sum(-1)  # [B, E]: the token itself counts once
    top_lp, top_ids = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)  # [B, E, M]
    return TokenLogprobs(lp.squeeze(-1), rank, top_lp, top_ids)


def rows(host: TokenLogprobs) -> list[HostRow]:
    """Per row, its :data:`HostRow`, from a :class:`TokenLogprobs` whose fields ``runner.readback`` made
    Python lists (nested [B][E], [B][E][M])."""
    return list(zip(host.logprob, host.rank, host.top_logprobs, host.top_ids))


def logprob_dict(token: int, logprob: float, rank: int, top_logprobs, top_ids, k: int, decode) -> dict:
    """vLLM's per-position dict: the chosen ``token`` first, then the ``k`` most likely (ranks 1..k).

    ``decode(id) -> str | None`` gives each entry's ``decoded_token``.
    """
    out = {token: Logprob(logprob, rank, decode(token))}
    for r, (lp, tid) in enumerate(zip(top_logprobs[:k], top_ids[:k]), start=1):
        if tid not in out:
            out[tid] = Logprob(lp, r, decode(tid))
    return out


def dicts(tokens: list[int], row: HostRow, k: int, decode: Callable[[int], Optional[str]]) -> list[dict]:
    """vLLM's dicts for ``tokens`` (position j is ``tokens[j]``) from one row's :data:`HostRow`."""
    lp, rank, top, ids = row
    return [logprob_dict(t, lp[j], rank[j], top[j], ids[j], k, decode) for j, t in enumerate(tokens)]


class Decoder:
    """Token id -> its text (``Logprob.decoded_token``), ``None`` without a tokenizer; memoised, as
    logprobs decode the same top tokens over and over."""

    def __init__(self, tokenizer):
        self.tokenizer, self.memo = tokenizer, {}

    def __call__(self, token: int) -> Optional[str]:
        if token not in self.memo:
            self.memo[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else None
        return self.memo[token]
