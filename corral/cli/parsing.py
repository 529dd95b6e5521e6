"""The argument parser every ``corral`` subcommand is built on: one-line usage errors, help
that shows defaults, and ``--debug`` accepted before or after the subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from corral.cli.errors import UsageError

DEBUG_HELP = "on an error, print the full traceback"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown as ``(default: X)`` where there is one worth showing (not for None,
    False, an empty value or help that already names its default); descriptions wrapped
    paragraph by paragraph (a blank line in a description is kept)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or (isinstance(default, (list, dict, str, tuple)) and not default)
        ):
            return text
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            super(HelpFormatter, self)._fill_text(part, width, indent)
            for part in text.split("\n\n")
        )


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are :class:`UsageError` (``main`` prints them as one
    line, exit 2) rather than a usage block and ``SystemExit(2)``. Its subparsers are Parsers
    too (argparse makes them of the parent's class), with :class:`HelpFormatter` and
    ``--debug``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand that is not given --debug leaves the top level's value.
        self.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
        )

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"See `{self.prog} --help`.")


def command_path(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The subcommand words of ``argv`` (``"eval"``, ``"sandbox image build"``; ``""`` when
    none is given), found without parsing, so that even a failed parse names its command."""
    words: list[str] = []
    for token in argv:
        if token.startswith("-"):
            continue
        choices = _subcommands(parser)
        if token not in choices:
            break
        words.append(token)
        parser = choices[token]
    return " ".join(words)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
