"""The admission queue: requests that wait for room, in the order they will get it.

An ``admit`` (or ``admit-preemptible``) with a wait (its own ``wait_s``, or its pool's
``queue.wait_s``) that cannot be placed for a reason room can cure is kept here as a
:class:`Waiting` entry (persisted, one row each) until it is admitted, times out, or is
cancelled (:mod:`reconciler.core.fold.queue` decides which, docs/architecture.md "The
admission queue").

Order (documented in docs/interface.md, "Queued admission"):

1. higher pool priority first;
2. across tenants, the lower weighted dominant-resource share first (a pool of no
   tenant counts as share 0);
3. then input order (the stream sequence of the ``admit``).

The index (:class:`WaitIndex`, derived: rebuilt from the entries by ``State.reindex``)
groups the entries in *lanes*: requests of one pool, kind, selected host and extra
claims, so of one shape. Within a lane the order is input order (same pool: same
priority and tenant), and a lane's head that does not fit means that none behind it
fits. So a step that frees room tries the head of each lane (a handful), never every
waiting request: the work per input does not grow with the queue.

Backfill (:data:`BACKFILL_LIMIT`): when a lane's head cannot be placed, the heads of
later lanes are still tried, so room the earlier request cannot use does not stand idle.
Each such admission onto a host the blocked request could use (one it fits on an empty
host) counts against it; once it has been passed :data:`BACKFILL_LIMIT` times, nothing
of its priority or lower is admitted onto a host it could use until it starts (or its
wait ends), so it is not overtaken forever.

Rules: pure (time is the input's JetStream timestamp, in milliseconds); deterministic
(every order ends on the input sequence, which is unique).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from reconciler.core.expiry import epoch_second
from reconciler.core.frozen import fast_init
from reconciler.core.inputs import Admit
from reconciler.core.model import (
    ClaimSpec,
    HostName,
    InstanceName,
    JobId,
    LeaseId,
    LeaseKind,
    PoolName,
    RequestId,
)

__all__ = [
    "BACKFILL_LIMIT",
    "QUEUE_REASONS",
    "Lane",
    "WaitIndex",
    "Waiting",
    "epoch_ms",
    "iso_ms",
]

#: how many times a blocked request may be overtaken on room it could use (see above)
BACKFILL_LIMIT = 8

#: the reasons a request waits for (the capacity reasons, and a tenant's quota)
QUEUE_REASONS = frozenset(
    {"insufficient-capacity", "no-suitable-host", "pool-at-max", "tenant-quota"}
)

#: a lane: requests of one shape (pool, kind, selected host, extra claims)
Lane = tuple[PoolName, LeaseKind, HostName | None, tuple[ClaimSpec, ...]]


@fast_init
@dataclass(frozen=True, slots=True)
class Waiting:
    """One request waiting for room: the command as it came, and its place in time."""

    request_id: RequestId
    pool: PoolName
    instance: InstanceName
    kind: LeaseKind
    job: JobId | None
    host: HostName | None
    claims: tuple[ClaimSpec, ...]
    preemptible: bool
    #: the stream sequence of its ``admit``: input order, and its lease id once admitted
    seq: int
    #: the ``admit``'s JetStream timestamp, as the stream wrote it
    queued_at: str
    #: its wait's end, epoch milliseconds: the timestamp plus its ``wait_s``
    deadline_ms: int
    #: why it waits (one of :data:`QUEUE_REASONS`), as last found
    reason: str
    #: how many admissions overtook it on room it could use (the backfill rule)
    passed: int = 0
    #: idle warm VMs of borrowers drained for it (its tenant reclaims), while any is left
    reclaim: tuple[LeaseId, ...] = ()

    @property
    def lane(self) -> Lane:
        return (self.pool, self.kind, self.host, self.claims)

    @property
    def verb(self) -> str:
        return "admit-preemptible" if self.preemptible else "admit"

    def command(self) -> Admit:
        """The ``admit`` it waits with (its wait spent: it is placed or not, now)."""
        return Admit(
            self.request_id,
            self.pool,
            self.instance,
            self.kind,
            self.job,
            self.host,
            self.claims,
            self.preemptible,
        )


def epoch_ms(timestamp: str) -> int | None:
    """Milliseconds since the epoch of an RFC 3339 UTC timestamp (``…Z``, any fraction,
    truncated to milliseconds); ``None`` when it is not one."""
    second = epoch_second(timestamp)
    if second is None:
        return None
    millis = 0
    if len(timestamp) > 20 and timestamp[19] == ".":
        digits = ""
        for ch in timestamp[20:23]:
            if not ch.isdigit():
                break
            digits += ch
        millis = int(digits.ljust(3, "0")) if digits else 0
    return second * 1000 + millis


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as an RFC 3339 UTC timestamp with milliseconds."""
    seconds, millis = divmod(ms, 1000)
    days, rest = divmod(seconds, 86_400)
    # the proleptic Gregorian date of a day count (H. Hinnant's civil_from_days)
    z = days + 719_468
    era, doe = divmod(z, 146_097)
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (1 if month <= 2 else 0)
    hour, rest = divmod(rest, 3600)
    minute, second = divmod(rest, 60)
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}.{millis:03d}Z"


@dataclass(slots=True)
class WaitIndex:
    """The waiting requests arranged for the fold (derived; see the module's rules)."""

    #: lane -> its requests' ids in input order (entries no longer waiting are skipped
    #: when they reach the head: a cancel or timeout does not search the lane)
    lanes: dict[Lane, deque[tuple[int, RequestId]]] = field(default_factory=dict)
    #: (deadline_ms, seq, request id), smallest first; stale entries skipped
    deadlines: list[tuple[int, int, RequestId]] = field(default_factory=list)
    #: a waiting request's instance -> its request id (cancel by release, duplicates)
    by_instance: dict[InstanceName, RequestId] = field(default_factory=dict)
    #: pool -> how many of its requests wait (positions, status)
    per_pool: dict[PoolName, int] = field(default_factory=dict)

    @classmethod
    def of(cls, waiting: dict[RequestId, Waiting]) -> WaitIndex:
        index = cls()
        for entry in sorted(waiting.values(), key=lambda w: w.seq):
            index.add(entry)
        return index

    def add(self, entry: Waiting) -> None:
        lane = self.lanes.get(entry.lane)
        if lane is None:
            lane = self.lanes[entry.lane] = deque()
        lane.append((entry.seq, entry.request_id))
        heapq.heappush(self.deadlines, (entry.deadline_ms, entry.seq, entry.request_id))
        self.by_instance[entry.instance] = entry.request_id
        self.per_pool[entry.pool] = self.per_pool.get(entry.pool, 0) + 1

    def remove(self, entry: Waiting) -> None:
        """Forget an entry that stopped waiting (its lane and deadline entries are
        dropped lazily, when they come to the front)."""
        if self.by_instance.get(entry.instance) == entry.request_id:
            del self.by_instance[entry.instance]
        n = self.per_pool.get(entry.pool, 0) - 1
        if n > 0:
            self.per_pool[entry.pool] = n
        else:
            self.per_pool.pop(entry.pool, None)

    def head(self, lane: Lane, waiting: dict[RequestId, Waiting]) -> Waiting | None:
        """The lane's first request still waiting (dropping those that stopped), or
        ``None`` (and the lane is dropped) when none is."""
        queue = self.lanes.get(lane)
        while queue:
            entry = waiting.get(queue[0][1])
            if entry is not None and entry.seq == queue[0][0]:
                return entry
            queue.popleft()
        self.lanes.pop(lane, None)
        return None

    def due(self, now_ms: int, waiting: dict[RequestId, Waiting]) -> Iterator[Waiting]:
        """The waiting requests whose deadline is at or before ``now_ms``, earliest first
        (each taken off the deadline heap)."""
        heap = self.deadlines
        while heap and heap[0][0] <= now_ms:
            _, seq, request_id = heapq.heappop(heap)
            entry = waiting.get(request_id)
            if entry is not None and entry.seq == seq:
                yield entry

    def next_deadline(self, waiting: dict[RequestId, Waiting]) -> int | None:
        heap = self.deadlines
        while heap:
            _, seq, request_id = heap[0]
            entry = waiting.get(request_id)
            if entry is not None and entry.seq == seq:
                return heap[0][0]
            heapq.heappop(heap)
        return None
