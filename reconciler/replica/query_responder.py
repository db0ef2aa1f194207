"""Queries over core NATS request-reply (docs/interface.md, "Queries").

Rules:

- Every replica subscribes to ``<prefix>.query.*`` in the queue group
  ``<prefix>-query``, so each request is answered by exactly one replica.
- The reply is ``{"ok": true, "result": …}`` or ``{"ok": false, "error": {code,
  message}}`` with the contract's codes (``cache-not-ready``, ``stale-runtime-inputs``,
  ``not-found``, ``invalid``) and ``internal`` (an addition) for a failure of ours.
- Until the replica's pipeline is synced every query but ``health`` answers
  ``cache-not-ready``. Answers are read from the replica's folded state; ``lease`` adds
  the lease's journal from the store.
- A request that is not a JSON object, or names no known query, is ``invalid``; a request
  without a reply subject is dropped. A query never changes anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reconciler.core.messages import (
    CACHE_NOT_READY,
    INTERNAL,
    INVALID,
    Subjects,
    error_reply,
    ok_reply,
)
from reconciler.core.queries import QUERIES, QueryError
from reconciler.replica.pipeline import Pipeline

__all__ = ["MAX_REQUEST_BYTES", "QueryResponder"]

logger = structlog.get_logger(__name__)

MAX_REQUEST_BYTES = 65_536

Health = Callable[[], Awaitable[dict[str, Any]]]


class QueryResponder:
    """Answers the contract's queries for one replica."""

    def __init__(self, *, nc: Client, pipeline: Pipeline, prefix: str, health: Health) -> None:
        self.nc = nc
        self.pipeline = pipeline
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.health = health
        self.answered = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            self.subjects.queries, queue=self.subjects.query_group, cb=self._on_request
        )

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except Exception as exc:  # a dead connection: nothing to undo
                    logger.debug("queries.unsubscribe_failed", error=repr(exc))

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        name = self.subjects.parse_query(msg.subject) or msg.subject
        try:
            reply = await self.answer(name, msg.data)
        except Exception as exc:  # never let one request take the subscription down
            logger.exception("query.failed", query=name)
            reply = error_reply(INTERNAL, f"{type(exc).__name__}: {exc}")
        try:
            await msg.respond(reply)
            self.answered += 1
        except Exception as exc:
            logger.debug("query.reply_failed", query=name, error=repr(exc))

    async def answer(self, name: str, data: bytes) -> bytes:
        """The reply bytes for query ``name`` with request body ``data``."""
        if len(data) > MAX_REQUEST_BYTES:
            return error_reply(INVALID, f"request of {len(data)} bytes is too large")
        try:
            request = orjson.loads(data) if data.strip() else {}
        except orjson.JSONDecodeError as exc:
            return error_reply(INVALID, f"request is not JSON: {exc}")
        if not isinstance(request, dict):
            return error_reply(INVALID, "request must be a JSON object")
        if name == "health":
            return ok_reply(await self.health())
        query = QUERIES.get(name)
        if query is None:
            known = ", ".join(sorted([*QUERIES, "health"]))
            return error_reply(INVALID, f"unknown query {name!r}; known: {known}")
        if not self.pipeline.synced.is_set():
            return error_reply(
                CACHE_NOT_READY,
                f"replica is catching up (applied {self.pipeline.committed_seq} of "
                f"{self.pipeline.head_at_start})",
            )
        try:
            result = query(self.pipeline.state, request)
        except QueryError as exc:
            return error_reply(exc.code, exc.message)
        if name == "lease":
            result["history"] = await self.pipeline.store.lease_history(str(result["lease_id"]))
        return ok_reply(result)
