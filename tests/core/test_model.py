"""The core model's fast lease copy stays exactly ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses

import pytest

from reconciler.core.model import (
    HostName,
    InstanceName,
    JobId,
    Lease,
    LeaseId,
    LeaseKind,
    LeaseState,
    PoolName,
    Resources,
    evolve_lease,
)

LEASE = Lease(
    lease_id=LeaseId("L1"),
    instance=InstanceName("vm-1"),
    host=HostName("h1"),
    host_uid="u-h1",
    pool=PoolName("web"),
    kind=LeaseKind.WARM,
    state=LeaseState.READY,
    demand=Resources(2, 4096, 20),
    gpus=(0, 1),
)


def test_lease_has_nothing_an_evolve_would_skip() -> None:
    """evolve_lease sets fields directly: only right while __init__ does nothing more."""
    assert not hasattr(Lease, "__post_init__")
    assert all(f.init for f in dataclasses.fields(Lease))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"state": LeaseState.CLAIMED, "job": JobId("job-1")},
        {"gpus": (), "held": Resources(1, 2, 3), "gate_seq": 7, "victim_of": None},
    ],
)
def test_evolve_lease_is_replace(changes: dict[str, object]) -> None:
    evolved = evolve_lease(LEASE, **changes)
    assert evolved == dataclasses.replace(LEASE, **changes)  # type: ignore[arg-type]
    assert evolved is not LEASE
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.state = LeaseState.RELEASED  # type: ignore[misc]


def test_evolve_lease_refuses_unknown_fields() -> None:
    with pytest.raises(TypeError, match="no field 'colour'"):
        evolve_lease(LEASE, colour="blue")
