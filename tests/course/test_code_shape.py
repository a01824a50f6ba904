"""The package reads at a glance: no function or method of ``refimpl/`` is longer than
``MAX_FUNCTION_LINES`` lines, docstring included (what a reader takes in at once; ruff's complexity rules in
pyproject.toml bound its branches and statements, mypy its types). A nested function counts within the one
that holds it, and on its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function in ``source`` longer than ``limit`` lines (decorators excluded)."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_of_the_package_is_longer_than_the_limit():
    found = [f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
             for path in sorted((ROOT / "refimpl").rglob("*.py"))
             for name, lines in long_functions(path.read_text())]
    assert not found, found
    assert len(list((ROOT / "refimpl").rglob("*.py"))) > 100  # control: the walk found the package


def test_the_rule_finds_a_long_function():
    """Negative control: a function of limit + 1 lines is found, one of the limit is not."""
    def source(lines: int) -> str:
        return "def f():\n" + "    x = 1\n" * (lines - 1)
    assert long_functions(source(MAX_FUNCTION_LINES + 1)) == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(source(MAX_FUNCTION_LINES)) == []
