"""Request bodies as JSON objects, with a bound on nesting."""

from __future__ import annotations

import json
from typing import Any

from corral.gateway.errors import bad_request


def json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object; a 400 saying why otherwise (not JSON, not an object, nested
    deeper than ``max_depth``)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        data = None  # deeper than the parser goes: deeper than any limit
        depth_error = True
    else:
        depth_error = _opens(raw) > max_depth and _depth(data) > max_depth
    if depth_error:
        raise bad_request(
            f"the body is nested more than {max_depth} levels deep", code="json_too_deep"
        )
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return data


def _opens(raw: bytes) -> int:
    # An upper bound on the depth, at C speed: most bodies are shallow enough to stop here.
    return raw.count(b"{") + raw.count(b"[")


def _depth(data: Any) -> int:
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return deepest
