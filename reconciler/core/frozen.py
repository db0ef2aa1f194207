"""Fast construction and copy of the core's frozen, slotted dataclasses.

Every entity of the core is a frozen dataclass (``frozen=True, slots=True``), and the
fold builds several per input: a decision record and its output, a lease version, a
journal transition, a placement result. A frozen dataclass's generated ``__init__`` has
to get past the class's own ``__setattr__`` (which refuses every write), so it writes
each field with ``object.__setattr__(self, name, value)``; on CPython 3.11 that costs
about twice what calling the field's slot descriptor (``Cls.field.__set__``) does, which
is where ``object.__setattr__`` ends up anyway. Measured with valgrind, building a
six-field ``DecisionRecord`` takes about 10,500 instructions through the dataclass
``__init__`` and 6,400 through the descriptors; the saving grows with the field count
(a lease has 24).

So this module generates, once per class at import:

- :func:`fast_init`: a replacement ``__init__`` with the dataclass's exact parameters
  (names, order, defaults, default factories) that writes every slot through its
  descriptor, in field order;
- :func:`evolver`: ``dataclasses.replace`` for one class, which reads every field in one
  call and writes them the same way.

Rules: only for frozen, slotted dataclasses whose fields are all ``init`` fields,
positional (no ``kw_only``) and plain (no ``InitVar``), and that have no
``__post_init__``: then the generated ``__init__`` does exactly what the dataclass's does
(checked at decoration, and by ``tests/test_core_frozen.py``). Instances stay frozen:
assignment still raises ``FrozenInstanceError``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Protocol, TypeVar

__all__ = ["Evolve", "evolver", "fast_init"]

_T = TypeVar("_T")


def _checked_fields(cls: type[Any]) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of ``cls``, after checking it is a dataclass these generators handle."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__")
    found = dataclasses.fields(cls)
    for f in found:
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name} is not a positional init field")
    return found


def _setters(cls: type[Any], found: tuple[dataclasses.Field[Any], ...]) -> dict[str, Any]:
    """``_set_<i>``: the ``__set__`` of the slot descriptor of field ``i``."""
    return {f"_set_{i}": cls.__dict__[f.name].__set__ for i, f in enumerate(found)}


def fast_init(cls: type[_T]) -> type[_T]:
    """Class decorator (above ``@dataclass``): the same ``__init__``, writing each slot
    through its descriptor; see the module's docstring."""
    found = _checked_fields(cls)
    namespace: dict[str, Any] = _setters(cls, found)
    namespace["_NO_VALUE"] = object()
    params = []
    body = []
    for i, f in enumerate(found):
        value = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{i}"] = f.default
            params.append(f"{f.name}=_default_{i}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{i}"] = f.default_factory
            params.append(f"{f.name}=_NO_VALUE")
            value = f"(_factory_{i}() if {f.name} is _NO_VALUE else {f.name})"
        else:
            params.append(f.name)
        body.append(f"    _set_{i}(self, {value})")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"])
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = f"{cls.__name__}'s dataclass __init__, writing slots directly (see frozen)."
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class Evolve(Protocol[_T]):
    """What :func:`evolver` makes: ``evolve(entity, **changes)``, a changed copy."""

    def __call__(self, entity: _T, /, **changes: Any) -> _T: ...


def evolver(cls: type[_T]) -> Evolve[_T]:
    """``dataclasses.replace`` for instances of ``cls`` (exactly ``cls``, not a subclass),
    at about a third of its cost: every field read in one call, each slot written through
    its descriptor, with no keyword arguments built on the way."""
    found = _checked_fields(cls)
    names = tuple(f.name for f in found)
    namespace: dict[str, Any] = _setters(cls, found)
    namespace.update(
        _cls=cls,
        _new=object.__new__,
        _values_of=operator.attrgetter(*names),
        _index={name: i for i, name in enumerate(names)},
    )
    body = "\n".join(f"    _set_{i}(new, values[{i}])" for i in range(len(names)))
    source = f"""def evolve(entity, /, **changes):
    if changes:
        values = list(_values_of(entity))
        for name, value in changes.items():
            i = _index.get(name)
            if i is None:
                raise TypeError(f"{cls.__name__} has no field {{name!r}}")
            values[i] = value
    else:
        values = _values_of(entity)
    new = _new(_cls)
{body}
    return new
"""
    exec(source, namespace)
    evolve: Evolve[_T] = namespace["evolve"]
    return evolve
