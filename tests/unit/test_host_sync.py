"""The no-host-sync rule (ARCHITECTURE.md, "Contract"): the step path (verifiers, proposers, nn, step, sampling)
reads no device data on the host and draws randomness only from funcspec.rng. The one allowed copy is the engine's ``readback``
(see test_engine.py's runtime count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import funcspec

ROOT = Path(funcspec.__file__).parent
SCANNED = ("verifiers/*.py", "proposers/*.py", "nn/*.py", "step.py", "sampling.py", "logprobs.py")

SYNC_CALLS = {"item", "tolist", "cpu", "numpy", "nonzero"}
"""``x.item()`` etc.: a device-to-host copy (nonzero: a data-dependent shape, hence a sync)."""
RNG_CALLS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
             "multinomial", "Generator", "manual_seed", "seed"}
"""Global or stateful torch RNG: not reproducible across eager, compiled and batch shapes."""

ALLOWED = {
    # The host drafter runs between graphs on Python lists of the running requests.
    "proposers/suffix.py": {"HostDrafter.__init__", "HostDrafter._sync", "HostDrafter.drafts",
                            "HostDrafter.finish"},
}
"""Functions that run eagerly on the host, outside every graph, where a sync is legitimate (file -> qualnames)."""


def host_syncs(source: str, allowed=frozenset()) -> list[tuple[str, int, str]]:
    """(function qualname, line, call) of every host sync or torch RNG call outside the ``allowed`` functions."""
    found = []

    def visit(node, scope: tuple[str, ...]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + (node.name,)
        qualname = ".".join(scope)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and qualname not in allowed:
            name = node.func.attr
            to_cpu = name == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args)
            if name in SYNC_CALLS or name in RNG_CALLS or to_cpu:
                found.append((qualname or "<module>", node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(source), ())
    return found


def _files() -> list[Path]:
    return sorted(p for pattern in SCANNED for p in ROOT.glob(pattern))


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_step_path_has_no_host_sync_or_torch_rng(path):
    rel = str(path.relative_to(ROOT))
    assert host_syncs(path.read_text(), ALLOWED.get(rel, frozenset())) == [], rel


def test_scan_covers_the_step_path_and_its_allow_list_is_live():
    rels = {str(p.relative_to(ROOT)) for p in _files()}
    assert {"step.py", "sampling.py", "verifiers/common.py", "proposers/chain.py", "nn/llama.py"} <= rels
    for rel, names in ALLOWED.items():  # NOTE: a stale entry would silently allow a renamed function
        defined = _qualnames((ROOT / rel).read_text())
        assert names <= defined, (rel, names - defined)


def _qualnames(source: str) -> set[str]:
    out = set()

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + (node.name,)
            out.add(".".join(scope))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(source), ())
    return out


def test_the_scan_can_fail():
    src = '''
def propose(cfg, params, state, ctx, k):
    n = ctx.lens.max().item()  # a sync in graph code
    return torch.randint(0, 9, (n,)), state

class HostDrafter:
    def drafts(self, rows, b, k):
        return x.tolist()
'''
    assert host_syncs(src) == [("propose", 3, "item"), ("propose", 4, "randint"), ("HostDrafter.drafts", 8, "tolist")]
    assert host_syncs(src, {"HostDrafter.drafts"}) == [("propose", 3, "item"), ("propose", 4, "randint")]
