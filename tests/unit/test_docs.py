"""The docs say what the code does: funcspec/ARCHITECTURE.md's and docs/'s claims, checked mechanically.

Each check is a function of the repository root that returns what it found
wrong (empty: nothing), so the same functions can be run on another copy of the
tree. Nothing here imports torch or funcspec: the files are read as text, the
Python ones parsed with ``ast``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = "funcspec/ARCHITECTURE.md"
LAYERING = "tests/unit/test_layering.py"

# NOTE: spelled in two parts so that this file does not cite the document it bans.
BANNED_DOC = re.compile("DESIGN" + r"(\.md|\s*§)")
SCANNED_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg"}
# Hand-written docs that must not name the machine that wrote them (bench results in graphs/results/cpu/ are
# generated records and keep theirs); docs/*.md are added by hand_written().
HAND_WRITTEN = ("README.md", ARCH, "graphs/results/HISTORY.md", "models/README.md", "notebooks/README.md")
# NOTE: the README is a user's first page and ARCHITECTURE.md a newcomer's map; reference material goes to
# docs/, which these caps keep it from drifting back from
LINE_CAPS = {"README.md": 150, ARCH: 200}
# The commands the README promises (.ci/run calls `make test`)
COMMANDS = ("make run", "make test")
MACHINE_PATH = re.compile(r"(?<![\w.~])/(root|home|work|tmp)/")
FILE_NAME = re.compile(r"\.(json|py|md|bin|cpp|h|txt|zip|gguf|safetensors|pt)$")


def _text(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8")


def docs_pages(root: Path) -> list[str]:
    """The pages of docs/, repository-relative."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))


def hand_written(root: Path) -> list[str]:
    """Every hand-written doc that exists: :data:`HAND_WRITTEN` and docs/*.md."""
    return [rel for rel in HAND_WRITTEN if (root / rel).is_file()] + docs_pages(root)


def code_docs(root: Path) -> list[str]:
    """The docs whose backticked paths and names must exist: ARCHITECTURE.md and docs/*.md."""
    return [ARCH] + docs_pages(root)


def _code_spans(text: str) -> list[str]:
    """The contents of every inline code span, fenced blocks left out."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"(?ms)^```.*?^```", "", text))


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text."""
    match = re.search(rf"(?ms)^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text)
    assert match, f"no '## {heading}' section"
    return match.group(1)


# ----------------------------------------------------------------------------- paths and names


def _exists(root: Path, rel: str) -> bool:
    """A path, where ``<placeholder>`` parts stand for any name (``proposers/<method>.py``) and ``**`` for any
    directories."""
    pattern = re.sub(r"<[^>]+>", "*", rel)
    return any(root.glob(pattern)) if "*" in pattern else (root / pattern).exists()


def missing_paths(root: Path = ROOT) -> list[str]:
    """Backticked paths in ARCHITECTURE.md and docs/*.md that do not exist: ``funcspec/...`` and ``tests/...``
    from the repository root, and a bare file (``engine.py``, ``nn/llama.py``, ``stream.cpp``) or package
    (``serve/``) anywhere under ``funcspec/``. Spans of ARCHITECTURE.md come bare, the others as ``doc: span``."""
    bad = []
    package = root / "funcspec"
    for doc in code_docs(root):
        where = "" if doc == ARCH else f"{doc}: "
        for span in sorted(set(_code_spans(_text(root, doc)))):
            if span.startswith(("funcspec/", "tests/")):
                if not _exists(root, span.rstrip("/")):
                    bad.append(where + span)
            elif re.fullmatch(r"[\w<>]+(/[\w<>]+)*(\.(py|cpp|h)|/)", span):
                rel = span.rstrip("/")
                if not (_exists(package, rel) or _exists(package, "**/" + rel)):
                    bad.append(where + span)
    return bad


def _module_file(package: Path, parts: list[str]) -> Path | None:
    path = package.joinpath(*parts)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _names(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level names: definitions, assignments and imports (a package re-exports what it imports)."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
    return out


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class-level fields and the ``self.x`` it assigns."""
    out = set(_names(ast.Module(body=cls.body, type_ignores=[])))
    out.update(n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
               and isinstance(n.value, ast.Name) and n.value.id == "self")
    return out


def unresolved_names(root: Path = ROOT) -> list[str]:
    """Backticked dotted names in ARCHITECTURE.md and docs/*.md that name nothing in the code (reported as
    :func:`missing_paths` reports paths): ``module.name`` where the
    first part is a funcspec module or package (``nn.llama.commit_path``, ``kernels.quant.reference``), and
    ``Class.member`` for a class defined in funcspec (``Runner.move_slot``). Other spans (``cfg.ops.linear``,
    ``torch.compile``) are not names this test can check."""
    package = root / "funcspec"
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in package.rglob("*.py")}
    classes: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    top = {p.stem if p.suffix == ".py" else p.name for p in package.iterdir() if p.suffix == ".py" or p.is_dir()}
    bad = []
    spans = sorted({("" if doc == ARCH else f"{doc}: ", span)
                    for doc in code_docs(root) for span in _code_spans(_text(root, doc))})
    for where, span in spans:
        match = re.fullmatch(r"(?:funcspec\.)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?", span)
        if not match or FILE_NAME.search(span):  # config.json, methods.py: files, not names
            continue
        parts = match.group(1).split(".")
        if parts[0] in top:
            prefixes = [(i, _module_file(package, parts[:i])) for i in range(len(parts), 0, -1)]
            i, path = next(((i, f) for i, f in prefixes if f is not None), (0, None))  # the longest module
            rest = parts[i:]
            names = _names(trees[path]) if path is not None and rest else {}
            ok = path is not None and not rest or (rest[0] in names and (
                len(rest) == 1 or (isinstance(names[rest[0]], ast.ClassDef) and len(rest) == 2
                                   and rest[1] in _members(names[rest[0]]))))
        elif parts[0] in classes and len(parts) == 2:
            ok = any(parts[1] in _members(c) for c in classes[parts[0]])
        else:
            continue
        if not ok:
            bad.append(where + span)
    return bad


def test_architecture_paths_exist():
    assert missing_paths() == [], f"{ARCH} or docs/ names paths that do not exist"


def test_architecture_names_exist():
    assert unresolved_names() == [], f"{ARCH} or docs/ names functions, classes or modules that do not exist"


# ----------------------------------------------------------------------------- the proposer line cap


def proposer_cap(root: Path = ROOT) -> int:
    """The line cap ARCHITECTURE.md states for the files of ``proposers/``."""
    text = re.sub(r"\s+", " ", _text(root, ARCH))
    caps = re.findall(r"\*\*`proposers/`\*\*: one file per method, each at most (\d+) lines", text)
    assert len(caps) == 1, f"{ARCH} must state one line cap for proposers/ ('each at most N lines')"
    return int(caps[0])


def over_cap(root: Path = ROOT) -> dict[str, int]:
    """Files of ``funcspec/proposers/`` longer than the stated cap: name -> lines."""
    cap = proposer_cap(root)
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted((root / "funcspec" / "proposers").glob("*.py"))}
    return {name: n for name, n in lines.items() if n > cap}


def test_proposer_files_keep_the_stated_cap():
    assert over_cap() == {}, f"split these files or change the rule in {ARCH} (and say why)"


# ----------------------------------------------------------------------------- the layers


def _literal(root: Path, rel: str, name: str):
    """The literal value assigned to module-level ``name`` in a Python file, read without importing it."""
    for node in ast.parse(_text(root, rel)).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{rel} assigns no {name}")


def documented_layers(root: Path = ROOT) -> list[tuple[str, set[str]]]:
    """The "Layers" table of ARCHITECTURE.md, lowest layer first: (layer, units)."""
    rows = []
    for line in _section(_text(root, ARCH), "Layers").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], set(re.findall(r"`(\w+)`", cells[1]))))
    return rows[::-1]


def documented_exceptions(root: Path = ROOT) -> set[tuple[str, str]]:
    """The exceptions ARCHITECTURE.md lists: "Exceptions (...): none." or `importer` → `unit` pairs."""
    match = re.search(r"(?m)^Exceptions \(`ALLOWED` in `tests/unit/test_layering.py`\): (.*)$",
                      _section(_text(root, ARCH), "Layers"))
    assert match, f"{ARCH} must list the layering exceptions ('Exceptions (`ALLOWED` in ...): ...')"
    listed = match.group(1).strip().rstrip(".")
    return set() if listed == "none" else set(re.findall(r"`([\w.]+)` → `(\w+)`", listed))


def test_documented_layers_are_the_tested_layers():
    tested = [(name, set(units)) for name, units in _literal(ROOT, LAYERING, "LAYERS")]
    assert documented_layers() == tested


def test_documented_exceptions_are_the_allow_list():
    assert documented_exceptions() == set(_literal(ROOT, LAYERING, "ALLOWED"))


# ----------------------------------------------------------------------------- the whole tree


def _scanned(root: Path):
    """Text files of the repository: no hidden directories (.git, .venv), build metadata or caches."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(p.startswith(".") or p.endswith(".egg-info") or p == "__pycache__" for p in rel):
            continue
        if path.is_file() and (path.suffix in SCANNED_SUFFIXES or path.name == "Makefile"):
            yield path


def banned_citations(root: Path = ROOT) -> list[str]:
    """``file:line`` of every citation of a design document that the repository does not have."""
    out = []
    for path in _scanned(root):
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if BANNED_DOC.search(line):
                out.append(f"{path.relative_to(root)}:{n}")
    return out


def test_no_file_cites_a_missing_design_document():
    assert banned_citations() == []


def machine_paths(root: Path = ROOT) -> list[str]:
    """``file:line`` of absolute paths of some machine (``/root/...``) in the hand-written docs."""
    out = []
    for rel in hand_written(root):
        for n, line in enumerate(_text(root, rel).splitlines(), 1):
            if MACHINE_PATH.search(line):
                out.append(f"{rel}:{n}")
    return out


def test_docs_name_no_machine_paths():
    """A reader's machine has no /root/.pyenv: name a repo-relative path or the command that finds it."""
    assert machine_paths() == []


# ----------------------------------------------------------------------------- links


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text(encoding="utf-8"))
    return {_anchor(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def broken_links(root: Path = ROOT) -> list[str]:
    """Relative links of README.md, the other hand-written docs (docs/ included) and graphs/results/**/*.md
    whose file (or heading anchor) does not exist."""
    docs = {root / rel for rel in hand_written(root)}
    docs |= set((root / "graphs" / "results").rglob("*.md"))
    bad = []
    for doc in sorted(docs):
        text = re.sub(r"(?ms)^```.*?^```", "", doc.read_text(encoding="utf-8"))
        text = re.sub(r"`[^`\n]*`", "``", text)  # a link's text may be code; code is never a link
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            rel, _, anchor = target.partition("#")
            path = (doc.parent / rel).resolve() if rel else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                bad.append(f"{doc.relative_to(root)}: {target}")
    return bad


def test_relative_links_resolve():
    assert broken_links() == []


# ----------------------------------------------------------------------------- the README


def _links(text: str) -> set[str]:
    return set(re.findall(r"\]\(([^)#\s]+)", re.sub(r"(?ms)^```.*?^```", "", text)))


def readme_faults(root: Path = ROOT) -> list[str]:
    """What the README breaks of its promises: the two commands in a code block, a link to every docs/ page
    (none orphaned) and to ARCHITECTURE.md, and the line caps of it and ARCHITECTURE.md."""
    text = _text(root, "README.md")
    blocks = "\n".join(re.findall(r"(?ms)^```[^\n]*\n(.*?)^```", text))
    out = [f"no `{c}` in a README code block" for c in COMMANDS if not re.search(rf"(?m)^{c}\b", blocks)]
    linked = _links(text)
    out += [f"README does not link {rel}" for rel in [*docs_pages(root), ARCH] if rel not in linked]
    for rel, cap in LINE_CAPS.items():
        n = len(_text(root, rel).splitlines())
        if n > cap:
            out.append(f"{rel} has {n} lines, over its cap of {cap}")
    return out


def test_readme_keeps_its_promises():
    assert readme_faults() == []


def test_the_commands_are_makefile_targets():
    targets = set(re.findall(r"(?m)^([\w-]+):", _text(ROOT, "Makefile")))
    assert {c.split()[1] for c in COMMANDS} <= targets
    assert "make test" in _text(ROOT, ".ci/run")


def test_the_checks_catch_stale_docs(tmp_path):
    """Each check finds the fault it exists for, in a copy of the docs with one fault each."""
    for rel in (ARCH, LAYERING, "README.md", *docs_pages(ROOT)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(_text(ROOT, rel))
    (tmp_path / "docs" / "orphan.md").write_text("`funcspec/gone2.py`, `step.nothing`, [x](gone.md), /home/me\n")
    proposers = tmp_path / "funcspec" / "proposers"
    proposers.mkdir(parents=True)
    (proposers / "ngram.py").write_text("x = 1\n" * (proposer_cap() + 1))
    (tmp_path / "funcspec" / "step.py").write_text("def spec_step():\n    pass\n")
    (tmp_path / "funcspec" / "ARCHITECTURE.md").write_text(
        _text(ROOT, ARCH) + "\n`funcspec/gone.py`, `step.commit_path`, `Runner.nothing`; see " + "DESIGN" + ".md\n"
        + "[a link](nowhere.md)\n")
    (tmp_path / "README.md").write_text(_text(ROOT, "README.md") + "\n[gone](graphs/results/gone.md)\n"
                                        "[anchor](funcspec/ARCHITECTURE.md#no-such-heading) /root/.pyenv\n")
    assert "funcspec/gone.py" in missing_paths(tmp_path)
    assert "step.commit_path" in unresolved_names(tmp_path)
    assert over_cap(tmp_path) == {"ngram.py": proposer_cap() + 1}
    assert banned_citations(tmp_path) == [f"{ARCH}:{len(_text(tmp_path, ARCH).splitlines()) - 1}"]
    assert "README.md: graphs/results/gone.md" in broken_links(tmp_path)
    assert "README.md: funcspec/ARCHITECTURE.md#no-such-heading" in broken_links(tmp_path)
    assert machine_paths(tmp_path) == [f"README.md:{len(_text(tmp_path, 'README.md').splitlines())}",
                                       "docs/orphan.md:1"]
    assert "docs/orphan.md: funcspec/gone2.py" in missing_paths(tmp_path)
    assert "docs/orphan.md: step.nothing" in unresolved_names(tmp_path)
    assert "docs/orphan.md: gone.md" in broken_links(tmp_path)
    assert readme_faults(tmp_path) == ["README does not link docs/orphan.md"]
    (tmp_path / "README.md").write_text(_text(ROOT, "README.md").replace("make test", "make check") + "x\n" * 150)
    faults = readme_faults(tmp_path)
    assert "no `make test` in a README code block" in faults and any("over its cap" in f for f in faults)
    layering = _text(ROOT, LAYERING).replace('("step", {"step"}),', '("step", {"step", "runner"}),')
    (tmp_path / LAYERING).write_text(layering)
    tested = [(name, set(units)) for name, units in _literal(tmp_path, LAYERING, "LAYERS")]
    assert documented_layers(tmp_path) != tested
