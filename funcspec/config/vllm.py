"""vLLM's ``speculative_config`` and vLLM-Ascend's ``additional_config`` dicts, translated into ``SpecConfig`` fields.

The dicts are taken unchanged, with local paths in place of hub names. This
module owns what is vLLM-shaped: the known, used and ignored keys, the method
aliases, and vLLM's fallbacks (method from the model name, K from
``n_predict`` or the suffix tree depth). The semantics follow vLLM's
``SpeculativeConfig`` and vLLM-Ascend's ``AscendConfig``; each place where
funcspec differs is marked ``NOTE:``. Inside funcspec, ``num_speculative_tokens``
is called ``max_k``: the largest K of any step.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional

from funcspec import methods
from funcspec.checkpoints import layouts
from funcspec.checkpoints.files import read_json_object
from funcspec.quant.formats import STORED, on_load
from funcspec.config import rules
from funcspec.config.additional import DynamicSpecConfig, RejectionSamplerConfig
from funcspec.config.checks import (EXTRA, RS, SPEC, check_int, check_mapping, is_int, no_unknown_keys,
                                    synthetic_rates)
from funcspec.config.tree import DYNAMIC_KEYS, parse_dynamic_tree, parse_token_tree, tree_max_k
from funcspec.token_tree import DynamicTree, TokenTree

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
"""Method names vLLM accepts and rewrites to a canonical name (a row of ``funcspec.methods``)."""


_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
)
_USED_SPEC_KEYS = frozenset(
    {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
     "num_speculative_tokens_per_batch_size", "rejection_sample_method",
     "synthetic_acceptance_rates", "synthetic_acceptance_length", "draft_model_config",
     "draft_tensor_parallel_size", "speculative_token_tree", "quantization", *DYNAMIC_KEYS, *_SUFFIX_KEYS}
)
# Keys of vLLM's SpeculativeConfig that change nothing in funcspec. They are accepted
# and reported in SpecConfig.ignored_keys. _check_ignored_values refuses the values
# that would change the result. NOTE: "enforce_eager" is vLLM's eager switch for the
# draft alone; funcspec's draft runs inside the target's step graph, whose backend
# LLM(enforce_eager=...) picks.
_IGNORED_SPEC_KEYS = frozenset(
    {"enforce_eager", "disable_padded_drafter_batch",
     "moe_backend", "attention_backend", "kv_cache_dtype", "max_model_len", "revision",
     "code_revision", "index_share_for_mtp_iteration", "disable_eagle_block_drop",
     "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
     "draft_load_config", "enable_adaptive_verification", "draft_sample_method",
     "dspark_draft_topk"}
)
_KNOWN_SPEC_KEYS = _USED_SPEC_KEYS | _IGNORED_SPEC_KEYS | {"tensor_parallel_size"}
_USED_ADDITIONAL_KEYS = ("rejection_sampler_config", "dynamic_spec_config", "draft_window_size")


def spec_fields(speculative_config: Optional[Mapping | str], additional_config: Optional[Mapping | str],
                check_paths: bool, target: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The ``SpecConfig`` fields for vLLM's dicts (or JSON strings), or ``None`` without a speculative_config.

    ``additional_config`` is validated even then, and its keys that need
    speculation are named in a warning. vLLM's aliases and fallbacks are
    resolved here (``target``: the target checkpoint, where ``mtp`` finds its
    K); ``SpecConfig`` then checks the fields (``rules.resolve``).
    """
    spec = _parse_json(SPEC[:-1], speculative_config)
    extra = _parse_json(EXTRA[:-1], additional_config) or {}
    rejection = RejectionSamplerConfig.from_dict(extra.get("rejection_sampler_config"))
    dynamic = DynamicSpecConfig.from_dict(extra.get("dynamic_spec_config"))
    if spec is None:
        _warn_without_speculation(extra)
        return None
    no_unknown_keys(SPEC, spec, _KNOWN_SPEC_KEYS)
    method = _resolve_method(spec, check_paths)
    _check_ignored_values(spec, method)
    model = _resolve_model(spec, method, check_paths)
    static_tree, dynamic_tree = _trees(spec)
    tree = static_tree or dynamic_tree
    if tree is not None:
        max_k = tree_max_k(tree, spec.get("num_speculative_tokens"))
    else:
        max_k = _resolve_max_k(spec, method, model or (target if method == "mtp" else None), check_paths)
        _warn_capped(spec.get("num_speculative_tokens_per_batch_size"), max_k)
    return dict(
        method=method,
        num_speculative_tokens=max_k,
        model=model,
        **_ngram_window(spec, method),
        num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"),
        rejection_sample_method=spec.get("rejection_sample_method", "standard"),
        synthetic_acceptance_rates=_resolve_synthetic(spec, max_k),
        **_suffix_fields(spec, method),
        eagle_aux_hidden_state_layer_ids=_aux_layers(spec, method),
        rejection_sampler=rejection,
        draft_window_size=_draft_window(extra, method),
        dynamic_spec=dynamic,
        draft_tensor_parallel_size=spec.get("draft_tensor_parallel_size"),
        speculative_token_tree=static_tree,
        dynamic_tree=dynamic_tree,
        quantization=on_load(spec.get("quantization"), SPEC + "quantization")
        if not methods.lookup(method).model == methods.NONE else None,
        ignored_keys=_ignored_keys(spec, extra, method, rejection),
    )


def _trees(spec: Mapping) -> tuple[Optional[TokenTree], Optional[DynamicTree]]:
    """The static and the dynamic token tree of ``spec`` (at most one of them)."""
    static = spec.get("speculative_token_tree")
    static = None if static is None else parse_token_tree(static)
    dynamic = parse_dynamic_tree(spec)
    if static is not None and dynamic is not None:
        raise ValueError(f"{SPEC}speculative_token_tree cannot be combined with {SPEC}{DYNAMIC_KEYS[0]} "
                         "(a static and a dynamic tree)")
    return static, dynamic


def _parse_json(name: str, value: Any) -> Optional[Mapping]:
    """A dict, or the JSON string given on the command line, as a mapping (``None`` passes through)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from err
    return check_mapping(name, value)


def _resolve_method(spec: Mapping, check_paths: bool = True) -> str:
    """The canonical method: vLLM's aliases applied, or inferred from ``model`` as vLLM does."""
    method = spec.get("method")
    if method is None:
        method = _infer_method(spec.get("model"), check_paths)
    if not isinstance(method, str):
        raise ValueError(f"{SPEC}method must be a string, got {method!r}")
    method = METHOD_ALIASES.get(method, method)
    if not methods.lookup(method).supported:
        raise ValueError(f"{SPEC}method {method!r} is a vLLM method that funcspec does not implement")
    return method


def _infer_method(model: Any, check_paths: bool = True) -> str:
    """vLLM's method detection, used when ``method`` is missing: the draft checkpoint's own layout
    (speculators' algorithm, a Medusa or MTP config, an EAGLE head), else its name, else ``draft_model``."""
    if model is None:
        raise ValueError(f"{SPEC}method is required (or give {SPEC}model)")
    if model in ("ngram", "[ngram]"):
        return "ngram"
    if check_paths and isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        _draft_config(model)  # a corrupt config.json is an error naming it, not "a draft model"
        try:
            return layouts.detect(model)[0].method
        except (ValueError, OSError):
            pass  # not a head funcspec recognises (a draft model): vLLM's name rules below
    name = os.fspath(model).lower() if isinstance(model, (str, os.PathLike)) else ""
    for needle, method in (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark")):
        if needle in name:
            return method
    return "draft_model"


def _check_ignored_values(spec: Mapping, method: str) -> None:
    """Refuse the values of no-effect keys that would change the result, as vLLM does."""
    if "tensor_parallel_size" in spec:
        raise ValueError(
            f"{SPEC}tensor_parallel_size is not a valid key; vLLM takes draft_tensor_parallel_size"
        )
    if spec.get("use_heterogeneous_vocab"):
        raise ValueError(f"{SPEC}use_heterogeneous_vocab=True is not supported by funcspec")
    if spec.get("draft_sample_method", "greedy") not in ("greedy", "probabilistic"):
        raise ValueError(
            f"{SPEC}draft_sample_method must be 'greedy' or 'probabilistic', got {spec['draft_sample_method']!r}"
        )
    only = {"enable_adaptive_verification": "dspark", "dspark_draft_topk": "dspark",
            "index_share_for_mtp_iteration": "mtp"}
    for key, needed in only.items():
        if spec.get(key) not in (None, False) and method != needed:
            raise ValueError(f"{SPEC}{key} is only supported with method {needed!r}, got method {method!r}")


def _resolve_model(spec: Mapping, method: str, check_paths: bool) -> Optional[str]:
    """The draft path: ``None`` for model-free methods, otherwise checked to exist (with ``check_paths``)."""
    model = spec.get("model")
    if model is None or methods.lookup(method).model == methods.NONE:
        return None
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if check_paths and isinstance(model, str) and model and not os.path.exists(model):
        raise ValueError(
            f"{SPEC}model {model!r} does not exist: funcspec loads local checkpoints only, never "
            f"hub names (pass check_paths=False to skip this check)"
        )
    return model


def _resolve_max_k(spec: Mapping, method: str, model: Optional[str], check_paths: bool) -> int:
    """``num_speculative_tokens``, or vLLM's fallbacks for it.

    Suffix falls back to ``suffix_decoding_max_tree_depth``. A draft's
    ``config.json`` falls back to ``n_predict`` (an MTP checkpoint's: to
    ``num_nextn_predict_layers``; for mtp ``model`` is the target when no draft
    is given). Otherwise the key is required.
    """
    max_k, origin = spec.get("num_speculative_tokens"), ""
    if max_k is None and method == "suffix":
        depth = spec.get("suffix_decoding_max_tree_depth", 24)
        max_k = check_int(SPEC + "suffix_decoding_max_tree_depth", depth, lo=1)
        origin = " (its default: suffix_decoding_max_tree_depth)"
    read = max_k is None and check_paths and model
    if read and model:  # (read: a model)
        max_k, origin = _n_predict(model, method), f" (from {os.path.join(model, 'config.json')})"
    if max_k is None:
        where = " (its checkpoint's config.json gives no num_nextn_predict_layers)" if read and method == "mtp" else ""
        raise ValueError(f"{SPEC}num_speculative_tokens is required for method {method!r}{where}")
    # Checked here (and again by SpecConfig) because the synthetic rates depend on it.
    rules.check_max_k(method, max_k, origin)
    return max_k


def _draft_config(model: str | os.PathLike) -> Optional[dict]:
    """The draft directory's ``config.json``, ``None`` without one; ``ValueError`` naming the file when it is
    not a JSON object."""
    path = os.path.join(model, "config.json")
    return read_json_object(path) if os.path.isfile(path) else None


def _n_predict(model: str, method: str) -> Optional[int]:
    """The draft's own K, as vLLM reads it: speculators' first proposal method's ``speculative_tokens``,
    else ``n_predict`` from its ``config.json`` (``None`` without either, or without the file); an MTP
    checkpoint's is its ``num_nextn_predict_layers`` (vLLM's ``n_predict`` for every MTP model)."""
    hf = _draft_config(model) if os.path.isdir(model) else None
    if hf is None:
        return None
    if method == "mtp":
        n = hf.get("num_nextn_predict_layers")
        return n if is_int(n) else None
    try:
        methods_ = (hf.get("speculators_config") or {}).get("proposal_methods") or [{}]
        n = methods_[0].get("speculative_tokens", hf.get("n_predict"))
    except (AttributeError, TypeError, IndexError, KeyError):  # an unexpected speculators_config shape
        return None
    return n if is_int(n) else None


def _warn_capped(table: Any, max_k: int) -> None:
    """Warn about each batch-size table entry whose K is above ``num_speculative_tokens``: vLLM (and funcspec's
    lookup) caps it there without a word. A malformed table is left to ``SpecConfig``'s checks."""
    if isinstance(table, (str, bytes, Mapping)) or not hasattr(table, "__iter__"):
        return
    capped = [list(e) for e in table if isinstance(e, (list, tuple)) and len(e) == 3 and is_int(e[2]) and e[2] > max_k]
    if capped:
        warnings.warn(f"{SPEC}num_speculative_tokens_per_batch_size entries {capped} ask for more drafts than "
                      f"{SPEC}num_speculative_tokens={max_k}: they run with K={max_k}", stacklevel=4)


_NEEDS_SPECULATION = ("rejection_sampler_config", "dynamic_spec_config", "draft_window_size")


def _warn_without_speculation(extra: Mapping) -> None:
    """Warn about the ``additional_config`` keys that act on speculation when there is none."""
    given = [EXTRA + k for k in _NEEDS_SPECULATION if extra.get(k) is not None]
    if given:
        warnings.warn(f"{given} have no effect without a speculative_config: nothing is drafted or verified",
                      stacklevel=4)


def _ngram_window(spec: Mapping, method: str) -> dict[str, Any]:
    """The given n-gram bounds for ngram (``SpecConfig`` fills in defaults). Other methods drop them."""
    if method != "ngram":
        return {}
    return {key: spec.get(key) for key in ("prompt_lookup_min", "prompt_lookup_max")}


def _suffix_fields(spec: Mapping, method: str) -> dict[str, Any]:
    """The given suffix decoding settings. They are dropped (and reported) for other methods."""
    return {key: spec[key] for key in _SUFFIX_KEYS if key in spec} if method == "suffix" else {}


def _resolve_synthetic(spec: Mapping, max_k: int) -> Optional[tuple[float, ...]]:
    """The synthetic rates (a length resolved to rates), or ``None`` when not synthetic."""
    rates, length = spec.get("synthetic_acceptance_rates"), spec.get("synthetic_acceptance_length")
    if spec.get("rejection_sample_method", "standard") == "synthetic":
        return synthetic_rates(rates, length, max_k)
    if rates is not None or length is not None:
        raise ValueError(
            f"{SPEC}synthetic_acceptance_rates / {SPEC}synthetic_acceptance_length are only valid "
            f"with rejection_sample_method='synthetic'"
        )
    return None


def _hf_config(spec: Mapping) -> Mapping:
    """``draft_model_config["hf_config"]`` as a mapping (empty when absent)."""
    dmc = check_mapping(SPEC + "draft_model_config", spec.get("draft_model_config") or {})
    return check_mapping(SPEC + "draft_model_config.hf_config", dmc.get("hf_config") or {})


def _aux_layers(spec: Mapping, method: str) -> Optional[Any]:
    """The auxiliary layer ids for methods that read them (checked by ``SpecConfig``)."""
    if not methods.lookup(method).aux_layers:
        return None
    return _hf_config(spec).get("eagle_aux_hidden_state_layer_ids")


def _draft_window(extra: Mapping, method: str) -> Optional[int]:
    """``draft_window_size`` for methods with draft attention. It is dropped (and reported) for the rest.

    vLLM-Ascend forces the window off for mtp, because MTP reuses the target's own layers.
    """
    window = extra.get("draft_window_size")
    if window is not None:
        check_int(EXTRA + "draft_window_size", window, lo=1)
    return window if methods.lookup(method).draft_window else None


def _ignored_keys(spec: Mapping, extra: Mapping, method: str, rs: RejectionSamplerConfig) -> tuple[str, ...]:
    """Dotted paths of the given keys that have no effect for this method in funcspec."""
    ignored = [SPEC + k for k in spec if k in _IGNORED_SPEC_KEYS]
    unused = {
        "model": methods.lookup(method).model == methods.NONE,
        "quantization": methods.lookup(method).model == methods.NONE or spec.get("quantization") in STORED,
        "prompt_lookup_min": method != "ngram",
        "prompt_lookup_max": method != "ngram",
        **{k: method != "suffix" for k in _SUFFIX_KEYS},
    }
    ignored += [SPEC + k for k, is_unused in unused.items() if is_unused and spec.get(k) is not None]
    ignored += _ignored_draft_config(spec, method)
    ignored += [EXTRA + k for k in extra if k not in _USED_ADDITIONAL_KEYS]
    if extra.get("draft_window_size") is not None and not methods.lookup(method).draft_window:
        ignored.append(EXTRA + "draft_window_size")
    if rs.enable_entropy_verify and spec.get("rejection_sample_method") == "synthetic":
        ignored.append(RS + "enable_entropy_verify")
    return tuple(ignored)


def _ignored_draft_config(spec: Mapping, method: str) -> list[str]:
    """Everything in ``draft_model_config`` except the auxiliary layer ids (when the method reads them)."""
    prefix = SPEC + "draft_model_config."
    dmc = check_mapping(prefix[:-1], spec.get("draft_model_config") or {})
    ignored = [prefix + k for k in dmc if k != "hf_config"]
    used = {"eagle_aux_hidden_state_layer_ids"} if methods.lookup(method).aux_layers else set()
    return ignored + [prefix + "hf_config." + k for k in _hf_config(spec) if k not in used]
