"""Imports flow one way (funcspec/ARCHITECTURE.md, "Layers"): no cycles, no import of a higher layer.

The test parses every module of the package with ``ast`` (nothing is
imported, so it runs in milliseconds) and collects every ``import``
statement, at module level and inside functions alike: a function-level
import is still a dependency, only a later one.

What counts as an edge:
  - ``import funcspec.a.b`` and ``from funcspec.a import b``: the module
    ``funcspec.a.b`` if it is one, else the package ``funcspec.a`` (its
    ``__init__.py``, a re-export facade that belongs to the package's layer).
  - Relative imports are resolved against the importing module.
  - Imports under ``if TYPE_CHECKING:`` too. They never run, but the module
    still depends on the other one's names (for its annotations, its readers and
    type checkers), and a cycle through them is one that a later runtime import
    (a check that needs an isinstance, a default) closes without a warning.

What does not (each is said here so that the test's blind spots are known):
  - ``importlib.import_module(name)`` with a computed name (proposers' registry);
  - the implicit import of parent packages that Python performs for
    ``import funcspec.a.b``: every module would otherwise depend on
    ``funcspec/__init__.py``, the public facade at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "funcspec"

# Lowest first. A module may import its own layer and any layer below it.
# Keys are the first name under funcspec (``nn`` for funcspec.nn.eagle);
# "__init__" is funcspec/__init__.py, the public facade (load_model, Engine, LLM).
LAYERS: list[tuple[str, set[str]]] = [
    # pytrees, token-tree shapes, keys, sentinels, outputs, the method registry, the host suffix tree,
    # the tensor-parallel group and its all-reduce, host-made constant tables
    ("base", {"pytree", "token_tree", "rng", "types", "outputs", "methods", "suffix_tree", "parallel", "constants"}),
    ("kernels", {"kernels"}),  # every device- and ISA-specific piece, and Ops
    ("nn", {"nn"}),  # math only, over cfg.ops
    ("formats", {"checkpoints", "quant"}),  # HF formats: config, weight files, layouts; prepare_params
    ("step parts", {"proposers", "verifiers", "sampling", "dynamic", "logprobs"}),  # pure functions over explicit state
    ("step", {"step"}),
    ("capture", {"capture"}),
    ("config", {"config"}),  # SpecConfig parsing; takes backend names from capture
    # host loop: scheduler (requests, slots) and runner (device state, graphs), wired by engine;
    # extract: the hidden-state prefill hook the engine installs; distributed: tensor-parallel ranks;
    # args: every engine argument (EngineArgs); build: the engine's build steps
    ("engine", {"engine", "scheduler", "runner", "plan", "extract", "distributed", "args", "build"}),
    ("llm", {"llm", "__init__"}),
    # public API users; serve: the OpenAI-compatible server (it drives an Engine by add/abort/step)
    ("tools", {"bench", "tune", "train", "zoo", "cli", "serve"}),
]

# Known violations in files owned by other work, as (importer module, imported unit) -> why.
# The imported unit is the first name under funcspec, so a split of config.py into a
# package keeps matching. Every entry must still be a violation (see
# test_allow_list_is_not_stale): fix the import, then delete its line here.
ALLOWED: dict[tuple[str, str], str] = {
    # An annotation only, under TYPE_CHECKING (an edge since TYPE_CHECKING imports count). Fix in dynamic.py: a
    # string annotation without the import (or a Protocol of the fields it reads), then delete this line.
    ("funcspec.dynamic", "config"): "TYPE_CHECKING import of config.DynamicSpecConfig for an annotation",
}

# nn heads share math through nn.llama only; format helpers live in funcspec.checkpoints.
# nn.dsa: DeepSeek-V3.2's indexer, shared by the DeepSeek decoder and its MTP layer.
NN_SHARED = {"funcspec.nn", "funcspec.nn.llama", "funcspec.nn.deepseek", "funcspec.nn.dsa"}  # kernels: cfg.ops


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in ``tree``: module level, in functions, under ``if TYPE_CHECKING:``."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is a funcspec module, or None outside funcspec."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The funcspec modules that module ``name`` imports (see the module docstring for what counts)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: strip the module (unless a package) and level - 1 packages
                anchor = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_pkg else 0))]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.update(t for t in (_resolve(t, modules) for t in targets) if t is not None and t != name)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the funcspec modules it imports."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def unit(module: str) -> str:
    """``funcspec.nn.eagle`` -> ``nn``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_index() -> dict[str, int]:
    return {u: i for i, (_, units) in enumerate(LAYERS) for u in units}


def layer_violations(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importer, imported unit) -> the imported modules, for every import of a higher layer."""
    rank, out = layer_index(), {}
    for src, dsts in graph.items():
        for dst in dsts:
            if rank[unit(dst)] > rank[unit(src)]:
                out.setdefault((src, unit(dst)), []).append(dst)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer(graph):
    rank = layer_index()
    missing = sorted(m for m in graph if unit(m) not in rank)
    assert not missing, f"place these modules in LAYERS (tests/unit/test_layering.py): {missing}"


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_higher_layer(graph):
    bad = {k: v for k, v in layer_violations(graph).items() if k not in ALLOWED}
    lines = [f"{src} imports {sorted(dsts)} (layer {u!r} is above {unit(src)!r})" for (src, u), dsts in sorted(bad.items())]
    assert not bad, "imports against the layers (ARCHITECTURE.md):\n" + "\n".join(lines)


def test_allow_list_is_not_stale(graph):
    stale = sorted(set(ALLOWED) - set(layer_violations(graph)))
    assert not stale, f"these imports were fixed; delete them from ALLOWED: {stale}"


def test_nn_is_math_only(graph):
    """nn imports only nn, pytree, rng, types, parallel and the kernels' ``Ops`` and ``QuantFormat`` (and their
    huge-page memory): a head shares math through nn.llama, not another head, and no nn module loads or builds a
    kernel."""
    for src in (m for m in graph if unit(m) == "nn"):
        allowed = ("nn", "pytree", "rng", "types", "parallel")
        assert all(unit(d) in allowed or d in ("funcspec.kernels", "funcspec.kernels.cpu") for d in graph[src]), \
            (src, sorted(graph[src]))
        heads = {d for d in graph[src] if unit(d) == "nn"} - NN_SHARED
        assert src in NN_SHARED or not heads, f"{src} imports another head: {sorted(heads)}"


def test_kernels_import_nothing_above_them(graph):
    """The kernel layer is self-contained: it never imports funcspec's math, formats or runtime."""
    for src in (m for m in graph if unit(m) == "kernels"):
        assert all(unit(d) == "kernels" for d in graph[src]), (src, sorted(graph[src]))


def test_capture_decides_auto_without_bench(graph):
    """auto is a rule on the device, not a lookup of benchmark files (bench sits above capture)."""
    capture = [m for m in graph if unit(m) == "capture"]
    assert capture and not any(unit(d) in ("bench", "config") for m in capture for d in graph[m])


def test_the_checks_catch_a_bad_import(tmp_path):
    """A copy of the package with one bad import fails the layer and cycle checks; the clean copy passes."""
    import shutil

    root = tmp_path / "funcspec"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    clean = import_graph(root)
    assert find_cycle(clean) is None and set(layer_violations(clean)) <= set(ALLOWED)

    eagle = root / "nn" / "eagle.py"
    eagle.write_text(eagle.read_text() + "\n\ndef _bad():\n    from funcspec.checkpoints import eagle  # noqa\n")
    bad = import_graph(root)
    assert ("funcspec.nn.eagle", "checkpoints") in layer_violations(bad)
    assert find_cycle(bad) == ["funcspec.checkpoints.eagle", "funcspec.nn.eagle", "funcspec.checkpoints.eagle"]

    step = root / "step.py"
    step.write_text("if TYPE_CHECKING:\n    import funcspec.engine\n" + step.read_text())
    assert "funcspec.engine" in import_graph(root)["funcspec.step"]  # TYPE_CHECKING imports are edges too
    assert ("funcspec.step", "engine") in layer_violations(import_graph(root))


def test_a_cycle_through_type_checking_fails(tmp_path):
    """A cycle closed by an import under ``if TYPE_CHECKING:`` is a cycle (config/rules.py once imported
    SpecConfig that way from config/spec.py, which imports rules)."""
    import shutil

    root = tmp_path / "funcspec"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    rules = root / "config" / "rules.py"
    rules.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                     "    from funcspec.config.spec import SpecConfig  # noqa\n" + rules.read_text())
    assert find_cycle(import_graph(root)) == ["funcspec.config.rules", "funcspec.config.spec",
                                              "funcspec.config.rules"]


# ----------------------------------------------------------------------------- tools use the public engine API

ROOT = PACKAGE.parent
ENGINE_PARTS = ("runner", "scheduler")  # Engine's device state and its request queues: the engine's own business


def part_reads(source: str, where: str) -> list[str]:
    """``where:line: .part`` for every read of an engine part in ``source``: ``x.runner`` or ``x.scheduler``, and
    ``getattr(x, "runner")``. A tool reads ``Engine.stats()`` and the engine's other public methods instead, so
    that the engine's parts can change without breaking the server, the benchmarks or the CLI."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
            found.append((node.lineno, node.col_offset, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_PARTS):
            found.append((node.lineno, node.col_offset, node.args[1].value))
    return [f"{where}:{line}: .{part}" for line, _, part in sorted(found)]  # in source order


def notebook_cells(path: Path, where: str) -> list[tuple[str, str]]:
    """``(where[cell i], source)`` of each code cell of notebook ``path``, IPython magics (``%``, ``!``) blanked
    so that the cell parses and keeps its line numbers."""
    import json

    cells = json.loads(path.read_text())["cells"]
    return [(f"{where}[cell {i}]",
             "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                       for line in "".join(cell["source"]).splitlines()))
            for i, cell in enumerate(cells) if cell["cell_type"] == "code"]


def tool_sources() -> list[tuple[str, str]]:
    """``(where, source)`` of every tool: the package's modules in the "tools" layer, tools/ and the notebooks."""
    tools = dict(LAYERS)["tools"]
    files = [p for name, p in module_names().items() if unit(name) in tools] + sorted((ROOT / "tools").rglob("*.py"))
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in files]
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    return out + [cell for nb in notebooks for cell in notebook_cells(nb, str(nb.relative_to(ROOT)))]


def test_tools_read_no_engine_parts():
    sources = tool_sources()
    assert any(where == "funcspec/cli.py" for where, _ in sources) and any("[cell" in w for w, _ in sources)
    bad = [line for where, source in sources for line in part_reads(source, where)]
    assert not bad, "tools read the engine's parts; use Engine.stats() or another public method:\n" + "\n".join(bad)


def test_the_part_check_catches_a_planted_read(tmp_path):
    """Each way of reaching a part is reported with its file and line; the public API is not."""
    snippet = ("def f(llm, engine):\n"
               "    graphs = engine.stats()['graphs']\n"
               "    waiting = engine.waiting_ids()\n"
               "    compiled = llm.engine.runner.compiled\n"
               "    return bool(engine.scheduler.waiting), getattr(engine, 'runner')\n")
    assert part_reads(snippet, "funcspec/serve/x.py") == [
        "funcspec/serve/x.py:4: .runner", "funcspec/serve/x.py:5: .scheduler", "funcspec/serve/x.py:5: .runner"]
    nb = tmp_path / "nb.ipynb"
    nb.write_text('{"cells": [{"cell_type": "markdown", "source": ["eng.runner"]}, {"cell_type": "code", "source": '
                  '["%matplotlib inline\\n", "st = eng.stats()\\n", "eng.scheduler.waiting"]}]}')
    ((where, source),) = notebook_cells(nb, "nb.ipynb")
    assert where == "nb.ipynb[cell 1]" and part_reads(source, where) == ["nb.ipynb[cell 1]:3: .scheduler"]
