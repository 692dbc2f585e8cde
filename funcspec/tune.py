"""``funcspec tune-k``: choose K per batch size from measured step costs and measured acceptance.

Inputs are two benchmark results:

- ``funcspec bench capture``: ``buckets[i]`` gives the median step cost
  (``replay_ms`` or ``eager_ms``) of bucket (B, K).
- ``funcspec bench spec``: ``rows[i].per_position_acceptance`` of a method,
  measured at K = ``rows[i].k``.

Glossary: B is a batch bucket (the padded batch a graph runs), n
an active batch size (1..max_batch), K the drafts per step, a_i the measured
acceptance at draft position i.

``Engine.stats()["per_position_acceptance"][i]`` counts the speculative row-steps
that emitted more than i+1 tokens, over all speculative row-steps. So a_i is
the unconditional probability that the first i+1 drafts were all accepted (not
a rate conditional on position i-1), and a step with K drafts emits

    E[tokens | K] = 1 + sum_{i<K} a_i       (the bonus/recovered token, plus accepted drafts).

NOTE: using a_i measured at K_meas for a smaller K assumes that drafting fewer
tokens drafts a prefix of the same tokens (true for every funcspec proposer)
and that the steps' start positions do not change the statistics.

For each bucket B the tuner (:func:`tune_chain`) picks the K in the measured range that maximises

    tokens/s(B, K) = B · E[tokens | K] / cost(B, K)

(ties go to the smaller K: the same speed with fewer drafts to verify). An
active batch of n rows runs in bucket B = the smallest measured B >= n, and
n · E / cost(B, K) has the same argmax over K as B · E / cost(B, K), so n
inherits the bucket's K.

Token trees (:func:`tune_tree`; ``--tree``): a bucket is (B, N), N the node count a
step drafts (the tree cut to N nodes, ``funcspec.token_tree.truncate``). A tree's
acceptance at N is not a prefix of a bigger tree's (its first N nodes, or best N,
are a different tree), so nothing is inferred across N: the spec result holds
rows of one tree measured at several N (``bench spec --tree --tree-sizes``; a
row's ``k`` is its N, ``tree`` the whole tree's keys, ``per_position_acceptance``
per depth d: P(the accepted path reached depth d+1)), and

    E[tokens | N] = 1 + sum_d a_d(N)   (the row's τ),   E[tokens | 0] = 1.

The costs come from ``bench capture --tree`` (bucket K = N). Per bucket B the
tuner picks, among the measured N (and 0 where the capture measured K = 0)
inside B's measured range, the N maximising B · E[tokens | N] / cost(B, N),
ties to the smaller N; a cost between two measured N is interpolated as for K.

The result is a vLLM-Ascend config: ``speculative_config`` with
``num_speculative_tokens_per_batch_size`` ranges covering 1..max_batch (K, or a
tree's N beside the tree's keys), ``compilation_config.cudagraph_capture_sizes``
(B · (K_B + 1) for every bucket B in use) and ``max_num_seqs``: exactly
``funcspec.LLM``'s (and vLLM's) keyword arguments, so ``LLM(model, **json.load(open(path)))`` uses it as it is.
The ``tuning`` block (the inputs and the whole tokens/s table) goes to a
sibling ``<name>.tuning.json``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

COST_FIELDS = ("replay_ms", "eager_ms")
"""The capture result's per-bucket step costs, in milliseconds."""

# The speculative_config keys the tuner writes; spec_keys may not set them (nor a token tree's keys).
_TUNED_KEYS = frozenset({"method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"})


# ----------------------------------------------------------------------------- reading the inputs


def _number(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number (not a bool); otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(name: str, value: Any, lo: int) -> int:
    """``value`` if it is an integer >= ``lo``; otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def _list(name: str, value: Any) -> Sequence:
    """``value`` if it is a JSON list; otherwise a ValueError naming ``name``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return value


def default_cost_field(capture: Mapping) -> str:
    """``replay_ms`` when every bucket of the capture result has it, else ``eager_ms``."""
    buckets = _list("capture.buckets", capture.get("buckets"))
    return "replay_ms" if buckets and all("replay_ms" in b for b in buckets) else "eager_ms"


def read_costs(capture: Mapping, field: str) -> dict[int, dict[int, float]]:
    """Measured step costs of a ``bench capture`` result: ``{B: {K: ms}}``.

    Every bucket needs integer ``B`` >= 1, ``K`` >= 0 and a positive ``field``;
    a (B, K) pair measured twice is refused.
    """
    if field not in COST_FIELDS:
        raise ValueError(f"cost must be one of {COST_FIELDS}, got {field!r}")
    costs: dict[int, dict[int, float]] = {}
    for i, bucket in enumerate(_list("capture.buckets", capture.get("buckets"))):
        where = f"capture.buckets[{i}]"
        if not isinstance(bucket, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(bucket).__name__}")
        for key in ("B", "K", field):
            if key not in bucket:
                raise ValueError(f"{where}.{key} is missing")
        b, k = _count(f"{where}.B", bucket["B"], 1), _count(f"{where}.K", bucket["K"], 0)
        ms = _number(f"{where}.{field}", bucket[field])
        if ms <= 0:
            raise ValueError(f"{where}.{field} must be > 0, got {ms!r}")
        if k in costs.setdefault(b, {}):
            raise ValueError(f"{where}: bucket (B={b}, K={k}) is measured twice")
        costs[b][k] = ms
    if not costs:
        raise ValueError("capture.buckets must not be empty")
    return costs


def read_acceptance(spec: Mapping, method: str) -> tuple[list[float], int]:
    """The measured ``per_position_acceptance`` of ``method`` in a ``bench spec`` result, and its row index.

    Among funcspec rows of the method, the one with the most positions (the
    largest K) is used; the first such row in file order wins a tie. Greedy
    acceptance does not depend on the batch size, so rows that differ only
    in ``batch`` measure the same thing.
    """
    from funcspec.config import METHOD_ALIASES

    method = METHOD_ALIASES.get(method, method)
    best: Optional[tuple[int, int]] = None  # (positions, row index)
    for i, row in enumerate(_list("spec.rows", spec.get("rows"))):
        # NOTE: token-tree rows are skipped: their acceptance is per depth of an N-node tree, not per K
        # (read_tree_acceptance reads them).
        if not isinstance(row, Mapping) or row.get("engine", "funcspec") != "funcspec" or row.get("tree"):
            continue
        if "method" not in row:
            raise ValueError(f"spec.rows[{i}].method is missing")
        if METHOD_ALIASES.get(row["method"], row["method"]) != method:
            continue
        acc = _list(f"spec.rows[{i}].per_position_acceptance", row.get("per_position_acceptance"))
        if best is None or len(acc) > best[0]:
            best = (len(acc), i)
    if best is None:
        found = sorted({str(r.get("method")) for r in spec["rows"]
                        if isinstance(r, Mapping) and r.get("engine", "funcspec") == "funcspec"})
        raise ValueError(f"spec.rows has no funcspec row with method {method!r}; methods: {found}")
    i = best[1]
    return _check_acceptance(f"spec.rows[{i}].per_position_acceptance", spec["rows"][i]), i


def _check_acceptance(name: str, row: Mapping, per_k: bool = True) -> list[float]:
    """The row's acceptance: probabilities in [0, 1] that never increase with the position; K of them
    (``per_k``), or one per depth of a tree row."""
    acc = [_number(name, a) for a in _list(name, row.get("per_position_acceptance"))]
    if not acc:
        raise ValueError(f"{name} is empty: the row did not speculate (k = {row.get('k')!r})")
    if per_k and "k" in row and row["k"] != len(acc):
        raise ValueError(f"{name} has {len(acc)} positions but the row's k is {row['k']!r}")
    if any(not 0.0 <= a <= 1.0 for a in acc):
        raise ValueError(f"{name} must hold probabilities in [0, 1], got {acc}")
    # P(first i+2 accepted) <= P(first i+1 accepted): a rise means per-position conditional rates.
    if any(later > earlier for earlier, later in zip(acc, acc[1:])):
        raise ValueError(
            f"{name} must not increase with the position (it is P(the first i+1 drafts are all "
            f"accepted), as Engine.stats() reports it), got {acc}"
        )
    return acc


def parse_tree(method: str, keys: Any, name: str):
    """The ``TokenTree`` / ``DynamicTree`` that token-tree keys describe (as a row or result records them)."""
    from funcspec.config import SpecConfig

    if not isinstance(keys, Mapping) or not keys:
        raise ValueError(f"{name} must be a dict of token-tree keys, got {keys!r}")
    try:
        tree = SpecConfig.from_vllm({"method": method, "model": "-", **keys}, check_paths=False).tree  # type: ignore[union-attr]  # a method given
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err
    if tree is None:
        raise ValueError(f"{name} describes no token tree: {dict(keys)!r}")
    return tree


def read_tree_acceptance(spec: Mapping, method: str, tree: Optional[Mapping] = None
                         ) -> tuple[dict, dict[int, list[float]], dict[int, int]]:
    """The tree rows of ``method`` in a ``bench spec`` result: ``(tree keys, {N: per-depth acceptance},
    {N: row index})``, sorted by N.

    A tree row's ``k`` is its node count N and its ``tree`` the whole tree's keys
    (``bench spec --tree --tree-sizes``). Rows are grouped by the tree they
    describe (parsed, so the spelling of the keys does not matter); ``tree`` picks
    one group by its keys, else the method must have rows of exactly one tree.
    The first row of each N in file order wins: greedy acceptance does not
    depend on the batch size.
    """
    from funcspec.config import METHOD_ALIASES

    method = METHOD_ALIASES.get(method, method)
    groups: dict[Any, tuple[Mapping, list[int]]] = {}  # parsed tree -> (its keys, row indices)
    for i, row in enumerate(_list("spec.rows", spec.get("rows"))):
        if not isinstance(row, Mapping) or row.get("engine", "funcspec") != "funcspec" or not row.get("tree"):
            continue
        if "method" not in row:
            raise ValueError(f"spec.rows[{i}].method is missing")
        if METHOD_ALIASES.get(row["method"], row["method"]) == method:
            groups.setdefault(parse_tree(method, row["tree"], f"spec.rows[{i}].tree"), (row["tree"], []))[1].append(i)
    found = [dict(keys) for keys, _ in groups.values()]
    want = parse_tree(method, tree, "tree") if tree is not None else None
    if want is not None and want not in groups:
        raise ValueError(f"spec.rows has no funcspec row of method {method!r} with tree {dict(tree)}; trees: {found}")  # type: ignore[arg-type]  # want: a tree
    if want is None and len(groups) != 1:
        raise ValueError(f"spec.rows has {len(groups)} token trees of method {method!r}, not one"
                         + (f": pick one with tree=<its keys> (--tree JSON): {found}" if groups else ""))
    parsed = want if want is not None else next(iter(groups))
    keys, indices = groups[parsed]
    acceptance: dict[int, list[float]] = {}
    rows: dict[int, int] = {}
    for i in indices:
        n = _count(f"spec.rows[{i}].k", spec["rows"][i].get("k"), 1)
        if n > parsed.size:
            raise ValueError(f"spec.rows[{i}].k={n} is above the {parsed.size} nodes of its tree")
        if n not in rows:
            rows[n] = i
            acceptance[n] = _check_acceptance(f"spec.rows[{i}].per_position_acceptance", spec["rows"][i], per_k=False)
    return dict(keys), dict(sorted(acceptance.items())), dict(sorted(rows.items()))


# ----------------------------------------------------------------------------- the model


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E[tokens emitted per row-step | K = k] = 1 + sum_{i<k} a_i, with a_i = P(first i+1 drafts accepted).

    ``k`` may not exceed the measured positions: the acceptance beyond them is unknown.
    """
    _count("k", k, 0)
    if k > len(acceptance):
        raise ValueError(
            f"k={k} is beyond the measured per_position_acceptance ({len(acceptance)} positions)"
        )
    return 1.0 + sum(acceptance[:k])


def interpolate_cost(measured: Mapping[int, float], k: int, b: int = 0) -> float:
    """cost(B, k) from the costs measured at B: exact at a measured K, else linear between its neighbours.

    NOTE: a step's cost grows about linearly in its B·(K+1) query tokens at a
    fixed B, so a straight line between two measured K is a fair guess. Outside
    the measured K range there is no such anchor: ``k`` below the smallest or
    above the largest measured K is a ValueError, never an extrapolation.
    """
    if k in measured:
        return measured[k]
    ks = sorted(measured)
    if not ks[0] < k < ks[-1]:
        raise ValueError(
            f"k={k} is outside the measured K range {ks[0]}..{ks[-1]} of capture bucket B={b}: "
            f"funcspec tune-k does not extrapolate costs"
        )
    j = bisect.bisect_left(ks, k)
    lo, hi = ks[j - 1], ks[j]
    return measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo)


def throughput_table(costs: Mapping[int, Mapping[int, float]], acceptance: Sequence[float],
                     max_k: Optional[int] = None) -> list[dict]:
    """Expected tokens/s of every bucket B and every K it can be tuned to, sorted by (B, K).

    The K of bucket B run from its smallest measured K to the largest K that
    both the capture (for this B) and the acceptance measured, capped at
    ``max_k``. Each row: ``B, K, cost_ms, interpolated, expected_tokens, tokens_per_s``.
    """
    rows = []
    for b in sorted(costs):
        measured = costs[b]
        top = min(max(measured), len(acceptance))
        if max_k is not None:
            top = min(top, max_k)
        if top < min(measured):
            raise ValueError(
                f"capture bucket B={b} has no K in {min(measured)}..{top} (K measured: {sorted(measured)}, "
                f"per_position_acceptance positions: {len(acceptance)}, max_k: {max_k})"
            )
        rows += [_row(b, measured, k, expected_tokens(acceptance, k)) for k in range(min(measured), top + 1)]
    return rows


def _row(b: int, measured: Mapping[int, float], k: int, expected: float) -> dict:
    """One table row: bucket B at K (a tree: N), its (interpolated) cost and expected tokens/s."""
    ms = interpolate_cost(measured, k, b)
    return {"B": b, "K": k, "cost_ms": ms, "interpolated": k not in measured,
            "expected_tokens": expected, "tokens_per_s": b * expected / ms * 1e3}


def tree_throughput_table(costs: Mapping[int, Mapping[int, float]], expected: Mapping[int, float],
                          max_n: Optional[int] = None) -> list[dict]:
    """Expected tokens/s of every bucket B at every node count N it can be tuned to, sorted by (B, N).

    N runs over the node counts measured by the spec result (``expected``:
    N -> E[tokens | N]) and 0 (no drafting, E = 1), those inside B's measured K
    range (a cost between two measured N is interpolated, never extrapolated),
    capped at ``max_n``. Rows as :func:`throughput_table`'s, with K = N.
    """
    rows = []
    for b in sorted(costs):
        measured = costs[b]
        lo, hi = min(measured), max(measured)
        ns = [n for n in sorted({0, *expected}) if lo <= n <= hi and (max_n is None or n <= max_n)]
        if not ns:
            raise ValueError(f"capture bucket B={b} has no N in {lo}..{hi} with measured acceptance "
                             f"(tree sizes measured: {sorted(expected)}, max_k: {max_n})")
        rows += [_row(b, measured, n, expected.get(n, 1.0)) for n in ns]
    return rows


def best_k(rows: Sequence[Mapping]) -> dict[int, int]:
    """Per bucket B, the K with the highest tokens/s; a tie goes to the smaller K."""
    best: dict[int, Mapping] = {}
    for row in sorted(rows, key=lambda r: (r["B"], r["K"])):
        if row["B"] not in best or row["tokens_per_s"] > best[row["B"]]["tokens_per_s"]:
            best[row["B"]] = row
    return {b: row["K"] for b, row in best.items()}


def buckets_for(buckets: Sequence[int], max_batch: int) -> list[int]:
    """The measured buckets an engine with up to ``max_batch`` active rows pads to (sorted).

    An active batch of n rows pads to the smallest bucket >= n. A ``max_batch``
    above the largest bucket is a ValueError: its cost was never measured.
    """
    buckets = sorted(buckets)
    _count("max_batch", max_batch, 1)
    if max_batch > buckets[-1]:
        raise ValueError(
            f"max_batch={max_batch} is above the largest measured capture bucket B={buckets[-1]}: "
            f"funcspec tune-k does not extrapolate costs"
        )
    return buckets[: bisect.bisect_left(buckets, max_batch) + 1]


def k_per_batch_size(best: Mapping[int, int], max_batch: int) -> list[int]:
    """``ks[n - 1]`` = K for n active rows, n = 1..max_batch: the K of n's bucket."""
    buckets = buckets_for(list(best), max_batch)
    return [best[buckets[bisect.bisect_left(buckets, n)]] for n in range(1, max_batch + 1)]


def compress_ranges(ks: Sequence[int]) -> list[list[int]]:
    """vLLM's ``[[start_bs, end_bs, K], ...]`` from ``ks[n - 1]`` = K of batch size n.

    Runs of equal K merge into one range; the ranges cover 1..len(ks) with no gap.
    """
    ranges: list[list[int]] = []
    for n, k in enumerate(ks, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = n
        else:
            ranges.append([n, n, k])
    return ranges


def capture_sizes(best: Mapping[int, int], buckets: Sequence[int]) -> list[int]:
    """vLLM's ``cudagraph_capture_sizes``: the sorted, distinct token counts B · (K_B + 1) of the buckets."""
    return sorted({b * (best[b] + 1) for b in buckets})


# ----------------------------------------------------------------------------- the exported config


def tune(capture: Mapping, spec: Mapping, method: str, *, tree: bool | Mapping = False, **kwargs) -> dict:
    """:func:`tune_chain`, or :func:`tune_tree` where ``tree`` asks for a token tree: ``True`` for the
    method's only tree among the spec rows, or that tree's keys (a dict) to pick one. The one place that
    chooses between them, for ``funcspec tune-k [--tree [JSON]]`` and :func:`tune_files`; ``kwargs`` are
    theirs (``max_batch``, ``cost``, ``max_k``, ``spec_keys``, ``paths``).
    """
    if not isinstance(tree, (bool, Mapping)):
        raise ValueError(f"tree must be True, False or a dict of token-tree keys, got {tree!r}")
    if tree is False:
        return tune_chain(capture, spec, method, **kwargs)
    return tune_tree(capture, spec, method, tree=None if tree is True else tree, **kwargs)


def tune_chain(capture: Mapping, spec: Mapping, method: str, *, max_batch: Optional[int] = None,
               cost: Optional[str] = None, max_k: Optional[int] = None, spec_keys: Optional[Mapping] = None,
               paths: Optional[Mapping[str, str]] = None) -> dict:
    """The vLLM-Ascend-style config choosing ``method``'s K per batch size, from a capture result and a spec
    result (both dicts).

    Args:
        capture: a ``funcspec bench capture`` result.
        spec: a ``funcspec bench spec`` result with a funcspec (chain) row of ``method``.
        method: the speculative method (a vLLM name or alias).
        max_batch: the largest active batch the table covers (default: the
            largest measured bucket).
        cost: ``replay_ms`` or ``eager_ms`` (default: replay_ms when every bucket has it).
        max_k: the largest K to consider (default: everything measured).
        spec_keys: extra ``speculative_config`` keys passed through unchanged,
            e.g. ``{"model": DRAFT_DIR}`` or the n-gram window.
        paths: ``{"capture": ..., "spec": ...}`` recorded in ``tuning``.

    Returns:
        ``{"speculative_config", "compilation_config", "tuning"}``. The
        speculative_config is checked by :meth:`SpecConfig.from_vllm`.
    """
    inputs = _read_inputs(capture, method, cost, spec_keys)
    acceptance, row = read_acceptance(spec, inputs.method)
    if max_k is not None:
        _check_max_k(max_k, inputs.costs, len(acceptance), "K",
                     f"the measured spec.rows[{row}].per_position_acceptance ({len(acceptance)} positions)")
    choice = _choose(inputs.costs, max_batch, lambda measured: throughput_table(measured, acceptance, max_k))
    # NOTE: vLLM needs num_speculative_tokens >= 1 even when K = 0 wins everywhere;
    # the table's K = 0 then keeps every step autoregressive.
    tokens = {"num_speculative_tokens": max(max(choice.best.values()), 1)}
    return _export(inputs, choice, tokens, {"spec_row": row, "per_position_acceptance": acceptance},
                   spec_keys, paths)


def tune_tree(capture: Mapping, spec: Mapping, method: str, *, tree: Optional[Mapping] = None,
              max_batch: Optional[int] = None, cost: Optional[str] = None, max_k: Optional[int] = None,
              spec_keys: Optional[Mapping] = None, paths: Optional[Mapping[str, str]] = None) -> dict:
    """The config choosing the node count N of ``method``'s token tree per batch size (module docstring).

    Args as :func:`tune_chain`'s, but ``spec`` holds the method's tree rows (``bench spec --tree-sizes``),
    ``capture`` the tree's (B, N) buckets (``bench capture --tree``), ``max_k`` caps N, and ``tree`` is the
    keys of the tree to tune (a dict, however spelled), or ``None`` for the method's only tree among the
    spec rows. The speculative_config carries the tree's keys and its whole node count.
    """
    inputs = _read_inputs(capture, method, cost, spec_keys)
    keys, acceptance, rows = read_tree_acceptance(spec, inputs.method, tree)
    parsed = parse_tree(inputs.method, keys, "the tuned tree")
    if not capture.get("tree") or parse_tree(inputs.method, capture["tree"], "capture.tree") != parsed:
        # NOTE: a (B, N) bucket costs drafting and verifying the tree cut to N; a chain's (B, K)
        # or another tree's buckets cost something else.
        warnings.warn(f"capture result was measured with tree {capture.get('tree')!r}, tuning tree {keys}",
                      stacklevel=2)
    if max_k is not None:
        _check_max_k(max_k, inputs.costs, max(acceptance), "N",
                     f"the largest tree size N measured in spec.rows ({max(acceptance)})")
    expected = {n: 1.0 + sum(acc) for n, acc in acceptance.items()}  # E[tokens | N] = 1 + sum_d a_d(N)
    choice = _choose(inputs.costs, max_batch, lambda measured: tree_throughput_table(measured, expected, max_k))
    info = {"tree": keys, "tree_nodes": parsed.size, "spec_rows": {str(n): i for n, i in rows.items()},
            "per_depth_acceptance": {str(n): acc for n, acc in acceptance.items()},
            "expected_tokens": {str(n): e for n, e in expected.items()}}
    return _export(inputs, choice, {**keys, "num_speculative_tokens": parsed.size}, info, spec_keys, paths)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What both kinds read alike: the method's canonical name, the cost field and the capture's costs."""

    method: str
    cost: str  # a COST_FIELDS entry
    costs: dict[int, dict[int, float]]  # {B: {K or N: ms}}


def _read_inputs(capture: Mapping, method: str, cost: Optional[str], spec_keys: Optional[Mapping]) -> _Inputs:
    """The method's canonical name and the capture's costs; refuses ``spec_keys`` that the tuner sets."""
    from funcspec.config import METHOD_ALIASES
    from funcspec.config.tree import DYNAMIC_KEYS

    method = METHOD_ALIASES.get(method, method)
    field = cost or default_cost_field(capture)
    if capture.get("method") not in (None, method):
        # NOTE: a bucket's cost includes its proposer's drafting; another method's costs mislead.
        warnings.warn(f"capture result was measured with method {capture['method']!r}, tuning {method!r}",
                      stacklevel=3)
    clash = sorted(set(spec_keys or {}) & (_TUNED_KEYS | {"speculative_token_tree", *DYNAMIC_KEYS}))
    if clash:
        raise ValueError(f"spec_keys.{clash[0]} is set by the tuner; pass only method-specific keys")
    return _Inputs(method, field, read_costs(capture, field))


def _check_max_k(max_k: Any, costs: Mapping[int, Mapping[int, float]], measured: int, letter: str,
                 spec_measured: str) -> None:
    """``max_k`` may not ask for a K (a tree: N) that neither input measured: the spec result's ``measured``
    (named by ``spec_measured``), or the largest of the capture's buckets."""
    _count("max_k", max_k, 0)
    if max_k > measured:
        raise ValueError(f"max_k={max_k} is beyond {spec_measured}")
    top = max(max(ks) for ks in costs.values())
    if max_k > top:
        raise ValueError(f"max_k={max_k} is beyond the largest {letter} measured in capture.buckets ({top})")


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The buckets in use, the tokens/s table over them, the best K (N) per bucket and vLLM's ranges of it."""

    max_batch: int
    buckets: list[int]
    table: list[dict]
    best: dict[int, int]
    ranges: list[list[int]]


def _choose(costs: Mapping[int, Mapping[int, float]], max_batch: Optional[int],
            table_of: Callable[[dict[int, Mapping[int, float]]], list[dict]]) -> _Choice:
    """Both kinds' choice: the buckets ``max_batch`` pads to, ``table_of`` their costs, the best per bucket."""
    max_batch = max(costs) if max_batch is None else max_batch
    buckets = buckets_for(list(costs), max_batch)
    table = table_of({b: costs[b] for b in buckets})
    best = best_k(table)
    return _Choice(max_batch, buckets, table, best, compress_ranges(k_per_batch_size(best, max_batch)))


def _export(inputs: _Inputs, choice: _Choice, speculative: Mapping, info: Mapping, spec_keys: Optional[Mapping],
            paths: Optional[Mapping[str, str]]) -> dict:
    """The config: ``speculative`` (the kind's own keys) between ``spec_keys`` and the table, checked by
    :meth:`SpecConfig.from_vllm`; ``info`` (the kind's inputs) in ``tuning``."""
    from funcspec.config import SpecConfig

    speculative_config = {**(spec_keys or {}), "method": inputs.method, **speculative,
                          "num_speculative_tokens_per_batch_size": choice.ranges}
    SpecConfig.from_vllm(speculative_config, check_paths=False)
    tuning = {
        **dict(paths or {}),
        "method": inputs.method,
        "cost": inputs.cost,
        "max_batch": choice.max_batch,
        **info,
        "batch_buckets": choice.buckets,
        "best_k": {str(b): k for b, k in choice.best.items()},
        "tokens_per_s": choice.table,
    }
    return {"speculative_config": speculative_config,
            "compilation_config": {"cudagraph_capture_sizes": capture_sizes(choice.best, choice.buckets)},
            "tuning": tuning}


def tune_files(capture_path, spec_path, method: str, out_path, **kwargs) -> dict:
    """Read the two result files and :func:`tune`; returns the config.

    Writes ``out_path`` (``speculative_config``, ``compilation_config`` and
    ``max_num_seqs``: ``funcspec.LLM`` keyword arguments, as they are) and
    ``out_path`` with suffix ``.tuning.json`` (the ``tuning`` block).
    """
    capture = json.loads(Path(capture_path).read_text())
    spec = json.loads(Path(spec_path).read_text())
    cfg = tune(capture, spec, method, paths={"capture": str(capture_path), "spec": str(spec_path)}, **kwargs)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(llm_kwargs(cfg), indent=2) + "\n")
    out.with_suffix(".tuning.json").write_text(json.dumps(cfg["tuning"], indent=2) + "\n")
    return cfg


def llm_kwargs(cfg: Mapping) -> dict:
    """The ``funcspec.LLM`` / vLLM ``LLM`` keyword arguments of a :func:`tune` result."""
    return {"speculative_config": cfg["speculative_config"], "compilation_config": cfg["compilation_config"],
            "max_num_seqs": cfg["tuning"]["max_batch"]}


def load(path) -> dict:
    """``funcspec.LLM`` keyword arguments from a ``tune-k`` file: ``LLM(model, **load(path))``."""
    return json.loads(Path(path).read_text())


def format_table(cfg: Mapping) -> str:
    """A readable table: one line per bucket B with its chosen K (a tree's N) and the tokens/s of every K.

    A ``~`` marks tokens/s whose cost was interpolated between measured K.
    """
    tuning = cfg["tuning"]
    rows = tuning["tokens_per_s"]
    ks = sorted({r["K"] for r in rows})
    by = {(r["B"], r["K"]): r for r in rows}
    letter = "N" if "tree" in tuning else "K"
    head = f"{'B':>4} {'best ' + letter:>6} | " + " ".join(f"{letter + '=' + str(n):>10}" for n in ks)
    what = f"method {tuning['method']}" + (f", tree {json.dumps(tuning['tree'])}" if "tree" in tuning else "")
    lines = [f"expected tokens/s ({tuning['cost']}, {what}; ~ = interpolated cost)", head]
    for b_str, k_best in tuning["best_k"].items():
        b = int(b_str)
        cells = []
        for n in ks:
            r = by.get((b, n))
            cells.append(f"{r['tokens_per_s']:>9.1f}{'~' if r['interpolated'] else ' '}" if r else f"{'-':>10}")
        lines.append(f"{b:>4} {k_best:>6} | " + " ".join(cells))
    spec = cfg["speculative_config"]
    lines.append(f"num_speculative_tokens_per_batch_size = {spec['num_speculative_tokens_per_batch_size']}")
    lines.append(f"cudagraph_capture_sizes = {cfg['compilation_config']['cudagraph_capture_sizes']}")
    return "\n".join(lines)
