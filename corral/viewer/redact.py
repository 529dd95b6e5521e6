"""Secrets out of what the viewer serves: it may be shared on a loopback port, so no auth
token or key that a run folder or a gateway holds ever leaves the process.

A value is dropped (replaced by :data:`REDACTED`) when its key names a secret: ``api_key``,
``secret``, ``password``, ``authorization``, ``credential``, ``cookie``, or a key ending in
``token``/``key`` whose value is a string. The last rule keeps token *ids* (``tokens``,
``held_token``: integers) and names of variables (``token_var``) while dropping
``admin_token: "..."``. Strings that start like an HTTP credential (``Bearer ...``) are
dropped wherever they sit in metadata.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[redacted]"

# Any value under these keys is a secret, whatever its type.
_ALWAYS = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|authorization|credential|cookie|private[_-]?key)", re.I
)
# A string under a key ending so is a secret (auth_token, admin_token, access_key, key).
_STRING_SUFFIX = re.compile(r"(^|[_\-.])?(token|key)$", re.I)
_CREDENTIAL_VALUE = re.compile(r"^\s*(bearer|basic|token)\s+\S{8,}", re.I)


def secret_key(key: str, value: Any) -> bool:
    """Whether ``key: value`` holds a secret (module docstring)."""
    if _ALWAYS.search(key):
        return True
    return isinstance(value, str) and bool(_STRING_SUFFIX.search(key))


def scrub(data: Any) -> Any:
    """A copy of JSON-like ``data`` with every secret replaced by :data:`REDACTED`."""
    if isinstance(data, dict):
        return {k: REDACTED if secret_key(str(k), v) else scrub(v) for k, v in data.items()}
    if isinstance(data, list):
        return [scrub(v) for v in data]
    if isinstance(data, str) and _CREDENTIAL_VALUE.match(data):
        return REDACTED
    return data
