"""A griffe extension for the API reference: what the page shows of each class's members.

* An attribute documented the Sphinx way, by ``#:`` comment lines just above it (the config's
  fields, the attributes a constructor sets), gets those lines as its docstring.
* A member that overrides a documented one without a docstring of its own (``Tree.reduce``)
  gets the base class's.
* An attribute the constructor sets shows no value (an expression of the constructor's).
* A class that users never construct (:data:`NOT_CONSTRUCTED`) shows no constructor: its
  ``__init__`` takes internal objects, and the page would present it as the way to make one.
"""

from __future__ import annotations

from typing import Any

import griffe

#: Classes users get from burncoll rather than build: ``register`` returns a Communicator,
#: ``async_op=True`` a Work, ``start_orchestrator`` an Orchestrator, ``ddp`` a DataParallel
#: (a Communicator's constructor is its core's).
NOT_CONSTRUCTED = ("burncoll.comm.core.CommunicatorCore", "burncoll.work.Work",
                   "burncoll.orchestration.orchestrator.Orchestrator", "burncoll.train.ddp.DataParallel")


def comment_above(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above ``obj``'s first line, without the marker."""
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return None
    lines = obj.filepath.read_text().splitlines()
    found: list[str] = []
    index = obj.lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(found) or None


class MemberDocs(griffe.Extension):
    """See the module docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if not isinstance(obj, griffe.Attribute):
            return
        if obj.docstring is None:
            text = comment_above(obj)
            if text is not None:
                obj.docstring = griffe.Docstring(text, parent=obj)
        if "instance-attribute" in obj.labels and "class-attribute" not in obj.labels:
            obj.value = None  # an expression of the constructor's, not a default

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for path in NOT_CONSTRUCTED:
            cls = pkg.modules_collection.get_member(path)
            if cls is not None and "__init__" in cls.members:
                del cls.members["__init__"]
        _inherit(pkg)


def _inherit(obj: griffe.Object) -> None:
    """Give each undocumented override in ``obj`` (recursively) its base's docstring."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            for name, own in member.members.items():
                if own.is_alias or own.docstring is not None:
                    continue
                base = _documented_in_bases(member, name)
                if base is not None:
                    own.docstring = griffe.Docstring(base, parent=own)
        if member.is_module or member.is_class:
            _inherit(member)


def _documented_in_bases(cls: griffe.Object, name: str) -> str | None:
    try:
        bases = cls.resolved_bases  # type: ignore[attr-defined]
    except Exception:  # an unresolvable base (a library's): nothing to inherit from there
        return None
    for base in bases:
        member = base.members.get(name)
        if member is not None and not member.is_alias and member.docstring is not None:
            return str(member.docstring.value)
    return None
