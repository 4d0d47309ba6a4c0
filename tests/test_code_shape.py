"""The shape the code keeps (CONTRIBUTING.md): one concept per module, short functions, no stubs.

These are limits a reviewer would otherwise have to count by hand; the layer contracts are
checked by ``lint-imports`` in CI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "burncoll"
SOURCES = sorted(PACKAGE.rglob("*.py"))

#: One concept per module; split only where a concept splits. This bound only catches a
#: module that has grown several concepts: a tighter cap moved code between files instead of
#: removing it, so a module may hold its whole concept up to here.
MODULE_LINES = 700
FUNCTION_LINES = 60


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_the_package_has_sources() -> None:
    assert len(SOURCES) > 50, PACKAGE


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= MODULE_LINES, f"{path.name} has {lines} lines; more than one concept?"
    long = [f"{f.name} ({(f.end_lineno or f.lineno) - f.lineno + 1} lines)"
            for f in _functions(ast.parse(text))
            if (f.end_lineno or f.lineno) - f.lineno + 1 > FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {FUNCTION_LINES} lines: {', '.join(long)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_not_implemented_stubs(path: Path) -> None:
    """A base class states what subclasses provide with ``abc.abstractmethod`` or a Protocol,
    never with a method that raises ``NotImplementedError``."""
    stubs = [
        node.lineno for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in (
            ast.unparse(node.exc))
    ]
    assert not stubs, f"{path.name} raises NotImplementedError at lines {stubs}"
