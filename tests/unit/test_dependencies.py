"""Every runtime dependency that pyproject.toml declares is imported by the package (an unused one, such as
einops was, only costs every install)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(package: Path) -> set[str]:
    """The top-level names of every ``import`` in ``package``, at module level and inside functions alike."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def import_name(requirement: str) -> str:
    """``torch==2.13.*`` -> ``torch``: the distribution's name as Python imports it (``-`` becomes ``_``)."""
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("-", "_")


def test_every_declared_dependency_is_imported():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    unused = sorted(d for d in deps if import_name(d) not in imported_modules(ROOT / "funcspec"))
    assert unused == [], f"pyproject.toml [project] dependencies that funcspec never imports: {unused}"


def test_import_name_strips_the_version_and_spells_dashes_as_python_does():
    assert [import_name(r) for r in ("torch==2.13.*", "numpy>=1.26", "typing-extensions", "gguf")] == [
        "torch", "numpy", "typing_extensions", "gguf"]
