"""The sizes the codebase keeps (ADR 0024): no function over 60 lines and no class over 300
lines in `src/`, counted from the syntax tree (a function's or class's first line to its last,
docstring and comments included). A new concern goes into a module of its own, not into the
nearest class."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "specserve"
MAX_FUNCTION, MAX_CLASS = 60, 300


def _oversized(path: Path, root: Path = SRC) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else \
            MAX_FUNCTION if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        lines = node.end_lineno - node.lineno + 1 if limit is not None else 0
        if limit is not None and lines > limit:
            out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_60_lines_and_no_class_over_300_in_src():
    files = [p for p in SRC.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert len(files) > 100
    assert [o for p in files for o in _oversized(p)] == []


def test_the_count_finds_an_oversized_function(tmp_path):
    """The check can fail: a 61-line function is found."""
    big = tmp_path / "probe.py"
    big.write_text("def f():\n" + "    x = 1\n" * 60)
    assert _oversized(big, tmp_path) == ["probe.py:1 f (61 lines)"]
