"""The leader's reaper of abandoned reservations (CONTRACT.md, "Retention").

A cold lease is ``reserved`` from its admission until its creator reports the VM
created (``mark-created``). A creator that crashed in between never does: without this,
the lease would hold its capacity (and GPUs) forever. The leader releases it, as the
warm-pool reconciler releases warm VMs that never boot:

- Rules (DESIGN.md: the fold stays the only judge): the reaper never changes state. For
  a cold lease still reserved ``timeout_s`` after its admission it publishes a
  ``release`` command on the IN stream, request id ``abandon-<lease_id>`` (and that as
  ``in:…`` ``Nats-Msg-Id``), so two leaders publish one command, and the fold, which
  still sees the lease reserved or not, decides.
- The admission time is the stream time of the lease's final ``admitted`` decision
  (``DecisionRecord.final_at``); a decision already evicted by ``--decision-retention``
  is older than that retention, and its lease counts as abandoned too.
- Which leases to look at comes from the state's ``reserved_cold`` index (reserved
  cold leases only, never a scan of every lease); each is a key of a work queue, looked
  at again when it comes due, and all of them every ``interval_s`` (a resync).
- Time here is the wall clock: this is liveness, not safety; what it decides enters the
  log as a command like any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
import structlog
from nats.js import JetStreamContext

from reconciler.core.model import LeaseId, RequestId
from reconciler.core.state import is_reserved_cold
from reconciler.replica.caches import Caches
from reconciler.work.queue import WorkQueue, run_with_resync

__all__ = [
    "DEFAULT_JOURNAL_RETENTION_S",
    "DEFAULT_RESERVATION_TIMEOUT_S",
    "ReservationReaper",
    "abandon_request_id",
]

logger = structlog.get_logger(__name__)

#: ``--journal-retention``'s default: 90 days of stream time
DEFAULT_JOURNAL_RETENTION_S = 90 * 86_400
#: ``--reservation-timeout``'s default
DEFAULT_RESERVATION_TIMEOUT_S = 900.0


def abandon_request_id(lease_id: str) -> RequestId:
    return RequestId(f"abandon-{lease_id}")


class ReservationReaper:
    """Publishes ``release`` for cold leases reserved longer than ``timeout_s``, while
    leading."""

    def __init__(
        self,
        *,
        caches: Caches,
        js: JetStreamContext,
        prefix: str,
        timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.caches = caches
        self.js = js
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._wall = wall
        self.queue: WorkQueue[str] = WorkQueue(
            name="reservations", clock=clock, backoff_base=0.5, backoff_cap=60.0
        )
        self.published = 0

    async def run(self) -> None:
        await run_with_resync(
            self.queue,
            self.reap,
            keys=lambda: sorted(self.caches.state.reserved_cold),
            every_s=self.interval_s,
        )

    async def reap(self, key: str) -> None:
        """One look at one lease: release it if it was abandoned, else look again when
        it would be."""
        state = self.caches.state
        lease = state.leases.get(LeaseId(key))
        if lease is None or not is_reserved_cold(lease):
            return  # created, released or evicted meanwhile
        request_id = abandon_request_id(lease.lease_id)
        if request_id in state.decisions:
            return  # released already (or refused): the fold had its say
        record = state.decisions.get(lease.request_id) if lease.request_id else None
        admitted_at = record.final_at if record is not None else None
        now = self._wall()
        if admitted_at is not None and now - admitted_at < self.timeout_s:
            self.queue.add_after(key, admitted_at + self.timeout_s - now)
            return
        payload = {"v": 1, "request_id": request_id, "instance": lease.instance}
        await self.js.publish(
            f"{self.prefix}.in.cmd.release",
            orjson.dumps(payload),
            headers={"Nats-Msg-Id": f"in:{request_id}"},
        )
        self.published += 1
        logger.warning(
            "reservation.abandoned",
            lease_id=lease.lease_id,
            instance=lease.instance,
            host=lease.host,
            pool=lease.pool,
            waited_s=round(now - admitted_at) if admitted_at is not None else None,
        )
