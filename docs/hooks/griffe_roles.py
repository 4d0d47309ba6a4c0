"""A griffe extension for the API reference: burncoll's docstrings are written with Sphinx
roles (``:class:`~burncoll.Work```, ``:meth:`wait```) and reST literal blocks (``::``); the
site renders Markdown. Each role becomes inline code, a link where the target is a name the
API page documents (``burncoll.Work``, ``burncoll.Communicator.all_reduce``), and a paragraph
ending in ``::`` ends in ``:``."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

#: ``:role:`target``` and ``:role:`~target```.
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def public_names() -> frozenset[str]:
    """``burncoll.<name>`` for every name of ``burncoll.__all__`` (read, not imported)."""
    init = Path(__file__).resolve().parents[2] / "burncoll" / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return frozenset(f"burncoll.{name}" for name in ast.literal_eval(node.value))
    return frozenset()


def _linked(target: str, documented: frozenset[str]) -> bool:
    return target in documented or any(target.startswith(name + ".") for name in documented)


def convert(text: str, documented: frozenset[str] = frozenset()) -> str:
    """``text`` with its Sphinx roles as Markdown (inline code, linked when documented)."""

    def one(match: re.Match[str]) -> str:
        short, target = match.group(1) == "~", match.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        if target.endswith("()"):
            target = target[:-2]
        if _linked(target, documented):
            return f"[`{shown}`][{target}]"
        return f"`{shown}`"

    text = ROLE.sub(one, text)
    return re.sub(r"(?<=\S)::$", ":", text, flags=re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring as it is loaded (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.documented = public_names()

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value, self.documented)
