"""Exact JSON round trips for the core's frozen dataclasses.

``encode(entity)`` gives the JSON bytes of an entity; ``decode(cls, data)`` rebuilds one
that is ``==`` to it. Encoding is what orjson's native dataclass support writes (fields in
definition order, enums as their values, tuples as arrays) plus frozensets as sorted
arrays, so it is deterministic. orjson's own dataclass path is slow, though: for every
instance, nested ones too, it asks a slotted instance for its ``__dict__`` (an
``AttributeError`` raised and cleared), then reads each field's definition and looks the
field up by name. So for each dataclass it can, the codec generates once a function that
turns an instance into the dict orjson would write it as (nested dataclasses, and tuples
of them, turned too), and orjson dumps that dict, to the same bytes
(``tests/store/test_codec.py`` compares the two on every class of the model): a lease's
encode takes a third less time, a smaller entity's about half. Anything else (not a
dataclass, or one whose instances have a ``__dict__``) is dumped as it is.

Decoding is driven by the class's type hints: for each class a converter is derived once
from ``typing.get_type_hints`` and ``dataclasses.fields`` and cached. It understands
dataclasses, enums, ``NewType`` (unwrapped to its supertype), ``X | None``,
``tuple[T, ...]``, fixed tuples, ``frozenset[T]``, ``list[T]``, ``dict[str, T]``, scalars
and ``object``; any other hint is refused when the converter is built, never silently
passed through.

Rules:

- A field missing from the JSON takes its dataclass default, so adding a defaulted field
  to a model needs no data migration. An unknown key is an error (:class:`CodecError`).
- A field added to a stored entity later is marked
  :data:`~reconciler.core.model.ADDED_LATER`: it is written only when it holds another
  value than its default, so every entity that never sets it keeps its exact encoding,
  and every state its digest (replays of older streams stay byte for byte). This is
  orjson's dataclass path less those fields.
- ``GpuPolicy.overrides`` values are typed ``object``: on load they are re-validated by
  :func:`reconciler.core.runtime.validate_overrides`, which gives back the typed tuple
  (``MigMode``/``ComputeMode`` enums, bools, ints, ``None``) the fold built.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import keyword
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

import orjson

from reconciler.core.model import OMITTED_AT_DEFAULT, GpuPolicy
from reconciler.core.runtime import RuntimeConfigError, validate_overrides

T = TypeVar("T")

#: turns decoded JSON into the typed value; ``None`` means "the JSON value as it is"
Converter = Callable[[Any], Any]


class CodecError(ValueError):
    """Stored JSON that does not describe the entity it should."""


# ---------------------------------------------------------------------------- encoding


def _default(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode(entity: object) -> bytes:
    """The JSON of ``entity`` (a dataclass of the model, or anything built from them)."""
    to_builtins = _TO_BUILTINS[type(entity)]
    if to_builtins is None:
        return orjson.dumps(entity, default=_default)
    return orjson.dumps(to_builtins(entity), default=_default)


#: a generated function: an instance of one class as the dict orjson would write it as
ToBuiltins = Callable[[Any], dict[str, Any]]

#: nested dataclasses turned into dicts inline, to this depth (deeper ones: orjson's path)
_INLINE_DEPTH = 3


class _ToBuiltinsCache(dict[type, ToBuiltins | None]):
    """Per class, its :data:`ToBuiltins` (``None``: orjson takes the value as it is),
    generated on the first encode of an instance of exactly that class."""

    def __missing__(self, cls: type) -> ToBuiltins | None:
        to_builtins = self[cls] = _to_builtins_of(cls)
        return to_builtins


_TO_BUILTINS = _ToBuiltinsCache()


def _encoded_fields(cls: type) -> list[tuple[str, Any]] | None:
    """The (name, type hint) of each field orjson writes for an instance of exactly
    ``cls``, in its order; ``None`` unless orjson writes such an instance as these fields
    read by name: a dataclass (``__dataclass_fields__`` in its own namespace) whose
    instances have no ``__dict__`` (else orjson may write that dict instead), all of whose
    bases are dataclasses too (not ``str``, ``int``, an enum...: orjson writes those as
    such), and whose fields are identifiers (read as ``obj.name``). Like orjson, it skips
    the fields whose names start with ``_`` and the pseudo-fields (``ClassVar``,
    ``InitVar``) that ``dataclasses.fields`` leaves out."""
    if getattr(cls, "__dictoffset__", -1) != 0 or not all(
        c is object or "__dataclass_fields__" in vars(c) for c in cls.__mro__
    ):
        return None
    names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    if not all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        return None
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: every value as it is
        hints = {}
    return [(n, hints.get(n, object)) for n in names]


def _omitted_at_default(cls: type) -> dict[str, Any]:
    """The fields of ``cls`` marked :data:`~reconciler.core.model.ADDED_LATER`, with
    their defaults: :func:`encode` leaves each out while it holds its default."""
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.metadata.get(OMITTED_AT_DEFAULT) and f.default is not dataclasses.MISSING
    }


def _to_builtins_of(cls: type) -> ToBuiltins | None:
    """``lambda o: {"f": o.f, ...}`` for ``cls``, as one generated dict display, with the
    fields typed as a dataclass (or ``X | None``) turned into dicts inline and those typed
    as a tuple of dataclasses into lists of dicts, each only when the value is exactly of
    that class (anything else is left for orjson, as it is). orjson writes the result to
    the bytes it writes for the instance (see the module's docstring)."""
    if _encoded_fields(cls) is None:
        return None
    source = _Source()
    body = source.display(cls, "o", ())
    code = f"def to_builtins(o):\n    return {body}\n"
    exec(compile(code, f"<codec encode {cls.__qualname__}>", "exec"), source.env)
    to_builtins: ToBuiltins = source.env["to_builtins"]
    return to_builtins


class _Source:
    """Python source for :func:`_to_builtins_of`, with the names it refers to."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {}
        self.count = itertools.count()

    def name(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{next(self.count)}"
        self.env[name] = value
        return name

    def display(self, cls: type, var: str, outer: tuple[type, ...]) -> str:
        fields = _encoded_fields(cls)
        assert fields is not None
        omitted = _omitted_at_default(cls)
        items = []
        for n, hint in fields:
            item = f"{n!r}: {self.value(hint, f'{var}.{n}', (*outer, cls))}"
            if n in omitted:  # only when set: entities that never set it keep their bytes
                default = self.name(omitted[n], "D")
                item = f"**({{{item}}} if {var}.{n} != {default} else {{}})"
            items.append(item)
        return "{" + ", ".join(items) + "}"

    def value(self, hint: Any, expr: str, outer: tuple[type, ...]) -> str:
        hint = _unwrapped(hint)
        if _inlinable(hint, outer):
            var = f"v{next(self.count)}"
            cls = self.name(hint, "C")
            inline = self.display(hint, var, outer)
            return f"({inline} if type({var} := {expr}) is {cls} else {var})"
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
            item = _unwrapped(args[0])
            if _inlinable(item, outer):
                n = next(self.count)
                var, each = f"v{n}", f"x{n}"
                cls = self.name(item, "C")
                inline = self.display(item, each, outer)
                items = f"[{inline} if type({each}) is {cls} else {each} for {each} in {var}]"
                return f"({items} if type({var} := {expr}) is tuple else {var})"
        return expr


def _unwrapped(hint: Any) -> Any:
    """``hint`` without ``NewType`` and ``| None`` around it."""
    while getattr(hint, "__supertype__", None) is not None:
        hint = hint.__supertype__
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        present = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(present) == 1:
            return _unwrapped(present[0])
    return hint


def _inlinable(hint: Any, outer: tuple[type, ...]) -> bool:
    return (
        isinstance(hint, type)
        and hint not in outer
        and len(outer) < _INLINE_DEPTH
        and _encoded_fields(hint) is not None
    )


# ---------------------------------------------------------------------------- decoding


def decode(cls: type[T], data: bytes | str) -> T:
    """The entity of type ``cls`` that ``data`` (from :func:`encode`) describes."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CodecError(f"{cls.__name__}: not JSON: {exc}") from exc
    return from_builtins(cls, obj)


def from_builtins(cls: type[T], obj: Any) -> T:
    """The entity of type ``cls`` that decoded JSON ``obj`` describes."""
    convert = converter(typing.cast(Any, cls))
    try:
        value = convert(obj) if convert is not None else obj
    except CodecError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CodecError(f"{cls.__name__}: {type(exc).__name__}: {exc}") from exc
    return typing.cast(T, value)


@cache
def converter(tp: Any) -> Converter | None:
    """The converter for a type hint, ``None`` when JSON already is the value."""
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # NewType
        return converter(supertype)
    if tp is Any or tp is object or tp is type(None) or tp in (str, int, bool, float):
        return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_converter(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return _optional_converter(tp, args)
    if origin is tuple:
        return _tuple_converter(tp, args)
    if origin is frozenset or origin is list:
        return _sequence_converter(origin, args[0])
    if origin is dict:
        return _dict_converter(tp, args)
    raise TypeError(f"the store codec does not know how to decode {tp!r}")


def _optional_converter(tp: Any, args: tuple[Any, ...]) -> Converter | None:
    present = [a for a in args if a is not type(None)]
    if len(present) != 1 or len(args) != 2:
        raise TypeError(f"only `X | None` unions can be decoded, not {tp!r}")
    inner = converter(present[0])
    if inner is None:
        return None

    def optional(value: Any) -> Any:
        return None if value is None else inner(value)

    return optional


def _tuple_converter(tp: Any, args: tuple[Any, ...]) -> Converter:
    if len(args) == 2 and args[1] is Ellipsis:
        item = converter(args[0])
        if item is None:
            return tuple
        return lambda value: tuple(map(item, value))
    if not args or args == ((),):
        return tuple
    items = [converter(a) for a in args]

    def fixed(value: Any) -> Any:
        if len(value) != len(items):
            raise CodecError(f"expected {len(items)} items for {tp!r}, got {len(value)}")
        return tuple(v if f is None else f(v) for f, v in zip(items, value, strict=True))

    return fixed


def _sequence_converter(origin: type, arg: Any) -> Converter:
    item = converter(arg)
    if item is None:
        return origin
    return lambda value: origin(map(item, value))


def _dict_converter(tp: Any, args: tuple[Any, ...]) -> Converter:
    key_type, value_type = args
    while getattr(key_type, "__supertype__", None) is not None:
        key_type = key_type.__supertype__
    if key_type is not str:
        raise TypeError(f"only dicts with str keys can be decoded, not {tp!r}")
    item = converter(value_type)
    if item is None:
        return dict
    return lambda value: {k: item(v) for k, v in value.items()}


def _dataclass_converter(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    specs: dict[str, Converter | None] = {f.name: converter(hints[f.name]) for f in fields}
    after = _AFTER_LOAD.get(cls)
    general = _general_builder(cls, specs, after)
    return _fast_builder(cls, [(f.name, hints[f.name]) for f in fields], general, after)


def _general_builder(
    cls: type, specs: dict[str, Converter | None], after: Converter | None
) -> Converter:
    """Any object: missing fields take their defaults, unknown ones are refused."""
    name = cls.__name__

    def build(value: Any) -> Any:
        if not isinstance(value, dict):
            raise CodecError(f"{name}: expected an object, got {type(value).__name__}")
        kwargs: dict[str, Any] = {}
        for key, raw in value.items():
            try:
                convert = specs[key]
            except KeyError:
                raise CodecError(f"{name}: unknown field {key!r}") from None
            kwargs[key] = raw if convert is None else convert(raw)
        entity = cls(**kwargs)
        return entity if after is None else after(entity)

    return build


def _fast_builder(
    cls: type, fields: list[tuple[str, Any]], general: Converter, after: Converter | None
) -> Converter:
    """The common case, an object with exactly the class's fields (what :func:`encode`
    writes), as one generated expression: no per-field call for plain JSON values.
    Anything else (a missing or unknown key, not an object) goes to ``general``."""
    env: dict[str, Any] = {"cls": cls, "general": general, "after": after}
    args = ", ".join(
        f"{name}={_inline(hint, f'd[{name!r}]', env, f'{i}')}"
        for i, (name, hint) in enumerate(fields)
    )
    finish = "entity" if after is None else "after(entity)"
    source = (
        "def build(d):\n"
        f"    if type(d) is not dict or len(d) != {len(fields)}:\n"
        "        return general(d)\n"
        "    try:\n"
        f"        entity = cls({args})\n"
        "    except KeyError:\n"
        "        return general(d)\n"
        f"    return {finish}\n"
    )
    exec(compile(source, f"<codec {cls.__qualname__}>", "exec"), env)
    build: Converter = env["build"]
    return build


def _inline(hint: Any, expr: str, env: dict[str, Any], tag: str) -> str:
    """Python source converting the JSON value ``expr`` to ``hint`` (names in ``env``)."""
    while getattr(hint, "__supertype__", None) is not None:
        hint = hint.__supertype__
    convert = converter(hint)
    if convert is None:
        return expr
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if (origin is typing.Union or origin is types.UnionType) and len(args) == 2:
        (inner,) = [a for a in args if a is not type(None)]
        var = f"v{tag}"
        return f"(None if ({var} := {expr}) is None else {_inline(inner, var, env, tag + '_')})"
    if origin is tuple and convert is tuple:
        return f"tuple({expr})"
    name = f"c{tag}"
    env[name] = convert
    return f"{name}({expr})"


def _gpu_policy_after_load(policy: GpuPolicy) -> GpuPolicy:
    try:
        typed = validate_overrides(policy.name, dict(policy.overrides))
    except RuntimeConfigError as exc:
        raise CodecError(str(exc)) from exc
    return dataclasses.replace(policy, overrides=typed)


#: per-class fix-ups after the generic conversion (typed ``object`` fields)
_AFTER_LOAD: dict[type, Callable[[Any], Any]] = {GpuPolicy: _gpu_policy_after_load}


__all__ = ["CodecError", "converter", "decode", "encode", "from_builtins"]
