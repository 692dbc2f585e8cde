"""Bucket tables: which (B, K, T) graphs exist, and how a live batch maps onto them."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional, Sequence


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


CAPTURE_MODES = ("startup", "lazy")
"""When an engine captures its graphs: all at start-up (nothing compiles once it is built), or each on first use."""

STARTUP_SAMPLING = ("greedy", "filtered")
"""Sampling modes captured at start-up: greedy, and the general mode that serves every other request
(a ``random`` bucket then runs in the ``filtered`` graph; its top-k/top-p are off, so it draws the same)."""


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The static (B, K, T) buckets one engine captures.

    Attributes:
        batch_buckets: sorted, distinct batch sizes.
        ks: sorted, distinct K values (0 is autoregressive decoding).
        startup: the graphs are captured at start-up (``capture="startup"``);
            else each bucket is captured on first use. Which mode's graph runs a
            bucket then is the engine plan's table (``EnginePlan.graph_modes``).
        context_buckets: sorted, distinct KV lengths T that attention reads; a
            step takes the smallest that holds every row's live tokens, so its
            cost follows the live context, not the cache's capacity. Empty: one
            bucket, the whole cache.
        pairs: the sorted (B, K) buckets when only some B pair with some K (a
            token tree with a node count N per batch size); empty: every B with every K.
        symbolic_batch: every batch bucket above 1 shares one graph whose batch
            size is symbolic (inductor); B = 1 keeps its own static graph
            (Dynamo specialises sizes 0 and 1).
    """

    batch_buckets: tuple[int, ...]
    ks: tuple[int, ...] = (0,)
    startup: bool = False
    context_buckets: tuple[int, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    symbolic_batch: bool = False

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
        object.__setattr__(self, "pairs", tuple(tuple(p) for p in self.pairs))
        if list(self.pairs) != sorted(set(self.pairs)) or \
                any(b not in self.batch_buckets or k not in self.ks for b, k in self.pairs):
            raise ValueError(f"BucketPlan.pairs must be sorted, distinct (B, K) of batch_buckets and ks, "
                             f"got {list(self.pairs)}")

    @staticmethod
    def for_engine(max_batch_size: int, max_k: int, batch_buckets=None, startup=False,
                   t_max: int | None = None, context_buckets=None, tree: bool = False,
                   tree_sizes: Optional[Sequence[int]] = None, symbolic_batch: bool = False) -> "BucketPlan":
        """Default plan: power-of-two batches, K from 0 to ``max_k``, power-of-two contexts up to ``t_max``.

        With ``symbolic_batch`` every batch size is its own bucket by default (they
        share one graph, so a batch of 3 runs 3 rows, not 4).

        With a token ``tree`` of ``max_k`` nodes a bucket is (B, N), and a step
        verifies N + 1 tokens per row. ``tree_sizes[n - 1]`` is the N that n active
        rows draft (the batch-size table): the plan holds (B, N) for the N of each
        n that pads to B, and (B, 0) for every B. Without ``tree_sizes``, N is ``max_k``.
        """
        if batch_buckets is None:
            batch_buckets = range(1, max_batch_size + 1) if symbolic_batch else default_batch_buckets(max_batch_size)
        buckets = tuple(batch_buckets)
        symbolic_batch = symbolic_batch and sum(b > 1 for b in buckets) > 1  # one bucket above 1 stays static
        if context_buckets is None:
            context_buckets = default_context_buckets(t_max) if t_max is not None else ()
        elif t_max is not None and (not context_buckets or max(context_buckets) != t_max):
            raise ValueError(f"context_buckets must end at the cache length {t_max} (max_model_len + K + 1), "
                             f"got {list(context_buckets)}")
        if not tree:
            return BucketPlan(buckets, tuple(range(max_k + 1)), startup, tuple(context_buckets),
                              symbolic_batch=symbolic_batch)
        pairs = tree_pairs(sorted(buckets), [max_k] * max_batch_size if tree_sizes is None else tree_sizes)
        ks = tuple(sorted({k for _, k in pairs}))
        return BucketPlan(buckets, ks, startup, tuple(context_buckets), pairs, symbolic_batch)

    def graph_batch(self, b: int) -> int:
        """The batch of the graph that runs bucket B: ``b``, or 0 (any B > 1) with a symbolic batch."""
        return 0 if self.symbolic_batch and b > 1 else b

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (B, K) bucket: ``pairs``, or each B with each K."""
        return list(self.pairs) if self.pairs else [(b, k) for b in self.batch_buckets for k in self.ks]

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
        return {k: [b * (k + 1) for b, kb in self.buckets if kb == k] for k in self.ks}


def tree_pairs(buckets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The sorted (B, N) a tree engine runs: (bucket of n, ``sizes[n - 1]``) for each active batch n
    that a bucket holds, and (B, 0) for every bucket B (sorted ``buckets``)."""
    pairs = {(b, 0) for b in buckets}
    for n, size in enumerate(sizes[: buckets[-1]], start=1):
        pairs.add((buckets[bisect.bisect_left(buckets, n)], size))
    return tuple(sorted(pairs))
