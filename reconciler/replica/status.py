"""The leader's status reconciler: ``out.status.host.<host>`` and ``out.status.pool.<pool>``.

Rules:

- Keys are ``("host", name)`` and ``("pool", name)`` on one keyed work queue. A committed
  batch marks the hosts and pools it touched; each is published ``debounce_s`` after its
  first change (changes meanwhile coalesce into that one publish), so a busy host costs
  at most one status per ``debounce_s``.
- Every ``progress_interval_s`` every known host and pool is published again, so that a
  watcher sees ``as_of_seq`` advance even when nothing about them changed.
- Payloads come from :mod:`reconciler.core.status` over the committed state; a key the
  state no longer knows publishes nothing. Status is informational and has no
  ``Nats-Msg-Id``: it is a plain publish, captured by the OUT stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import orjson
import structlog
from nats.aio.client import Client

from reconciler.core.model import HostName, PoolName
from reconciler.core.status import host_status, pool_status
from reconciler.replica.caches import Caches, Commit
from reconciler.work.queue import WorkQueue, run_with_resync

__all__ = ["StatusKey", "StatusReporter"]

logger = structlog.get_logger(__name__)

StatusKey = tuple[Literal["host", "pool"], str]


class StatusReporter:
    """Publishes host and pool status for one leadership term."""

    def __init__(
        self,
        *,
        caches: Caches,
        nc: Client,
        prefix: str,
        debounce_s: float = 1.0,
        progress_interval_s: float = 10.0,
        workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.caches = caches
        self.nc = nc
        self.prefix = prefix
        self.debounce_s = debounce_s
        self.progress_interval_s = progress_interval_s
        self.workers = workers
        self.queue: WorkQueue[StatusKey] = WorkQueue(name="status", clock=clock)
        self.published = 0

    def notify(self, commit: Commit) -> None:
        """Commit listener: debounce a status for every host and pool the batch touched."""
        for host in commit.fx.hosts:
            self.queue.add_after(("host", host), self.debounce_s)
        for pool in commit.fx.pools:
            self.queue.add_after(("pool", pool), self.debounce_s)

    async def run(self) -> None:
        """Publish until cancelled."""
        await run_with_resync(
            self.queue,
            self._publish,
            keys=self._everything,
            every_s=self.progress_interval_s,
            workers=self.workers,
        )

    def _everything(self) -> list[StatusKey]:
        state = self.caches.state
        hosts: list[StatusKey] = [("host", h) for h in sorted(state.hosts)]
        return hosts + [("pool", p) for p in sorted(state.pools)]

    async def _publish(self, key: StatusKey) -> None:
        kind, name = key
        state, as_of = self.caches.state, self.caches.committed_seq
        if kind == "host":
            payload = host_status(state, HostName(name), as_of_seq=as_of)
        else:
            payload = pool_status(state, PoolName(name), as_of_seq=as_of)
        if payload is None:
            return
        await self.nc.publish(f"{self.prefix}.out.status.{kind}.{name}", orjson.dumps(payload))
        self.published += 1
