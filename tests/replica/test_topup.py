"""The leader's warm top-up looking again at a refused pool: when room may have appeared
on a host, and not when an inventory or a snapshot only says again what the last one
said. Folded states and a fake clock; nothing is published (the bus side is in
tests/replica/test_replica.py)."""

from __future__ import annotations

from typing import Any, cast

import anyio

from reconciler.core.model import HostName, PoolName
from reconciler.core.state import State
from reconciler.replica.pipeline import Commit, Pipeline
from reconciler.replica.topup import WarmPoolReconciler
from tests.support.builders import (
    Fleet,
    admit,
    cmd,
    failure,
    inventory,
    lifecycle,
    pool,
    snapshot,
)
from tests.support.clock import FakeClock

WEB = PoolName("web")


class _Caches:
    """What the top-up reads of the pipeline: the state."""

    def __init__(self, state: State) -> None:
        self.state = state


def _full_fleet() -> Fleet:
    """One host of 16 CPUs, all booked by four cold leases of another pool, and a warm
    pool whose VMs need 4 CPUs: no room for a top-up."""
    fleet = Fleet()
    fleet.send(
        snapshot("h1", cpu=16),
        pool("cold", cpu=4),
        pool("web", cpu=4, min_ready=1, max_ready=1),
        *(admit(f"c{i}", "cold", f"vm-{i}") for i in range(4)),
    )
    return fleet


def _refused(fleet: Fleet, clock: FakeClock) -> WarmPoolReconciler:
    """A top-up that has seen the fleet once and had the web pool refused, its next try
    a minute away."""
    warm = WarmPoolReconciler(
        pipeline=cast(Pipeline, _Caches(fleet.state)), js=cast(Any, None), prefix="rc", clock=clock
    )
    _notify(warm, fleet, hosts={HostName("h1")})
    warm.refused[WEB] = (7, clock() + 60)
    return warm


def _notify(warm: WarmPoolReconciler, fleet: Fleet, *, hosts: set[HostName]) -> None:
    fx = fleet.send()
    fx.hosts.update(hosts)
    warm.notify(Commit(applied_seq=fleet.seq, fx=fx, inputs=1, dead_letters=0))


def _send(warm: WarmPoolReconciler, fleet: Fleet, *items: tuple[str, dict[str, Any]]) -> None:
    fx = fleet.send(*items)
    warm.notify(Commit(applied_seq=fleet.seq, fx=fx, inputs=len(items), dead_letters=0))


def test_an_inventory_or_snapshot_that_says_nothing_new_does_not_look_again() -> None:
    clock = FakeClock()
    fleet = _full_fleet()
    warm = _refused(fleet, clock)
    _send(warm, fleet, inventory("h1", [], revision=1), inventory("h1", [], revision=2))
    _send(warm, fleet, snapshot("h1", cpu=16, revision=2))
    assert WEB not in warm.queue.waiting()
    assert warm.refused[WEB] == (7, clock() + 60)  # the backoff stands


def test_a_lease_released_on_a_host_looks_again_within_recheck_s() -> None:
    clock = FakeClock()
    fleet = _full_fleet()
    warm = _refused(fleet, clock)
    _send(warm, fleet, cmd("release", "x0", instance="vm-0"))
    assert warm.queue.waiting()[WEB] == clock() + warm.recheck_s
    assert warm.refused[WEB] == (7, clock() + warm.recheck_s)


def test_a_host_that_grew_or_a_new_host_looks_again() -> None:
    clock = FakeClock()
    fleet = _full_fleet()
    warm = _refused(fleet, clock)
    _send(warm, fleet, snapshot("h1", cpu=32, revision=2))
    assert WEB in warm.queue.waiting()
    clock.advance(10)
    warm = _refused(fleet, clock)
    _send(warm, fleet, snapshot("h2", cpu=16))
    assert WEB in warm.queue.waiting()


def test_more_booked_on_a_host_does_not_look_again() -> None:
    clock = FakeClock()
    fleet = _full_fleet()
    fleet.send(snapshot("h1", cpu=20, revision=2))  # room for one more cold lease
    warm = _refused(fleet, clock)
    _send(warm, fleet, admit("c9", "cold", "vm-9"))
    assert WEB not in warm.queue.waiting()


def test_a_pool_that_needs_nothing_any_more_ends_its_backoff() -> None:
    clock = FakeClock()
    fleet = _full_fleet()
    warm = _refused(fleet, clock)
    fleet.send(pool("web", cpu=4, min_ready=0, max_ready=0))
    anyio.run(warm.reconcile, "web")
    assert WEB not in warm.refused


def test_a_pool_whose_warm_vms_fail_to_be_created_backs_off_longer_each_time() -> None:
    """The executor's failure releases the lease at once; the pool must not ask again at
    once, for ever (a bad image): each failure doubles its wait, and nothing but its
    backoff (not room appearing, not its own leases changing) looks again sooner."""
    clock = FakeClock()
    fleet = Fleet()
    fleet.send(snapshot("h1", cpu=16), pool("web", cpu=4, min_ready=1, max_ready=1))
    warm = WarmPoolReconciler(
        pipeline=cast(Pipeline, _Caches(fleet.state)), js=cast(Any, None), prefix="rc", clock=clock
    )
    waits = []
    for attempt in range(4):
        _send(warm, fleet, admit(f"w{attempt}", "web", f"w-{attempt}", kind="warm"))
        lease = fleet.state.lease_of_instance(f"w-{attempt}")
        assert lease is not None
        _send(warm, fleet, failure("h1", lease.instance, lease.lease_id, "create", "no image"))
        count, due = warm.refused[WEB]
        assert count == attempt + 1
        waits.append(due - clock())
        _send(warm, fleet, snapshot("h1", cpu=32, revision=attempt + 2))  # room appears
        assert warm.refused[WEB] == (count, due)  # which does not cut the backoff
        anyio.run(warm.reconcile, "web")  # a look meanwhile publishes nothing (js is None)
        assert warm.published == 0 and warm.queue.waiting()[WEB] <= due
    assert waits == [warm.backoff_base_s * 2**n for n in range(4)]
    # a VM of the pool that becomes ready again ends the backoff
    _send(
        warm,
        fleet,
        admit("ok", "web", "w-ok", kind="warm"),
        lifecycle("h1", "instance-ready", "w-ok"),
    )
    anyio.run(warm.reconcile, "web")
    assert WEB not in warm.refused
