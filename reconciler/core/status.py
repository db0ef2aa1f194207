"""Hosts and pools at a glance: the payloads of ``out.status.host.<host>`` and
``out.status.pool.<pool>`` (docs/interface.md, "Status, rejections and dead letters"),
and the warm-pool deficit the leader's top-up reconciler acts on.

Rules:

- Everything here is a read of the state; nothing is decided or changed.
- A host's ``booked`` counts every lease that books capacity there *and* the foreign
  instances of its latest inventory, exactly as admission does
  (:func:`reconciler.core.placement.booking`); so ``free`` may be negative when foreign
  VMs over-commit the host.
- A host's ``schedulable`` is what its snapshot says, ``cordon`` what operators said on
  the bus (``cordoned``, ``draining`` or ``None``); new work lands only where the first
  is true and the second ``None``.
- Pool counts follow the lease states: ``ready`` = idle, claimable warm VMs; ``booting`` =
  warm VMs reserved or created (not yet ready, not waiting at a launch gate);
  ``claimed`` = claimed or injected; ``pending_requests`` = preemptible admissions waiting
  at their launch gate.
- The admission queue (:func:`queue_status`) and the tenants' usage against their quota
  (:func:`tenant_status`) are what ``reconciler status`` shows besides.
"""

from __future__ import annotations

from typing import Any

from reconciler.core.fold.queue import current_shares, ordered, tenant_of
from reconciler.core.model import QUOTA_RESOURCES, HostName, PoolName
from reconciler.core.placement import booking
from reconciler.core.state import POOL_COUNTS, State
from reconciler.core.tenants import usage
from reconciler.core.waiting import Waiting, iso_ms

__all__ = [
    "failed_leases",
    "host_status",
    "pool_status",
    "queue_status",
    "tenant_status",
    "warm_deficit",
    "with_warm_claims",
]


def host_status(state: State, name: HostName, *, as_of_seq: int) -> dict[str, Any] | None:
    """The status payload of one host, or ``None`` for a host the state does not know."""
    host = state.hosts.get(name)
    if host is None:
        return None
    book = booking(state, host)
    by_state: dict[str, int] = {}
    for lease in state.active_on_host(name):
        by_state[lease.state.value] = by_state.get(lease.state.value, 0) + 1
    allocatable = host.allocatable
    return {
        "v": 1,
        "host": name,
        "uid": host.uid,
        "schedulable": host.schedulable,
        "cordon": host.cordon,
        "allocatable": allocatable.as_dict(),
        "booked": book.booked.as_dict(),
        "free": (allocatable - book.booked).as_dict(),
        "leases_by_state": dict(sorted(by_state.items())),
        "gpus_free": sorted(g.index for g in host.gpus if g.index not in book.used_gpus),
        "foreign_instances": len(host.foreign_instances),
        "as_of_seq": as_of_seq,
    }


def pool_status(state: State, name: PoolName, *, as_of_seq: int) -> dict[str, Any] | None:
    """The status payload of one pool, or ``None`` for a pool the state does not know."""
    pool = state.pools.get(name)
    if pool is None:
        return None
    held = state.pool_counts.get(name, {})
    counts = {count: held.get(count, 0) for count in POOL_COUNTS}
    return {
        "v": 1,
        "pool": name,
        "ready": len(state.pool_ready.get(name, ())),
        **counts,
        "instances": state.pool_booking.get(name, 0),
        "min_ready": pool.warm.min_ready,
        "max_ready": pool.warm.max_ready,
        "max_instances": pool.max_instances,
        "as_of_seq": as_of_seq,
    }


def with_warm_claims(row: dict[str, Any], claims: tuple[int, int]) -> dict[str, Any]:
    """A pool's status with its warm claims ``(claimed, no_warm)``: ``claimed`` (a ready
    warm VM was bound), ``no_warm`` (none was: the job went cold), and ``hit_ratio``
    (``None`` before any). The counts are the store's, not the state's."""
    claimed, missed = claims
    total = claimed + missed
    ratio = round(claimed / total, 4) if total else None
    return {**row, "warm_claims": {"claimed": claimed, "no_warm": missed, "hit_ratio": ratio}}


def warm_deficit(state: State, name: PoolName) -> int:
    """How many warm VMs the pool should be asked to admit now to reach ``min_ready``.

    Counts every unclaimed warm lease, booting or ready, as on its way; never asks beyond
    ``max_ready`` unclaimed warm VMs or ``max_instances`` in all. The fold judges each
    admission again: this is only how much to ask for.
    """
    pool = state.pools.get(name)
    if pool is None:
        return 0
    unclaimed = state.pool_warm_unclaimed.get(name, 0)
    wanted = pool.warm.min_ready - unclaimed
    room_ready = pool.warm.max_ready - unclaimed
    room_total = pool.max_instances - state.pool_booking.get(name, 0)
    return max(0, min(wanted, room_ready, room_total))


def failed_leases(state: State) -> list[dict[str, Any]]:
    """Every lease the state keeps that carries a fault (a create refused, a start
    failed, a delete that cannot be done), the newest first."""
    faulted = [le for le in state.leases.values() if le.fault is not None]
    faulted.sort(key=lambda le: (le.admitted_seq, le.lease_id), reverse=True)
    return [
        {
            "lease_id": le.lease_id,
            "instance": le.instance,
            "host": le.host,
            "pool": le.pool,
            "state": le.state.value,
            "fault": le.fault,
        }
        for le in faulted
    ]


def queue_status(state: State) -> list[dict[str, Any]]:
    """Each pool's admission queue, pools with a waiting request only: how many wait,
    the first in line (its request id, reason and when it was queued) and the earliest
    deadline."""
    first: dict[PoolName, Waiting] = {}
    earliest: dict[PoolName, int] = {}
    for entry in ordered(state):
        first.setdefault(entry.pool, entry)
        earliest[entry.pool] = min(earliest.get(entry.pool, entry.deadline_ms), entry.deadline_ms)
    return [
        {
            "pool": pool,
            "tenant": tenant_of(state, pool),
            "waiting": state.queue.per_pool.get(pool, 0),
            "head": head.request_id,
            "head_reason": head.reason,
            "head_queued_at": head.queued_at,
            "earliest_deadline": iso_ms(earliest[pool]),
        }
        for pool, head in sorted(first.items())
    ]


def tenant_status(state: State) -> list[dict[str, Any]]:
    """Each tenant's usage against its nominal quota (``None``: unlimited), weight,
    cohort, weighted dominant-resource share and waiting requests."""
    by_pool = current_shares(state)
    rows = []
    for name in sorted(state.tenants):
        tenant = state.tenants[name]
        used = usage(state, tenant)
        quota = tenant.quota.values()
        rows.append(
            {
                "tenant": name,
                "pools": list(tenant.pools),
                "usage": dict(zip(QUOTA_RESOURCES, used, strict=True)),
                "quota": dict(zip(QUOTA_RESOURCES, quota, strict=True)),
                "weight": tenant.weight,
                "cohort": tenant.cohort,
                "share": round(by_pool.get(tenant.pools[0], 0.0), 6) if tenant.pools else 0.0,
                "waiting": sum(state.queue.per_pool.get(p, 0) for p in tenant.pools),
            }
        )
    return rows
