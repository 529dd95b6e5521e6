"""``corral template check``: whether the gateway records a model's sessions as one sample
each, under both history modes."""

from __future__ import annotations

import argparse
import json
from typing import Any

from corral.cli.checks import model_folder
from corral.cli.errors import UsageError
from corral.cli.options import (
    add_rendering_flags,
)
from corral.gateway.settings import (
    HISTORY_MODES,
    GatewaySettings,
)


def add_template_command(sub: Any) -> None:
    template = sub.add_parser(
        "template", help="chat templates", description="Check a model's chat template."
    ).add_subparsers(dest="template_command", required=True, metavar="ACTION")
    check = template.add_parser(
        "check",
        help="whether the gateway records a model's sessions as one sample each",
        description="Plays synthetic multi-turn conversations (chat with and without a system "
        "prompt, tool-call loops, parallel calls, a tool error, reasoning on and off, a long "
        "history) with the template standing in for the model, under both history modes: "
        "how many samples each merges into and why each fork happens, which boundary token "
        "history finds or why it falls back, and whether the parsers read back the calls and "
        "reasoning. Prints a table per mode and a verdict; exits 0 when nothing breaks under "
        "--history, 1 with a FAIL line per broken shape on stderr.",
    )
    check.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    add_rendering_flags(check)
    check.add_argument(
        "--history",
        choices=HISTORY_MODES,
        default=GatewaySettings.history,
        help="the history mode the verdict is for (the gateway's --history)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=cmd_template_check)


def cmd_template_check(args: argparse.Namespace) -> int:
    import sys

    model = model_folder(args.model_dir, "MODEL_DIR")
    from corral.console import make_console, print_table
    from corral.gateway.rendering import TemplateError
    from corral.gateway.template_check import check_model_dir

    try:
        report = check_model_dir(
            model,
            history=args.history,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            chat_template_kwargs=args.chat_template_kwargs,
        )
    except TemplateError as exc:
        raise UsageError(f"{model}: {exc}", "Pass a model folder with a chat template.") from None
    failed = [s for s in report.shapes if s.breaks(report.history)]
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = make_console()
        for table in _template_tables(report):
            print_table(console, table)
        played = sum(1 for s in report.shapes if s.skipped is None)
        verdict = (
            f"ok: no shape breaks under {report.history} history ({played} played)"
            if not failed
            else f"BREAK: {len(failed)} of {played} shapes break under {report.history} "
            f"history ({', '.join(s.name for s in failed)})"
        )
        console.print(f"{args.model_dir}: {verdict}", markup=False, highlight=False)
    for shape in failed:
        reasons = "; ".join(shape.breaks(report.history))
        print(f"{args.model_dir}: FAIL {shape.name}: {reasons}", file=sys.stderr)
    return 1 if failed else 0


def _template_tables(report: Any) -> list[Any]:
    """A table per history mode (the verdict's first): each shape's samples, whether every
    turn extends the last, whether the parsers read the outputs back, and a note."""
    from rich.markup import escape
    from rich.table import Table

    def mark(good: bool) -> str:
        return "yes" if good else "[bold red]no[/bold red]"

    tables = []
    for history in sorted(HISTORY_MODES, key=lambda mode: mode != report.history):
        chosen = " (the verdict's)" if history == report.history else ""
        table = Table(title=f"{report.model}: {history} history{chosen}")
        for column in ("shape", "turns", "samples", "extends?", "parser ok?", "note"):
            table.add_column(column, justify="right" if column in ("turns", "samples") else "left")
        for shape in report.shapes:
            check = shape.under(history)
            if check is None:
                why = shape.skipped or shape.unrenderable or ""
                note = f"skipped: {why}" if shape.skipped else f"[bold red]{escape(why)}[/]"
                table.add_row(shape.name, str(shape.turns), "-", "-", "-", note)
                continue
            forks = sum(1 for t in check.turns if t.forks)
            problems = shape.breaks(history)
            table.add_row(
                shape.name,
                str(shape.turns),
                str(check.samples),
                "yes"
                if not forks
                else f"[bold red]no[/bold red] ({forks} fork{'s' * (forks > 1)})",
                mark(not shape.parser_misses),
                escape(problems[0]) if problems else _boundaries(check),
            )
        tables.append(table)
    return tables


def _boundaries(check: Any) -> str:
    """How token history continued each turn (``prefix 2, isolated 1``); append-only else."""
    if check.history != "tokens":
        return "every prompt extends the last"
    counts: dict[str, int] = {}
    for turn in check.turns:
        if turn.boundary is not None:
            counts[turn.boundary] = counts.get(turn.boundary, 0) + 1
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "one turn"
