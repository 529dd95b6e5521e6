"""Checks of the JSON Schemas clients send (tool parameters, output schemas)."""

from __future__ import annotations

import functools
import json
from typing import Any

from jsonschema import exceptions, validators

from corral.gateway.errors import bad_request


def check_tool_schema(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema object; a 400 naming ``param`` otherwise.

    Checked against the metaschema the schema names (draft 2020-12 when it names none);
    results are cached by the schema's text, since agents send the same tools every turn.
    """
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON Schema object", param=param)
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem is not None:
        leaf = param.rsplit(".", 1)[-1]
        raise bad_request(
            f"invalid '{leaf}' schema at '{param}': it is not a valid JSON Schema: {problem}",
            param=param,
            code="invalid_schema",
        )
    return schema


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> str | None:
    schema = json.loads(text)
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"{exc.message} (at {where})"
    return None
