"""Docstrings and comments say what the code does and why, not what it measured.

Benchmark figures in the package's prose (milliseconds, GB/s, speed-ups, "on a
2-core EPYC") go stale with the next kernel or machine and bury the point; they
live in graphs/results/ (the commands that made them, beside them), and a note
in the code names the file. This test reads every comment (``tokenize``) and
every string statement (``ast``: docstrings, attribute docstrings) of
``funcspec/`` outside the units whose job is measuring, and fails on a figure.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# NOTE: benchmarks, training, the K tuner report measurements by design; kernels/ is to be added here once its
# notes have moved (its module notes still hold the GB/s that chose each CPU's product)
EXCLUDED = ("funcspec/bench/", "funcspec/train/", "funcspec/tune.py")

_N = r"(?<![\w.])\d+(?:\.\d+)?"
MEASUREMENT = re.compile("|".join((
    _N + r"\s*(?:ns|µs|us|ms|GB/s|MB/s|GiB/s|tokens/s|tok/s|it/s)(?![\w/])",  # a time or a rate: 35 us, 8 GB/s
    _N + r"[×x](?=[\s,;:.)]|$)",  # a ratio: 1.8×, 2x faster (a shape, 8 x 2048 or 4x4, is not one)
    _N + r"\s*s\s+(?:against|vs\.?|versus|cold|warm)\b",  # a timing in seconds set against another
    _N + r"\s*% of (?:the |a |its )?(?:step|time|run|decode|prefill)",  # a share of measured time
    r"\bEPYC\b|\b\d+-core\b",  # the machine a figure was taken on (a CPU family, "Zen 4 and AMX", is not one)
)), re.IGNORECASE)


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every line of every string statement of a Python source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(out)


def measurements(root: Path = ROOT, excluded: tuple[str, ...] = EXCLUDED) -> list[str]:
    """``file:line: text`` of every comment or docstring line of ``funcspec/`` that holds a measurement."""
    bad = []
    for path in sorted((root / "funcspec").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(excluded):
            continue
        bad += [f"{rel}:{n}: {text.strip()}" for n, text in prose(path.read_text(encoding="utf-8"))
                if MEASUREMENT.search(text)]
    return bad


def test_no_measurements_in_docstrings_or_comments():
    found = measurements()
    assert not found, ("benchmark figures in funcspec's prose: move them to graphs/results/ and name the file "
                       "(tests/unit/test_docstrings.py)\n" + "\n".join(found))


def test_the_pattern_tells_figures_from_shapes_and_limits():
    figures = ["35 us a layer against 110", "0.8 ms a step", "1.8× faster", "median 1.8-2.8x", "at 12 GB/s",
               "a 16-layer toy 32 s against 126 s", "13% of the step", "on a busy 2-core machine", "a Zen 4 EPYC",
               "200 tokens/s"]
    plain = ["KV caches [L, S+1, H_kv, T, D]", "8 slots x 2048 positions", "a 4x4 tile", "int64s >= 0",
             "a 300 s timeout", "K + 1 <= 64 tokens", "2 MiB-aligned", "A × [.., H_t]", "MASK × K", "top-p 0.95",
             "sms", "x86", "CPUs so far: Cooper Lake, Sapphire Rapids, Zen 4"]
    assert [t for t in figures if not MEASUREMENT.search(t)] == []
    assert [t for t in plain if MEASUREMENT.search(t)] == []


def test_the_scan_reads_comments_and_docstrings_only(tmp_path):
    (tmp_path / "funcspec" / "bench").mkdir(parents=True)
    (tmp_path / "funcspec" / "a.py").write_text(
        '"""Module: 3 ms a step."""\nX = "5 ms"  # 2x faster\nY = 1\n"""Y: 4 GB/s."""\n\n\n'
        'def f():\n    """Fine."""\n    return "9 us"\n')
    (tmp_path / "funcspec" / "bench" / "b.py").write_text("# 1 ms\n")
    assert [line.split(":")[1] for line in measurements(tmp_path)] == ["1", "2", "4"]
    assert len(measurements(tmp_path, excluded=())) == 4
