"""Victim choice for a cold request that fits nowhere (after Kueue's minimal preemption).

Only unclaimed ``ready`` warm leases are candidates. Per host they are ordered by pool
priority (lowest first), then by how far their pool stands above ``min_ready`` (furthest
first), then newest ``ready`` first, then lease id. Candidates are taken until the
request fits; then the taken set is walked back, newest taken first, dropping every
victim the request does not need. A pool with ``protect_min_ready`` never loses a lease
that would take it below ``min_ready``. Among hosts: fewest victims, then the least
victim capacity, then the host name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reconciler.core.frozen import fast_init
from reconciler.core.model import (
    Host,
    Lease,
    Pool,
    PoolName,
    ResolvedClaim,
    Resources,
)
from reconciler.core.placement import Fit, HostFit, evaluate
from reconciler.core.state import State, is_idle_ready


@fast_init
@dataclass(frozen=True, slots=True)
class Preemption:
    fit: HostFit
    victims: tuple[Lease, ...]

    @property
    def victim_capacity(self) -> Resources:
        total = Resources()
        for v in self.victims:
            total = total + v.demand
        return total

    def rank(self) -> tuple[int, int, int, int, str]:
        cap = self.victim_capacity
        return (len(self.victims), cap.cpu, cap.memory_mib, cap.disk_gib, self.fit.host.name)


def _ready_counts(state: State) -> dict[PoolName, int]:
    return {pool: len(ids) for pool, ids in state.pool_ready.items()}


def _ordered_candidates(
    state: State,
    host: Host,
    ready: dict[PoolName, int],
    eligible: Callable[[Lease], bool] | None = None,
) -> list[Lease]:
    def key(lease: Lease) -> tuple[int, int, int, str]:
        pool = state.pools.get(lease.pool)
        priority = pool.priority if pool else 0
        min_ready = pool.warm.min_ready if pool else 0
        return (priority, -(ready.get(lease.pool, 0) - min_ready), -lease.ready_seq, lease.lease_id)

    return sorted(
        (
            le
            for le in state.active_on_host(host.name)
            if is_idle_ready(le) and (eligible is None or eligible(le))
        ),
        key=key,
    )


def _victims_on_host(
    state: State,
    host: Host,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    ready: dict[PoolName, int],
    eligible: Callable[[Lease], bool] | None = None,
) -> Preemption | None:
    remaining = dict(ready)
    taken: list[Lease] = []
    fit: HostFit | None = None
    for lease in _ordered_candidates(state, host, ready, eligible):
        owner = state.pools.get(lease.pool)
        if (
            owner is not None
            and owner.warm.protect_min_ready
            and remaining.get(lease.pool, 0) <= owner.warm.min_ready
        ):
            continue
        taken.append(lease)
        remaining[lease.pool] = remaining.get(lease.pool, 0) - 1
        trial = evaluate(state, host, pool, demand, claims, without=taken)
        if trial.fit is Fit.FITS:
            fit = trial
            break
    if fit is None:
        return None
    for lease in list(reversed(taken)):
        if len(taken) == 1:
            break
        fewer = [v for v in taken if v.lease_id != lease.lease_id]
        trial = evaluate(state, host, pool, demand, claims, without=fewer)
        if trial.fit is Fit.FITS:
            taken, fit = fewer, trial
    return Preemption(fit, tuple(sorted(taken, key=lambda le: le.lease_id)))


def choose_victims(
    state: State,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    hosts: Sequence[HostFit],
    *,
    eligible: Callable[[Lease], bool] | None = None,
) -> Preemption | None:
    """The best preemption over the hosts that failed only on capacity, or None;
    ``eligible``: which idle warm VMs may be taken (all, by default)."""
    ready = _ready_counts(state)
    options = [
        option
        for hf in hosts
        if hf.fit is Fit.CAPACITY
        and (option := _victims_on_host(state, hf.host, pool, demand, claims, ready, eligible))
        is not None
    ]
    if not options:
        return None
    return min(options, key=Preemption.rank)
