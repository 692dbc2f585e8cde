"""The engine's plan: what an engine's arguments decide about its steps, resolved once.

:func:`plan_engine` is pure. It reads the parsed ``SpecConfig``, the target's
``ModelConfig`` and kernels, and the engine's arguments, and returns an
:class:`EnginePlan` before any weight is prepared or any graph captured. The
engine, the runner and the scheduler read the plan; none of them re-derives the
largest K, the cache length, the buckets, the tree a bucket drafts, the rule
that verifies it in each sampling mode, or the graph a bucket's mode runs in.
Each of those is a table of the plan, built once (``shapes``, ``verify_rules``,
``graph_modes``); ``tests/unit/test_decisions.py`` fails where another module
derives one again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Collection, Mapping
from typing import Any, Optional, Sequence

import torch

from funcspec import methods, sampling
from funcspec.capture import STARTUP_SAMPLING, BucketPlan, resolve_backend
from funcspec.config import SpecConfig
from funcspec.config.additional import DynamicSpecConfig, RejectionSamplerConfig
from funcspec.kernels import Ops
from funcspec.nn import ModelConfig
from funcspec.sampling import Mode
from funcspec.token_tree import Chain, DynamicTree, Shape, TokenTree, truncate
from funcspec.verifiers import VerifyConfig


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """An engine's static decisions (hashable, never traced).

    Attributes:
        spec: the parsed speculative config, or ``None`` (autoregressive decoding;
            ``extract_hidden_states`` decodes autoregressively too).
        max_k: the largest K of any step (``SpecConfig.max_k``; a token tree's node count).
        max_model_len: the prompt + output limit.
        t_max: KV positions per slot, ``max_model_len + max_k + 1``: a full block
            verified past the limit never writes out of bounds.
        num_slots: KV slots (``max_num_seqs``), plus the scratch slot.
        backend: the resolved capture backend.
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
    bucket_plan: BucketPlan
    tree_frontiers: bool = True

    @property
    def startup(self) -> bool:
        """Every graph is captured before the engine returns (``BucketPlan.startup``)."""
        return self.bucket_plan.startup

    @property
    def tree(self) -> Optional[TokenTree | DynamicTree]:
        """The engine's token tree (``TokenTree`` or ``DynamicTree``), or ``None`` for chains."""
        return self.spec.tree if self.spec is not None else None

    @property
    def synthetic_rates(self) -> Optional[tuple[float, ...]]:
        """The synthetic verifier's per-position rates as configured, or ``None``."""
        rates = self.spec.synthetic_acceptance_rates if self.spec is not None else None
        return None if rates is None else tuple(rates)

    @functools.cached_property
    def shapes(self) -> dict[int, Shape]:
        """K -> the shape a bucket of K = N drafts proposes and verifies, for every K from 0 to ``max_k``:
        the engine's tree cut to N nodes (``token_tree.truncate``), or the ``Chain`` of K (chains, and K = 0).
        The one place the cut is made: the step hands it to in-graph proposers (``StepContext.tree``), the
        engine to host drafters."""
        return {k: bucket_shape(self.tree, k, self.tree_frontiers) for k in range(self.max_k + 1)}

    @functools.cached_property
    def verify_rules(self) -> dict[tuple[int, str], VerifyConfig]:
        """(K, mode name) -> the complete rule that verifies a bucket of K drafts whose rows sample in that
        mode (:func:`verify_rule`), for every K of :attr:`shapes` and every mode of ``sampling.MODES``."""
        return {(k, name): verify_rule(self.spec, k, shape, mode)
                for k, shape in self.shapes.items() for name, mode in sampling.MODES.items()}

    @functools.cached_property
    def graph_modes(self) -> dict[str, Mode]:
        """Mode name -> the mode of the graph that runs a bucket of that mode (:func:`graph_modes`)."""
        return graph_modes(self.startup)

    def bucket_tree(self, k: int) -> Shape:
        """The shape of a bucket of K drafts (:attr:`shapes`); a K outside 0..``max_k`` is a ``ValueError``."""
        if k not in self.shapes:
            raise ValueError(f"k must be in 0..{self.max_k} (this engine's largest K), got {k!r}")
        return self.shapes[k]

    def verify(self, k: int, mode: Mode = sampling.FILTERED) -> VerifyConfig:
        """The rule that verifies a bucket of K drafts in ``mode`` (:attr:`verify_rules`), read, never rebuilt."""
        self.bucket_tree(k)  # a K outside the plan is a ValueError naming k
        return self.verify_rules[k, mode.name]

    def to_dict(self) -> dict[str, Any]:
        """This plan as plain data (dicts, lists, str, int, float, bool, ``None``; JSON-able): what a
        tensor-parallel rank 0 sends its followers, which run it instead of planning from their own
        arguments. Each dataclass is a dict of its fields, each tuple a list; :meth:`from_dict` inverts it."""
        return _plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EnginePlan":
        """The plan :meth:`to_dict` wrote (``EnginePlan.from_dict(p.to_dict()) == p``, through JSON too).

        Lists become tuples again and each nested config is rebuilt through its own constructor (its
        checks run again); a missing or unknown field is a ``ValueError`` naming it.
        """
        d = _fields(cls, d, "EnginePlan", nested=("spec", "bucket_plan"))
        spec = None if d["spec"] is None else _spec(d["spec"])
        buckets = BucketPlan(**_fields(BucketPlan, d["bucket_plan"], "EnginePlan.bucket_plan"))
        return cls(**{**d, "spec": spec, "bucket_plan": buckets})


def bucket_shape(tree: Optional[TokenTree | DynamicTree], k: int, frontiers: bool = True) -> Shape:
    """The shape a bucket of K = N drafts proposes: ``tree`` cut to N nodes, or the ``Chain`` of K (no tree,
    or K = 0). ``frontiers``: a draft network expands the tree's frontiers (``token_tree.truncate``)."""
    return truncate(tree, k, frontiers) if tree is not None and k > 0 else Chain(k)


def verify_rule(spec: Optional[SpecConfig], k: int, shape: Optional[Shape] = None,
                mode: Mode = sampling.FILTERED) -> VerifyConfig:
    """The complete rule that verifies a bucket of K drafts of ``shape`` (``None``: a chain) in ``mode``.

    The rule depends on the speculative config only (not on the proposer), so every method's buckets share
    it: a bucket of no drafts (K = 0, and decoding without a speculative config: ``spec=None``) is verified
    by the standard rule, whose keyed draw of its one token is decoding's own; a token tree by ``"tree"``;
    a chain by the configured rule. ``mode`` sets ``filters`` and ``greedy`` (the rows' sampling).
    """
    modal = functools.partial(VerifyConfig, filters=mode.filters, greedy=mode.greedy)
    if k == 0 or spec is None:
        return modal()
    if shape is not None and not isinstance(shape, Chain):
        return modal(method="tree", depth=shape.depth)
    rs, rates = spec.rejection_sampler, spec.synthetic_acceptance_rates
    return modal(method=spec.verifier_method, posterior_threshold=rs.posterior_threshold,
                 posterior_alpha=rs.posterior_alpha, entropy=spec.verify_entropy,
                 synthetic_rates=None if rates is None else tuple(rates)[:k])


def graph_modes(startup: bool) -> dict[str, Mode]:
    """Mode name -> the mode of the graph that runs a bucket of that mode, for every ``sampling.MODES``.

    Captured on first use (``startup=False``), a bucket runs in its own mode's graph. After a start-up
    capture, a mode of ``STARTUP_SAMPLING`` runs in its own graph and every other in the general mode's
    (``filtered`` serves every request: a ``random`` bucket's rows have top-k and top-p off, so it draws
    the same), so that no step compiles; a logprobs mode runs in ``filtered_logprobs``, captured at start-up
    under ``capture_logprobs`` (:func:`startup_modes`), else on its first use.
    """
    def graph(mode: Mode) -> Mode:
        own = not mode.logprobs and mode.name in STARTUP_SAMPLING
        return mode if not startup or own else sampling.FILTERED.with_logprobs(mode.logprobs)

    return {name: graph(mode) for name, mode in sampling.MODES.items()}


def startup_modes(logprobs: bool = False) -> tuple[Mode, ...]:
    """The modes whose graphs a start-up capture compiles: those of ``STARTUP_SAMPLING``, the graphs
    :func:`graph_modes` runs every mode without logprobs in, and with ``logprobs`` (``capture_logprobs``) the
    general mode with them."""
    return tuple(sampling.MODES[name] for name in STARTUP_SAMPLING) + \
        ((sampling.FILTERED.with_logprobs(),) if logprobs else ())


def _plain(value: Any) -> Any:
    """``value`` as plain data: a dataclass as a dict of its fields, a tuple as a list (recursively)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    """Lists as tuples, recursively (every sequence of a plan is a tuple)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _fields(cls: type, d: Any, name: str, nested: Collection[str] = ()) -> dict[str, Any]:
    """``d``'s entries once they are exactly ``cls``'s fields, lists as tuples (except in the ``nested``
    configs, which the caller reads with their own fields)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{name} must be a dict of its fields, got {type(d).__name__}")
    want = [f.name for f in dataclasses.fields(cls)]
    for key in d:
        if key not in want:
            raise ValueError(f"{name} has no field {key!r} (fields: {want})")
    missing = [k for k in want if k not in d]
    if missing:
        raise ValueError(f"{name}.{missing[0]} is missing")
    return {k: v if k in nested else _tuples(v) for k, v in d.items()}


def _spec(d: Any) -> SpecConfig:
    """A :class:`SpecConfig` from its :func:`_plain` dict (``SpecConfig`` resolves a resolved config to itself)."""
    nested = {"rejection_sampler": RejectionSamplerConfig, "dynamic_spec": DynamicSpecConfig,
              "speculative_token_tree": TokenTree, "dynamic_tree": DynamicTree}
    d = _fields(SpecConfig, d, "EnginePlan.spec", nested)
    for key, kind in nested.items():
        if d[key] is not None:
            d[key] = kind(**_fields(kind, d[key], f"EnginePlan.spec.{key}"))
    return SpecConfig(**d)


ALLOW_LONG_MAX_MODEL_LEN = "FUNCSPEC_ALLOW_LONG_MAX_MODEL_LEN"
"""Set to 1 to allow a ``max_model_len`` above the model's maximum (vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""


def model_max_len(cfg: ModelConfig) -> int:
    """The longest context the model was built for, as vLLM derives it: ``max_position_embeddings``, times the
    factor of a linear RoPE scaling (which stretches positions)."""
    rope = dict(cfg.rope_scaling)
    factor = rope.get("factor", 1) if rope.get("rope_type", rope.get("type")) == "linear" else 1
    return int(cfg.max_position_embeddings * factor)


def check_model_len(max_model_len: int, derived: int) -> None:
    """Refuse a ``max_model_len`` above the model's maximum, naming both, as vLLM does; with
    :data:`ALLOW_LONG_MAX_MODEL_LEN` set to 1, warn instead."""
    if max_model_len <= derived:
        return
    message = (f"max_model_len={max_model_len} is above this model's maximum context of {derived} tokens "
               "(max_position_embeddings in its config.json): positions past it were never trained, and RoPE models "
               "decode garbage there")
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
        raise ValueError(f"{message}. Lower max_model_len, or set {ALLOW_LONG_MAX_MODEL_LEN}=1 to run it anyway")
    warnings.warn(f"{message}; allowed by {ALLOW_LONG_MAX_MODEL_LEN}=1", stacklevel=3)


def plan_engine(spec: Optional[SpecConfig], cfg: ModelConfig, ops: Ops, *, backend: str, device, dtype: torch.dtype,
                max_batch_size: int, max_model_len: Optional[int], batch_buckets: Optional[Sequence[int]],
                context_buckets: Optional[Sequence[int]], capture: str) -> EnginePlan:
    """Resolve an engine's plan from its arguments, each checked already (:class:`~funcspec.args.EngineArgs`,
    which checks ``speculative_config`` against the backend ``auto`` resolves to); what only the target's
    config can judge is a ``ValueError`` naming it."""
    max_k = spec.max_k if spec is not None else 0
    backend = resolve_backend(backend, device)
    if max_model_len is None:
        max_model_len = min(cfg.max_position_embeddings, 2048)
    check_model_len(max_model_len, model_max_len(cfg))
    t_max = max_model_len + max_k + 1
    tree = spec is not None and spec.tree is not None
    # a tree with a batch-size table drafts N(n) of its nodes at n active rows: bucket (B, N)
    sizes = [spec.k_for_batch_size(n) for n in range(1, max_batch_size + 1)] \
        if spec is not None and tree and spec.num_speculative_tokens_per_batch_size else None
    if context_buckets is None and not cfg.mla.kv_lora_rank and ops.reads_live_only(dtype, cfg.head_dim, device):
        context_buckets = (t_max,)  # the decode kernel reads only live positions: one context bucket
        # NOTE: latent attention (MLA) takes the reference attention, which reads the whole bucket
    startup = capture == "startup" and backend != "eager"  # eager has nothing to capture
    # NOTE: one graph for every batch above 1 only where no product picks its path by the row count
    symbolic = backend == "inductor" and ops.rows_free(dtype)
    buckets = BucketPlan.for_engine(max_batch_size, max_k, batch_buckets, startup, t_max, context_buckets,
                                    tree=tree, tree_sizes=sizes, symbolic_batch=symbolic)
    frontiers = spec is None or methods.lookup(spec.method).model != methods.NONE
    return EnginePlan(spec, max_k, max_model_len, t_max, max_batch_size, backend, buckets, frontiers)
