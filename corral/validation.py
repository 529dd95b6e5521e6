"""One way to say what pydantic found wrong: ``where: what`` per problem, joined by ``; ``.

Every boundary that validates untrusted data (a request body, a config file, an engine's
answer) turns a ``ValidationError`` into one line with :func:`validation_message`, so that a
user reads the same shape of message from each of them.
"""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["validation_message"]


def validation_message(exc: ValidationError, *, root: str = "", limit: int | None = None) -> str:
    """``loc.path: msg`` for each of ``exc``'s errors (the first ``limit`` of them, then how
    many more), joined by ``"; "``. An error at the top level is named ``root`` (left out when
    empty). Never raises."""
    errors = exc.errors(include_url=False)
    shown = errors if limit is None else errors[:limit]
    problems = []
    for error in shown:
        place = ".".join(str(part) for part in error["loc"]) or root
        problems.append(f"{place}: {error['msg']}" if place else str(error["msg"]))
    if len(errors) > len(shown):
        problems.append(f"and {len(errors) - len(shown)} more")
    return "; ".join(problems)
