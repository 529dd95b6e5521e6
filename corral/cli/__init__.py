"""``corral``: one command, a subcommand per component.

Each subcommand parses its arguments and hands them to a plain function (``args.func``); heavy
imports (torch, transformers) happen inside the subcommand that needs them.

How a command fails (:mod:`corral.cli.errors`): one line on stderr, ``corral <command>:
<problem>. <fix>``, exit 2 for a wrong invocation and 1 for work that failed; any other
exception is one line too (its type and message), and ``--debug`` adds the traceback.
Ctrl-C exits 130 without a word.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from corral.cli.errors import CliError, RunError, UsageError, error_line
from corral.cli.parsing import Parser, command_path

__all__ = ["CliError", "RunError", "UsageError", "build_parser", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("corral")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown (not installed)"


def build_parser() -> Parser:
    """The ``corral`` parser with every subcommand."""
    from corral.cli.bundle import add_bundle_command
    from corral.cli.harness import add_harness_command
    from corral.cli.main_job import add_run_command
    from corral.cli.model import add_model_command
    from corral.cli.play import add_play_command
    from corral.cli.rows import add_rows_commands
    from corral.cli.sandbox import add_sandbox_command
    from corral.cli.servers import add_server_commands
    from corral.cli.template import add_template_command
    from corral.cli.train import add_train_commands
    from corral.cli.view import add_view_command
    from corral.doctor import add_doctor_command

    parser = Parser(
        prog="corral",
        description="corral: an agentic RL gym. A chat gateway records every turn as exact "
        "training tokens.",
    )
    parser.set_defaults(debug=False)
    parser.add_argument(
        "--version", action="version", version=f"corral {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_command(sub)
    add_model_command(sub)
    add_server_commands(sub)
    add_rows_commands(sub)
    add_bundle_command(sub)
    add_sandbox_command(sub)
    add_template_command(sub)
    add_play_command(sub)
    add_harness_command(sub)
    add_train_commands(sub)
    add_view_command(sub)
    add_doctor_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``corral`` with ``argv`` (default: the process's arguments) and return the exit
    code: the command's own, a :class:`CliError`'s, 1 for an unexpected error, 130 for
    Ctrl-C. ``--help`` and ``--version`` exit through ``SystemExit(0)`` as argparse does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Until the parser is built (it imports every command's module), the first word stands in.
    command = next((word for word in argv if not word.startswith("-")), "")
    debug = "--debug" in argv
    try:
        parser = build_parser()
        command = command_path(parser, argv)
        debug = False  # from here on, what the parser says (not an --agent-cmd's word)
        args = parser.parse_args(argv)
        debug = bool(args.debug)
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # the one place every failure becomes one line
        if debug:
            traceback.print_exc()
        line, code = error_line(command, exc)
        print(line, file=sys.stderr)
        return code
