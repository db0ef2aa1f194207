"""Retention's clock: what the fold will forget, by the second it became forgettable.

Decided request ids and released leases are kept ``decision_retention_s`` seconds of
stream time after their final decision or their release (docs/long-lived.md).
This index files each under the second (epoch, from the input message's timestamp) it
was decided or released, in per-second buckets with a min-heap of the bucket seconds,
so a fold step finds what expired in O(expired + log buckets): never a scan of every
decision or lease. Buckets are keyed by the event's second, not by its expiry, so the
retention may change between runs without rebuilding anything.

An entry is a hint, checked against the state when it comes due: a decision decided
again later, or a lease whose release moved, is filed again under its new second and
its old entry is ignored.

Rules: pure (no clock read; time is what the caller passes, from message timestamps);
derived (rebuilt from the state's ``final_at`` and ``released_at`` by ``State.reindex``).
"""

from __future__ import annotations

import calendar
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from reconciler.core.model import LeaseId, RequestId

__all__ = ["SECONDS_SEEN", "ExpiryIndex", "epoch_second"]

#: :func:`epoch_second`'s cache: the seconds of the last few distinct timestamps, by
#: their first 19 characters (``YYYY-MM-DDTHH:MM:SS``). The fold reads it before it
#: calls the function, which it does for every input.
SECONDS_SEEN: dict[str, int] = {}


def epoch_second(timestamp: str) -> int | None:
    """Whole seconds since the epoch of an RFC 3339 UTC timestamp (``…Z``, any fraction);
    ``None`` when it is not one. The last few distinct seconds are cached: consecutive
    messages mostly share theirs."""
    head = timestamp[:19]
    cached = SECONDS_SEEN.get(head)
    if cached is not None:
        return cached
    try:
        if len(head) != 19 or head[4] != "-" or head[10] not in "Tt" or head[13] != ":":
            return None
        fields = (
            int(head[0:4]),
            int(head[5:7]),
            int(head[8:10]),
            int(head[11:13]),
            int(head[14:16]),
            int(head[17:19]),
        )
    except ValueError:
        return None
    second = calendar.timegm((*fields, 0, 0, 0))
    if len(SECONDS_SEEN) > 64:
        SECONDS_SEEN.clear()
    SECONDS_SEEN[head] = second
    return second


@dataclass(slots=True)
class ExpiryIndex:
    """Request ids and lease ids by the second of their final decision or release."""

    decisions: dict[int, list[RequestId]] = field(default_factory=dict)
    leases: dict[int, list[LeaseId]] = field(default_factory=dict)
    #: the seconds that have a bucket in either table, as a heap (smallest first)
    seconds: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        decisions: Iterable[tuple[int, RequestId]],
        leases: Iterable[tuple[int, LeaseId]],
    ) -> ExpiryIndex:
        index = cls()
        for second, request_id in decisions:
            index.add_decision(second, request_id)
        for second, lease_id in leases:
            index.add_lease(second, lease_id)
        return index

    def add_decision(self, second: int, request_id: RequestId) -> None:
        bucket = self.decisions.get(second)
        if bucket is None:
            bucket = self.decisions[second] = []
            heapq.heappush(self.seconds, second)  # a second pushed twice pops empty
        bucket.append(request_id)

    def add_lease(self, second: int, lease_id: LeaseId) -> None:
        bucket = self.leases.get(second)
        if bucket is None:
            bucket = self.leases[second] = []
            heapq.heappush(self.seconds, second)
        bucket.append(lease_id)

    def due(self, through: int) -> tuple[list[tuple[int, RequestId]], list[tuple[int, LeaseId]]]:
        """Take every entry filed at or before second ``through``, oldest second first."""
        decisions: list[tuple[int, RequestId]] = []
        leases: list[tuple[int, LeaseId]] = []
        seconds = self.seconds
        while seconds and seconds[0] <= through:
            second = heapq.heappop(seconds)
            for request_id in self.decisions.pop(second, ()):
                decisions.append((second, request_id))
            for lease_id in self.leases.pop(second, ()):
                leases.append((second, lease_id))
        return decisions, leases

    def __len__(self) -> int:
        return sum(map(len, self.decisions.values())) + sum(map(len, self.leases.values()))
