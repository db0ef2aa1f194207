"""What an admission checks and books, shared by an admission decided at once
(:mod:`.commands`) and one that waited in the queue (:mod:`.queue`)."""

from __future__ import annotations

from reconciler.core import inputs as ev
from reconciler.core.fold.step import Step
from reconciler.core.model import (
    RESERVED,
    WARM,
    Host,
    Lease,
    LeaseId,
    LeaseKind,
    Pool,
)
from reconciler.core.runtime import runtime_basis
from reconciler.core.state import State

__all__ = ["pool_at_max", "reserve"]


def pool_at_max(state: State, pool: Pool, kind: LeaseKind) -> str | None:
    booking_count = state.pool_booking.get(pool.name, 0)
    if booking_count >= pool.max_instances:
        return f"pool {pool.name!r} has {booking_count} of max_instances {pool.max_instances}"
    warm = state.pool_warm_unclaimed.get(pool.name, 0)
    if kind is WARM and warm >= pool.warm.max_ready:
        return (
            f"pool {pool.name!r} has {warm} unclaimed warm VMs of max_ready {pool.warm.max_ready}"
        )
    return None


def reserve(
    step: Step,
    cmd: ev.Admit,
    verb: str,
    pool: Pool,
    host: Host,
    gpus: tuple[int, ...],
    *,
    gate: tuple[LeaseId, ...] | None = None,
    lease_id: LeaseId | None = None,
) -> Lease:
    """Reserve the admission's lease on ``host`` (id ``L<seq>`` of the input that
    admits it, unless given: a queued request's is its own admit's sequence)."""
    basis = runtime_basis(step.state, host)
    lease = Lease(
        lease_id=lease_id if lease_id is not None else LeaseId(f"L{step.seq}"),
        instance=cmd.instance,
        host=host.name,
        host_uid=host.uid,
        pool=pool.name,
        kind=cmd.kind,
        state=RESERVED,
        demand=pool.flavor,
        gpus=gpus,
        project=pool.project,
        job=cmd.job,
        request_id=cmd.request_id,
        admitted_seq=step.seq,
        gate_seq=step.seq if gate is not None else None,
        awaiting_victims=gate or (),
        runtime_gpu_revision=basis[0],
        runtime_profile=basis[1],
        runtime_profile_revision=basis[2],
    )
    step.create(lease, verb)
    if cmd.job is not None:
        step.state.jobs[cmd.job] = lease.lease_id
    return lease
