"""The leader's reaper of abandoned reservations (docs/long-lived.md).

A cold lease is ``reserved`` from its admission until its creator reports the VM
created (``mark-created``). A creator that crashed in between never does: without this,
the lease would hold its capacity (and GPUs) forever. The leader releases it, as the
warm-pool reconciler releases warm VMs that never boot:

- Rules (docs/architecture.md: the fold stays the only judge): the reaper never changes state. For
  a cold lease still reserved ``timeout_s`` after its admission it publishes a
  ``release`` command on the IN stream, request id ``abandon-<lease_id>`` (and that as
  ``in:…`` ``Nats-Msg-Id``), published as every input is (:func:`reconciler.bus.sending.publish`),
  so two leaders publish one command, and the fold, which still sees the lease reserved
  or not, decides.
- The admission time is :meth:`~reconciler.core.state.State.admitted_at`, the stream
  time of the lease's final ``admitted`` decision; a decision already evicted by
  ``--decision-retention`` is older than that retention, and its lease counts as
  abandoned too.
- One scan of the leases when leadership starts (no index: it would cost every live
  lease memory for the few that wait): the reserved cold ones are filed in admission
  order, then each lease a commit leaves reserved and cold (O(batch)), in a FIFO
  (admission order is due order); a timer hands the oldest to a work queue (retries
  with backoff) when it comes due, where it is checked against the state again, and
  drops those no longer reserved.
- Time here is the wall clock: this is liveness, not safety; what it decides enters the
  log as a command like any other.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import orjson
import structlog
from nats.js import JetStreamContext

from reconciler.bus.sending import publish
from reconciler.core.messages import Origin, Subjects, command_msg_id
from reconciler.core.model import LeaseId, RequestId
from reconciler.core.state import is_reserved_cold
from reconciler.replica.pipeline import Commit, Pipeline
from reconciler.work.queue import WorkQueue, run_workers

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
        pipeline: Pipeline,
        js: JetStreamContext,
        prefix: str,
        timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.pipeline = pipeline
        self.js = js
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._wall = wall
        self.queue: WorkQueue[str] = WorkQueue(
            name="reservations", clock=clock, backoff_base=0.5, backoff_cap=60.0
        )
        #: reserved cold leases in the order they were filed, which is the order of their
        #: admissions, so of when they come due: a lease id each (8 bytes), not a heap
        #: entry (~90 bytes: 100,000 reserved leases held 9 MiB). A hint, checked
        #: against the state when it comes due.
        self._filed: deque[LeaseId] = deque()
        self._wakeup = anyio.Event()
        self.published = 0

    def _due_at(self, lease_id: LeaseId) -> float | None:
        """When a lease still reserved and cold comes due (0: its admission was evicted
        by the decision retention, so it is older than that); None when it is not."""
        state = self.pipeline.state
        lease = state.leases.get(lease_id)
        if lease is None or not is_reserved_cold(lease):
            return None
        admitted_at = state.admitted_at(lease)
        return 0.0 if admitted_at is None else admitted_at + self.timeout_s

    def _file(self, lease_id: LeaseId) -> None:
        if not self._filed:
            self._wakeup.set()
        self._filed.append(lease_id)

    def notify(self, commit: Commit) -> None:
        """Commit listener: file every lease the batch left reserved and cold (O(batch))."""
        leases = self.pipeline.state.leases
        for lease_id in commit.fx.leases:
            lease = leases.get(lease_id)
            if lease is not None and is_reserved_cold(lease):
                self._file(lease_id)

    async def run(self) -> None:
        """File the reserved cold leases there are (once, at the start of leadership),
        then hand each to the work queue when it comes due."""
        reserved = [le for le in self.pipeline.state.leases.values() if is_reserved_cold(le)]
        for lease in sorted(reserved, key=lambda le: (le.admitted_seq, le.lease_id)):
            self._file(lease.lease_id)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._timer, name="reservations-timer")
                await run_workers(self.queue, self.reap)
                tg.cancel_scope.cancel()
        finally:
            self.queue.shutdown()

    async def _timer(self) -> None:
        while True:
            now = self._wall()
            wait = self.interval_s
            while self._filed:
                due = self._due_at(self._filed[0])
                if due is not None and due > now:
                    wait = due - now
                    break
                lease_id = self._filed.popleft()
                if due is not None:
                    self.queue.add(lease_id)
            self._wakeup = anyio.Event()
            with anyio.move_on_after(min(max(wait, 0.0), self.interval_s)):
                await self._wakeup.wait()

    async def reap(self, key: str) -> None:
        """Release one lease if it was abandoned (the state may have moved on)."""
        state = self.pipeline.state
        lease = state.leases.get(LeaseId(key))
        if lease is None or not is_reserved_cold(lease):
            return  # created, released or evicted meanwhile
        request_id = abandon_request_id(lease.lease_id)
        if request_id in state.decisions:
            return  # released already (or refused): the fold had its say
        admitted_at = state.admitted_at(lease)
        now = self._wall()
        if admitted_at is not None and now - admitted_at < self.timeout_s:
            self._file(lease.lease_id)  # not yet (a clock step): file it again
            return
        payload = {"v": 1, "request_id": request_id, "instance": lease.instance}
        await publish(
            self.js,
            self.subjects.command("release"),
            orjson.dumps(payload),
            msg_id=command_msg_id(Origin.LEADER, request_id),
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
