"""The leader's outbox publisher: committed outputs onto the OUT stream, exactly once.

Rules (DESIGN.md, principle 3):

- Only the leader publishes. On election it first drains every unsent row its store
  holds (the previous leader may have died between commit and publish); the leader is
  *ready* only after that. Then it publishes whenever a committed batch wrote outputs,
  and at least every ``idle_s`` seconds.
- Rows are published in outbox order with their deterministic ``Nats-Msg-Id``s (the
  stream drops a duplicate inside its window), and marked published only after the
  stream confirmed them. A failure leaves them unsent; they are tried again with a
  backoff that doubles up to ``max_backoff_s``.
- When a drain leaves nothing unsent, every output of every input up to the position
  read with the rows is on the bus: the store records it
  (:meth:`~reconciler.store.sqlite.Store.mark_published_through`), and so does the
  leader key, from which followers learn it.
"""

from __future__ import annotations

import anyio
import structlog
from nats.js import JetStreamContext

from reconciler.bus.publisher import PublishError, publish_outputs
from reconciler.controller.caches import Commit
from reconciler.controller.leader import Leadership
from reconciler.store.sqlite import Store

__all__ = ["OutboxPublisher"]

logger = structlog.get_logger(__name__)


class OutboxPublisher:
    """Publishes a store's outbox while its replica leads."""

    def __init__(
        self,
        *,
        store: Store,
        js: JetStreamContext,
        prefix: str,
        batches_per_round: int = 50,
        publish_timeout_s: float = 10.0,
        idle_s: float = 1.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.store = store
        self.js = js
        self.prefix = prefix
        self.batches_per_round = batches_per_round
        self.publish_timeout_s = publish_timeout_s
        self.idle_s = idle_s
        self.max_backoff_s = max_backoff_s
        self.published = 0
        self._wake = anyio.Event()
        self._draining = anyio.Lock()

    def notify(self, commit: Commit) -> None:
        """Commit listener: a batch with outputs wakes the publisher."""
        if commit.fx.outputs:
            self._wake.set()

    async def run(self, leadership: Leadership, on_ready: anyio.Event | None = None) -> None:
        """Drain, report ready, then publish as batches commit; until cancelled."""
        await self._drain_retrying(leadership)
        if on_ready is not None:
            on_ready.set()
        while True:
            with anyio.move_on_after(self.idle_s):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self._drain_retrying(leadership)

    async def _drain_retrying(self, leadership: Leadership) -> None:
        delay = 0.05
        while True:
            try:
                await self.drain(leadership)
                return
            except PublishError as exc:
                logger.warning("outbox.publish_failed", error=str(exc), retry_in_s=delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def drain(self, leadership: Leadership) -> int:
        """Publish every unsent row; how many were published. Raises :class:`PublishError`.

        Drains never overlap (a final drain on shutdown waits for the running one), so a
        row is not sent twice by this publisher.
        """
        async with self._draining:
            return await self._drain(leadership)

    async def _drain(self, leadership: Leadership) -> int:
        sent = 0
        while True:
            snap = await self.store.outbox_snapshot(self.batches_per_round)
            if snap.rows:
                await publish_outputs(
                    self.js, snap.rows, prefix=self.prefix, timeout_s=self.publish_timeout_s
                )
                sent += len(snap.rows)
                self.published += len(snap.rows)
            if snap.rows or snap.through_seq > leadership.published_seq:
                await self.store.mark_published_through(snap.through_seq)
                leadership.published_seq = max(leadership.published_seq, snap.through_seq)
            if snap.complete:
                return sent
