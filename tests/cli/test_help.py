"""Every option and argument of every ``burncoll`` subcommand says what it does in ``--help``."""

from __future__ import annotations

import argparse

from burncoll.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "burncoll"
             ) -> dict[str, argparse.ArgumentParser]:
    found = {name: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found |= _parsers(sub, f"{name} {sub_name}")
    return found


def test_every_option_of_every_subcommand_has_a_description() -> None:
    parsers = _parsers(build_parser())
    assert {"burncoll demo", "burncoll launch", "burncoll bench",
            "burncoll orchestrator"} <= set(parsers)
    bare = [f"{name} {'/'.join(action.option_strings) or action.dest}"
            for name, parser in parsers.items() for action in parser._actions
            if not isinstance(action, argparse._SubParsersAction)  # its commands, below
            and (action.help is None or not str(action.help).strip())]
    bare += [f"{name} {action.dest}" for name, parser in parsers.items()
             for sub in parser._actions if isinstance(sub, argparse._SubParsersAction)
             for action in sub._choices_actions if not action.help]
    assert bare == []
    demo = parsers["burncoll demo"].format_help()
    assert "--steps STEPS" in demo and "(default 1000)" in demo
