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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from funcspec.proposers import keep_state, no_prefill
from funcspec.types import PLACEHOLDER, Proposal


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
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n_min/n_max: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    B, T = history.shape
    pos = torch.arange(T, device=history.device)  # [T]
    n_tok = lens.clamp(0, T)  # [B]

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

    # Only ends e <= N-2 are earlier occurrences; this also masks the garbage tail.
    earlier = pos[None, :] <= n_tok[:, None] - 2  # [B, T]
    run = torch.where(earlier, run, 0)  # [B, T]
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


# ---------------------------------------------------------------- protocol (DESIGN §4)

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
    """Drafts [B, K] from each row's history (prompt, output and the pending token)."""
    # NOTE: only the bucket's context is searched: every row's tokens lie below it.
    history = ctx.history[:, : ctx.read.length][ctx.slots]  # [B, T]
    drafts, _ = ngram_propose(history, ctx.lens + 1, k, cfg.n_min, cfg.n_max, cfg.max_model_len)
    return Proposal(drafts), state
