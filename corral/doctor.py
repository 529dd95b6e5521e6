"""``corral doctor``: what this machine has of what corral's parts need, and how to get the rest.

``corral doctor [BACKEND ...]`` prints a table of each sandbox backend's checks
(:mod:`corral.sandboxes.requirements`: the same checks ``corral serve --sandbox`` runs before
it starts) with ok / missing / warning and the fix for what is missing. With no backend named
it checks every backend and also the other parts (the local engine, the gateway, the trainer,
the agents' MCP server), then ends with one line: ``ready: local, bwrap; not ready: docker
(no docker daemon), e2b (E2B_API_KEY not set)``.

Exit status: with backends named, 1 when any of them is not ready, else 0; with none named,
0 (it is a report; read the last line).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.providers import BACKENDS
from corral.sandboxes.requirements import BackendReadiness, Check, Status, check_backend

_STYLES: dict[Status, str] = {"ok": "green", "missing": "bold red", "warning": "yellow"}


@dataclass(frozen=True, slots=True)
class Component:
    """One of corral's other parts and the packages it needs (missing ones never change the
    exit status: a machine that only serves envs needs no trainer)."""

    name: str
    checks: list[Check]


def _package(module: str, dist: str, fix: str) -> Check:
    """Whether ``module`` can be imported (found, not imported: megatron-core takes seconds)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        found = False
    if not found:
        return Check(dist, False, f"{dist} is not installed", fix)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return Check(dist, True, f"{dist} {version}")


def _cuda() -> Check:
    """Informational (always ok): whether torch sees a GPU. Imports torch (a few seconds)."""
    try:
        import torch
    except Exception as e:  # a broken torch install says why here, not as a traceback
        return Check("CUDA", True, f"not checked: torch cannot be imported ({e})")
    if not torch.cuda.is_available():
        return Check("CUDA", True, "not available: the local engine runs on CPU")
    count = torch.cuda.device_count()
    return Check("CUDA", True, f"{count} device(s): {torch.cuda.get_device_name(0)}")


def check_components() -> list[Component]:
    """The packages of the local engine, the gateway, the trainer and the agents."""
    local = "pip install 'corral[local]'"
    train = "pip install 'corral[train]'"
    torch = _package("torch", "torch", local)
    engine = [torch, *([_cuda()] if torch.ok else [])]
    engine += [_package("transformers", "transformers", local)]
    engine += [_package("llguidance", "llguidance", local)]
    gw = "pip install 'corral[gateway]'"  # the gateway tokenizes, it runs no model: no torch
    gateway = [
        _package("transformers", "transformers", gw),
        _package("jinja2", "jinja2", gw),
        _package("tokenizers", "tokenizers", gw),
    ]
    trainer = [
        _package("megatron.core", "megatron-core", train),
        _package("matplotlib", "matplotlib", train),
        _package("tensorboard", "tensorboard", train),
    ]
    agents = [_package("mcp", "mcp", "pip install 'corral[agents]'")]
    return [
        Component("local engine", engine),
        Component("gateway", gateway),
        Component("trainer", trainer),
        Component("agents", agents),
    ]


def summary_line(results: Sequence[BackendReadiness]) -> str:
    """``ready: local, bwrap; not ready: kubernetes (no kubeconfig), e2b (E2B_API_KEY not
    set)``; ``none`` for an empty side; a ready backend's warnings follow its name."""
    ready, not_ready = [], []
    for r in results:
        if r.ready:
            warned = " and ".join(c.summary for c in r.warnings)
            ready.append(f"{r.backend} (warning: {warned})" if warned else r.backend)
        else:
            not_ready.append(f"{r.backend} ({' and '.join(c.summary for c in r.failures)})")
    return f"ready: {', '.join(ready) or 'none'}; not ready: {', '.join(not_ready) or 'none'}"


def _table(title: str, first: str, rows: Sequence[tuple[str, Check]]) -> object:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # Text cells: fixes such as pip install 'corral[envs]' must not be read as rich markup.
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for header in (first, "check", "status", "detail", "fix"):
        table.add_column(header, overflow="fold")
    for owner, check in rows:
        table.add_row(
            Text(owner),
            Text(check.name),
            Text(check.status, style=_STYLES[check.status]),
            Text(check.detail),
            Text(check.fix),
        )
    return table


def run_doctor(backends: Sequence[str], *, image: str | None = None) -> int:
    """Check ``backends`` (all of them, plus the other components, when empty), print the
    tables and the summary line; the exit status described in the module docstring."""
    from corral.console import make_console, print_table

    console = make_console(highlight=False)

    def show(table: object) -> None:
        print_table(console, table)

    named = list(dict.fromkeys(backends))  # keep the order, drop repeats
    results = [check_backend(b, image=image) for b in (named or BACKENDS)]
    show(_table("sandbox backends", "backend", [(r.backend, c) for r in results for c in r.checks]))
    if not named:
        show(
            _table(
                "components",
                "component",
                [(p.name, c) for p in check_components() for c in p.checks],
            )
        )
    console.print(summary_line(results), markup=False, soft_wrap=True)
    if named and not all(r.ready for r in results):
        return 1
    return 0


def _backend(name: str) -> str:
    # argparse's choices= refuses an empty nargs="*" list (it checks [] against the choices).
    if name not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})"
        )
    return name


def cmd_doctor(args: argparse.Namespace) -> int:
    """``corral doctor``: see :func:`run_doctor`."""
    return run_doctor(args.backends, image=args.image)


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    """Add ``corral doctor`` to the CLI's subcommands."""
    doctor = sub.add_parser(
        "doctor",
        help="check what this machine has for each sandbox backend and corral's other parts",
        description="Checks each sandbox backend's set-up (the checks `corral serve --sandbox` "
        "runs before it starts) and prints each check as ok, missing or warning, with the fix "
        "for what is missing. With no BACKEND named, checks every backend and also the local "
        "engine, the gateway, the trainer and the agents' packages, and exits 0 (a report); "
        "the last line says which backends are ready. With backends named, exits 1 when any "
        "of them is not ready.",
    )
    doctor.add_argument(
        "backends",
        nargs="*",
        type=_backend,
        metavar="BACKEND",
        help=f"the backends to check, of {', '.join(BACKENDS)} (default: all, and the rest)",
    )
    doctor.add_argument(
        "--image",
        metavar="IMAGE",
        help=f"the docker image the docker backend must find (default: {DEFAULT_TAG}, "
        "what `corral sandbox image build` makes)",
    )
    doctor.set_defaults(func=cmd_doctor)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m corral.doctor [BACKEND ...]``: the same command without the CLI."""
    import sys

    parser = argparse.ArgumentParser(prog="corral")
    add_doctor_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
