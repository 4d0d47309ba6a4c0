"""Strategies are pure: their sources import only a small stdlib set and burncoll.strategies /
burncoll.errors (no threading, asyncio, socket, transport, numpy, jax, cupy).

Checked on the source with :mod:`ast` rather than ``sys.modules``: the stdlib itself may import
threading indirectly, which says nothing about the strategies.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import burncoll.strategies

PACKAGE_DIR = Path(burncoll.strategies.__file__).parent
SOURCES = sorted(PACKAGE_DIR.glob("*.py"))
ALLOWED_STDLIB = {"__future__", "abc", "collections.abc", "dataclasses", "enum", "functools",
                  "fractions", "math", "typing"}  # fmt: skip
ALLOWED_BURNCOLL = ("burncoll.strategies", "burncoll.errors")


def _imported_modules(tree: ast.AST) -> list[str]:
    mods: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside burncoll.strategies (or above it: reject)
                mods.append(
                    "burncoll.strategies" + (f".{node.module}" if node.module else "")
                    if node.level == 1
                    else f"<relative level {node.level}>"
                )
            else:
                mods.append(node.module or "")
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name in {"__import__", "import_module"}:
                mods.append(f"<dynamic import: {name}>")
    return mods


def _allowed(mod: str) -> bool:
    if mod in ALLOWED_STDLIB:
        return True
    return any(mod == p or mod.startswith(p + ".") for p in ALLOWED_BURNCOLL)


def test_sources_found() -> None:
    names = {p.name for p in SOURCES}
    assert {"__init__.py", "base.py", "schedule.py", "centralized.py", "tree.py", "ring.py"} <= (
        names
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_imports_are_pure(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [m for m in _imported_modules(tree) if not _allowed(m)]
    assert not bad, f"{path.name} imports {bad}; strategies must stay pure"


def test_checker_catches_forbidden_imports() -> None:
    src = "import threading\nfrom numpy import zeros\nimport burncoll.transport\nimport math\n"
    bad = [m for m in _imported_modules(ast.parse(src)) if not _allowed(m)]
    assert bad == ["threading", "numpy", "burncoll.transport"]
