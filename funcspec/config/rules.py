"""The rules a ``SpecConfig`` obeys, one check per field or combination.

:func:`resolve` runs them on the given field values and returns the final ones
(defaults filled in, tables sorted, numbers normalised); ``SpecConfig`` sets its
fields from that result once, so a config built by hand and one parsed from vLLM
dicts pass the same checks, and no check ever rewrites a built config. This
module works on plain values, never on a ``SpecConfig`` (``spec`` imports it).
Which fields a method takes is read from the method registry: each row's option
group (``funcspec.methods``: a draft model, the n-gram window, the suffix settings,
aux layers, a draft window, a batch table, trees, ...). A field of another
method's group is refused in one place (:func:`check_owners`) or ignored
(:data:`NOT_OWNED`); the per-field checks then judge the values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from funcspec import methods
from funcspec.token_tree import DynamicTree, TokenTree
from funcspec.config.additional import DynamicSpecConfig, RejectionSamplerConfig
from funcspec.config.tree import check_dynamic_tree, tree_max_k
from funcspec.config.checks import (DYN, EXTRA, MAX_DRAFT_TOKENS, RS, SPEC, check_float, check_int, field_path,
                                    is_int, synthetic_rates)

VLLM_METHODS = methods.supported()
"""The methods ``SpecConfig`` accepts, under their canonical names: the registry's
supported rows (vLLM-Ascend's guide, plus funcspec's ``echo``)."""

REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")

UNSUPPORTED, UNUSED, IGNORED = "unsupported", "unused", "ignored"
NOT_OWNED: dict[str, str] = {
    # vLLM ignores these where the method has no use for them, so config.vllm drops and reports them
    # (SpecConfig.ignored_keys); a SpecConfig built by hand has nowhere to report one, so it is refused.
    "model": UNUSED, "prompt_lookup_min": UNUSED, "prompt_lookup_max": UNUSED,
    "eagle_aux_hidden_state_layer_ids": UNUSED, "draft_window_size": UNUSED,
    # Kept as given and never read: every value is harmless. vLLM too checks the suffix settings only for
    # suffix, and quantizes only a draft checkpoint. (The suffix fields have defaults, so a given value
    # cannot be told from one nobody gave; their values are still checked.)
    "quantization": IGNORED, **{field: IGNORED for field in methods.SUFFIX},
    # Combinations funcspec or vLLM-Ascend's guide does not support: refused from vLLM dicts too.
    "num_speculative_tokens_per_batch_size": UNSUPPORTED, "dynamic_spec": UNSUPPORTED,
    "speculative_token_tree": UNSUPPORTED, "dynamic_tree": UNSUPPORTED, "draft_tensor_parallel_size": UNSUPPORTED,
}
"""What a method does with a field of an option group it does not own (``methods.owner_of``): refuse it
(``UNSUPPORTED``: "is not supported with"; ``UNUSED``: "is not used by") or keep it unread (``IGNORED``)."""
_REFUSED = {UNUSED: ("used", "by"), UNSUPPORTED: ("supported", "with")}


def resolve(given: Mapping[str, Any]) -> dict[str, Any]:
    """The final value of every ``SpecConfig`` field, from ``given`` (every field, its default where not given).

    Pure: ``given`` is not changed, and a resolved dict resolves to itself. The
    checks run in the order errors are reported.
    """
    method, max_k = given["method"], given["num_speculative_tokens"]
    check_method(method)
    check_max_k(method, max_k)
    check_owners(given, method)
    _check_model(method, given["model"])
    lo, hi = _ngram_window(method, given["prompt_lookup_min"], given["prompt_lookup_max"])
    table = _normalise_table(given["num_speculative_tokens_per_batch_size"])
    rs = given["rejection_sampler"]
    rates = _check_rejection(given["rejection_sample_method"], given["synthetic_acceptance_rates"], rs, max_k)
    factor, min_prob = _check_suffix(given)
    layers = _normalise_layers(given["eagle_aux_hidden_state_layer_ids"])
    _check_draft_window(given["draft_window_size"])
    _check_dynamic_spec(given["dynamic_spec"], method, max_k)
    _check_draft_tp(given["draft_tensor_parallel_size"])
    _check_tree(given["speculative_token_tree"], given["dynamic_tree"], method, max_k, table,
                verifier_method(given["rejection_sample_method"], rs), given["dynamic_spec"])
    _check_quantization(given["quantization"])
    return {
        **given,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
        "num_speculative_tokens_per_batch_size": table,
        "synthetic_acceptance_rates": rates,
        "suffix_decoding_max_spec_factor": factor,
        "suffix_decoding_min_token_prob": min_prob,
        "eagle_aux_hidden_state_layer_ids": layers,
        "ignored_keys": tuple(dict.fromkeys(given["ignored_keys"])),
    }


def verifier_method(rejection_sample_method: str, rs: RejectionSamplerConfig) -> str:
    """The verifier rule: "synthetic", "block", "magicmtp", "entropy" or "standard" (``SpecConfig.verifier_method``).

    MagicMTP combined with entropy verification is "magicmtp" (the entropy
    threshold is ``SpecConfig.verify_entropy``).
    """
    if rejection_sample_method != "standard":
        return rejection_sample_method
    if rs.enable_block_verify:
        return "magicmtp"
    if rs.enable_entropy_verify:
        return "entropy"
    return "standard"


def _check_quantization(name: Any) -> None:
    """The drafter's on-load quantization: a scheme funcspec applies, or ``None``."""
    from funcspec.quant.formats import check_scheme

    check_scheme(name)


def check_method(method: Any) -> None:
    """Refuse a method that is not a canonical method name of a supported row."""
    if method not in VLLM_METHODS:
        raise ValueError(
            f"{SPEC}method must be one of {sorted(VLLM_METHODS)} (or a vLLM alias: "
            f"'[ngram]', 'ngram_gpu', '<model>_mtp'), got {method!r}"
        )


def check_max_k(method: str, max_k: Any, origin: str = "") -> None:
    """``num_speculative_tokens`` in 1..:data:`MAX_DRAFT_TOKENS` for every method, and exactly 1 for one that does
    not speculate. ``origin`` says where a value nobody gave came from (vLLM's fallbacks)."""
    name = SPEC + "num_speculative_tokens"
    where = f" for method {method!r}{origin}"
    check_int(name, max_k, lo=1, where=where)
    if not methods.lookup(method).speculates and max_k != 1:
        raise ValueError(f"{name} must be exactly 1 for method {method!r} (it does not speculate), got {max_k}")
    if max_k > MAX_DRAFT_TOKENS:
        raise ValueError(f"{name} must be <= {MAX_DRAFT_TOKENS}{where}: a step verifies at most "
                         f"{MAX_DRAFT_TOKENS + 1} tokens per row (K + 1, as a token tree's N + 1), got {max_k}")


def check_owners(given: Mapping[str, Any], method: str) -> None:
    """Refuse a field of an option group that ``method``'s row does not hold, where ``given`` sets it (not
    ``None``; a draft tensor-parallel size only above 1, since 1 is the replicated drafter every method has).

    One rule for every group, in ``methods.GROUPS`` order; fields the method ignores pass (:data:`NOT_OWNED`).
    """
    own = methods.options_of(method)
    for field in methods.GROUPS:
        value = given[field]
        if field in own or NOT_OWNED[field] == IGNORED or not _sets(field, value):
            continue
        path, owners = field_path(field), methods.owner_of(field)
        names = f"method {owners[0]!r}" if len(owners) == 1 else f"methods {list(owners)}"
        if field == "draft_tensor_parallel_size":
            raise ValueError(f"{path}={value}: only {names} shards its drafter; the {method!r} drafter is "
                             "replicated (give 1 or None)")
        verb, prep = _REFUSED[NOT_OWNED[field]]
        raise ValueError(f"{path} is not {verb} {prep} method {method!r} (only {prep} {names})")


def _sets(field: str, value: Any) -> bool:
    """Whether ``value`` asks for something of ``field``'s group: not ``None``, and for the draft
    tensor-parallel size a sharded drafter (an int above 1; other values are judged by its own check)."""
    if field == "draft_tensor_parallel_size":
        return is_int(value) and value > 1
    return value is not None


def _check_model(method: str, model: Any) -> None:
    """``model`` is required by draft-model methods (registry ``model``); a model-free method's was refused by
    :func:`check_owners`."""
    if model is None:
        if methods.lookup(method).model == methods.REQUIRED:
            raise ValueError(f"{SPEC}model is required for method {method!r} (a local checkpoint directory)")
        return
    if not isinstance(model, str) or not model:
        raise ValueError(f"{SPEC}model must be a non-empty path string, got {model!r}")


def _ngram_window(method: str, lo: Any, hi: Any) -> tuple[Optional[int], Optional[int]]:
    """The n-gram window ``(min, max)`` with vLLM's defaults filled in, checked 1 <= min <= max; other methods have
    none: ``(None, None)``.

    With neither bound given, the window is 5..5. With one bound given, the
    other copies it. (:func:`check_owners` refused bounds given to another method.)
    """
    if methods.NGRAM_WINDOW[0] not in methods.options_of(method):
        return None, None
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None:
            check_int(SPEC + name, value, lo=1)
    if lo is None and hi is None:
        lo = hi = 5
    # NOTE: vLLM's docstring says the minimum "defaults to 1", but its code sets the
    # missing bound to the given one. So {"prompt_lookup_max": 4} means 4..4. Matching the code.
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if lo > hi:
        raise ValueError(f"{SPEC}prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return lo, hi


def _normalise_table(table: Any) -> Optional[tuple[tuple[int, int, int], ...]]:
    """vLLM's checks on the batch-size table, returned as sorted ``(start, end, K)`` triples.

    The ranges are positive, start <= end, do not overlap, and the first starts
    at 1. K >= 0; a K above ``num_speculative_tokens`` is clamped at lookup time,
    not refused. As in vLLM, the entries may come in any order.
    """
    name = SPEC + "num_speculative_tokens_per_batch_size"
    if table is None:
        return None
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
    start, end, k = (check_int(name, v, lo=0) for v in entry)
    if start < 1 or start > end:
        raise ValueError(f"{name} entry {list(entry)} needs 1 <= start_bs <= end_bs")
    return start, end, k


def _check_rejection(method: Any, rates: Any, rs: Any, max_k: int) -> Optional[tuple[float, ...]]:
    """Check the rejection method and combinations with vLLM-Ascend's options; returns the synthetic rates
    [max_k] ("synthetic"), else ``None``."""
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"{SPEC}rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}, got {method!r}")
    if method == "synthetic":
        rates = synthetic_rates(rates, None, max_k)
    elif rates is not None:
        raise ValueError(f"{SPEC}synthetic_acceptance_rates is only valid with rejection_sample_method='synthetic'")
    if not isinstance(rs, RejectionSamplerConfig):
        raise ValueError(f"{RS[:-1]} must be a RejectionSamplerConfig, got {type(rs).__name__}")
    if method != "standard" and rs.enable_block_verify:
        raise ValueError(
            f"{RS}enable_block_verify cannot be combined with {SPEC}rejection_sample_method={method!r}"
        )
    # Entropy verification adjusts per-token acceptance. Block verification has no
    # per-token test to adjust. Under synthetic the rates decide, so entropy is ignored there.
    if method == "block" and rs.enable_entropy_verify:
        raise ValueError(f"{RS}enable_entropy_verify cannot be combined with {SPEC}rejection_sample_method='block'")
    return rates


def _check_suffix(given: Mapping[str, Any]) -> tuple[float, float]:
    """vLLM's ranges for the suffix decoding settings; returns ``(max_spec_factor, min_token_prob)`` as floats."""
    check_int(SPEC + "suffix_decoding_max_tree_depth", given["suffix_decoding_max_tree_depth"], lo=1)
    check_int(SPEC + "suffix_decoding_max_cached_requests", given["suffix_decoding_max_cached_requests"], lo=0)
    factor = check_float(SPEC + "suffix_decoding_max_spec_factor", given["suffix_decoding_max_spec_factor"], lo=0.0)
    min_prob = check_float(SPEC + "suffix_decoding_min_token_prob", given["suffix_decoding_min_token_prob"],
                           lo=0.0, hi=1.0)
    return factor, min_prob


def _normalise_layers(layers: Any) -> Optional[tuple[int, ...]]:
    """The auxiliary hidden-state layer ids as a tuple of distinct ints >= 0, or ``None``."""
    name = SPEC + "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"{name} must be a non-empty list of layer indices, got {layers!r}")
    for layer in layers:
        check_int(name, layer, lo=0)
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} must not repeat a layer, got {list(layers)}")
    return tuple(layers)


def _check_draft_window(window: Any) -> None:
    """The draft KV window is a positive int (only draft models with their own attention take one:
    :func:`check_owners`)."""
    if window is None:
        return
    check_int(EXTRA + "draft_window_size", window, lo=1)


def _check_draft_tp(size: Any) -> None:
    """The drafter's tensor-parallel size is None or an int >= 1 (a sharded one, > 1, is a draft model's:
    :func:`check_owners`)."""
    if size is not None:
        check_int(SPEC + "draft_tensor_parallel_size", size, lo=1)


def _check_dynamic_spec(dyn: Any, method: str, max_k: int) -> None:
    """The confidence-based verify length must match the method and fit within K."""
    if dyn is None:
        return
    if not isinstance(dyn, DynamicSpecConfig):
        raise ValueError(f"{DYN[:-1]} must be a DynamicSpecConfig, got {type(dyn).__name__}")
    if dyn.method != method:
        raise ValueError(
            f"{DYN}method must equal {SPEC}method ({method!r}), got {dyn.method!r}"
        )
    if dyn.min_verify_tokens > max_k:
        raise ValueError(
            f"{DYN}method_params.min_verify_tokens must be <= {SPEC}num_speculative_tokens "
            f"({max_k}), got {dyn.min_verify_tokens}"
        )


def _check_tree(static: Any, dynamic: Any, method: str, max_k: int,
                table: Optional[tuple[tuple[int, int, int], ...]], rule: str, dyn: Any) -> None:
    """A token tree (a tree-drafting method's: :func:`check_owners`) needs the lossless standard rule (``rule``,
    the verifier); a batch-size table then gives the node count N per batch size (0 <= N <= the tree's size)."""
    if static is None and dynamic is None:
        return
    name = SPEC + ("speculative_token_tree" if static is not None else "speculative_eagle_topk")
    if static is not None and dynamic is not None:
        raise ValueError(f"{name} cannot be combined with a dynamic tree")
    if static is not None and not isinstance(static, TokenTree):
        raise ValueError(f"{name} must be a TokenTree, got {type(static).__name__}")
    if dynamic is not None:
        if not isinstance(dynamic, DynamicTree):
            raise ValueError(f"{SPEC}dynamic_tree must be a DynamicTree, got {type(dynamic).__name__}")
        check_dynamic_tree(dynamic, frontiers=methods.lookup(method).model != methods.NONE)
    tree = static or dynamic
    tree_max_k(tree, max_k)
    if rule != "standard":
        raise ValueError(f"{name} verifies with the lossless tree rule only, not {rule!r} "
                         f"({SPEC}rejection_sample_method and {RS}enable_* must stay off)")
    if dyn is not None:
        raise ValueError(f"{EXTRA}dynamic_spec_config cannot be combined with {name}: "
                         "a tree's size comes from num_speculative_tokens_per_batch_size, not confidence")
    _check_tree_sizes(table, tree.size)


def _check_tree_sizes(table: Optional[tuple[tuple[int, int, int], ...]], size: int) -> None:
    """With a tree, each table entry's value is a node count N: a step drafts the tree cut to N
    nodes (``token_tree.truncate``), which cannot exceed the tree. (A chain's K is clamped instead, as
    in vLLM; refusing here says that a tree bigger than the one given was never measured.)"""
    for start, end, n in table or ():
        if n > size:
            raise ValueError(f"{SPEC}num_speculative_tokens_per_batch_size entry {[start, end, n]}: with a token "
                             f"tree the value is its node count N, which must be <= the tree's {size} nodes")
