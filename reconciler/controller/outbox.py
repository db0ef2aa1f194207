"""The leader's outbox publisher: committed outputs onto the OUT stream, exactly once.

Rules (DESIGN.md, principle 3):

- Only the leader publishes. On election it first drains every unpublished batch its
  store holds (the previous leader may have died between commit and publish); the leader
  is *ready* only after that.
- Then it publishes each committed batch's outputs straight from memory, as the caches
  announce the commit: the outbox is not read back. Outputs are published in commit
  order with their deterministic ``Nats-Msg-Id``s (the stream drops a duplicate inside
  its window), and count as published only once the stream confirmed them. A failure
  keeps them queued and retries with a backoff that doubles up to ``max_backoff_s``; if
  the queue outgrows ``max_queued`` batches it is dropped and the store, which has
  everything, is drained instead.
- What is published is recorded in the leader's :class:`Leadership` at once (the leader
  key tells followers) and in the store at most every ``record_every_s`` and when idle
  (:meth:`~reconciler.store.sqlite.Store.mark_published_through`, which also deletes
  the batches' outbox rows). A crash in between only means publishing those batches
  again after the next election, inside the duplicate window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import structlog
from nats.aio.client import Client

from reconciler.bus.publisher import OutputPublisher, PublishError
from reconciler.controller.caches import Commit
from reconciler.controller.leader import Leadership
from reconciler.core.state import Output
from reconciler.store.sqlite import Store

__all__ = ["OutboxPublisher"]

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
    ) -> None:
        self.store = store
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
        self._overflowed = False
        self._committed = 0
        self._wake = anyio.Event()
        self._draining = anyio.Lock()
        self._recorded = 0
        self._recorded_at = clock()

    def notify(self, commit: Commit) -> None:
        """Commit listener: queue the batch's outputs and wake the publisher."""
        self._committed = max(self._committed, commit.applied_seq)
        if commit.fx.outputs:
            if len(self._queue) >= self.max_queued:
                self._queue.clear()  # the store has them all: drain it instead
                self._overflowed = True
            if not self._overflowed:
                self._queue.append((commit.applied_seq, list(commit.fx.outputs)))
        self._wake.set()

    async def run(self, leadership: Leadership, on_ready: anyio.Event | None = None) -> None:
        """Drain the store, report ready, then publish batches as they commit; until
        cancelled."""
        await self._retrying(lambda: self.drain(leadership))
        if on_ready is not None:
            on_ready.set()
        while True:
            with anyio.move_on_after(self.record_every_s):
                await self._wake.wait()
            self._wake = anyio.Event()
            if self._overflowed:
                self._overflowed = False
                await self._retrying(lambda: self.drain(leadership))
            else:
                await self._retrying(lambda: self._publish_queued(leadership))
            await self._record(leadership, force=False)

    async def flush(self, leadership: Leadership) -> None:
        """Publish what is queued, record it, and drain the store (a graceful stop)."""
        await self._publish_queued(leadership)
        await self._record(leadership, force=True)
        await self.drain(leadership)

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

    async def _publish_queued(self, leadership: Leadership) -> None:
        async with self._draining:
            while self._queue:
                batches = list(self._queue)
                outputs = [out for seq, outs in batches if seq > leadership.published_seq
                           for out in outs]  # fmt: skip
                await self._out.publish(outputs, timeout_s=self.publish_timeout_s)
                for _ in batches:
                    self._queue.popleft()
                self.published += len(outputs)
                leadership.published_seq = max(leadership.published_seq, batches[-1][0])
            # batches without outputs are published by definition
            leadership.published_seq = max(leadership.published_seq, self._committed)

    async def _record(self, leadership: Leadership, *, force: bool) -> None:
        due = self._clock() - self._recorded_at >= self.record_every_s
        if leadership.published_seq > self._recorded and (force or due):
            await self.store.mark_published_through(leadership.published_seq)
            self._recorded = leadership.published_seq
            self._recorded_at = self._clock()

    async def drain(self, leadership: Leadership) -> int:
        """Publish every unpublished batch of the store, and record it; how many outputs
        were published. Raises :class:`PublishError`.

        Drains never overlap with each other or with publishing from memory (a final
        drain on shutdown waits for the running one), so an output is not sent twice by
        this publisher.
        """
        async with self._draining:
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
