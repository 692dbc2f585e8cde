"""Bucket plans: which (B, K, T) graphs exist, and how a live batch maps onto them."""

from __future__ import annotations

import bisect
import dataclasses


def default_batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two up to ``max_batch_size``, plus ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return tuple(out + [max_batch_size])


MIN_CONTEXT_BUCKET = 256
"""The smallest context bucket: below it, attention is a small part of a step."""


def default_context_buckets(t_max: int) -> tuple[int, ...]:
    """Powers of two from ``MIN_CONTEXT_BUCKET`` below ``t_max``, plus ``t_max`` itself."""
    out, t = [], MIN_CONTEXT_BUCKET
    while t < t_max:
        out.append(t)
        t *= 2
    return tuple(out + [t_max])


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The static (B, K, T) buckets one engine captures.

    Attributes:
        batch_buckets: sorted, distinct batch sizes.
        ks: sorted, distinct K values (0 is autoregressive decoding).
        eager_capture: capture every bucket up front (else on first use).
        context_buckets: sorted, distinct KV lengths T that attention reads; a
            step takes the smallest that holds every row's live tokens, so its
            cost follows the live context, not the cache's capacity. Empty: one
            bucket, the whole cache.
    """

    batch_buckets: tuple[int, ...]
    ks: tuple[int, ...] = (0,)
    eager_capture: bool = False
    context_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "context_buckets", tuple(self.context_buckets))
        if list(self.context_buckets) != sorted(set(self.context_buckets)) or \
                any(t < 1 for t in self.context_buckets):
            raise ValueError(f"BucketPlan.context_buckets must be sorted, distinct and >= 1, "
                             f"got {list(self.context_buckets)}")
        for name in ("batch_buckets", "ks"):
            vals = tuple(getattr(self, name))
            object.__setattr__(self, name, vals)
            if not vals:
                raise ValueError(f"BucketPlan.{name} must not be empty")
            if list(vals) != sorted(set(vals)):
                raise ValueError(f"BucketPlan.{name} must be sorted and distinct, got {list(vals)}")
        if self.batch_buckets[0] < 1:
            raise ValueError(f"BucketPlan.batch_buckets must be >= 1, got {list(self.batch_buckets)}")
        if self.ks[0] < 0:
            raise ValueError(f"BucketPlan.ks must be >= 0, got {list(self.ks)}")

    @staticmethod
    def for_engine(max_batch_size: int, max_k: int, batch_buckets=None, eager_capture=False,
                   t_max: int | None = None, context_buckets=None, tree: bool = False) -> "BucketPlan":
        """Default plan: power-of-two batches, K from 0 to ``max_k``, power-of-two contexts up to ``t_max``.

        With a token ``tree`` of ``max_k`` = N nodes a bucket is (B, N): K is 0 or N
        (a tree has one size), and a step verifies N + 1 tokens per row.
        """
        buckets = default_batch_buckets(max_batch_size) if batch_buckets is None else tuple(batch_buckets)
        if context_buckets is None:
            context_buckets = default_context_buckets(t_max) if t_max is not None else ()
        elif t_max is not None and (not context_buckets or max(context_buckets) != t_max):
            raise ValueError(f"context_buckets must end at the cache length {t_max} (max_model_len + K + 1), "
                             f"got {list(context_buckets)}")
        ks = (0, max_k) if tree else tuple(range(max_k + 1))
        return BucketPlan(buckets, ks, eager_capture, tuple(context_buckets))

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (B, K) pair."""
        return [(b, k) for b in self.batch_buckets for k in self.ks]

    def context_bucket(self, n: int):
        """The smallest context bucket of at least ``n`` positions (``None`` without context buckets)."""
        if not self.context_buckets:
            return None
        i = bisect.bisect_left(self.context_buckets, n)
        if i == len(self.context_buckets):
            raise ValueError(f"context of {n} positions exceeds the largest bucket {self.context_buckets[-1]}")
        return self.context_buckets[i]

    def batch_bucket(self, n: int) -> int:
        """The smallest batch bucket that holds ``n`` rows."""
        i = bisect.bisect_left(self.batch_buckets, n)
        if i == len(self.batch_buckets):
            raise ValueError(f"batch of {n} exceeds the largest bucket {self.batch_buckets[-1]}")
        return self.batch_buckets[i]

    def capture_sizes(self) -> dict[int, list[int]]:
        """Per K, the token counts n·(K+1) that FULL-graph capture sees (vLLM-Ascend's capture sizes)."""
        return {k: [b * (k + 1) for b in self.batch_buckets] for k in self.ks}
