"""Tenants: who owns which pools, what they may use, and how they share (Kueue's model).

Rules (docs/interface.md, "Tenants"):

- A tenant's *usage* is what its pools' active leases book (:data:`~reconciler.core.
  model.QUOTA_RESOURCES`: vCPUs, memory, disk, GPUs, instances), idle warm VMs included.
- Its *nominal quota* is what it is guaranteed. Above it, a tenant of a cohort may
  *borrow*: up to its ``borrowing_limit`` (none: no limit of its own), and only while
  the cohort has room to lend: each member lends the part of its nominal quota its
  ``lending_limit`` allows (none: all of it), and the cohort's lent-out room, what its
  members use beyond the part they keep for themselves, may not exceed that
  (:func:`quota_refusal`). A resource a tenant's quota does not name is unlimited.
- A tenant under its nominal quota whose request waits for room *reclaims*: idle warm
  VMs of a borrower in its cohort are drained for it (never a claimed one; see
  :mod:`reconciler.core.fold.queue`).
- Fair sharing: a tenant's *share* is its dominant resource's usage over its nominal
  quota (over the fleet's allocatable room, for a resource its quota leaves
  unlimited), divided by its weight; waiting requests of the lower share go first.

Pure: no I/O; a tenant's usage is a sum over its few pools' counts, kept by the state.
"""

from __future__ import annotations

from collections.abc import Sequence

from reconciler.core.model import QUOTA_RESOURCES, PoolName, Quota, ResolvedClaim, Resources, Tenant
from reconciler.core.state import State

__all__ = [
    "borrower_pools",
    "demand_of",
    "fleet_room",
    "owner",
    "quota_refusal",
    "shares",
    "under_nominal",
    "usage",
]

Vector = list[int]


def owner(state: State, pool: PoolName) -> Tenant | None:
    """The tenant whose pools name ``pool``, if any (at most one does: the fold refuses a
    tenant naming another tenant's pool, :mod:`reconciler.core.configs`)."""
    for name in sorted(state.tenants):
        tenant = state.tenants[name]
        if pool in tenant.pools:
            return tenant
    return None


def usage(state: State, tenant: Tenant) -> Vector:
    """What its pools' active leases book, in :data:`QUOTA_RESOURCES` order."""
    total = [0, 0, 0, 0, 0]
    for pool in tenant.pools:
        used = state.pool_used.get(pool)
        if used is not None:
            total[0] += used[0]
            total[1] += used[1]
            total[2] += used[2]
            total[3] += used[3]
        total[4] += state.pool_booking.get(pool, 0)
    return total


def demand_of(flavor: Resources, claims: Sequence[ResolvedClaim]) -> Vector:
    """One more instance of ``flavor`` with ``claims``' GPUs."""
    gpus = sum(c.gpu.count for c in claims if c.gpu is not None)
    return [flavor.cpu, flavor.memory_mib, flavor.disk_gib, gpus, 1]


def _limit(quota: Quota | None, r: int) -> int | None:
    return quota.values()[r] if quota is not None else None


def under_nominal(state: State, tenant: Tenant, demand: Vector) -> bool:
    """Whether ``demand`` more keeps the tenant within its nominal quota."""
    used = usage(state, tenant)
    nominal = tenant.quota.values()
    return all(n is None or used[r] + demand[r] <= n for r, n in enumerate(nominal))


def quota_refusal(state: State, tenant: Tenant, demand: Vector) -> str | None:
    """Why ``demand`` more would take the tenant past what it may use (nominal quota,
    borrowing limit, its cohort's room to lend), or ``None`` when it may."""
    used = usage(state, tenant)
    nominal = tenant.quota.values()
    members: list[Tenant] | None = None
    for r, name in enumerate(QUOTA_RESOURCES):
        n = nominal[r]
        if n is None:
            continue
        wanted = used[r] + demand[r]
        if wanted <= n:
            continue
        if tenant.cohort is None:
            return f"tenant {tenant.name!r} would use {wanted} {name}, over its quota of {n}"
        limit = _limit(tenant.borrowing_limit, r)
        if limit is not None and wanted - n > limit:
            return (
                f"tenant {tenant.name!r} would borrow {wanted - n} {name}, over its "
                f"borrowing limit of {limit}"
            )
        if members is None:
            members = [t for t in state.tenants.values() if t.cohort == tenant.cohort]
        lendable = lent = 0
        for member in members:
            m_nominal = member.quota.values()[r]
            if m_nominal is None:
                continue
            lends = _limit(member.lending_limit, r)
            lends = m_nominal if lends is None else min(lends, m_nominal)
            kept = m_nominal - lends
            m_used = usage(state, member)[r] + (demand[r] if member.name == tenant.name else 0)
            lendable += lends
            lent += max(0, m_used - kept)
        if lent > lendable:
            return (
                f"tenant {tenant.name!r} would borrow {wanted - n} {name}; cohort "
                f"{tenant.cohort!r} has {max(0, lendable - (lent - (wanted - n)))} to lend"
            )
    return None


def borrower_pools(state: State, tenant: Tenant) -> set[PoolName]:
    """The pools of the other tenants of ``tenant``'s cohort that use more than their
    nominal quota of some resource (whose idle warm VMs it may reclaim)."""
    if tenant.cohort is None:
        return set()
    pools: set[PoolName] = set()
    for other in state.tenants.values():
        if other.cohort != tenant.cohort or other.name == tenant.name:
            continue
        used = usage(state, other)
        if any(n is not None and used[r] > n for r, n in enumerate(other.quota.values())):
            pools.update(other.pools)
    return pools


def fleet_room(state: State) -> Vector:
    """The allocatable room of the hosts that admit: the share of a resource a quota
    leaves unlimited is counted against it."""
    total = [0, 0, 0, 0, 0]
    for host in state.hosts.values():
        if host.schedulable and host.cordon is None:
            room = host.allocatable
            total[0] += room.cpu
            total[1] += room.memory_mib
            total[2] += room.disk_gib
            total[3] += len(host.gpus)
    return total


def shares(state: State, room: Vector) -> dict[PoolName, float]:
    """Each tenant's pools -> its weighted dominant-resource share (pools of no tenant
    are absent: share 0)."""
    out: dict[PoolName, float] = {}
    for name in sorted(state.tenants, reverse=True):  # the first by name wins a pool
        tenant = state.tenants[name]
        used = usage(state, tenant)
        nominal = tenant.quota.values()
        dominant = 0.0
        for r in range(5):
            n = nominal[r]
            denominator = n if n is not None else (room[r] if r < 4 else 0)
            if denominator > 0:
                dominant = max(dominant, used[r] / denominator)
        for pool in tenant.pools:
            out[pool] = dominant / tenant.weight
    return out
