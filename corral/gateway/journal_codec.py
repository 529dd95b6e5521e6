"""Exact JSON for the gateway's own value types, so that the session journal can keep what a
session remembers (replayed answers, stored Responses) and read back equal objects.

Plain JSON loses the difference between a tuple and a list and the class of a dataclass; here
both are tagged: a dataclass becomes ``{"$": "ClassName", field: value, ...}``, a tuple
``{"$t": [...]}``, and a dict that could be mistaken for either (or has keys that are not
strings) ``{"$d": [[key, value], ...]}``. Only the classes in :data:`VALUE_TYPES` are ever
built back: a journal is data, never code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from corral.gateway import turns
from corral.gateway.dialects.openai_responses import KeptResponse

# The turn vocabulary (messages, tools, results, stream events) and the Responses dialect's
# kept response: plain frozen dataclasses, safe to build from data.
VALUE_TYPES: dict[str, type[Any]] = {
    name: cls
    for name, cls in [*vars(turns).items(), ("KeptResponse", KeptResponse)]
    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
}

_TAGS = ("$", "$t", "$d")


class ValueDecodeError(ValueError):
    """A journalled value that does not decode (an unknown class, a field it lacks)."""


_PLAIN = (str, int, float, bool, type(None))
# Each known class's init fields, by class (dataclasses.fields costs more than the encoding).
_FIELDS: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.init) for cls in VALUE_TYPES.values()
}


def encode_value(value: Any) -> Any:
    """``value`` as JSON-ready data that :func:`decode_value` turns back into an equal value.

    ``TypeError`` for a dataclass outside :data:`VALUE_TYPES` or a value JSON cannot hold."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    names = _FIELDS.get(kind)
    if names is not None:
        out: dict[str, Any] = {"$": kind.__name__}
        for name in names:
            v = getattr(value, name)
            out[name] = v if type(v) in _PLAIN else encode_value(v)
        return out
    if kind is tuple:
        return {"$t": [v if type(v) in _PLAIN else encode_value(v) for v in value]}
    if kind is list:
        return [v if type(v) in _PLAIN else encode_value(v) for v in value]
    if kind is dict:
        if all(type(k) is str for k in value) and not any(t in value for t in _TAGS):
            return {k: v if type(v) in _PLAIN else encode_value(v) for k, v in value.items()}
        return {"$d": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    for plain in (bool, int, float, str):  # a subclass (an IntEnum, a str enum): its value
        if isinstance(value, plain):
            return plain(value)
    raise TypeError(f"the journal cannot keep a {kind.__qualname__}")


def decode_value(data: Any) -> Any:
    """The value :func:`encode_value` made ``data`` from; :class:`ValueDecodeError` when
    ``data`` names a class outside :data:`VALUE_TYPES` or does not fit it."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "$t" in data:
        return tuple(decode_value(v) for v in data["$t"])
    if "$d" in data:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in data["$d"]}
    if "$" in data:
        cls = VALUE_TYPES.get(data["$"])
        if cls is None:
            raise ValueDecodeError(f"unknown value type {data['$']!r} in the journal")
        fields = {k: decode_value(v) for k, v in data.items() if k != "$"}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueDecodeError(f"a journalled {cls.__name__} does not fit it: {exc}") from None
    return {k: decode_value(v) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list | dict):
        raise ValueDecodeError("a journalled dict key is not hashable")
    return key
