"""The launch gate of a preemptible admission: victims held, released, and the gate
opened only on fresh proof of the fit.

Rules (docs/architecture.md, "admit-preemptible"): a pending cold lease books at least
what its victims hold until every victim is released (:func:`held_by`); a lease released
while its victims still run waits for them as ``deleting`` (:func:`release`); once its
victims are gone, its gate opens when a snapshot or inventory of its host newer than the
pending decision proves the fit again (:func:`check_gates`), and it is decided
``admitted``. A victim whose VM cannot be deleted ends the preemption
(:func:`victim_failed`): the request is decided ``rejected`` (``preemption-failed``),
its lease released, and every one of its victims books its own room again as
``deleting`` (they are still there until Incus says otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

from reconciler.core.fold.step import Step
from reconciler.core.model import (
    DELETING,
    RELEASED,
    RESERVED,
    ZERO,
    HostName,
    Lease,
    LeaseId,
    Resources,
)
from reconciler.core.placement import booking

__all__ = ["check_gates", "held_by", "release", "victim_failed"]


def release(step: Step, lease: Lease, event: str) -> None:
    """Release a lease (idempotent) and let any launch gate waiting on it move."""
    if lease.state is RELEASED:
        return
    if lease.gate_seq is not None and lease.awaiting_victims:
        # Its victims still run: keep booking their room until they are gone, so
        # nothing else can be admitted onto capacity that is not free yet.
        if lease.state is not DELETING:
            step.move(lease, DELETING, event)
        step.note(f"{lease.lease_id} waits for its victims before it is released")
        return
    released = step.move(
        lease,
        RELEASED,
        event,
        suspect_revision=None,
        gate_seq=None,
        awaiting_victims=(),
        held=ZERO,
        held_gpus=(),
    )
    if released.victim_of is not None:
        _victim_gone(step, released)


def _victim_gone(step: Step, victim: Lease) -> None:
    record = step.state.decisions.get(victim.victim_of) if victim.victim_of else None
    pending = step.state.leases.get(record.lease_id) if record and record.lease_id else None
    if pending is None or pending.gate_seq is None:
        return
    remaining = tuple(v for v in pending.awaiting_victims if v != victim.lease_id)
    held, held_gpus = held_by(step, remaining)
    pending = step.move(
        pending,
        pending.state,
        "victim-released",
        awaiting_victims=remaining,
        held=held,
        held_gpus=held_gpus,
    )
    if pending.state is DELETING:
        if not remaining:
            release(step, pending, "victims-released")
        return
    check_gates(step, pending.host)


def victim_failed(step: Step, victim: Lease, fault: str) -> None:
    """A victim's VM cannot be deleted: end the preemption that waits for it."""
    record = step.state.decisions.get(victim.victim_of) if victim.victim_of else None
    pending = step.state.leases.get(record.lease_id) if record and record.lease_id else None
    step.move(victim, DELETING, "delete-failed", victim_of=None, fault=fault)
    if pending is None or pending.gate_seq is None:
        return
    # its other victims, being deleted, book their own room again until they are gone
    for lease_id in pending.awaiting_victims:
        other = step.state.leases[lease_id]
        if lease_id != victim.lease_id and other.state is not RELEASED:
            step.move(other, DELETING, "preemption-failed", victim_of=None)
    waiting = pending.state is not DELETING  # not released by its requester meanwhile
    released = step.move(
        pending,
        RELEASED,
        "preemption-failed",
        gate_seq=None,
        awaiting_victims=(),
        held=ZERO,
        held_gpus=(),
        fault=fault,
    )
    if waiting and released.request_id is not None:
        step.decide(
            released.request_id,
            "admit-preemptible",
            "rejected",
            reason="preemption-failed",
            detail=f"victim {victim.instance} on {victim.host} cannot be deleted: {fault}",
            lease=released,
        )


def held_by(step: Step, victims: Iterable[LeaseId]) -> tuple[Resources, tuple[int, ...]]:
    total = Resources()
    gpus: set[int] = set()
    for lease_id in victims:
        victim = step.state.leases[lease_id]
        total = total + victim.demand
        gpus.update(victim.gpus)
    return total, tuple(sorted(gpus))


def check_gates(step: Step, host_name: HostName) -> None:
    """Open every launch gate on the host whose victims are gone and whose fit a
    snapshot or inventory newer than the pending decision proves again."""
    host = step.state.hosts.get(host_name)
    if host is None:
        return
    for lease in step.state.gated_on(host_name):
        if lease.awaiting_victims or lease.state is not RESERVED:
            continue
        if not host.admits:
            step.note(f"gate of {lease.lease_id} stays shut: {host_name} is unschedulable")
            continue
        gate = lease.gate_seq or 0
        if host.snapshot_seq <= gate and host.inventory_seq <= gate:
            continue
        book = booking(step.state, host, without=[lease])
        room = host.allocatable - book.booked
        if not lease.demand.fits_in(room) or book.used_gpus & set(lease.gpus):
            step.note(f"gate of {lease.lease_id} stays shut: fit not proven on {host_name}")
            continue
        opened = step.move(lease, lease.state, "gate-opened", gate_seq=None)
        assert opened.request_id is not None
        step.decide(opened.request_id, "admit-preemptible", "admitted", lease=opened)
