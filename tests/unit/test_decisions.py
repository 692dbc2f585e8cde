"""Each decision is made in one module (funcspec/ARCHITECTURE.md, ``plan.py``: "nothing re-derives those values").

The engine's plan owns a bucket's shape, its complete verify rule per sampling
mode and the graph a mode runs in; ``SpecConfig.max_k`` the largest K; the
engine a batch's sampling mode. Like ``test_layering.py``, the test parses every
module of the package with ``ast`` (nothing is imported) and fails where a
module other than the owner makes one of those decisions again:

  - calls of a deciding function (``truncate``, ``verify_rule``, ``graph_modes``,
    ``mode_for``, ``Mode.with_logprobs``) outside its owner;
  - ``VerifyConfig(...)`` built outside the plan (and the standalone
    ``verifiers.rejection_sample``), or a ``replace(...)`` that rewrites one of
    its fields (``filters=``, ``greedy=``, ...) anywhere;
  - reads of ``num_speculative_tokens`` in the engine and ``llm`` layers, which
    read ``plan.max_k`` (or ``SpecConfig.max_k`` / ``EngineArgs.max_k`` before there is a plan).

What it does not see (said here so that its blind spots are known): a decision
re-derived by other means (a hand-written ``min(k, ...)`` cut, a mode picked by
``if`` on temperatures), and calls through another name (``f = truncate``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from funcspec.verifiers import VerifyConfig

PACKAGE = Path(__file__).resolve().parents[2] / "funcspec"

DECIDERS: dict[str, set[str]] = {
    "truncate": {"funcspec.plan", "funcspec.token_tree"},  # a bucket's shape: EnginePlan.shapes
    "verify_rule": {"funcspec.plan"},  # a bucket's complete rule: EnginePlan.verify_rules
    "graph_modes": {"funcspec.plan"},  # the graph a mode runs in: EnginePlan.graph_modes
    "mode_for": {"funcspec.engine", "funcspec.sampling"},  # a batch's (and a prefill's) sampling mode
    "with_logprobs": {"funcspec.sampling", "funcspec.plan"},  # a mode's logprobs twin (Mode, the graph table)
}
"""Function name -> the modules that may call it (its owner, and where it is defined)."""

VERIFY_CONFIG_BUILDERS = {"funcspec.plan", "funcspec.verifiers", "funcspec.step"}
"""Where ``VerifyConfig(...)`` may be built: the plan, ``rejection_sample`` (one call's own rule) and
``StepConfig``'s default field (the K = 0 rule of a bucket built by hand)."""

MAX_K_READERS = {"funcspec.engine", "funcspec.runner", "funcspec.plan", "funcspec.scheduler", "funcspec.extract",
                 "funcspec.distributed", "funcspec.build", "funcspec.args", "funcspec.llm", "funcspec"}
"""The engine and ``llm`` layers: they read ``plan.max_k`` or ``SpecConfig.max_k``, never the vLLM field."""

# Known violations in files owned by other work, as (module, what) -> why. Every entry must still be a
# violation (test_allow_list_is_not_stale): point the module at the owner, then delete its line here.
ALLOWED: dict[tuple[str, str], str] = {}


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _called(node: ast.Call) -> str | None:
    """The name a call calls: ``f`` of ``f(...)`` and of ``a.b.f(...)``."""
    fn = node.func
    return fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None


def _owner(module: str, owners: set[str]) -> bool:
    """``module`` is one of ``owners`` or inside one of those packages."""
    return any(module == o or module.startswith(o + ".") for o in owners)


def decisions(name: str, tree: ast.AST) -> set[tuple[str, str]]:
    """(module, what) for every decision module ``name`` makes outside its owner."""
    rule_fields = {f.name for f in dataclasses.fields(VerifyConfig)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = _called(node)
            if called in DECIDERS and not _owner(name, DECIDERS[called]):
                out.add((name, called))
            if called == "VerifyConfig" and not _owner(name, VERIFY_CONFIG_BUILDERS):
                out.add((name, "VerifyConfig"))
            if called == "replace" and {k.arg for k in node.keywords} & rule_fields:
                out.add((name, "replace of a VerifyConfig field"))
        if isinstance(node, ast.Attribute) and node.attr == "num_speculative_tokens" and name in MAX_K_READERS:
            out.add((name, "num_speculative_tokens"))
    return out


def all_decisions() -> set[tuple[str, str]]:
    return {d for name, path in module_names().items() for d in decisions(name, ast.parse(path.read_text()))}


def test_each_decision_is_made_by_its_owner_only():
    extra = sorted(all_decisions() - set(ALLOWED))
    assert extra == [], f"decisions re-derived outside their owner (see this test's docstring): {extra}"


def test_allow_list_is_not_stale():
    assert sorted(set(ALLOWED) - all_decisions()) == []


def test_the_scan_sees_what_it_looks_for():
    src = """
from funcspec.token_tree import truncate
import dataclasses
shape = truncate(tree, 3)
mode = sampling.mode_for(params).with_logprobs(True)
rule = dataclasses.replace(plan.verify(k), filters=False, greedy=True)
own = VerifyConfig("standard")
k = spec.num_speculative_tokens
"""
    assert decisions("funcspec.runner", ast.parse(src)) == {
        ("funcspec.runner", "truncate"), ("funcspec.runner", "mode_for"), ("funcspec.runner", "with_logprobs"),
        ("funcspec.runner", "replace of a VerifyConfig field"), ("funcspec.runner", "VerifyConfig"),
        ("funcspec.runner", "num_speculative_tokens")}
    assert decisions("funcspec.plan", ast.parse(src)) == {  # the plan builds rules and cuts trees
        ("funcspec.plan", "mode_for"), ("funcspec.plan", "replace of a VerifyConfig field"),
        ("funcspec.plan", "num_speculative_tokens")}
