"""How a ``corral`` command fails: one line on stderr that names the problem and the fix.

A command raises :class:`UsageError` (the invocation is wrong: a flag, a path, a setting;
exit 2) or :class:`RunError` (the invocation is fine but the work failed: a server cannot be
reached, a token is refused, a package is missing; exit 1). :func:`error_line` turns those and
every other exception into the line :func:`corral.cli.main` prints, and the exit code.
"""

from __future__ import annotations

# The optional packages a command may need, by top-level module name: the distribution that
# provides it and the corral extra that installs it (pyproject's optional-dependencies).
PACKAGE_EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "local"),
    "llguidance": ("llguidance", "local"),
    "transformers": ("transformers", "gateway"),
    "tokenizers": ("tokenizers", "gateway"),
    "jinja2": ("jinja2", "gateway"),
    "mcp": ("mcp", "gateway"),
    "megatron": ("megatron-core", "train"),
    "matplotlib": ("matplotlib", "train"),
    "tensorboard": ("tensorboard", "train"),
    "docker": ("docker", "envs"),
    "pyseccomp": ("pyseccomp", "envs"),
    "kubernetes": ("kubernetes", "kubernetes"),
    "e2b": ("e2b", "e2b"),
    "ray": ("ray", "ray"),
}


class CliError(Exception):
    """A failure the user can act on: ``problem`` says what is wrong, ``fix`` (a sentence,
    optional) what to do about it. ``exit_code`` is what the command exits with."""

    exit_code = 1

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem.rstrip()
        self.fix = fix.strip()

    def message(self) -> str:
        """``problem. fix`` as one line (a problem that ends a sentence gets no extra stop)."""
        text = self.problem
        if self.fix:
            text += ("" if text.endswith((".", "?", "!")) else ".") + " " + self.fix
        return _one_line(text)


class UsageError(CliError):
    """The command was called wrongly (a flag, a path, a setting): exit 2, as argparse does."""

    exit_code = 2


class RunError(CliError):
    """The command was called rightly but could not do its work: exit 1."""

    exit_code = 1


def missing_package(exc: ModuleNotFoundError) -> RunError | None:
    """The :class:`RunError` for an optional package that is not installed (the one in
    :data:`PACKAGE_EXTRAS` that ``exc`` names), or ``None`` when ``exc`` is about any other
    module (a bug, not an installation to fix)."""
    top = (exc.name or "").split(".")[0]
    if top not in PACKAGE_EXTRAS:
        return None
    distribution, extra = PACKAGE_EXTRAS[top]
    return RunError(
        f"this command needs {distribution}, which is not installed",
        f"Install it with: pip install 'corral[{extra}]'",
    )


def leaf(exc: BaseException) -> BaseException:
    """The first exception inside ``exc``'s (nested) exception groups, or ``exc`` itself: a
    task group's failure is reported as the task's exception, not as the group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def first_of(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of ``kind`` in ``exc``, its groups and their causes, or ``None``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        item = todo.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, kind):
            return item
        if isinstance(item, BaseExceptionGroup):
            todo.extend(item.exceptions)
        if item.__cause__ is not None:
            todo.append(item.__cause__)
    return None


def error_line(command: str, exc: BaseException) -> tuple[str, int]:
    """The line to print for ``exc`` raised by ``corral <command>`` (``command`` is the
    subcommand path, e.g. ``eval`` or ``model tiny``; empty before one is known) and the exit
    code: the error's own for a :class:`CliError`, 1 for anything else."""
    prog = f"corral {command}".rstrip()
    exc = leaf(exc)
    if isinstance(exc, ModuleNotFoundError):
        exc = missing_package(exc) or exc
    if isinstance(exc, CliError):
        return f"{prog}: {exc.message()}", exc.exit_code
    what = _one_line(str(exc)) or "(no message)"
    return f"{prog}: {type(exc).__name__}: {what} (run with --debug for the traceback)", 1


def _one_line(text: str) -> str:
    """``text`` on one line: its lines joined, runs of blanks collapsed."""
    return " ".join(text.split())
