"""The engine's plan: what an engine's arguments decide about its steps, resolved once.

:func:`plan_engine` is pure. It reads the parsed ``SpecConfig``, the target's
``ModelConfig`` and kernels, and the engine's arguments, and returns an
:class:`EnginePlan` before any weight is prepared or any graph captured. The
engine, the runner and the scheduler read the plan; none of them re-derives the
largest K, the cache length, the buckets, the tree a bucket drafts or the rule
that verifies it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from funcspec import methods
from funcspec.capture import BucketPlan, resolve_backend
from funcspec.config import SpecConfig
from funcspec.kernels import Ops
from funcspec.nn import ModelConfig
from funcspec.token_tree import truncate
from funcspec.verifiers import VerifyConfig, verify_config


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """An engine's static decisions (hashable, never traced).

    Attributes:
        spec: the parsed speculative config, or ``None`` (autoregressive decoding;
            ``extract_hidden_states`` decodes autoregressively too).
        max_k: the largest K of any step (``num_speculative_tokens``; a token tree's node count).
        max_model_len: the prompt + output limit.
        t_max: KV positions per slot, ``max_model_len + max_k + 1``: a full block
            verified past the limit never writes out of bounds.
        num_slots: KV slots (``max_num_seqs``), plus the scratch slot.
        backend: the resolved capture backend.
        startup: every graph is captured before the engine returns.
        bucket_plan: the (B, K, T) buckets and their graphs (:class:`~funcspec.capture.BucketPlan`).
        tree_frontiers: a draft network expands a tree's frontiers (``False`` for
            ngram and suffix, which caps the depth of a cut dynamic tree).
    """

    spec: Optional[SpecConfig]
    max_k: int
    max_model_len: int
    t_max: int
    num_slots: int
    backend: str
    startup: bool
    bucket_plan: BucketPlan
    tree_frontiers: bool = True

    @property
    def tree(self):
        """The engine's token tree (``TokenTree`` or ``DynamicTree``), or ``None`` for chains."""
        return self.spec.tree if self.spec is not None else None

    @property
    def synthetic_rates(self) -> Optional[tuple[float, ...]]:
        """The synthetic verifier's per-position rates as configured, or ``None``."""
        rates = self.spec.synthetic_acceptance_rates if self.spec is not None else None
        return None if rates is None else tuple(rates)

    def verify(self, k: int) -> Optional[VerifyConfig]:
        """The rule that verifies a bucket of K drafts (``None`` without speculation)."""
        return verify_config(self.spec, k) if self.spec is not None else None

    def bucket_tree(self, k: int):
        """The token tree a bucket of K = N drafts proposes and verifies: the engine's tree cut to N nodes
        (``token_tree.truncate``), or ``None`` for chains and K = 0. The one place the cut is made: the
        step hands it to in-graph proposers (``StepContext.tree``), the engine to host drafters."""
        return truncate(self.tree, k, self.tree_frontiers) if self.tree is not None and k > 0 else None


def plan_engine(spec: Optional[SpecConfig], cfg: ModelConfig, ops: Ops, *, backend: str, device, dtype: torch.dtype,
                max_batch_size: int, max_model_len: Optional[int], batch_buckets: Optional[Sequence[int]],
                context_buckets: Optional[Sequence[int]], capture: str) -> EnginePlan:
    """Resolve an engine's plan from its parsed arguments; a bad value is a ``ValueError`` naming it."""
    max_k = spec.num_speculative_tokens if spec is not None else 0
    if spec is not None:
        spec.validate_for_backend(backend)  # before importing torch_npu: report K+1 <= 16 first
    backend = resolve_backend(backend, device)
    if max_model_len is None:
        max_model_len = min(cfg.max_position_embeddings, 2048)
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    t_max = max_model_len + max_k + 1
    tree = spec is not None and spec.tree is not None
    # a tree with a batch-size table drafts N(n) of its nodes at n active rows: bucket (B, N)
    sizes = [spec.k_for_batch_size(n) for n in range(1, max_batch_size + 1)] \
        if tree and spec.num_speculative_tokens_per_batch_size else None
    if context_buckets is None and ops.reads_live_only(dtype, cfg.head_dim, device):
        context_buckets = (t_max,)  # the decode kernel reads only live positions: one context bucket
    startup = capture == "startup" and backend != "eager"  # eager has nothing to capture
    buckets = BucketPlan.for_engine(max_batch_size, max_k, batch_buckets, startup, t_max, context_buckets,
                                    tree=tree, tree_sizes=sizes, symbolic_batch=backend == "inductor")
    frontiers = spec is None or methods.lookup(spec.method).model != methods.NONE
    return EnginePlan(spec, max_k, max_model_len, t_max, max_batch_size, backend, startup, buckets, frontiers)
