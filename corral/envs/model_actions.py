"""Run commands on the model's behalf, out of the runner's reach (standard library only).

An env that runs a program for the model (a shell command, a test suite) builds its command
line with :func:`model_argv`. Inside a sandbox the env server's runner was started with
``CORRAL_MODEL_JAIL``, a JSON list of strings: the backend's prefix that puts the command
where it cannot read, write, signal or trace the runner (see :mod:`corral.sandboxes` for what
each backend uses). Outside a sandbox (tests, ``needs = "none"``) the variable is absent and
the command runs as given.

This module is copied into every sandbox beside the runner (:mod:`corral.envs.hosting`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

JAIL_VARIABLE = "CORRAL_MODEL_JAIL"


def model_jail() -> list[str]:
    """The backend's command prefix for model actions (empty outside a sandbox).

    Raises ``ValueError`` when the variable is set but not a JSON list of strings: running the
    model's command unjailed because of a malformed setting would be the wrong failure.
    """
    raw = os.environ.get(JAIL_VARIABLE)
    if not raw:
        return []
    prefix = json.loads(raw)
    if not isinstance(prefix, list) or not all(isinstance(p, str) for p in prefix):
        raise ValueError(f"{JAIL_VARIABLE} must be a JSON list of strings, got {raw[:80]!r}")
    return prefix


def model_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed with the backend's jail: the command line to run for the model."""
    return [*model_jail(), *argv]
