"""The console every command prints through.

On a terminal it is rich's own. Piped into a file or another program it never wraps a line
and lays tables out at their natural width: rich would wrap at 80 columns there, which breaks
the paths and numbers people grep for. Whether output is piped is asked of stdout itself, not
of rich (which takes FORCE_COLOR for a terminal): colours may be forced into a log, wrapping
should not be.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

# Wide enough for any table corral prints; rich pads a table only to its natural width.
PIPED_WIDTH = 1000


def make_console(**options: Any) -> Console:
    """A rich Console with ``options``; piped, one that does not wrap (see the module)."""
    if sys.stdout.isatty():
        return Console(**options)
    return Console(width=PIPED_WIDTH, soft_wrap=True, **options)


def print_table(console: Console, table: Any) -> None:
    """Print ``table`` (any renderable); piped, without the blanks rich pads each line with
    to the table's width."""
    if console.is_terminal:
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    for line in captured.get().splitlines():
        console.print(line.rstrip(), markup=False, highlight=False)
