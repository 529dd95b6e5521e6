"""Secrets (bearer tokens) are read from the environment variable that a flag or setting names,
never from the command line or a settings file, so they stay out of process listings and
shell history. One reader, one message; each layer turns :class:`SecretMissing` into its own
error (the CLI's exit, ``ServicesError``, ``PlayerError``)."""

from __future__ import annotations

import os
from collections.abc import Mapping


class SecretMissing(ValueError):
    """A variable was named for a secret but is unset or empty; the message names both."""


def env_secret(var: str | None, what: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of ``var`` in ``env`` (default ``os.environ``); None when no variable is
    named (the caller decides whether that leaves something open). SecretMissing when ``var``
    is named but unset or empty: an empty bearer token would look like no auth at all."""
    if var is None:
        return None
    value = (os.environ if env is None else env).get(var)
    if not value:
        raise SecretMissing(f"{what}: environment variable {var} is not set or empty")
    return value
