"""The core's fast paths do exactly what the plain code they replace did.

- ``frozen.fast_init`` gives every frozen dataclass of the core the ``__init__`` its
  ``@dataclass`` generated, only faster: same parameters, defaults and factories, the
  same instance, still frozen;
- ``frozen.evolver`` is ``dataclasses.replace``;
- placement's integer scorer is ``evaluate`` then ``_room``;
- a decision's lease, built in sorted key order, is ``Lease.as_dict()``;
- the launch-gate index holds exactly the gated active leases;
- ``choose_host`` answers what ``place`` does;
- the lease indexes follow the predicates and properties they spell out.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections import Counter
from typing import Any

import orjson
import pytest

from reconciler.core import frozen, inputs, model, placement, preemption, state
from reconciler.core.messages import lease_payload
from reconciler.core.model import (
    Host,
    HostName,
    JobId,
    Lease,
    LeaseId,
    LeaseKind,
    LeaseState,
    RequestId,
    Resources,
    evolve_host,
    evolve_lease,
)
from reconciler.core.state import State
from tests.core.test_fold_golden import Rich
from tests.core.test_model import LEASE
from tests.support import builders as b


def _frozen_classes() -> list[type[Any]]:
    found = []
    for module in (model, state, inputs, placement, preemption):
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and dataclasses.is_dataclass(value)
                and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
            ):
                found.append(value)
    return found


FROZEN = _frozen_classes()


def test_every_frozen_dataclass_of_the_core_has_the_fast_init() -> None:
    assert len(FROZEN) >= 30
    for cls in FROZEN:
        assert cls.__init__.__doc__ and "writing slots directly" in cls.__init__.__doc__, cls


def _reference_init(cls: type[Any]) -> Any:
    """The ``__init__`` ``@dataclass`` generates, on a copy of ``cls`` without the fast one."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        else (f.name, f.type)
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True, slots=True)


@pytest.mark.parametrize("cls", FROZEN, ids=lambda c: c.__name__)
def test_the_fast_init_has_the_dataclass_signature(cls: type[Any]) -> None:
    reference = _reference_init(cls)
    fast = inspect.signature(cls.__init__).parameters
    plain = inspect.signature(reference.__init__).parameters
    assert list(fast) == list(plain)
    for name, param in fast.items():
        if name == "self":
            continue
        other = plain[name]
        assert param.kind is other.kind, name
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        if f.default is not dataclasses.MISSING:
            assert param.default is f.default
        elif f.default_factory is dataclasses.MISSING:
            assert param.default is inspect.Parameter.empty


@pytest.mark.parametrize("cls", FROZEN, ids=lambda c: c.__name__)
def test_the_fast_init_builds_what_the_dataclass_builds(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    values = [object() for _ in fields]
    built = cls(*values)
    assert type(built) is cls
    assert [getattr(built, f.name) for f in fields] == values
    by_name = cls(**{f.name: v for f, v in zip(fields, values, strict=True)})
    assert [getattr(by_name, f.name) for f in fields] == values
    required = [
        f
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    minimal = cls(*values[: len(required)])
    for f in fields[len(required) :]:
        got = getattr(minimal, f.name)
        if f.default is not dataclasses.MISSING:
            assert got is f.default
        else:
            assert got == f.default_factory()  # type: ignore[operator]
            assert got is not getattr(cls(*values[: len(required)]), f.name)  # fresh each time
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, fields[0].name, 1)
    if required:
        with pytest.raises(TypeError, match="missing"):
            cls()


def test_frozen_generators_refuse_what_they_cannot_copy_exactly() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Posted:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(slots=True)
    class Thawed:
        x: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Derived:
        x: int
        y: int = dataclasses.field(init=False, default=0)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Private:
        _cls: int

    for cls in (Posted, Thawed, Derived, Private):
        with pytest.raises(TypeError):
            frozen.fast_init(cls)
        with pytest.raises(TypeError):
            frozen.evolver(cls)


def test_the_fast_init_builds_a_subclass_too() -> None:
    """A subclass (with slots of its own, so another layout) is built field by field."""

    @frozen.fast_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Base:
        a: int
        b: int
        c: int = 3

    @dataclasses.dataclass(frozen=True, slots=True)
    class Sub(Base):
        d: int = 4

        def __init__(self, a: int, b: int, d: int) -> None:
            Base.__init__(self, a, b)
            object.__setattr__(self, "d", d)

    sub = Sub(1, 2, 5)
    assert type(sub) is Sub
    assert (sub.a, sub.b, sub.c, sub.d) == (1, 2, 3, 5)
    base = Base(1, 2)
    assert type(base) is Base and (base.a, base.b, base.c) == (1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.a = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"uid": "u2", "snapshot_revision": 4, "labels": {"a": "b"}, "gpus": ()},
        {"foreign_gpus": frozenset({1}), "capacity": Resources(1, 2, 3)},
    ],
)
def test_evolve_host_is_replace(changes: dict[str, Any]) -> None:
    host = Host(name=HostName("h1"), uid="u1", labels={"zone": "a"}, capacity=Resources(8, 8, 8))
    evolved = evolve_host(host, **changes)
    assert type(evolved) is Host
    assert evolved == dataclasses.replace(host, **changes)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.uid = "u3"  # type: ignore[misc]
    assert evolved is not host
    with pytest.raises(TypeError, match="no field 'colour'"):
        evolve_host(host, colour="blue")


def test_lease_payload_is_as_dict_in_sorted_order() -> None:
    variants: list[dict[str, Any]] = [
        {},
        {"job": JobId("j1")},
        {"adopted": True, "suspect_revision": 3},
        {"gate_seq": 5, "awaiting_victims": (LeaseId("L7"), LeaseId("L3"))},
        {"state": LeaseState.RELEASED, "kind": LeaseKind.COLD, "gpus": ()},
        {
            "adopted": True,
            "gate_seq": 1,
            "job": JobId("j"),
            "suspect_revision": 0,
            "request_id": RequestId("r"),
        },
    ]
    for changes in variants:
        lease = evolve_lease(LEASE, **changes)
        built = lease_payload(lease)
        assert built == lease.as_dict()
        assert orjson.dumps(built) == orjson.dumps(
            {k: str(v) if isinstance(v, str) else v for k, v in built.items()}
        )
        assert orjson.dumps(built) == orjson.dumps(lease.as_dict(), option=orjson.OPT_SORT_KEYS)


def test_the_scalar_scorer_is_evaluate_then_room() -> None:
    rng = random.Random(5)
    fleet = b.Fleet()
    for i in range(40):
        fleet.send(
            b.snapshot(
                f"h{i}",
                cpu=rng.choice([0, 2, 8, 16]),
                memory_mib=rng.choice([0, 4096, 65536]),
                disk_gib=rng.choice([0, 20, 500]),
                reserve=b.res(rng.choice([0, 1]), 0, rng.choice([0, 10])),
                labels={"zone": rng.choice("ab")},
                schedulable=rng.random() > 0.2,
            )
        )
    fleet.send(b.pool("any", cpu=2, memory_mib=4096, disk_gib=20, max_instances=1000))
    fleet.send(b.pool("zoned", cpu=1, memory_mib=1024, disk_gib=5, host_selector={"zone": "b"}))
    fleet.send(b.pool("wide", cpu=1, memory_mib=0, disk_gib=0, placement="spread"))
    for n in range(60):
        fleet.send(b.admit(f"a{n}", rng.choice(["any", "zoned", "wide"]), f"vm{n}"))
    st: State = fleet.state
    for pool in st.pools.values():
        spread = pool.placement is model.Placement.SPREAD
        fast = placement._scalar_scorer(st, pool, pool.flavor, spread)
        full = placement._claims_scorer(st, pool, pool.flavor, (), spread)
        for name in st.host_order:
            stage, value = fast(name)
            assert (stage, value) == full(name), name
            assert type(stage) is placement.Fit


def test_the_gate_index_holds_the_gated_active_leases() -> None:
    fleet = b.Fleet()
    fleet.send(
        b.snapshot("h1", cpu=8, memory_mib=16384, disk_gib=100),
        b.pool("warm", cpu=4, memory_mib=8192, disk_gib=40, min_ready=0, max_ready=4),
        b.pool("cold", cpu=4, memory_mib=8192, disk_gib=40, max_instances=10),
        b.admit("w1", "warm", "w1", kind="warm"),
        b.admit("w2", "warm", "w2", kind="warm"),
        b.lifecycle("h1", "instance-ready", "w1"),
        b.lifecycle("h1", "instance-ready", "w2"),
        b.admit("p1", "cold", "c1", preemptible=True),
    )
    st = fleet.state

    def scanned() -> list[Lease]:
        return sorted(
            (le for le in st.leases.values() if le.active and le.gate_seq is not None),
            key=lambda le: le.lease_id,
        )

    assert [le.instance for le in scanned()] == ["c1"]
    assert st.gated_on(HostName("h1")) == scanned()
    victims = [le.instance for le in st.leases.values() if le.state is LeaseState.VICTIM]
    assert victims
    for name in victims:
        fleet.send(b.lifecycle("h1", "instance-deleted", name))
    assert st.gated_on(HostName("h1")) == scanned() != []
    fleet.send(b.snapshot("h1", revision=2, cpu=8, memory_mib=16384, disk_gib=100))
    assert st.gated_on(HostName("h1")) == scanned() == []


def test_the_lease_indexes_follow_the_predicates_they_spell_out() -> None:
    """``State._count_host``/``_count_pool`` inline ``booked_demand``, ``booked_gpus``,
    :func:`~reconciler.core.state.pool_count_of`, ``is_idle_ready`` and
    ``is_booting_warm``: their indexes are what a scan with those gives, all along the
    golden test's rich stream (GPUs, preemption and gates, adoption, suspects, claims)."""
    rich = Rich(3)
    rich.setup()
    for step in range(2000):
        rich.step()
        if step % 25:
            continue
        st = rich.state
        active = [le for le in st.leases.values() if le.active]
        booking = [le for le in active if le.books_capacity]
        assert {k: v for k, v in st.pool_counts.items() if v} == _grouped(
            (le.pool, c) for le in active if (c := state.pool_count_of(le)) is not None
        )
        assert {k: v for k, v in st.pool_ready.items() if v} == _members(
            le for le in active if state.is_idle_ready(le)
        )
        assert {k: v for k, v in st.pool_booting.items() if v} == _members(
            le for le in active if state.is_booting_warm(le) and le.victim_of is None
        )
        booked: dict[str, list[int]] = {}
        for le in booking:
            row = booked.setdefault(le.host, [0, 0, 0])
            d = le.booked_demand
            row[0] += d.cpu
            row[1] += d.memory_mib
            row[2] += d.disk_gib
        assert {k: v for k, v in st.booked.items() if any(v)} == {
            k: v for k, v in booked.items() if any(v)
        }
        assert {k: v for k, v in st.gpus_held.items() if v} == {
            h: dict(Counter(ix for le in booking if le.host == h for ix in le.booked_gpus))
            for h in {le.host for le in booking if le.booked_gpus}
        }


def _grouped(pairs: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for pool, key in pairs:
        counts = out.setdefault(pool, {})
        counts[key] = counts.get(key, 0) + 1
    return out


def _members(leases: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for le in leases:
        out.setdefault(le.pool, set()).add(le.lease_id)
    return out


def test_choose_host_is_what_place_chooses() -> None:
    """The fold admits through ``placement.choose_host``, which leaves the winner's
    HostFit unbuilt: it names the host and GPUs ``place`` chooses, or gives the same
    result when nothing fits (pools with claims and selectors, along the rich stream)."""
    rich = Rich(4)
    rich.setup()
    compared = 0
    for step in range(1500):
        rich.step()
        if step % 50:
            continue
        st = rich.state
        for pool in st.pools.values():
            try:
                claims = placement.resolve_claims(st, placement.merge_claims(pool, ()))
            except placement.ClaimError:
                continue
            for selected in (None, *st.host_order[:2]):
                full = placement.place(st, pool, pool.flavor, claims, selected=selected)
                found = placement.choose_host(st, pool, pool.flavor, claims, selected=selected)
                if full.chosen is None:
                    assert found == full
                else:
                    assert found == (full.chosen.host, full.chosen.gpus)
                compared += 1
    assert compared > 100
