"""``SpecConfig``: the parsed and validated speculative settings one engine runs with.

The dataclass and its lookups live here; the field checks are in ``rules`` and
the translation of vLLM's dicts is in ``vllm``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Optional

from funcspec import methods
from funcspec.capture.backends import BACKENDS  # the capture layer owns backend names
from funcspec.config import rules, vllm
from funcspec.config.additional import DynamicSpecConfig, RejectionSamplerConfig
from funcspec.config.checks import SPEC, check_int
from funcspec.token_tree import DynamicTree, TokenTree

NPU_MAX_QUERY_TOKENS = 16
"""``npu_fused_infer_attention_score`` takes at most this many query tokens per decode round."""


@dataclasses.dataclass(frozen=True, init=False)
class SpecConfig:
    """A parsed and validated vLLM ``speculative_config``, plus vLLM-Ascend's ``additional_config`` keys.

    Build it from vLLM dicts with :meth:`from_vllm`. Direct construction runs the
    same checks and fills in the n-gram window defaults. It does not resolve
    aliases or the other vLLM fallbacks, and it does not look at the filesystem.
    Either way the fields are resolved first (:func:`funcspec.config.rules.resolve`)
    and each is set once, to its final value: a built config is never rewritten.

    Attributes:
        method: the canonical vLLM method name (see ``funcspec.methods``).
        num_speculative_tokens: the most drafts per step (``max_k`` inside
            funcspec), >= 1 (exactly 1 for extract_hidden_states).
        model: the local draft checkpoint directory, or ``None`` for the
            model-free methods (ngram, suffix, echo, extract_hidden_states) and
            for mtp without one (it then reuses the target's own MTP layers).
        prompt_lookup_min, prompt_lookup_max: the n-gram window (ngram only,
            else ``None``). vLLM's defaults: 5..5, or the given bound for both.
        num_speculative_tokens_per_batch_size: sorted ``(start_bs, end_bs, K)``
            triples, or ``None``. See :meth:`k_for_batch_size`. With a token
            tree K is the node count N that batch size drafts (<= the tree's size).
        rejection_sample_method: "standard", "block" or "synthetic".
        synthetic_acceptance_rates: the per-position unconditional rates for
            "synthetic" (a given ``synthetic_acceptance_length`` is resolved to
            rates); ``None`` otherwise.
        suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests,
        suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob: suffix
            decoding settings, with vLLM's defaults.
        eagle_aux_hidden_state_layer_ids: the target layers whose hidden states
            the method reads, from ``draft_model_config.hf_config``, or ``None``
            (the proposer's default).
        rejection_sampler: vLLM-Ascend's block and entropy verify settings.
        draft_window_size: the draft KV sliding window W, or ``None`` (off).
        dynamic_spec: the confidence-based verify length, or ``None``.
        draft_tensor_parallel_size: ``None`` or 1 replicates the drafter on
            every tensor-parallel rank; N > 1 shards it across the target's N
            ranks like the target (``draft_model`` only; N must equal the
            engine's ``tensor_parallel_size``, which the engine checks).
        speculative_token_tree: vLLM's static token tree, breadth-first, or
            ``None`` (a chain). ``num_speculative_tokens`` is its node count; a
            step that drafts N nodes (the batch-size table) uses its first N.
        dynamic_tree: an EAGLE-2 dynamic tree (SGLang's ``speculative_eagle_topk``,
            ``speculative_num_steps``, ``speculative_num_draft_tokens``), or ``None``;
            a step that drafts N nodes keeps its best N (``token_tree.truncate``).
        quantization: quantize the drafter's own weights on load (``"int8"``,
            ``"int4"``, ...: :data:`funcspec.quant.formats.SCHEMES`), or ``None``
            (vLLM's ``speculative_config.quantization``). Tensors the drafter shares
            with the target (an LM head) are the target's, as the target was prepared.
        ignored_keys: the given keys, as dotted paths, that vLLM accepts but
            that have no effect in funcspec. The caller warns about them once.
    """

    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    num_speculative_tokens_per_batch_size: Optional[tuple[tuple[int, int, int], ...]] = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: Optional[tuple[float, ...]] = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    eagle_aux_hidden_state_layer_ids: Optional[tuple[int, ...]] = None
    rejection_sampler: RejectionSamplerConfig = RejectionSamplerConfig()
    draft_window_size: Optional[int] = None
    dynamic_spec: Optional[DynamicSpecConfig] = None
    draft_tensor_parallel_size: Optional[int] = None
    speculative_token_tree: Optional[TokenTree] = None
    dynamic_tree: Optional[DynamicTree] = None
    quantization: Optional[str] = None
    ignored_keys: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Take the fields as the dataclass would (positional in field order, or by name), resolve them
        (``rules.resolve``: checks, defaults, normalised values), then set each once."""
        try:
            bound = _SIGNATURE.bind(*args, **kwargs)
        except TypeError as err:  # a missing or unknown argument, as the generated __init__ would say
            raise TypeError(f"SpecConfig(): {err}") from None
        bound.apply_defaults()
        # NOTE: object.__setattr__ is how a frozen dataclass's generated __init__ sets its fields too.
        for name, value in rules.resolve(bound.arguments).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_vllm(
        cls,
        speculative_config: Optional[Mapping | str],
        additional_config: Optional[Mapping | str] = None,
        *,
        check_paths: bool = True,
        target: Optional[str] = None,
    ) -> Optional["SpecConfig"]:
        """Parse vLLM's ``speculative_config`` (and vLLM-Ascend's ``additional_config``).

        Each argument may be a dict or the JSON string given to ``--speculative-config``
        or ``--additional-config``. Returns ``None`` when ``speculative_config`` is
        ``None``; ``additional_config`` is still validated then (its verifier and
        drafting keys are named in a warning: without speculation they do nothing).
        With ``check_paths`` (the default) ``model`` must be an existing local path. A
        missing ``num_speculative_tokens`` is filled in as vLLM does: from a draft
        ``config.json``'s ``n_predict``, or for ``mtp`` from ``num_nextn_predict_layers`` of
        the MTP checkpoint (``model``, else the ``target`` checkpoint directory).
        """
        fields = vllm.spec_fields(speculative_config, additional_config, check_paths, target)
        return None if fields is None else cls(**fields)

    @property
    def tree(self) -> Optional[TokenTree | DynamicTree]:
        """The token tree every step drafts (static or dynamic), or ``None`` for chains."""
        return self.speculative_token_tree or self.dynamic_tree

    @property
    def max_k(self) -> int:
        """The largest K of any step, derived here only: ``num_speculative_tokens`` for a method that
        speculates, 0 for one that does not (``extract_hidden_states`` decodes autoregressively)."""
        return self.num_speculative_tokens if methods.lookup(self.method).speculates else 0

    def k_for_batch_size(self, bs: int) -> int:
        """K for a step with ``bs`` active requests, from ``num_speculative_tokens_per_batch_size``.

        This is vLLM's lookup. A batch size inside a range uses that range's K.
        A gap, or a batch size past the last range, inherits the K of the range
        before it. K is clamped to :attr:`max_k`. K = 0 means no
        drafting. ``bs`` 0 gives 0. Without a table, K is :attr:`max_k`.
        With a token tree, K is the node count N the step drafts (the tree cut to
        N nodes, :func:`funcspec.token_tree.truncate`).
        """
        check_int("bs", bs, lo=0)
        table = self.num_speculative_tokens_per_batch_size
        if table is None:
            return self.max_k
        k = 0
        for start, _end, range_k in table:
            if bs < start:
                break
            k = range_k
        return min(k, self.max_k)

    @property
    def verifier_method(self) -> str:
        """The verifier rule: "synthetic", "block", "magicmtp", "entropy" or "standard".

        Greedy rows (temperature 0) are handled inside every rule, so greedy is
        not a config choice. MagicMTP combined with entropy verification is
        "magicmtp" with :attr:`verify_entropy` set.
        """
        return rules.verifier_method(self.rejection_sample_method, self.rejection_sampler)

    @property
    def verify_entropy(self) -> bool:
        """Whether the entropy-adjusted threshold applies (rules "entropy" and "magicmtp" only)."""
        return self.rejection_sampler.enable_entropy_verify and self.verifier_method in ("entropy", "magicmtp")

    def validate_for_backend(self, backend: str) -> None:
        """Refuse settings that ``backend`` cannot capture.

        On "aclgraph", ``npu_fused_infer_attention_score`` takes at most 16 query
        tokens per decode round, so ``num_speculative_tokens + 1 <= 16``. Resolve
        "auto" to a concrete backend before calling this.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "aclgraph" and self.num_speculative_tokens + 1 > NPU_MAX_QUERY_TOKENS:
            raise ValueError(
                f"{SPEC}num_speculative_tokens must be <= {NPU_MAX_QUERY_TOKENS - 1} on backend "
                f"'aclgraph': npu_fused_infer_attention_score takes at most {NPU_MAX_QUERY_TOKENS} "
                f"query tokens per decode round (num_speculative_tokens + 1 <= {NPU_MAX_QUERY_TOKENS}), "
                f"got {self.num_speculative_tokens}"
            )


def _signature(cls: type) -> inspect.Signature:
    """The signature a dataclass's generated ``__init__`` would have: every field, in order, with its default."""
    empty = inspect.Parameter.empty
    return inspect.Signature([
        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          default=empty if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
    ])


_SIGNATURE = _signature(SpecConfig)
SpecConfig.__signature__ = _SIGNATURE  # type: ignore[attr-defined]  # help() and inspect show the fields, not (*args, **kwargs)
