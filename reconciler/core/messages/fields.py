"""Reading a message's JSON object: each field checked for its type, or a clear error.

A reader of the contract's messages ignores fields it does not know (docs/interface.md,
"Conventions") and refuses a message whose known fields are missing or of the wrong
type with :class:`MessageError`, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

__all__ = [
    "MessageError",
    "field_int",
    "field_ints",
    "field_object",
    "field_objects",
    "field_str",
    "field_strs",
    "json_object",
    "optional_str",
]


class MessageError(ValueError):
    """Bytes that are not the message the contract describes."""


def json_object(data: bytes, what: str) -> dict[str, Any]:
    """``data`` as a JSON object; ``what`` names the message in the error."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MessageError(f"{what} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MessageError(f"{what} is not a JSON object")
    return body


def _field(body: Mapping[str, Any], key: str) -> Any:
    try:
        return body[key]
    except KeyError:
        raise MessageError(f"field {key!r} is missing") from None


def field_str(body: Mapping[str, Any], key: str) -> str:
    value = _field(body, key)
    if not isinstance(value, str):
        raise MessageError(f"field {key!r} is not a string")
    return value


def optional_str(body: Mapping[str, Any], key: str) -> str | None:
    """A string field that may be absent (or null)."""
    return None if body.get(key) is None else field_str(body, key)


def field_int(body: Mapping[str, Any], key: str) -> int:
    value = _field(body, key)
    if type(value) is not int:
        raise MessageError(f"field {key!r} is not an integer")
    return value


def field_object(body: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = _field(body, key)
    if not isinstance(value, dict):
        raise MessageError(f"field {key!r} is not an object")
    return value


def _list(body: Mapping[str, Any], key: str) -> list[Any]:
    value = _field(body, key)
    if not isinstance(value, list):
        raise MessageError(f"field {key!r} is not a list")
    return value


def field_ints(body: Mapping[str, Any], key: str) -> list[int]:
    values = _list(body, key)
    if not all(type(v) is int for v in values):
        raise MessageError(f"field {key!r} is not a list of integers")
    return values


def field_strs(body: Mapping[str, Any], key: str) -> list[str]:
    values = _list(body, key)
    if not all(isinstance(v, str) for v in values):
        raise MessageError(f"field {key!r} is not a list of strings")
    return values


def field_objects(body: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    values = _list(body, key)
    if not all(isinstance(v, dict) for v in values):
        raise MessageError(f"field {key!r} is not a list of objects")
    return values
