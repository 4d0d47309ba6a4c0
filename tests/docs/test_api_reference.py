"""The API reference documents every public attribute and hides the constructors users never
call: loaded with griffe and the extensions mkdocs.yml gives mkdocstrings, as the site is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import burncoll

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "docs" / "hooks"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("griffe") is None,
                                reason="griffe is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def package() -> object:
    import griffe

    sys.path.insert(0, str(HOOKS))
    try:
        from griffe_members import MemberDocs
        from griffe_roles import SphinxRoles
    finally:
        sys.path.remove(str(HOOKS))
    listed = (REPO / "mkdocs.yml").read_text()
    assert "griffe_members.py:MemberDocs" in listed and "griffe_roles.py:SphinxRoles" in listed
    return griffe.load("burncoll", search_paths=[str(REPO)], resolve_aliases=True,
                       extensions=griffe.load_extensions(MemberDocs(), SphinxRoles()))


def _public_classes(package: object) -> dict[str, object]:
    found = {}
    for name in burncoll.__all__:
        obj = package[name]  # type: ignore[index]
        target = obj.final_target if obj.is_alias else obj
        if target.is_class:
            found[name] = target
    return found


def test_every_public_attribute_and_property_has_a_docstring(package: object) -> None:
    classes = _public_classes(package)
    assert {"Communicator", "CollectiveConfig", "Work", "ReduceOp", "Tree"} <= set(classes)
    missing = [f"{name}.{member}" for name, cls in classes.items()
               for member, obj in cls.all_members.items()  # type: ignore[attr-defined]
               if not member.startswith("_") and obj.is_attribute
               and (obj.docstring is None or not obj.docstring.value.strip())]
    assert missing == []
    rank = classes["Communicator"].all_members["rank"]  # type: ignore[attr-defined]
    assert "peer_id" in rank.docstring.value and rank.value is None  # no constructor's code


def test_only_the_classes_users_build_show_a_constructor(package: object) -> None:
    from griffe_members import NOT_CONSTRUCTED  # imported (cached) by the fixture

    classes = _public_classes(package)
    for name in ("Communicator", "Work", "Orchestrator"):
        assert "__init__" not in classes[name].members, name  # type: ignore[attr-defined]
    for path in NOT_CONSTRUCTED:  # each names a class that still exists
        cls = package.modules_collection.get_member(path)  # type: ignore[attr-defined]
        assert cls.is_class and "__init__" not in cls.members, path
    for name in ("CollectiveConfig", "Tree"):
        assert "__init__" in classes[name].all_members, name  # type: ignore[attr-defined]


def test_long_code_lines_wrap_instead_of_being_cut() -> None:
    assert "  - stylesheets/extra.css" in (REPO / "mkdocs.yml").read_text()
    css = (REPO / "docs" / "stylesheets" / "extra.css").read_text()
    assert ".md-typeset pre > code" in css and "white-space: pre-wrap" in css
