"""The leader's clock for the admission queue (docs/architecture.md, "The admission
queue").

A queued request's wait ends on message time: the fold ends every wait whose deadline
is at or before an input's JetStream timestamp (:mod:`reconciler.core.fold.queue`). On
an idle bus no input comes, so the leader publishes one:

- Rules (the fold stays the only judge): the timer never changes state. When the wall
  clock passes a waiting request's deadline (plus :data:`SLACK_S`), it publishes
  ``cmd.queue-timeout`` naming it, request id :func:`timeout_request_id` (and that as
  ``in:…`` ``Nats-Msg-Id``), so two leaders publish one command; the fold, which reads
  the command's timestamp, decides. A command whose timestamp fell short of the
  deadline (the server's clock behind the leader's) leaves the request waiting: the
  timer files it again and publishes a new attempt a second later.
- The deadlines are filed at the start of leadership (one pass over the waiting
  requests) and from each commit's touched queue entries (O(batch)), in a min-heap of
  hints checked against the state when they come due.
- Time here is the wall clock: liveness, not safety; what it decides enters the log as
  a command like any other.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable

import anyio
import orjson
import structlog
from nats.js import JetStreamContext

from reconciler.bus.sending import publish
from reconciler.core.messages import Origin, Subjects, command_msg_id, is_token
from reconciler.core.model import RequestId
from reconciler.replica.pipeline import Commit, Pipeline

__all__ = ["SLACK_S", "QueueTimer", "timeout_request_id"]

logger = structlog.get_logger(__name__)

#: how long after a deadline the command is published (the server stamps it later
#: still, so its timestamp is past the deadline)
SLACK_S = 0.02
#: how long after an attempt the request, if it still waits, gets another
RETRY_S = 1.0


def timeout_request_id(request_id: str, attempt: int = 1) -> RequestId:
    """``queue-timeout-<request id>`` (``-<attempt>`` after the first); a digest of the
    request id when that would not be one subject token (at most 128 characters)."""
    suffix = "" if attempt == 1 else f"-{attempt}"
    candidate = f"queue-timeout-{request_id}{suffix}"
    if is_token(candidate):
        return RequestId(candidate)
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:40]
    return RequestId(f"queue-timeout-{digest}{suffix}")


class QueueTimer:
    """Publishes ``queue-timeout`` for waiting requests whose deadline passed, while
    leading."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        js: JetStreamContext,
        prefix: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.pipeline = pipeline
        self.js = js
        self.subjects = Subjects(prefix)
        self._wall = wall
        #: (when to act, epoch ms; request id; attempt)
        self._due: list[tuple[int, RequestId, int]] = []
        self._wakeup = anyio.Event()
        self.published = 0

    def _file(self, at_ms: int, request_id: RequestId, attempt: int) -> None:
        if not self._due or at_ms < self._due[0][0]:
            self._wakeup.set()
        heapq.heappush(self._due, (at_ms, request_id, attempt))

    def notify(self, commit: Commit) -> None:
        """Commit listener: file the deadline of every request the batch queued."""
        waiting = self.pipeline.state.waiting
        for request_id in commit.fx.waiting:
            entry = waiting.get(request_id)
            if entry is not None:
                self._file(entry.deadline_ms, request_id, 1)

    async def run(self) -> None:
        for entry in self.pipeline.state.waiting.values():
            self._file(entry.deadline_ms, entry.request_id, 1)
        while True:
            now_ms = int(self._wall() * 1000)
            wait_s = 1.0
            while self._due:
                at_ms, request_id, attempt = self._due[0]
                if at_ms + SLACK_S * 1000 > now_ms:
                    wait_s = (at_ms - now_ms) / 1000 + SLACK_S
                    break
                heapq.heappop(self._due)
                await self._expire(request_id, attempt, now_ms)
            self._wakeup = anyio.Event()
            with anyio.move_on_after(min(max(wait_s, 0.001), 1.0)):
                await self._wakeup.wait()

    async def _expire(self, request_id: RequestId, attempt: int, now_ms: int) -> None:
        entry = self.pipeline.state.waiting.get(request_id)
        if entry is None:
            return  # admitted, cancelled or timed out meanwhile
        if entry.deadline_ms > now_ms:  # filed again with a later deadline: not yet
            self._file(entry.deadline_ms, request_id, attempt)
            return
        command_id = timeout_request_id(request_id, attempt)
        payload = {"v": 1, "request_id": command_id, "waiting": request_id}
        try:
            await publish(
                self.js,
                self.subjects.command("queue-timeout"),
                orjson.dumps(payload),
                msg_id=command_msg_id(Origin.LEADER, command_id),
            )
        except Exception as exc:  # the bus is away: try again shortly
            logger.warning("queue.timeout_publish_failed", request_id=request_id, error=repr(exc))
            self._file(now_ms + int(RETRY_S * 1000), request_id, attempt)
            return
        self.published += 1
        logger.info("queue.timeout", request_id=request_id, pool=entry.pool, attempt=attempt)
        # still waiting a second later (the command stamped before the deadline): again
        self._file(now_ms + int(RETRY_S * 1000), request_id, attempt + 1)
