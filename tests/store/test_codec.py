"""The store codec's encode gives exactly the bytes orjson's own dataclass path gives.

``encode`` turns a dataclass into a dict through a generated function and dumps that
(:mod:`reconciler.store.codec`); the bytes must stay those of ``orjson.dumps(entity,
default=_default)``, which every stored row, snapshot and state digest was written with.
Every dataclass of the model is drawn with every field varied (nested dataclasses,
optional ones, tuples of them, frozensets, enums, ``NewType`` strings), and also with
values of the wrong type in any field (which the generated code must leave to orjson).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, ClassVar

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core import model, state
from reconciler.store.codec import _TO_BUILTINS, _default, decode, encode

#: every dataclass of the model and of the state module, but the state's containers
#: (``State``, ``Effects``: mutable, never encoded)
MODEL_CLASSES: list[type[Any]] = [
    c
    for module in (model, state)
    for c in vars(module).values()
    if isinstance(c, type)
    and dataclasses.is_dataclass(c)
    and c.__module__ == module.__name__
    and c not in (state.State, state.Effects)
]

#: the entities the store encodes (its tables), each with a generated converter
STORED = (
    model.Host,
    model.Pool,
    model.ResourceClass,
    model.GpuProfile,
    model.GpuPolicy,
    model.Lease,
)


def old_encode(entity: object) -> bytes:
    """The store encoding as it was: orjson's own dataclass path, less the fields marked
    ``ADDED_LATER`` that hold their default (written only when set)."""
    data = orjson.dumps(entity, default=_default)
    if not _has_added_later(type(entity)):
        return data
    return orjson.dumps(_strip(entity, orjson.loads(data)))


def _has_added_later(cls: type[Any]) -> bool:
    return dataclasses.is_dataclass(cls) and any(
        f.metadata.get(model.OMITTED_AT_DEFAULT) for f in dataclasses.fields(cls)
    )


def _strip(entity: Any, raw: Any) -> Any:
    """``raw`` (the JSON of ``entity``) without its ADDED_LATER fields at their default."""
    if dataclasses.is_dataclass(entity) and isinstance(raw, dict):
        for f in dataclasses.fields(entity):
            value = getattr(entity, f.name)
            if f.metadata.get(model.OMITTED_AT_DEFAULT) and value == f.default:
                raw.pop(f.name, None)
            elif f.name in raw:
                raw[f.name] = _strip(value, raw[f.name])
    elif isinstance(entity, tuple | list) and isinstance(raw, list):
        return [_strip(e, r) for e, r in zip(entity, raw, strict=False)]
    return raw


def assert_same_bytes(entity: object) -> None:
    try:
        expected = old_encode(entity)
    except orjson.JSONEncodeError as exc:
        with pytest.raises(orjson.JSONEncodeError) as found:
            encode(entity)
        assert str(found.value) == str(exc)
        return
    assert encode(entity) == expected


# ------------------------------------------------------------------------ strategies

_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_TEXT = st.text(max_size=8)


def _wild() -> st.SearchStrategy[Any]:
    """Values of any type, for a field that should hold another."""
    return st.one_of(
        st.none(),
        _INTS,
        _TEXT,
        st.booleans(),
        st.tuples(_INTS, _TEXT),
        st.frozensets(_TEXT, max_size=3),
        st.dictionaries(_TEXT, _INTS, max_size=2),
        st.lists(_INTS, max_size=2),
        st.sampled_from([model.Resources(1, 2, 3), model.ZERO, model.WarmPolicy(1, 2, True)]),
        st.sampled_from(list(model.LeaseState) + list(model.MigMode)),
    )


def typed(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the type ``hint`` (a field's), as the fold builds them."""
    while getattr(hint, "__supertype__", None) is not None:  # NewType
        hint = hint.__supertype__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of(*(typed(a) for a in args))
    if hint is type(None):
        return st.none()
    if hint is str:
        return _TEXT
    if hint is bool:
        return st.booleans()
    if hint is int:
        return _INTS
    if hint is bytes:
        return st.binary(max_size=8)
    if hint is object:  # GpuPolicy.overrides values
        return st.one_of(st.none(), st.booleans(), _INTS, st.sampled_from(list(model.MigMode)))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(list(hint))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return instances(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(typed(args[0]), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*(typed(a) for a in args))
    if origin is frozenset or origin is set:
        return st.frozensets(typed(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(typed(args[0]), typed(args[1]), max_size=3)
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    raise AssertionError(f"no strategy for {hint!r}")


def instances(cls: type[Any], *, wild: bool = False) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` with every field drawn (``wild``: or of any type at all)."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        drawn = typed(hints[f.name])
        fields[f.name] = st.one_of(drawn, _wild()) if wild else drawn
    return st.builds(cls, **fields)


# ------------------------------------------------------------------------------ tests


def test_every_model_dataclass_is_covered() -> None:
    assert set(STORED) <= set(MODEL_CLASSES)
    assert {model.Resources, model.Gpu, model.WarmPolicy, model.ClaimSpec} <= set(MODEL_CLASSES)


@pytest.mark.parametrize("cls", STORED, ids=lambda c: c.__name__)
def test_every_stored_entity_class_has_a_generated_converter(cls: type[Any]) -> None:
    assert _TO_BUILTINS[cls] is not None


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None)  # timing is not under test: a busy machine is slow
@given(data=st.data())
def test_encode_gives_the_bytes_of_orjson_dataclass_path(cls: type[Any], data: Any) -> None:
    assert_same_bytes(data.draw(instances(cls)))


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None)  # timing is not under test: a busy machine is slow
@given(data=st.data())
def test_values_of_another_type_are_left_to_orjson(cls: type[Any], data: Any) -> None:
    assert_same_bytes(data.draw(instances(cls, wild=True)))


@pytest.mark.parametrize(
    "cls",
    [c for c in STORED if c is not model.GpuPolicy],  # its overrides are validated on load
    ids=lambda c: c.__name__,
)
@settings(max_examples=50, deadline=None)  # timing is not under test: a busy machine is slow
@given(data=st.data())
def test_stored_entities_round_trip(cls: type[Any], data: Any) -> None:
    entity = data.draw(instances(cls))
    assert decode(cls, encode(entity)) == entity


def test_a_field_added_later_is_written_only_when_set() -> None:
    flavor = model.Resources(2, 4096, 20)
    plain = model.Pool(model.PoolName("p"), flavor)
    assert b"queue_wait_s" not in encode(plain)
    waiting = model.Pool(model.PoolName("p"), flavor, queue_wait_s=300)
    assert encode(waiting).endswith(b',"instance_type":null,"queue_wait_s":300}')
    assert decode(model.Pool, encode(plain)) == plain
    assert decode(model.Pool, encode(waiting)) == waiting


def test_the_examples_that_matter_byte_for_byte() -> None:
    gpus = tuple(
        model.Gpu(i, "nvidia", "A100", 81920, f"0000:{i:02x}:00.0", i // 4) for i in range(4)
    )
    host = model.Host(
        model.HostName("h1"),
        labels={"zone": "a", "gpu": "yes"},
        capacity=model.Resources(64, 262144, 2000),
        gpus=gpus,
        gpu_profile=None,
        foreign_pci=frozenset({"0000:03:00.0", "0000:01:00.0"}),
        foreign_gpus=frozenset({3, 1}),
        foreign_instances=("x", "y"),
    )
    claim = model.ClaimSpec("g", model.ClassName("gpu"), model.GpuRequest(1, "nvidia"))
    pool = model.Pool(
        model.PoolName("p"),
        model.Resources(2, 4096, 20),
        claims=(claim, model.ClaimSpec("h", model.ClassName("gpu"))),
        instance_type=model.InstanceType.CONTAINER,
        placement=model.Placement.SPREAD,
    )
    lease = model.Lease(
        model.LeaseId("l1"),
        model.InstanceName("vm-1"),
        model.HostName("h1"),
        "u-h1",
        model.PoolName("p"),
        model.LeaseKind.WARM,
        model.LeaseState.READY,
        model.Resources(2, 4096, 20),
        gpus=(0, 1),
        job=model.JobId("job-1"),
        awaiting_victims=(model.LeaseId("l2"),),
        held=model.Resources(1, 1, 1),
    )
    for entity in (host, pool, lease, model.ZERO):
        assert encode(entity) == old_encode(entity)
    assert encode(lease).startswith(b'{"lease_id":"l1","instance":"vm-1","host":"h1"')
    assert b'"demand":{"cpu":2,"memory_mib":4096,"disk_gib":20}' in encode(lease)
    assert b'"foreign_pci":["0000:01:00.0","0000:03:00.0"]' in encode(host)


# ----------------------------------------------------- classes the codec leaves to orjson


@dataclasses.dataclass
class _WithDict:
    a: int
    b: str = "x"


@dataclasses.dataclass(frozen=True, slots=True)
class _Hidden:
    a: int
    _private: int = 0
    shared: ClassVar[int] = 3


class _Subclass(model.Resources):  # not a dataclass of its own: orjson refuses it
    __slots__ = ()


class _StrData(str):
    pass


def test_what_is_not_a_plain_slotted_dataclass_keeps_orjsons_own_path() -> None:
    odd = _WithDict(1)
    odd.extra = 2  # type: ignore[attr-defined]  # orjson writes the instance's __dict__
    for value in (odd, _WithDict(2), {"a": 1}, [1, 2], "s", 3, None):
        assert _TO_BUILTINS[type(value)] is None
        assert_same_bytes(value)
    assert _TO_BUILTINS[_Subclass] is None
    assert_same_bytes(_Subclass(1, 2, 3))
    assert_same_bytes(_StrData("s"))


def test_private_fields_and_class_variables_are_skipped_as_orjson_does() -> None:
    assert _TO_BUILTINS[_Hidden] is not None
    assert encode(_Hidden(1, 2)) == old_encode(_Hidden(1, 2)) == b'{"a":1}'


def test_unencodable_values_fail_as_before() -> None:
    too_big = dataclasses.replace(model.Resources(1, 2, 3), cpu=2**64)
    assert_same_bytes(too_big)
    assert_same_bytes(model.WarmPolicy(min_ready=object()))  # type: ignore[arg-type]
