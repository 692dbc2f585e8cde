"""Static configuration: per-request sampling parameters and the parsed ``speculative_config``.

Configs are frozen, hashable dataclasses (DESIGN §3): they are part of a bucket's
key and are never traced. Every constructor validates and normalises its fields,
so an instance is always complete and consistent. A bad value raises
``ValueError`` whose message names the field (DESIGN §8.8), for example
``speculative_config.num_speculative_tokens must be >= 1 for method 'ngram', got 0``.

:meth:`SpecConfig.from_vllm` takes vLLM / vLLM-Ascend ``speculative_config`` and
``additional_config`` dicts unchanged, with local paths in place of hub names.
The semantics follow vLLM's ``SpeculativeConfig`` and vLLM-Ascend's
``AscendConfig``. Each place where funcspec differs is marked ``NOTE:``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from funcspec.capture.backends import BACKENDS  # the capture layer owns backend names

# The field paths that error messages name.
_S = "speculative_config."
_A = "additional_config."
_RS = _A + "rejection_sampler_config."
_DYN = _A + "dynamic_spec_config."

VLLM_METHODS = frozenset(
    {"ngram", "suffix", "medusa", "eagle", "eagle3", "mtp", "dflash", "dspark",
     "draft_model", "extract_hidden_states", "echo"}
)
"""The speculative methods of the vLLM-Ascend guide, under their canonical vLLM names, plus
funcspec's ``echo`` (a benchmark proposer that always drafts; see ``proposers/echo.py``)."""

BUILT_METHODS = frozenset({"ngram", "suffix", "draft_model", "dflash", "dspark", "medusa", "eagle", "eagle3", "mtp",
                           "extract_hidden_states", "echo"})
"""Methods whose proposer exists in ``funcspec/proposers``. Extend it when a proposer lands."""

# vLLM's deprecated per-model MTP method names. vLLM rewrites each to "mtp" with a warning.
_MTP_MODEL_TYPES = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
)

METHOD_ALIASES: Mapping[str, str] = {
    "[ngram]": "ngram",  # vLLM's legacy spelling
    # NOTE: vLLM's "ngram_gpu" is the same n-gram rule run as device tensor ops.
    # funcspec's ngram proposer always runs that way, so the two are one method here.
    "ngram_gpu": "ngram",
    **{name: "mtp" for name in _MTP_MODEL_TYPES},
}
"""Method names vLLM accepts and rewrites to a canonical name."""

# Valid vLLM methods that are outside funcspec's feature set: refused, not "unknown".
_OUT_OF_SCOPE_METHODS = frozenset({"mlp_speculator", "custom_class"})

_MODEL_REQUIRED = frozenset({"eagle", "eagle3", "dflash", "dspark", "medusa", "draft_model"})
_MODEL_FREE = frozenset({"ngram", "suffix", "extract_hidden_states", "echo"})  # mtp: model optional
_AUX_LAYER_METHODS = frozenset({"eagle3", "dflash", "dspark", "extract_hidden_states"})
_WINDOW_METHODS = frozenset({"eagle", "eagle3", "dflash", "dspark", "draft_model"})
# The guide: suffix is already per-request dynamic, DSpark is not supported on the
# batch-size path, and extract_hidden_states does not speculate.
_NO_BATCH_TABLE = frozenset({"suffix", "dspark", "extract_hidden_states"})

REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")
DYNAMIC_SPEC_METHODS = ("dspark", "dflash")
NPU_MAX_QUERY_TOKENS = 16
"""``npu_fused_infer_attention_score`` takes at most this many query tokens per decode round."""

_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
)
_USED_SPEC_KEYS = frozenset(
    {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
     "num_speculative_tokens_per_batch_size", "rejection_sample_method",
     "synthetic_acceptance_rates", "synthetic_acceptance_length", "draft_model_config",
     "enforce_eager", *_SUFFIX_KEYS}
)
# Keys of vLLM's SpeculativeConfig that change nothing in funcspec. They are accepted
# and reported in SpecConfig.ignored_keys. _check_ignored_values refuses the values
# that would change the result.
_IGNORED_SPEC_KEYS = frozenset(
    {"draft_tensor_parallel_size", "disable_padded_drafter_batch", "quantization",
     "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len", "revision",
     "code_revision", "index_share_for_mtp_iteration", "disable_eagle_block_drop",
     "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
     "draft_load_config", "enable_adaptive_verification", "draft_sample_method",
     "dspark_draft_topk"}
)
_KNOWN_SPEC_KEYS = _USED_SPEC_KEYS | _IGNORED_SPEC_KEYS | {"tensor_parallel_size"}
_USED_ADDITIONAL_KEYS = ("rejection_sampler_config", "dynamic_spec_config", "draft_window_size")
_DYN_PARAMS = ("initial_verify_budget_per_req", "budget_update_interval", "budget_threshold",
               "min_verify_tokens")


# ----------------------------------------------------------------------------- checks


def _is_int(value: Any) -> bool:
    """True for a real integer. ``bool`` is excluded: ``True`` is never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """True for an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(name: str, value: Any, lo: int, hi: Optional[int] = None, where: str = "") -> int:
    """``value`` if it is an integer in ``[lo, hi]``; otherwise a ValueError naming ``name``."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer{where}, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}{where}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}{where}, got {value!r}")
    return value


def _float(name: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> float:
    """``value`` as a float if it is finite and in the range; otherwise a ValueError naming ``name``."""
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if hi is None and too_low:
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and (too_low or value > hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; otherwise a ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _mapping(name: str, value: Any) -> Mapping:
    """``value`` if it is a mapping (a dict); otherwise a ValueError naming ``name``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    return value


def _no_unknown_keys(prefix: str, d: Mapping, known) -> None:
    """Refuse keys of ``d`` outside ``known``, suggesting the closest known key."""
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
            raise ValueError(f"{prefix}{key} is not a known key{hint}")


def _set(obj: Any, name: str, value: Any) -> None:
    """Store a normalised value on a frozen dataclass during ``__post_init__``."""
    object.__setattr__(obj, name, value)


# ----------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's names, defaults and checks.

    Construct it with keywords, as in vLLM: ``SamplingParams(temperature=0.8, top_p=0.95)``.

    Attributes:
        temperature: >= 0. 0 makes the request greedy.
        top_p: nucleus mass in (0, 1]. 1 disables top-p.
        top_k: 0 disables top-k. vLLM's other "off" value, -1, is stored as 0.
        max_tokens: the most tokens to generate, >= 1. ``None`` means generate
            until ``max_model_len`` (or a stop rule) ends the request.
        min_tokens: EOS and stop rules are not applied before this many
            tokens. Must be <= ``max_tokens``.
        seed: the request's seed. ``None`` lets the engine choose one.
        stop: stop strings, always stored as a tuple (empty for none). A
            single string is one stop string.
        stop_token_ids: extra stop token ids, always stored as a tuple.
        ignore_eos: keep generating past EOS.
        n: completions per prompt. Only 1 is supported.
        repetition_penalty, presence_penalty, frequency_penalty, min_p: accepted
            only at their neutral values (1, 0, 0, 0). funcspec's verifiers do not
            implement these logit processors.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    seed: Optional[int] = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: bool = False
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        _set(self, "temperature", _float("SamplingParams.temperature", self.temperature, lo=0.0))
        _set(self, "top_p", _float("SamplingParams.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        # vLLM quietly accepts -1 as "off". One spelling keeps equal configs equal.
        _set(self, "top_k", max(_int("SamplingParams.top_k", self.top_k, lo=-1), 0))
        _check_lengths(self)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        _set(self, "stop", _stop_strings(self.stop))
        _set(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        _bool("SamplingParams.ignore_eos", self.ignore_eos)
        _check_unsupported_sampling(self)

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0


def _check_lengths(p: SamplingParams) -> None:
    """Check ``max_tokens`` (>= 1 or None) and ``min_tokens`` (0..max_tokens)."""
    if p.max_tokens is not None:
        _int("SamplingParams.max_tokens", p.max_tokens, lo=1)
    _int("SamplingParams.min_tokens", p.min_tokens, lo=0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(
            f"SamplingParams.min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}"
        )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list of strings) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def _stop_ids(ids: Any) -> tuple[int, ...]:
    """``stop_token_ids`` (None or a list of ints >= 0) as a tuple."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
        _is_int(t) and t >= 0 for t in ids
    ):
        raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids >= 0, got {ids!r}")
    return tuple(ids)


def _check_unsupported_sampling(p: SamplingParams) -> None:
    """Refuse ``n`` != 1 and the logit processors funcspec does not implement."""
    if p.n != 1 or not _is_int(p.n):
        raise ValueError(f"SamplingParams.n must be 1 (funcspec returns one completion per prompt), got {p.n!r}")
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    for name, value in neutral.items():
        if getattr(p, name) != value:
            raise ValueError(
                f"SamplingParams.{name}={getattr(p, name)!r} is not supported by funcspec "
                f"(only the neutral value {value})"
            )


# ----------------------------------------------------------------------------- additional_config


@dataclasses.dataclass(frozen=True)
class RejectionSamplerConfig:
    """vLLM-Ascend's ``additional_config["rejection_sampler_config"]``.

    Attributes:
        enable_block_verify: MagicMTP block verification (lossy). vLLM-Ascend
            applies it only when K >= 3; the verifier enforces that.
        enable_entropy_verify: entropy verification (lossy).
        posterior_threshold: upper bound of the entropy threshold, in (0, 1].
        posterior_alpha: how strongly entropy lowers the threshold, >= 0.
    """

    enable_block_verify: bool = False
    enable_entropy_verify: bool = False
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4

    def __post_init__(self) -> None:
        _bool(_RS + "enable_block_verify", self.enable_block_verify)
        _bool(_RS + "enable_entropy_verify", self.enable_entropy_verify)
        _set(self, "posterior_threshold",
             _float(_RS + "posterior_threshold", self.posterior_threshold, lo=0.0, hi=1.0, lo_open=True))
        _set(self, "posterior_alpha", _float(_RS + "posterior_alpha", self.posterior_alpha, lo=0.0))

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> "RejectionSamplerConfig":
        """Parse the dict. ``None`` gives the defaults. An unknown key is a ValueError."""
        if d is None:
            return cls()
        _no_unknown_keys(_RS, _mapping(_RS[:-1], d), {f.name for f in dataclasses.fields(cls)})
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class DynamicSpecConfig:
    """vLLM-Ascend's confidence-based verify length (``additional_config["dynamic_spec_config"]``).

    Attributes:
        method: "dspark" (confidence head) or "dflash" (max softmax). It must
            equal the speculative method.
        initial_verify_budget_per_req: the verify budget per request before the
            first update, >= 1.
        budget_update_interval: steps between budget updates, >= 1.
        budget_threshold: survival probability that counts a token toward the
            budget, in (0, 1].
        min_verify_tokens: every request verifies at least this many drafts, >= 1.
    """

    method: str
    initial_verify_budget_per_req: int = 5
    budget_update_interval: int = 16
    budget_threshold: float = 0.3
    min_verify_tokens: int = 1

    def __post_init__(self) -> None:
        if self.method not in DYNAMIC_SPEC_METHODS:
            raise ValueError(f"{_DYN}method must be one of {DYNAMIC_SPEC_METHODS}, got {self.method!r}")
        params = _DYN + "method_params."
        _int(params + "initial_verify_budget_per_req", self.initial_verify_budget_per_req, lo=1)
        _int(params + "budget_update_interval", self.budget_update_interval, lo=1)
        _set(self, "budget_threshold",
             _float(params + "budget_threshold", self.budget_threshold, lo=0.0, hi=1.0, lo_open=True))
        _int(params + "min_verify_tokens", self.min_verify_tokens, lo=1)

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> Optional["DynamicSpecConfig"]:
        """Parse ``{"method": ..., "method_params": {...}}``.

        Returns ``None`` for ``None`` or a missing method: in vLLM-Ascend that
        disables the feature. Unknown keys are a ValueError.
        """
        if d is None:
            return None
        _no_unknown_keys(_DYN, _mapping(_DYN[:-1], d), ("method", "method_params"))
        if d.get("method") is None:
            return None
        params = d.get("method_params") or {}
        _no_unknown_keys(_DYN + "method_params.", _mapping(_DYN + "method_params", params), _DYN_PARAMS)
        return cls(method=d["method"], **params)


# ----------------------------------------------------------------------------- SpecConfig


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """A parsed and validated vLLM ``speculative_config``, plus vLLM-Ascend's ``additional_config`` keys.

    Build it from vLLM dicts with :meth:`from_vllm`. Direct construction runs the
    same checks and fills in the n-gram window defaults. It does not resolve
    aliases or the other vLLM fallbacks, and it does not look at the filesystem.

    Attributes:
        method: the canonical vLLM method name (see ``VLLM_METHODS``).
        num_speculative_tokens: K, the most drafts per step, >= 1 (exactly 1
            for extract_hidden_states).
        model: the local draft checkpoint directory, or ``None`` for ngram,
            suffix and extract_hidden_states (and for mtp, which reuses the
            target's own MTP layers).
        prompt_lookup_min, prompt_lookup_max: the n-gram window (ngram only,
            else ``None``). vLLM's defaults: 5..5, or the given bound for both.
        num_speculative_tokens_per_batch_size: sorted ``(start_bs, end_bs, K)``
            triples, or ``None``. See :meth:`k_for_batch_size`.
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
        enforce_eager: the draft-specific eager override, or ``None`` to inherit.
        rejection_sampler: vLLM-Ascend's block and entropy verify settings.
        draft_window_size: the draft KV sliding window W, or ``None`` (off).
        dynamic_spec: the confidence-based verify length, or ``None``.
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
    enforce_eager: Optional[bool] = None
    rejection_sampler: RejectionSamplerConfig = RejectionSamplerConfig()
    draft_window_size: Optional[int] = None
    dynamic_spec: Optional[DynamicSpecConfig] = None
    ignored_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_method(self.method)
        _check_k(self.method, self.num_speculative_tokens)
        _check_model(self.method, self.model)
        _check_ngram_window(self)
        _set(self, "num_speculative_tokens_per_batch_size",
             _normalise_table(self.num_speculative_tokens_per_batch_size, self.method))
        _check_rejection(self)
        _check_suffix(self)
        _set(self, "eagle_aux_hidden_state_layer_ids",
             _normalise_layers(self.eagle_aux_hidden_state_layer_ids, self.method))
        if self.enforce_eager is not None:
            _bool(_S + "enforce_eager", self.enforce_eager)
        _check_draft_window(self.method, self.draft_window_size)
        _check_dynamic_spec(self)
        _set(self, "ignored_keys", tuple(dict.fromkeys(self.ignored_keys)))
        # Last, so that a config for a method still being built reports its real errors first.
        if self.method not in BUILT_METHODS:
            raise ValueError(
                f"{_S}method {self.method!r} is a valid vLLM method but its proposer is not "
                f"built yet in funcspec; built: {sorted(BUILT_METHODS)}"
            )

    @classmethod
    def from_vllm(
        cls,
        speculative_config: Optional[Mapping | str],
        additional_config: Optional[Mapping | str] = None,
        *,
        check_paths: bool = True,
    ) -> Optional["SpecConfig"]:
        """Parse vLLM's ``speculative_config`` (and vLLM-Ascend's ``additional_config``).

        Each argument may be a dict or the JSON string given to ``--speculative-config``
        or ``--additional-config``. Returns ``None`` when ``speculative_config`` is
        ``None``; ``additional_config`` is still validated then. With ``check_paths``
        (the default) ``model`` must be an existing local path. A draft
        ``config.json`` with ``n_predict`` fills in a missing ``num_speculative_tokens``,
        as in vLLM.
        """
        spec = _parse_json(_S[:-1], speculative_config)
        extra = _parse_json(_A[:-1], additional_config) or {}
        rejection = RejectionSamplerConfig.from_dict(extra.get("rejection_sampler_config"))
        dynamic = DynamicSpecConfig.from_dict(extra.get("dynamic_spec_config"))
        if spec is None:
            return None
        _no_unknown_keys(_S, spec, _KNOWN_SPEC_KEYS)
        method = _resolve_method(spec)
        _check_ignored_values(spec, method)
        model = _resolve_model(spec, method, check_paths)
        k = _resolve_k(spec, method, model, check_paths)
        return cls(
            method=method,
            num_speculative_tokens=k,
            model=model,
            **_ngram_window(spec, method),
            num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"),
            rejection_sample_method=spec.get("rejection_sample_method", "standard"),
            synthetic_acceptance_rates=_resolve_synthetic(spec, k),
            **_suffix_fields(spec, method),
            eagle_aux_hidden_state_layer_ids=_aux_layers(spec, method),
            enforce_eager=spec.get("enforce_eager"),
            rejection_sampler=rejection,
            draft_window_size=_draft_window(extra, method),
            dynamic_spec=dynamic,
            ignored_keys=_ignored_keys(spec, extra, method, rejection),
        )

    @property
    def max_k(self) -> int:
        """The largest K of any bucket: ``num_speculative_tokens``."""
        return self.num_speculative_tokens

    def k_for_batch_size(self, bs: int) -> int:
        """K for a step with ``bs`` active requests, from ``num_speculative_tokens_per_batch_size``.

        This is vLLM's lookup. A batch size inside a range uses that range's K.
        A gap, or a batch size past the last range, inherits the K of the range
        before it. K is clamped to ``num_speculative_tokens``. K = 0 means no
        drafting. ``bs`` 0 gives 0. Without a table, K is ``num_speculative_tokens``.
        """
        _int("bs", bs, lo=0)
        table = self.num_speculative_tokens_per_batch_size
        if table is None:
            return self.num_speculative_tokens
        k = 0
        for start, _end, range_k in table:
            if bs < start:
                break
            k = range_k
        return min(k, self.num_speculative_tokens)

    @property
    def verifier_method(self) -> str:
        """The verifier rule: "synthetic", "block", "magicmtp", "entropy" or "standard".

        Greedy rows (temperature 0) are handled inside every rule, so greedy is
        not a config choice. MagicMTP combined with entropy verification is
        "magicmtp" with :attr:`verify_entropy` set.
        """
        if self.rejection_sample_method != "standard":
            return self.rejection_sample_method
        if self.rejection_sampler.enable_block_verify:
            return "magicmtp"
        if self.rejection_sampler.enable_entropy_verify:
            return "entropy"
        return "standard"

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
                f"{_S}num_speculative_tokens must be <= {NPU_MAX_QUERY_TOKENS - 1} on backend "
                f"'aclgraph': npu_fused_infer_attention_score takes at most {NPU_MAX_QUERY_TOKENS} "
                f"query tokens per decode round (num_speculative_tokens + 1 <= {NPU_MAX_QUERY_TOKENS}), "
                f"got {self.num_speculative_tokens}"
            )


# ----------------------------------------------------------------------------- SpecConfig checks


def _check_method(method: Any) -> None:
    """Refuse a method that is not a canonical vLLM method name."""
    if method not in VLLM_METHODS:
        raise ValueError(
            f"{_S}method must be one of {sorted(VLLM_METHODS)} (or a vLLM alias: "
            f"'[ngram]', 'ngram_gpu', '<model>_mtp'), got {method!r}"
        )


def _check_k(method: str, k: Any) -> None:
    """K >= 1 for every method, and exactly 1 for extract_hidden_states."""
    name = _S + "num_speculative_tokens"
    _int(name, k, lo=1, where=f" for method {method!r}")
    if method == "extract_hidden_states" and k != 1:
        raise ValueError(f"{name} must be exactly 1 for method 'extract_hidden_states' (it does not speculate), got {k}")


def _check_model(method: str, model: Any) -> None:
    """``model`` is required by draft-model methods and unused by the model-free ones."""
    if model is None:
        if method in _MODEL_REQUIRED:
            raise ValueError(f"{_S}model is required for method {method!r} (a local checkpoint directory)")
        return
    if method in _MODEL_FREE:
        raise ValueError(f"{_S}model is not used by method {method!r}, got {model!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{_S}model must be a non-empty path string, got {model!r}")


def _check_ngram_window(cfg: SpecConfig) -> None:
    """Fill in vLLM's n-gram window defaults, then check 1 <= min <= max. Other methods have no window.

    With neither bound given, the window is 5..5. With one bound given, the
    other copies it.
    """
    lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
    if cfg.method != "ngram":
        if lo is not None or hi is not None:
            raise ValueError(f"{_S}prompt_lookup_min/prompt_lookup_max are only used by method 'ngram'")
        return
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None:
            _int(_S + name, value, lo=1)
    if lo is None and hi is None:
        lo = hi = 5
    # NOTE: vLLM's docstring says the minimum "defaults to 1", but its code sets the
    # missing bound to the given one. So {"prompt_lookup_max": 4} means 4..4. Matching the code.
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    _set(cfg, "prompt_lookup_min", lo)
    _set(cfg, "prompt_lookup_max", hi)
    if lo > hi:
        raise ValueError(f"{_S}prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")


def _normalise_table(table: Any, method: str) -> Optional[tuple[tuple[int, int, int], ...]]:
    """vLLM's checks on the batch-size table, returned as sorted ``(start, end, K)`` triples.

    The ranges are positive, start <= end, do not overlap, and the first starts
    at 1. K >= 0; a K above ``num_speculative_tokens`` is clamped at lookup time,
    not refused. As in vLLM, the entries may come in any order.
    """
    name = _S + "num_speculative_tokens_per_batch_size"
    if table is None:
        return None
    if method in _NO_BATCH_TABLE:
        raise ValueError(f"{name} is not supported with method {method!r}")
    if isinstance(table, (str, bytes)) or not isinstance(table, Sequence) or not table:
        raise ValueError(f"{name} must be a non-empty list of [start_bs, end_bs, K] entries, got {table!r}")
    rows = tuple(sorted(_table_row(name, entry) for entry in table))
    prev_end = 0
    for start, end, _k in rows:
        if start <= prev_end:
            raise ValueError(f"{name} batch-size ranges must be non-overlapping, got {[list(r) for r in rows]}")
        prev_end = end
    if rows[0][0] != 1:
        raise ValueError(f"{name} the first batch-size range must start at 1, got {[list(r) for r in rows]}")
    return rows


def _table_row(name: str, entry: Any) -> tuple[int, int, int]:
    """One ``[start_bs, end_bs, K]`` entry, checked."""
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 3:
        # NOTE: newer vLLM also takes 5-item (bs_lo, bs_hi, ctx_lo, ctx_hi, K) entries.
        # funcspec picks K from the batch size only, so it refuses them rather than ignore ctx.
        raise ValueError(f"{name} entries must be [start_bs, end_bs, K] (3 integers), got {entry!r}")
    start, end, k = (_int(name, v, lo=0) for v in entry)
    if start < 1 or start > end:
        raise ValueError(f"{name} entry {list(entry)} needs 1 <= start_bs <= end_bs")
    return start, end, k


def _check_rejection(cfg: SpecConfig) -> None:
    """Check the rejection method, its synthetic rates, and combinations with vLLM-Ascend's options."""
    method, rs = cfg.rejection_sample_method, cfg.rejection_sampler
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"{_S}rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}, got {method!r}")
    if method == "synthetic":
        _set(cfg, "synthetic_acceptance_rates",
             _validated_rates(cfg.synthetic_acceptance_rates, None, cfg.num_speculative_tokens))
    elif cfg.synthetic_acceptance_rates is not None:
        raise ValueError(f"{_S}synthetic_acceptance_rates is only valid with rejection_sample_method='synthetic'")
    if not isinstance(rs, RejectionSamplerConfig):
        raise ValueError(f"{_RS[:-1]} must be a RejectionSamplerConfig, got {type(rs).__name__}")
    if method != "standard" and rs.enable_block_verify:
        raise ValueError(
            f"{_RS}enable_block_verify cannot be combined with {_S}rejection_sample_method={method!r}"
        )
    # Entropy verification adjusts per-token acceptance. Block verification has no
    # per-token test to adjust. Under synthetic the rates decide, so entropy is ignored there.
    if method == "block" and rs.enable_entropy_verify:
        raise ValueError(f"{_RS}enable_entropy_verify cannot be combined with {_S}rejection_sample_method='block'")


def _validated_rates(rates: Any, length: Any, k: int) -> tuple[float, ...]:
    """The synthetic rates, from exactly one of ``rates`` and ``length``, checked by the synthetic verifier."""
    # Imported here because the verifiers import torch, and configs must stay cheap to import.
    from funcspec.verifiers.synthetic import validate_synthetic

    # Type checks first: the verifier's float() would raise TypeError, or accept strings.
    if rates is not None and (isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence)
                              or not all(_is_number(r) for r in rates)):
        raise ValueError(f"{_S}synthetic_acceptance_rates must be a list of numbers, got {rates!r}")
    if length is not None and not _is_number(length):
        raise ValueError(f"{_S}synthetic_acceptance_length must be a number, got {length!r}")
    try:
        return tuple(validate_synthetic(rates, length, k))
    except ValueError as err:
        msg = str(err)
        raise ValueError(_S + msg if msg.startswith("synthetic_") else f"{_S[:-1]}: {msg}") from err


def _check_suffix(cfg: SpecConfig) -> None:
    """vLLM's ranges for the suffix decoding settings."""
    _int(_S + "suffix_decoding_max_tree_depth", cfg.suffix_decoding_max_tree_depth, lo=1)
    _int(_S + "suffix_decoding_max_cached_requests", cfg.suffix_decoding_max_cached_requests, lo=0)
    _set(cfg, "suffix_decoding_max_spec_factor",
         _float(_S + "suffix_decoding_max_spec_factor", cfg.suffix_decoding_max_spec_factor, lo=0.0))
    _set(cfg, "suffix_decoding_min_token_prob",
         _float(_S + "suffix_decoding_min_token_prob", cfg.suffix_decoding_min_token_prob, lo=0.0, hi=1.0))


def _normalise_layers(layers: Any, method: str) -> Optional[tuple[int, ...]]:
    """The auxiliary hidden-state layer ids as a tuple of distinct ints >= 0, or ``None``."""
    name = _S + "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"
    if layers is None:
        return None
    if method not in _AUX_LAYER_METHODS:
        raise ValueError(f"{name} is not used by method {method!r}")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"{name} must be a non-empty list of layer indices, got {layers!r}")
    for layer in layers:
        _int(name, layer, lo=0)
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} must not repeat a layer, got {list(layers)}")
    return tuple(layers)


def _check_draft_window(method: str, window: Any) -> None:
    """The draft KV window is a positive int, and only draft models with their own attention use it."""
    if window is None:
        return
    _int(_A + "draft_window_size", window, lo=1)
    if method not in _WINDOW_METHODS:
        raise ValueError(f"{_A}draft_window_size is not used by method {method!r}")


def _check_dynamic_spec(cfg: SpecConfig) -> None:
    """The confidence-based verify length must match the method and fit within K."""
    dyn = cfg.dynamic_spec
    if dyn is None:
        return
    if not isinstance(dyn, DynamicSpecConfig):
        raise ValueError(f"{_DYN[:-1]} must be a DynamicSpecConfig, got {type(dyn).__name__}")
    if dyn.method != cfg.method:
        raise ValueError(
            f"{_DYN}method must equal {_S}method ({cfg.method!r}), got {dyn.method!r}"
        )
    if dyn.min_verify_tokens > cfg.num_speculative_tokens:
        raise ValueError(
            f"{_DYN}method_params.min_verify_tokens must be <= {_S}num_speculative_tokens "
            f"({cfg.num_speculative_tokens}), got {dyn.min_verify_tokens}"
        )


# ----------------------------------------------------------------------------- from_vllm helpers


def _parse_json(name: str, value: Any) -> Optional[Mapping]:
    """A dict, or the JSON string given on the command line, as a mapping (``None`` passes through)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from err
    return _mapping(name, value)


def _resolve_method(spec: Mapping) -> str:
    """The canonical method: vLLM's aliases applied, or inferred from ``model`` as vLLM does."""
    method = spec.get("method")
    if method is None:
        method = _infer_method(spec.get("model"))
    if not isinstance(method, str):
        raise ValueError(f"{_S}method must be a string, got {method!r}")
    method = METHOD_ALIASES.get(method, method)
    if method in _OUT_OF_SCOPE_METHODS:
        raise ValueError(f"{_S}method {method!r} is a vLLM method that funcspec does not implement")
    return method


def _infer_method(model: Any) -> str:
    """vLLM's method detection from the draft model's name, used when ``method`` is missing."""
    if model is None:
        raise ValueError(f"{_S}method is required (or give {_S}model)")
    if model in ("ngram", "[ngram]"):
        return "ngram"
    name = os.fspath(model).lower() if isinstance(model, (str, os.PathLike)) else ""
    for needle, method in (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark")):
        if needle in name:
            return method
    # NOTE: vLLM also reads the draft's hf_config model_type (medusa, *_mtp). funcspec
    # does not parse checkpoints here; give "method" for those.
    return "draft_model"


def _check_ignored_values(spec: Mapping, method: str) -> None:
    """Refuse the values of no-effect keys that would change the result, as vLLM does."""
    if "tensor_parallel_size" in spec:
        raise ValueError(
            f"{_S}tensor_parallel_size is not a valid key; vLLM takes draft_tensor_parallel_size"
        )
    if spec.get("draft_tensor_parallel_size") not in (None, 1):
        raise ValueError(
            f"{_S}draft_tensor_parallel_size must be 1 or None (funcspec runs on one device), "
            f"got {spec['draft_tensor_parallel_size']!r}"
        )
    if spec.get("use_heterogeneous_vocab"):
        raise ValueError(f"{_S}use_heterogeneous_vocab=True is not supported by funcspec")
    if spec.get("draft_sample_method", "greedy") not in ("greedy", "probabilistic"):
        raise ValueError(
            f"{_S}draft_sample_method must be 'greedy' or 'probabilistic', got {spec['draft_sample_method']!r}"
        )
    only = {"enable_adaptive_verification": "dspark", "dspark_draft_topk": "dspark",
            "index_share_for_mtp_iteration": "mtp"}
    for key, needed in only.items():
        if spec.get(key) not in (None, False) and method != needed:
            raise ValueError(f"{_S}{key} is only supported with method {needed!r}, got method {method!r}")


def _resolve_model(spec: Mapping, method: str, check_paths: bool) -> Optional[str]:
    """The draft path: ``None`` for model-free methods, otherwise checked to exist (with ``check_paths``)."""
    model = spec.get("model")
    if model is None or method in _MODEL_FREE:
        return None
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if check_paths and isinstance(model, str) and model and not os.path.exists(model):
        raise ValueError(
            f"{_S}model {model!r} does not exist: funcspec loads local checkpoints only, never "
            f"hub names (pass check_paths=False to skip this check)"
        )
    return model


def _resolve_k(spec: Mapping, method: str, model: Optional[str], check_paths: bool) -> int:
    """``num_speculative_tokens``, or vLLM's fallbacks for it.

    Suffix falls back to ``suffix_decoding_max_tree_depth``. A draft's
    ``config.json`` falls back to ``n_predict``. Otherwise the key is required.
    """
    k = spec.get("num_speculative_tokens")
    if k is None and method == "suffix":
        depth = spec.get("suffix_decoding_max_tree_depth", 24)
        k = _int(_S + "suffix_decoding_max_tree_depth", depth, lo=1)
    if k is None and check_paths and model:
        k = _n_predict(model)
    if k is None:
        raise ValueError(f"{_S}num_speculative_tokens is required for method {method!r}")
    # Checked here (and again in __post_init__) because the synthetic rates depend on K.
    _check_k(method, k)
    return k


def _n_predict(model: str) -> Optional[int]:
    """``n_predict`` from the draft's ``config.json``, if it has one."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            n = json.load(f).get("n_predict")
    except (OSError, ValueError, AttributeError):
        return None
    return n if _is_int(n) else None


def _ngram_window(spec: Mapping, method: str) -> dict[str, Any]:
    """The given n-gram bounds for ngram (``__post_init__`` fills in defaults). Other methods drop them."""
    if method != "ngram":
        return {}
    return {key: spec.get(key) for key in ("prompt_lookup_min", "prompt_lookup_max")}


def _suffix_fields(spec: Mapping, method: str) -> dict[str, Any]:
    """The given suffix decoding settings. They are dropped (and reported) for other methods."""
    return {key: spec[key] for key in _SUFFIX_KEYS if key in spec} if method == "suffix" else {}


def _resolve_synthetic(spec: Mapping, k: int) -> Optional[tuple[float, ...]]:
    """The synthetic rates (a length resolved to rates), or ``None`` when not synthetic."""
    rates, length = spec.get("synthetic_acceptance_rates"), spec.get("synthetic_acceptance_length")
    if spec.get("rejection_sample_method", "standard") == "synthetic":
        return _validated_rates(rates, length, k)
    if rates is not None or length is not None:
        raise ValueError(
            f"{_S}synthetic_acceptance_rates / {_S}synthetic_acceptance_length are only valid "
            f"with rejection_sample_method='synthetic'"
        )
    return None


def _hf_config(spec: Mapping) -> Mapping:
    """``draft_model_config["hf_config"]`` as a mapping (empty when absent)."""
    dmc = _mapping(_S + "draft_model_config", spec.get("draft_model_config") or {})
    return _mapping(_S + "draft_model_config.hf_config", dmc.get("hf_config") or {})


def _aux_layers(spec: Mapping, method: str) -> Optional[Any]:
    """The auxiliary layer ids for methods that read them (checked in ``__post_init__``)."""
    if method not in _AUX_LAYER_METHODS:
        return None
    return _hf_config(spec).get("eagle_aux_hidden_state_layer_ids")


def _draft_window(extra: Mapping, method: str) -> Optional[int]:
    """``draft_window_size`` for methods with draft attention. It is dropped (and reported) for the rest.

    vLLM-Ascend forces the window off for mtp, because MTP reuses the target's own layers.
    """
    window = extra.get("draft_window_size")
    if window is not None:
        _int(_A + "draft_window_size", window, lo=1)
    return window if method in _WINDOW_METHODS else None


def _ignored_keys(spec: Mapping, extra: Mapping, method: str, rs: RejectionSamplerConfig) -> tuple[str, ...]:
    """Dotted paths of the given keys that have no effect for this method in funcspec."""
    ignored = [_S + k for k in spec if k in _IGNORED_SPEC_KEYS]
    unused = {
        "model": method in _MODEL_FREE,
        "prompt_lookup_min": method != "ngram",
        "prompt_lookup_max": method != "ngram",
        **{k: method != "suffix" for k in _SUFFIX_KEYS},
    }
    ignored += [_S + k for k, is_unused in unused.items() if is_unused and spec.get(k) is not None]
    ignored += _ignored_draft_config(spec, method)
    ignored += [_A + k for k in extra if k not in _USED_ADDITIONAL_KEYS]
    if extra.get("draft_window_size") is not None and method not in _WINDOW_METHODS:
        ignored.append(_A + "draft_window_size")
    if rs.enable_entropy_verify and spec.get("rejection_sample_method") == "synthetic":
        ignored.append(_RS + "enable_entropy_verify")
    return tuple(ignored)


def _ignored_draft_config(spec: Mapping, method: str) -> list[str]:
    """Everything in ``draft_model_config`` except the auxiliary layer ids (when the method reads them)."""
    prefix = _S + "draft_model_config."
    dmc = _mapping(prefix[:-1], spec.get("draft_model_config") or {})
    ignored = [prefix + k for k in dmc if k != "hf_config"]
    used = {"eagle_aux_hidden_state_layer_ids"} if method in _AUX_LAYER_METHODS else set()
    return ignored + [prefix + "hf_config." + k for k in _hf_config(spec) if k not in used]
