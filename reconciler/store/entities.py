"""Exact JSON round trips for the core's frozen dataclasses, driven by their type hints.

``dump(entity)`` gives JSON-ready builtins; ``load(cls, data)`` rebuilds an equal entity.
The converter for each class is derived once from ``typing.get_type_hints`` and cached:
dataclasses, enums, ``NewType``, ``X | None``, ``tuple[T, ...]``, ``frozenset[T]`` and
``dict[str, T]`` are understood. ``GpuPolicy.overrides`` holds values typed ``object``;
they are re-validated on load so that enums come back as enums.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

from reconciler.core.model import GpuPolicy
from reconciler.core.runtime import validate_overrides

T = TypeVar("T")
Loader = Callable[[Any], Any]


def dump(value: Any) -> Any:
    """Builtins for any entity (dataclass, enum, tuple, frozenset, dict, scalar)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset):
        return sorted(dump(v) for v in value)
    if isinstance(value, tuple | list):
        return [dump(v) for v in value]
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    return value


def load(cls: type[T], data: Any) -> T:
    entity: Any = _loader(typing.cast(Any, cls))(data)
    if isinstance(entity, GpuPolicy):
        typed = validate_overrides(entity.name, dict(entity.overrides))
        entity = dataclasses.replace(entity, overrides=typed)
    return typing.cast(T, entity)


@cache
def _loader(tp: Any) -> Loader:
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # NewType
        return _loader(supertype)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_loader(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            item = _loader(inner[0])
            return lambda v: None if v is None else item(v)
        return lambda v: v
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _loader(args[0])
            return lambda v: tuple(item(x) for x in v)
        loaders = [_loader(a) for a in args]
        return lambda v: tuple(f(x) for f, x in zip(loaders, v, strict=True))
    if origin is frozenset:
        item = _loader(args[0])
        return lambda v: frozenset(item(x) for x in v)
    if origin is dict:
        value = _loader(args[1])
        return lambda v: {k: value(x) for k, x in v.items()}
    return lambda v: v  # int, str, bool, object


def _dataclass_loader(cls: type) -> Loader:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _loader(hints[f.name])) for f in dataclasses.fields(cls)]

    def build(data: Any) -> Any:
        return cls(**{name: f(data[name]) for name, f in fields if name in data})

    return build
