"""The folded state and what one fold step produces.

:class:`State` is the only mutable object of the core: a set of dictionaries of frozen
entities plus a few derived indexes, changed only by :mod:`reconciler.core.fold`.
Each step records what it touched in :class:`Effects`, so the store can write exactly
the rows that changed, in the same transaction as the outbox and the position.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TypeVar

from reconciler.core.candidates import CandidateIndex
from reconciler.core.expiry import ExpiryIndex
from reconciler.core.frozen import fast_init
from reconciler.core.messages import Decision, Output, decision_id
from reconciler.core.model import (
    CLAIMED,
    COLD,
    CREATED,
    DRAINING,
    INJECTED,
    READY,
    RELEASED,
    RESERVED,
    VICTIM,
    WARM,
    ZERO,
    ClassName,
    GpuPolicy,
    GpuProfile,
    Host,
    HostName,
    InstanceName,
    JobId,
    Lease,
    LeaseId,
    Pool,
    PoolName,
    RequestId,
    ResourceClass,
    Tenant,
)
from reconciler.core.waiting import WaitIndex, Waiting

_K = TypeVar("_K", bound=str)


#: warm states that count against a pool's max_ready
WARM_UNCLAIMED = (RESERVED, CREATED, READY)


def is_idle_ready(lease: Lease) -> bool:
    """A warm VM that is booted, unclaimed and not in doubt: claimable, preemptible."""
    return (
        lease.kind is WARM
        and lease.state is READY
        and lease.job is None
        and lease.victim_of is None
        and lease.suspect_revision is None
    )


def is_idle_warm(lease: Lease) -> bool:
    """A warm VM that serves no job and is not on its way out: booting or ready,
    unclaimed, neither a victim nor waiting at a launch gate (what a drain deletes)."""
    return (
        lease.kind is WARM
        and lease.state in WARM_UNCLAIMED
        and lease.job is None
        and lease.victim_of is None
        and lease.gate_seq is None
    )


#: the counts of a pool's status (``out.status.pool.<pool>``) that follow its leases
POOL_COUNTS = ("booting", "claimed", "draining", "victims", "pending_requests")


def pool_count_of(lease: Lease) -> str | None:
    """Which of :data:`POOL_COUNTS` an active lease adds to, if any: ``pending_requests``
    while it waits at a launch gate, else by its state (warm VMs reserved or created
    are ``booting``)."""
    if lease.gate_seq is not None:
        return "pending_requests"
    state = lease.state
    if state is VICTIM:
        return "victims"
    if state is DRAINING:
        return "draining"
    if state is CLAIMED or state is INJECTED:
        return "claimed"
    if lease.kind is WARM and (state is RESERVED or state is CREATED):
        return "booting"
    return None


def is_booting_warm(lease: Lease) -> bool:
    """A warm VM admitted and not ready yet: reserved or created, past its gate."""
    return lease.kind is WARM and lease.state in (RESERVED, CREATED) and lease.gate_seq is None


def is_reserved_cold(lease: Lease) -> bool:
    """A cold lease admitted (no launch gate shut) whose VM was not created yet."""
    return lease.kind is COLD and lease.state is RESERVED and lease.gate_seq is None


@fast_init
@dataclass(frozen=True, slots=True)
class Transition:
    """One lease transition, appended to the journal with its cause."""

    input_seq: int
    lease_id: LeaseId
    event: str
    from_state: str | None
    to_state: str
    #: the input's stream time, in whole seconds since the epoch (journal retention)
    at: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """The latest decision for a request id, kept for idempotent replies."""

    request_id: RequestId
    verb: str
    phase: str
    payload: bytes
    lease_id: LeaseId | None = None
    #: stream time (epoch seconds) of its final decision: retention counts from it
    final_at: int | None = None

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` (docs/interface.md): derived, so no copy is kept per request."""
        return decision_id(self.request_id, self.phase)

    @property
    def decision(self) -> Decision:
        """The decision itself, read from its bytes."""
        return Decision.parse(self.payload)


@dataclass(slots=True)
class Effects:
    """What one batch of fold steps did: outputs, journal rows, touched keys."""

    outputs: list[Output] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    #: hosts and pools whose status may have changed: their own entity, or a lease on
    #: them (what status publishing and the warm top-up look at)
    hosts: set[HostName] = field(default_factory=set)
    pools: set[PoolName] = field(default_factory=set)
    #: hosts and pools whose own entity changed (snapshot, inventory, config): the rows
    #: the store rewrites. A lease changing does not change them.
    host_rows: set[HostName] = field(default_factory=set)
    pool_rows: set[PoolName] = field(default_factory=set)
    classes: set[ClassName] = field(default_factory=set)
    profiles: set[str] = field(default_factory=set)
    policies: set[str] = field(default_factory=set)
    leases: set[LeaseId] = field(default_factory=set)
    decisions: set[RequestId] = field(default_factory=set)
    #: jobs whose binding was dropped (their lease evicted by retention)
    jobs: set[JobId] = field(default_factory=set)
    #: pools whose warm VM could not be created or started (the top-up backs off)
    failed_pools: set[PoolName] = field(default_factory=set)
    #: requests that began or stopped waiting, or whose queue entry changed (its row)
    waiting: set[RequestId] = field(default_factory=set)
    #: tenants whose config changed (their rows)
    tenants: set[str] = field(default_factory=set)
    #: how waits ended (metrics): ``(how, pool, waited ms)``, how being ``admitted``,
    #: ``timed-out``, ``cancelled`` or ``refused``; and admissions that did not wait
    waits_ended: list[tuple[str, PoolName, int]] = field(default_factory=list)
    admitted_at_once: int = 0
    #: input kinds recorded but ignored (stale revisions, no-op events), for logs
    notes: list[tuple[int, str]] = field(default_factory=list)
    #: every decision written: (verb, outcome, reason or ``None``), for the metrics;
    #: not part of what the store writes or a replay compares
    verdicts: list[tuple[str, str, str | None]] = field(default_factory=list)
    #: every claim-warm decided on a known pool for a new job: (pool, ``claimed`` or
    #: ``no-warm``), the warm hit ratio's counts (the store sums them per pool)
    warm_claims: list[tuple[PoolName, str]] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        self.outputs.extend(other.outputs)
        self.transitions.extend(other.transitions)
        self.hosts |= other.hosts
        self.pools |= other.pools
        self.host_rows |= other.host_rows
        self.pool_rows |= other.pool_rows
        self.classes |= other.classes
        self.profiles |= other.profiles
        self.policies |= other.policies
        self.leases |= other.leases
        self.decisions |= other.decisions
        self.jobs |= other.jobs
        self.failed_pools |= other.failed_pools
        self.waiting |= other.waiting
        self.tenants |= other.tenants
        self.waits_ended.extend(other.waits_ended)
        self.admitted_at_once += other.admitted_at_once
        self.notes.extend(other.notes)
        self.verdicts.extend(other.verdicts)
        self.warm_claims.extend(other.warm_claims)


@dataclass(slots=True)
class State:
    """Everything the fold knows. Derived indexes are rebuilt by :meth:`reindex`."""

    applied_seq: int = 0
    hosts: dict[HostName, Host] = field(default_factory=dict)
    pools: dict[PoolName, Pool] = field(default_factory=dict)
    classes: dict[ClassName, ResourceClass] = field(default_factory=dict)
    profiles: dict[str, GpuProfile] = field(default_factory=dict)
    policies: dict[str, GpuPolicy] = field(default_factory=dict)
    leases: dict[LeaseId, Lease] = field(default_factory=dict)
    decisions: dict[RequestId, DecisionRecord] = field(default_factory=dict)
    #: job identity -> the lease it was bound to, for as long as that lease is kept
    jobs: dict[JobId, LeaseId] = field(default_factory=dict)
    #: released lease -> stream time (epoch seconds) of its release, until evicted
    released_at: dict[LeaseId, int] = field(default_factory=dict)
    #: seconds of stream time a final decision and a released lease are kept; ``None``
    #: keeps them forever. Configuration, not state: every replica and every replay of
    #: one stream must fold with the same value (``--decision-retention``).
    decision_retention_s: int | None = None
    #: requests waiting for room (reconciler.core.waiting), by request id
    waiting: dict[RequestId, Waiting] = field(default_factory=dict)
    #: tenants (config), by name
    tenants: dict[str, Tenant] = field(default_factory=dict)

    # ---- derived (not persisted; rebuilt from the above by reindex) ----
    #: instance -> its latest lease
    by_instance: dict[InstanceName, LeaseId] = field(default_factory=dict)
    #: host -> lease ids of active leases there
    on_host: dict[HostName, set[LeaseId]] = field(default_factory=dict)
    #: pool -> its active leases counted by :func:`pool_count_of` (no zero counts), so a
    #: pool's status is a lookup, not a scan of every lease the pool holds
    pool_counts: dict[PoolName, dict[str, int]] = field(default_factory=dict)
    #: host -> [cpu, memory_mib, disk_gib] booked by leases (foreign instances apart)
    booked: dict[HostName, list[int]] = field(default_factory=dict)
    #: host -> GPU index -> how many capacity-booking leases hold it (1 unless broken)
    gpus_held: dict[HostName, dict[int, int]] = field(default_factory=dict)
    #: pool -> capacity-booking leases / unclaimed warm leases (for max_instances, max_ready)
    pool_booking: dict[PoolName, int] = field(default_factory=dict)
    pool_warm_unclaimed: dict[PoolName, int] = field(default_factory=dict)
    #: pool -> lease ids of ready, unclaimed, unsuspected warm leases (claim and victim pool)
    pool_ready: dict[PoolName, set[LeaseId]] = field(default_factory=dict)
    #: pool -> lease ids of warm leases still booting (reserved or created, not gated),
    #: so the boot-timeout check looks at a handful of leases, not at the whole pool
    pool_booting: dict[PoolName, set[LeaseId]] = field(default_factory=dict)
    #: host -> lease ids of active leases waiting at a launch gate there, so a snapshot
    #: checks its host's few gates instead of every lease on the host
    gated_on_host: dict[HostName, set[LeaseId]] = field(default_factory=dict)
    #: host names in order (placement's iteration order), rebuilt when a host appears
    host_order: list[HostName] = field(default_factory=list)
    #: which hosts fit which request shapes, kept up to date from a log of host changes
    candidates: CandidateIndex = field(default_factory=CandidateIndex)
    #: what retention will evict, by the second it was decided or released
    expiry: ExpiryIndex = field(default_factory=ExpiryIndex)
    #: the waiting requests by lane, deadline, instance and pool
    queue: WaitIndex = field(default_factory=WaitIndex)
    #: pool -> [cpu, memory_mib, disk_gib, gpus] booked by its active leases (tenants'
    #: usage; its instances are ``pool_booking``)
    pool_used: dict[PoolName, list[int]] = field(default_factory=dict)

    def reindex(self) -> None:
        self.by_instance = {}
        self.on_host = {}
        self.pool_counts = {}
        self.booked = {}
        self.gpus_held = {}
        self.pool_booking = {}
        self.pool_used = {}
        self.pool_warm_unclaimed = {}
        self.pool_ready = {}
        self.pool_booting = {}
        self.gated_on_host = {}
        self.host_order = sorted(self.hosts)
        self.candidates = CandidateIndex()
        self.expiry = ExpiryIndex.of(
            ((r.final_at, r.request_id) for r in self.decisions.values() if r.final_at is not None),
            ((at, lease_id) for lease_id, at in self.released_at.items()),
        )
        for lease in sorted(self.leases.values(), key=lambda le: (le.admitted_seq, le.lease_id)):
            self.by_instance[lease.instance] = lease.lease_id
            self._count(lease, +1)
        self.queue = WaitIndex.of(self.waiting)

    def put_host(self, host: Host) -> None:
        if host.name not in self.hosts:
            # in place, O(log n) + a memmove: a sort per new host made 10,000 hosts
            # arriving cost O(n² log n) on the deciding loop (issue 15)
            bisect.insort(self.host_order, host.name)
        self.hosts[host.name] = host
        self.candidates.touch(host.name)

    def _count(self, lease: Lease, sign: int) -> None:
        """Add (+1) or remove (-1) a lease's contribution to the derived indexes."""
        if lease.state is not RELEASED:  # lease.active
            self._count_host(lease, sign)
            self._count_pool(lease, sign)

    # _count_host and _count_pool run for every lease the fold stores (_count_pool twice
    # for most), so they spell out the properties and predicates they stand for (a test
    # keeps them the same) and look indexes up before they make an entry.

    def _count_host(self, lease: Lease, sign: int) -> None:
        """An active lease's share of its host: membership, and the capacity it books
        (which placement reads, so the host is logged for the candidate index)."""
        host = lease.host
        self.candidates.log.append(host)  # candidates.touch(), without the call
        members = self.on_host.get(host)
        if sign > 0:
            if members is None:
                self.on_host[host] = {lease.lease_id}
            else:
                members.add(lease.lease_id)
        elif members is not None:
            members.discard(lease.lease_id)
        if lease.victim_of is not None:
            return
        row = self.booked.get(host)
        if row is None:
            row = self.booked[host] = [0, 0, 0]
        held_gpus = lease.held_gpus
        # lease.booked_demand and lease.booked_gpus, their common case first
        d = lease.demand if lease.held is ZERO and not held_gpus else lease.booked_demand
        row[0] += sign * d.cpu
        row[1] += sign * d.memory_mib
        row[2] += sign * d.disk_gib
        gpus = lease.gpus if not held_gpus else lease.booked_gpus
        if gpus:
            held = self.gpus_held.setdefault(host, {})
            for ix in gpus:
                n = held.get(ix, 0) + sign
                if n:
                    held[ix] = n
                else:
                    held.pop(ix, None)
        pool = lease.pool
        self.pool_booking[pool] = self.pool_booking.get(pool, 0) + sign
        used = self.pool_used.get(pool)
        if used is None:
            used = self.pool_used[pool] = [0, 0, 0, 0]
        used[0] += sign * d.cpu
        used[1] += sign * d.memory_mib
        used[2] += sign * d.disk_gib
        used[3] += sign * len(gpus)

    def _count_pool(self, lease: Lease, sign: int) -> None:
        """An active lease's share of its pool's counts and warm indexes, which follow
        its state (what :meth:`_count_host` counts does not)."""
        state = lease.state
        # pool_count_of(lease)
        counted: str | None
        if lease.gate_seq is not None:
            counted = "pending_requests"
            _member(self.gated_on_host, lease.host, lease.lease_id, sign)
        elif state is VICTIM:
            counted = "victims"
        elif state is DRAINING:
            counted = "draining"
        elif state is CLAIMED or state is INJECTED:
            counted = "claimed"
        elif lease.kind is WARM and (state is RESERVED or state is CREATED):
            counted = "booting"
        else:
            counted = None
        if counted is not None:
            counts = self.pool_counts.get(lease.pool)
            if counts is None:
                counts = self.pool_counts[lease.pool] = {}
            n = counts.get(counted, 0) + sign
            if n:
                counts[counted] = n
            else:
                del counts[counted]
        # the warm indexes below hold warm leases only (cold ones return here, at once)
        if lease.victim_of is not None or lease.kind is not WARM:
            return
        pool = lease.pool
        if state in WARM_UNCLAIMED:
            self.pool_warm_unclaimed[pool] = self.pool_warm_unclaimed.get(pool, 0) + sign
        # is_idle_ready(lease) and is_booting_warm(lease), for a warm lease not a victim
        if state is READY and lease.job is None and lease.suspect_revision is None:
            _member(self.pool_ready, pool, lease.lease_id, sign)
        elif (state is RESERVED or state is CREATED) and lease.gate_seq is None:
            _member(self.pool_booting, pool, lease.lease_id, sign)

    def put_lease(self, lease: Lease) -> None:
        """Store a lease and keep the derived indexes in step.

        Most updates move an active lease from one state to the next on the same host,
        booking the same: then only the pool's counts change, and the host is not
        logged for placement to evaluate again."""
        lease_id = lease.lease_id
        old = self.leases.get(lease_id)
        self.leases[lease_id] = lease
        if old is None:
            self.by_instance[lease.instance] = lease_id
            self._count(lease, +1)
        elif old.state is not RELEASED and lease.state is not RELEASED and _books_alike(old, lease):
            self._count_pool(old, -1)
            self._count_pool(lease, +1)
        else:
            self._count(old, -1)
            self._count(lease, +1)

    def admitted_at(self, lease: Lease) -> int | None:
        """The stream second (epoch) of ``lease``'s admission: its request's final
        decision. ``None`` when that decision is no longer kept (evicted by the decision
        retention, so it is older than that) or the lease has no request (adopted)."""
        record = self.decisions.get(lease.request_id) if lease.request_id is not None else None
        return record.final_at if record is not None else None

    def lease_of_instance(self, instance: str) -> Lease | None:
        # the name as it is: an InstanceName() call is a Python-level call returning it
        lease_id = self.by_instance.get(instance)  # type: ignore[call-overload]
        return self.leases.get(lease_id) if lease_id is not None else None

    def active_on_host(self, host: HostName) -> list[Lease]:
        ids = self.on_host.get(host, ())
        return [self.leases[i] for i in sorted(ids)]

    def gated_on(self, host: HostName) -> list[Lease]:
        """The active leases on ``host`` waiting at a launch gate, by lease id."""
        ids = self.gated_on_host.get(host)
        return [self.leases[i] for i in sorted(ids)] if ids else []

    def booting_in_pool(self, pool: PoolName) -> list[Lease]:
        """The pool's booting warm leases (:func:`is_booting_warm`) that book capacity."""
        ids = self.pool_booting.get(pool, ())
        return [self.leases[i] for i in sorted(ids)]


def _books_alike(a: Lease, b: Lease) -> bool:
    """Whether two versions of an active lease add the same to their host's indexes
    (on_host, booked, gpus_held, pool_booking): same host and pool, both booking or both
    promised away, and when booking, the same demand and GPUs."""
    if a.host != b.host or a.pool != b.pool or (a.victim_of is None) != (b.victim_of is None):
        return False
    if a.victim_of is not None:
        return True
    # ``is`` first: a lease evolved without a new demand keeps the same objects (then
    # the properties below, Python-level calls, would give the same), and a dataclass
    # ``==`` is a Python-level call
    if (
        a.demand is b.demand
        and a.held is b.held
        and a.gpus is b.gpus
        and a.held_gpus is b.held_gpus
    ):
        return True
    da, db = a.booked_demand, b.booked_demand
    return (da is db or da == db) and a.booked_gpus == b.booked_gpus


def _member(index: dict[_K, set[LeaseId]], key: _K, lid: LeaseId, sign: int) -> None:
    """Add (+1) or remove (-1) a lease id in a per-pool or per-host index."""
    members = index.get(key)
    if members is None:
        index[key] = members = set()
    if sign > 0:
        members.add(lid)
    else:
        members.discard(lid)
