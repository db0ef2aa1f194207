"""The leader's status reconciler: ``out.status.host.<host>`` and ``out.status.pool.<pool>``.

Rules:

- Keys are ``("host", name)`` and ``("pool", name)`` on one keyed work queue. A committed
  batch marks the hosts and pools it touched; each is published ``debounce_s`` after its
  first change (changes meanwhile coalesce into that one publish), so a busy host costs
  at most one status per ``debounce_s``.
- Every ``progress_interval_s`` every known host and pool is published again, so that a
  watcher sees ``as_of_seq`` advance even when nothing about them changed. The round is
  paced over the interval (:func:`~reconciler.work.queue.run_with_resync`) and capped at
  :data:`PROGRESS_RATE` keys a second, and a key published less than an interval ago (it
  changed lately) is skipped by it: with 10,000 hosts a full round takes 50 s in slices
  of 64 keys, never a burst on the event loop that decides, and costs the bus 200 small
  messages a second (issue 15). Changed hosts are still published ``debounce_s`` after
  their change. The host keys come from the state's sorted host list (no sort per round).
- Payloads come from :mod:`reconciler.core.status` over the committed state; a key the
  state no longer knows publishes nothing. Status is informational and has no
  ``Nats-Msg-Id``: it is a plain publish, captured by the OUT stream. It is not flushed
  on its own: it waits in the connection's buffer (at most :data:`LAZY_FLUSH_S`) and
  leaves with the next decisions and acks, in one socket write. With 10,000 hosts at a
  thousand commands a second almost every command changes a host of its own, so there
  are about as many statuses as decisions, and a write (and a wake-up of nats-server)
  each cost more than the rest of the status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import orjson
import structlog
from nats.aio.client import Client

from reconciler.bus.wire import LazyFlush, Wire, supported
from reconciler.core.messages import Subjects
from reconciler.core.model import HostName, PoolName
from reconciler.core.status import host_status, pool_status
from reconciler.replica.pipeline import Commit, Pipeline
from reconciler.work.queue import WorkQueue, run_with_resync

__all__ = ["PROGRESS_RATE", "StatusKey", "StatusReporter"]

logger = structlog.get_logger(__name__)

StatusKey = tuple[Literal["host", "pool"], str]

#: at most this many unchanged hosts and pools a second are published by a progress round
PROGRESS_RATE = 200.0
#: a status waits at most this long in the connection's buffer for other messages to
#: leave with (:class:`~reconciler.bus.wire.LazyFlush`)
LAZY_FLUSH_S = 0.02


class StatusReporter:
    """Publishes host and pool status for one leadership term."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        nc: Client,
        prefix: str,
        debounce_s: float = 1.0,
        progress_interval_s: float = 10.0,
        workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.nc = nc
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.debounce_s = debounce_s
        self.progress_interval_s = progress_interval_s
        self.workers = workers
        self.queue: WorkQueue[StatusKey] = WorkQueue(name="status", clock=clock)
        self.published = 0
        self._clock = clock
        #: key -> when it was last published; keys a resync round may skip
        self._fresh: dict[StatusKey, float] = {}
        #: keys queued by a resync round (not by a change)
        self._resynced: set[StatusKey] = set()
        self._lazy = LazyFlush(nc, within_s=LAZY_FLUSH_S) if supported(nc) else None

    def notify(self, commit: Commit) -> None:
        """Commit listener: debounce a status for every host and pool the batch touched."""
        resynced = self._resynced
        for host in commit.fx.hosts:
            key: StatusKey = ("host", host)
            resynced.discard(key)  # a change: its run publishes, fresh or not
            self.queue.add_after(key, self.debounce_s)
        for pool in commit.fx.pools:
            key = ("pool", pool)
            resynced.discard(key)
            self.queue.add_after(key, self.debounce_s)

    async def run(self) -> None:
        """Publish until cancelled."""
        await run_with_resync(
            self.queue,
            self._publish,
            keys=self._everything,
            every_s=self.progress_interval_s,
            workers=self.workers,
            max_rate=PROGRESS_RATE,
        )

    def _everything(self) -> list[StatusKey]:
        state = self.pipeline.state
        stale = self._clock() - self.progress_interval_s
        fresh = self._fresh
        keys: list[StatusKey] = [("host", h) for h in state.host_order]
        keys += [("pool", p) for p in sorted(state.pools)]
        due = [k for k in keys if fresh.get(k, stale) <= stale]
        self._resynced.update(due)
        return due

    async def _publish(self, key: StatusKey) -> None:
        kind, name = key
        if key in self._resynced:
            self._resynced.discard(key)
            last = self._fresh.get(key)
            if last is not None and last > self._clock() - self.progress_interval_s:
                return  # published since the round began (it changed): fresh enough
        state, as_of = self.pipeline.state, self.pipeline.committed_seq
        if kind == "host":
            payload = host_status(state, HostName(name), as_of_seq=as_of)
        else:
            payload = pool_status(state, PoolName(name), as_of_seq=as_of)
        if payload is None:
            return
        subject = self.subjects.status(kind, name)
        if self._lazy is None:
            await self.nc.publish(subject, orjson.dumps(payload))
        else:  # with the next decisions' socket write, or within LAZY_FLUSH_S
            wire = Wire(self.nc)
            wire.add(subject, orjson.dumps(payload), "", None)
            await wire.send(self.nc, flush=False)
            self._lazy.request()
        self._fresh[key] = self._clock()
        self.published += 1
