"""The leader's outbox publisher: committed outputs onto the OUT stream, exactly once.

Rules (docs/architecture.md, rule 3):

- Only the leader publishes. On election it first drains every unpublished batch its
  store holds (the previous leader may have died between commit and publish); the leader
  is *ready* only after that.
- Then it publishes each committed batch's outputs straight from memory, as the pipeline
  announce the commit: the outbox is not read back. Outputs are published in commit
  order with their deterministic ``Nats-Msg-Id``s (the stream drops a duplicate inside
  its window), and count as published only once the stream confirmed them, in commit
  order. A batch is sent without waiting for the confirmations of the batches before
  it (up to :data:`MAX_IN_FLIGHT` rounds), so a decision's latency does not include
  the stream's answers to earlier ones. A failure (an error answer, a confirmation
  later than ``publish_timeout_s``, a reconnect of the connection since it was sent)
  abandons every round in flight and sends them all again with a backoff that
  doubles up to ``max_backoff_s``; if the queue outgrows
  ``max_queued`` batches it is dropped and the store, which has everything, is
  drained instead.
- What is published is recorded in the leader's :class:`Leadership` at once (the leader
  key tells followers) and in the store at most every ``record_every_s`` and when idle
  (:meth:`~reconciler.store.sqlite.Store.mark_published_through`, which also deletes
  the batches' outbox rows). A crash in between only means publishing those batches
  again after the next election, inside the duplicate window.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import structlog
from nats.aio.client import Client

from reconciler.bus.publisher import OutputPublisher, PublishError, Round
from reconciler.core.messages import Output
from reconciler.replica.leader import Leadership
from reconciler.replica.pipeline import Commit
from reconciler.store.sqlite import Store

__all__ = ["MAX_IN_FLIGHT", "OutboxPublisher"]

#: rounds of publishes awaiting the stream's confirmations at once
MAX_IN_FLIGHT = 8

logger = structlog.get_logger(__name__)


class OutboxPublisher:
    """Publishes a store's outbox while its replica leads."""

    def __init__(
        self,
        *,
        store: Store,
        nc: Client,
        prefix: str,
        batches_per_round: int = 50,
        publish_timeout_s: float = 10.0,
        record_every_s: float = 0.5,
        max_queued: int = 1000,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_published: Callable[[list[Output]], None] | None = None,
    ) -> None:
        self.store = store
        #: told the outputs of every batch published from memory once confirmed (the
        #: decision latency, :class:`reconciler.replica.fleet_metrics.FleetWatch`)
        self._on_published = on_published
        self.prefix = prefix
        self._out = OutputPublisher(nc, prefix=prefix)
        self.batches_per_round = batches_per_round
        self.publish_timeout_s = publish_timeout_s
        self.record_every_s = record_every_s
        self.max_queued = max_queued
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self.published = 0
        #: committed batches not yet published: (applied_seq, outputs)
        self._queue: deque[tuple[int, list[Output]]] = deque()
        #: rounds sent and not yet settled, oldest first: (round, batches it covers);
        #: they cover the first ``_sent`` batches of the queue
        self._rounds: deque[tuple[Round, int]] = deque()
        self._sent = 0
        self._overflowed = False
        self._committed = 0
        self._wake = anyio.Event()
        # uncontended in the hot path: taken without a trip through the event loop
        self._draining = anyio.Lock(fast_acquire=True)
        self._recorded = 0
        self._recorded_at = clock()

    def notify(self, commit: Commit) -> None:
        """Commit listener: queue the batch's outputs and wake the publisher."""
        self._committed = max(self._committed, commit.applied_seq)
        if commit.fx.outputs:
            if len(self._queue) >= self.max_queued:
                self._overflowed = True  # the store has them all: drain it instead
            if not self._overflowed:
                self._queue.append((commit.applied_seq, list(commit.fx.outputs)))
        self._wake.set()

    async def run(self, leadership: Leadership, on_ready: anyio.Event | None = None) -> None:
        """Drain the store, report ready, then publish batches as they commit; until
        cancelled."""
        await self._retrying(lambda: self.drain(leadership))
        if on_ready is not None:
            on_ready.set()
        delay = 0.05
        while True:
            if not self._wake.is_set():
                with anyio.move_on_after(self._idle_s()):
                    await self._wake.wait()
            self._wake = anyio.Event()
            try:
                if self._overflowed:
                    await self.drain(leadership, overflowed=True)
                else:
                    await self._pump(leadership)
            except PublishError as exc:
                self._abandon()
                logger.warning("outbox.publish_failed", error=str(exc), retry_in_s=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                self._poke()
                continue
            delay = 0.05
            await self._record(leadership, force=False)

    async def flush(self, leadership: Leadership) -> None:
        """Publish what is queued, wait for its confirmations, record it, and drain the
        store (a graceful stop). Raises :class:`PublishError`."""
        while True:
            await self._pump(leadership)
            if not self._rounds:
                break
            with anyio.move_on_after(self._idle_s()):
                await self._wake.wait()
            self._wake = anyio.Event()
        await self._record(leadership, force=True)
        await self.drain(leadership)

    def _poke(self) -> None:
        self._wake.set()

    def _idle_s(self) -> float:
        """How long the loop may sleep: until the next record is due, or until the
        oldest round in flight is late."""
        wait = self.record_every_s
        if self._rounds:
            wait = min(wait, self._rounds[0][0].deadline - anyio.current_time())
        return max(wait, 0.0)

    async def _retrying(self, attempt: Callable[[], Awaitable[object]]) -> None:
        delay = 0.05
        while True:
            try:
                await attempt()
                return
            except PublishError as exc:
                logger.warning("outbox.publish_failed", error=str(exc), retry_in_s=delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def _pump(self, leadership: Leadership) -> None:
        """Settle the rounds confirmed since the last look, in commit order, then send
        every queued batch not sent yet as one more round, without waiting for it.

        Several rounds are in flight at once (up to :data:`MAX_IN_FLIGHT`): a decision
        goes out as soon as its batch commits, not after the confirmations of the
        batches before it. A round that failed or is late raises :class:`PublishError`;
        the caller abandons every round in flight and sends them all again (the stream
        drops what it already has by ``Nats-Msg-Id``).
        """
        async with self._draining:
            now = anyio.current_time()
            while self._rounds:
                round_, covered = self._rounds[0]
                problem = round_.problem(now) or self._out.lost(round_)
                if problem is not None:
                    raise PublishError(problem)
                if not round_.confirmed:
                    break
                self._rounds.popleft()
                self._out.forget(round_)
                last = 0
                for _ in range(covered):
                    last, outputs = self._queue.popleft()
                    if self._on_published is not None:
                        self._on_published(outputs)
                self._sent -= covered
                self.published += round_.count
                leadership.published_seq = max(leadership.published_seq, last)
            if self._sent < len(self._queue) and len(self._rounds) < MAX_IN_FLIGHT:
                batches = list(itertools.islice(self._queue, self._sent, None))
                outputs = [out for seq, outs in batches if seq > leadership.published_seq
                           for out in outs]  # fmt: skip
                round_ = await self._out.send(
                    outputs, timeout_s=self.publish_timeout_s, on_settled=self._poke
                )
                self._rounds.append((round_, len(batches)))
                self._sent += len(batches)
                if not outputs:
                    self._poke()  # nothing to wait for: settle it on the next look
            if not self._queue:
                # batches without outputs are published by definition
                leadership.published_seq = max(leadership.published_seq, self._committed)

    def _abandon(self) -> None:
        """Give up on every round in flight: their batches are sent again from the head."""
        for round_, _ in self._rounds:
            self._out.forget(round_)
        self._rounds.clear()
        self._sent = 0

    async def _record(self, leadership: Leadership, *, force: bool) -> None:
        due = self._clock() - self._recorded_at >= self.record_every_s
        if leadership.published_seq > self._recorded and (force or due):
            await self.store.mark_published_through(leadership.published_seq)
            self._recorded = leadership.published_seq
            self._recorded_at = self._clock()

    async def drain(self, leadership: Leadership, *, overflowed: bool = False) -> int:
        """Publish every unpublished batch of the store, and record it; how many outputs
        were published. Raises :class:`PublishError`. ``overflowed``: the memory queue
        grew too long and is dropped first.

        Drains never overlap with each other or with publishing from memory (a final
        drain on shutdown waits for the running one), so an output is not sent twice by
        this publisher.
        """
        async with self._draining:
            if overflowed:
                self._queue.clear()
                self._overflowed = False
            self._abandon()  # whatever is in flight, the drain sends again
            sent = 0
            while True:
                snap = await self.store.outbox_snapshot(self.batches_per_round)
                if snap.rows:
                    await self._out.publish(snap.rows, timeout_s=self.publish_timeout_s)
                    sent += len(snap.rows)
                    self.published += len(snap.rows)
                if snap.rows or snap.through_seq > self._recorded:
                    await self.store.mark_published_through(snap.through_seq)
                    self._recorded = max(self._recorded, snap.through_seq)
                leadership.published_seq = max(leadership.published_seq, snap.through_seq)
                if snap.complete:
                    # what the memory queue holds up to here is on the bus already
                    while self._queue and self._queue[0][0] <= snap.through_seq:
                        self._queue.popleft()
                    return sent
