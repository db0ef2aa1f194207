"""Queries over core NATS request-reply (docs/interface.md, "Queries").

Rules:

- Every replica subscribes to ``<prefix>.query.*`` in the queue group
  ``<prefix>-query``, so each request is answered by exactly one replica.
- The reply is ``{"ok": true, "result": …}`` or ``{"ok": false, "error": {code,
  message}}`` with the contract's codes (``cache-not-ready``, ``stale-runtime-inputs``,
  ``not-found``, ``invalid``) and ``internal`` (an addition) for a failure of ours.
- Until the replica's pipeline is synced every query but ``health`` answers
  ``cache-not-ready``. Answers are read from the replica's folded state; ``lease`` adds
  the lease's journal from the store, and with ``"decisions": true`` the latest
  decision of each request that names the lease (from the store, summarised as the
  ``decisions`` query summarises them); ``fleet`` adds each pool's warm claims (the
  warm hit ratio), which the store counts.
- A request that is not a JSON object, or names no known query, is ``invalid``; a request
  without a reply subject is dropped. A query never changes anything.
- ``config-check`` (what ``apply --dry-run`` and ``diff`` ask) is an ``apply-config``
  body: it is decoded as that command would be (its items against their own schemas,
  :meth:`~reconciler.bus.decoder.Decoder.decode`) and checked by the fold's own checks,
  without applying anything. It may be as large as a command (1 MiB); every other
  request is at most :data:`MAX_REQUEST_BYTES`.
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

from reconciler.bus.decoder import BadInput
from reconciler.core.inputs import ApplyConfig
from reconciler.core.messages import (
    CACHE_NOT_READY,
    INTERNAL,
    INVALID,
    MAX_PAYLOAD_BYTES,
    Subjects,
    error_reply,
    ok_reply,
)
from reconciler.core.queries import (
    ADAPTER_QUERIES,
    QUERIES,
    QueryError,
    config_check,
    decision_summary,
)
from reconciler.core.status import with_warm_claims
from reconciler.replica.pipeline import Pipeline

__all__ = ["CONFIG_CHECK", "MAX_REQUEST_BYTES", "QueryResponder"]

logger = structlog.get_logger(__name__)

MAX_REQUEST_BYTES = 65_536
CONFIG_CHECK = ADAPTER_QUERIES[1]

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
        """The reply bytes for query ``name`` with request body ``data``: never more than
        a message may carry (the server would refuse the reply, and the asker would wait
        out its timeout without learning why)."""
        reply = await self._answer(name, data)
        if len(reply) > MAX_PAYLOAD_BYTES:
            return error_reply(
                INVALID,
                f"the answer is {len(reply)} bytes, over the {MAX_PAYLOAD_BYTES} a message "
                "may carry: ask for less (a smaller 'limit', one pool, tenant or host)",
            )
        return reply

    async def _answer(self, name: str, data: bytes) -> bytes:
        limit = MAX_PAYLOAD_BYTES if name == CONFIG_CHECK else MAX_REQUEST_BYTES
        if len(data) > limit:
            return error_reply(INVALID, f"request of {len(data)} bytes is over {limit}")
        try:
            request = orjson.loads(data) if data.strip() else {}
        except orjson.JSONDecodeError as exc:
            return error_reply(INVALID, f"request is not JSON: {exc}")
        if not isinstance(request, dict):
            return error_reply(INVALID, "request must be a JSON object")
        if name == "health":
            return ok_reply(await self.health())
        query = QUERIES.get(name)
        if query is None and name != CONFIG_CHECK:
            known = ", ".join(sorted([*QUERIES, *ADAPTER_QUERIES]))
            return error_reply(INVALID, f"unknown query {name!r}; known: {known}")
        if not self.pipeline.synced.is_set():
            return error_reply(
                CACHE_NOT_READY,
                f"replica is catching up (applied {self.pipeline.committed_seq} of "
                f"{self.pipeline.head_at_start})",
            )
        if query is None:
            return self._config_check(request)
        try:
            result = query(self.pipeline.state, request)
        except QueryError as exc:
            return error_reply(exc.code, exc.message)
        if name == "fleet":
            claims = await self.pipeline.store.warm_claims()
            result["pools"] = [
                with_warm_claims(row, claims.get(str(row["pool"]), (0, 0)))
                for row in result["pools"]
            ]
        if name == "lease":
            lease_id = str(result["lease_id"])
            result["history"] = await self.pipeline.store.lease_history(lease_id)
            if request.get("decisions") is True:
                records = await self.pipeline.store.decisions_for(lease_id=lease_id)
                summaries = [decision_summary(r.payload) for r in records]
                summaries.sort(key=lambda d: (d["input_seq"] or 0, d["request_id"]))
                result["decisions"] = summaries
        return ok_reply(result)

    def _config_check(self, request: dict[str, Any]) -> bytes:
        """Decode ``request`` as an ``apply-config`` body and answer what it would do."""
        body = {
            "items": request.get("items", []),
            "delete": request.get("delete", []),
            "v": 1,
            "request_id": "config-check",
        }
        decoded = self.pipeline.decoder.decode(
            self.subjects.command("apply-config"), orjson.dumps(body), prefix=self.prefix
        )
        if isinstance(decoded, BadInput):
            return error_reply(INVALID, decoded.error)
        assert isinstance(decoded.input, ApplyConfig)
        return ok_reply(config_check(self.pipeline.state, decoded.input))
