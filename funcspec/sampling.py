"""Logit processing and sampling shared by autoregressive decoding and verifiers.

Both paths call :func:`target_probs`, so speculative decoding verifies against
exactly the distribution that plain sampling draws from (ARCHITECTURE.md, "Contract").

Per-row parameters are tensors, so one captured graph serves any mix of
sampling settings: ``temperature [B]`` (0 means greedy), ``top_k [B]`` int64
(0 means off), ``top_p [B]`` in (0, 1].
"""

from __future__ import annotations

import dataclasses

import torch

from funcspec import rng
from funcspec.kernels.argmax import first_max


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a bucket's rows need from sampling (static: part of the bucket's key).

    The host knows every request's parameters, so it picks the cheapest mode
    that serves all rows, as vLLM's sampler skips top-k/top-p when every row
    has them off:

    Attributes:
        greedy: every row has temperature 0: argmax only, O(V), no
            probabilities, no exponential race.
        filters: some row has top-k or top-p on: the O(V log V) sort runs.
        logprobs: some row asked for logprobs: the step also returns the
            target's log-probabilities of its emitted tokens and their top
            ``logprobs.MAX_LOGPROBS`` (``logprobs.token_logprobs``). Buckets
            without such rows do none of that work.
    """

    greedy: bool = False
    filters: bool = True
    logprobs: bool = False

    @property
    def name(self) -> str:
        """``greedy``, ``random`` or ``filtered``, with ``_logprobs`` appended when the rows need them."""
        base = "greedy" if self.greedy else "filtered" if self.filters else "random"
        return base + "_logprobs" if self.logprobs else base

    def with_logprobs(self, on: bool = True) -> "Mode":
        """The same sampling with (or without) logprobs (``self`` when unchanged, so the named modes stay
        singletons)."""
        return self if self.logprobs == on else dataclasses.replace(self, logprobs=on)


GREEDY = Mode(greedy=True, filters=False)
RANDOM = Mode(greedy=False, filters=False)
FILTERED = Mode(greedy=False, filters=True)
"""The general mode: serves any mix of rows."""
MODES = {m.name: m for base in (GREEDY, RANDOM, FILTERED) for m in (base, base.with_logprobs())}

def mode_for(params) -> Mode:
    """The cheapest mode serving requests with these ``SamplingParams`` (or ``Sampling``-like) values."""
    params = list(params)
    logprobs = any(getattr(p, "logprobs", None) is not None for p in params)
    if all(p.temperature <= 0 for p in params):
        mode = GREEDY
    elif any(p.top_k > 0 or p.top_p < 1.0 for p in params if p.temperature > 0):
        mode = FILTERED
    else:
        mode = RANDOM
    return mode.with_logprobs(logprobs)


def _broadcast_rows(x, ref: torch.Tensor, dtype) -> torch.Tensor:
    """Broadcast a float/int or [B] tensor to ``[B, 1, ..., 1]`` matching ``ref``'s rank."""
    x = torch.as_tensor(x, dtype=dtype, device=ref.device)
    if x.dim() == 0:
        x = x.expand(ref.shape[0])
    return x.reshape((ref.shape[0],) + (1,) * (ref.dim() - 1))


def apply_top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Mask logits [B, ..., V] outside top-k, then outside the top-p nucleus, to -inf.

    Ties at the k-th value are all kept, as in vLLM. The nucleus keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (always at
    least one token).
    """
    vocab = logits.shape[-1]
    k = _broadcast_rows(top_k, logits, torch.int64)
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab))
    p = _broadcast_rows(top_p, logits, torch.float32)
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)  # [B, ..., V]
    kth = torch.gather(sorted_logits, -1, (k - 1).expand(*logits.shape[:-1], 1))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # mass strictly before each sorted position: keep while it is < top_p
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = (before < p) | (p >= 1.0)  # top_p = 1 keeps every token (fp32 cumsums can round past 1)
    # the smallest kept logit is the nucleus threshold
    thresh = torch.where(keep, sorted_logits, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < thresh, float("-inf"))


def target_probs(logits: torch.Tensor, temperature, top_k=0, top_p=1.0, filters: bool = True) -> torch.Tensor:
    """The sampling distribution [B, ..., V] float32 for raw logits [B, ..., V].

    Temperature, then top-k, then top-p. Rows with temperature 0 get the
    one-hot distribution of ``argmax`` (first index on ties), which makes every
    verifier reduce to greedy verification on those rows. ``filters=False``
    (static) skips top-k/top-p: only valid when every row has them off.
    """
    logits = logits.float()
    t = _broadcast_rows(temperature, logits, torch.float32)
    greedy = t <= 0
    scaled = logits / torch.where(greedy, 1.0, t)
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p) if filters else scaled, dim=-1)
    onehot = torch.nn.functional.one_hot(first_max(logits), logits.shape[-1]).float()
    return torch.where(greedy, onehot, probs)


def sample(key: torch.Tensor, logits: torch.Tensor, temperature, top_k=0, top_p=1.0,
           mode: Mode = FILTERED) -> torch.Tensor:
    """Sample token ids [B, ...] from logits [B, ..., V] with per-row keys ``key [B, ...]``."""
    return draw(key, logits, temperature, top_k, top_p, mode)[0]


def draw(key: torch.Tensor, logits: torch.Tensor, temperature, top_k=0, top_p=1.0, mode: Mode = FILTERED):
    """Token ids [B, ...] and their distribution q [B, ..., V], or ``None`` under ``GREEDY``.

    Under ``GREEDY`` the token is ``argmax`` (first index on ties), exactly what
    the one-hot ``target_probs`` and its race give, at O(V) and with no q: a
    greedy draft is deterministic, so verifiers treat q as one-hot.
    """
    if mode.greedy:
        return first_max(logits), None
    q = target_probs(logits, temperature, top_k, top_p, mode.filters)
    return rng.categorical(key, q), q
