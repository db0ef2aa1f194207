"""The provider's side of the bus: commands with their final decisions, and queries.

Rules:

- A command is published to ``<prefix>.in.cmd.<verb>`` with ``Nats-Msg-Id`` =
  ``garm:<request_id>``, after subscribing to its decision subject and after reading the
  decision already stored in the OUT stream (``$JS.API.STREAM.MSG.GET``): a retried call
  finds what an earlier, killed one was answered, and a re-sent command is deduplicated.
- A ``pending`` decision (a preemption waiting for its victims) is waited through; the
  whole wait is bounded by ``decision_timeout``. A missing final decision is an error,
  never a guess.
- Queries retry for a short while when no replica answers or caches are not synced yet.
- Payloads hold identities, never a secret of the bootstrap.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError

from reconciler.bus.streams import StreamNames
from reconciler.garm.protocol import ProviderError

__all__ = ["Admission"]

logger = structlog.get_logger(__name__)

_RETRYABLE_QUERY_ERRORS = ("cache-not-ready",)


class Admission:
    """Commands and queries of one provider call, over one NATS connection."""

    def __init__(
        self,
        nc: Client,
        *,
        prefix: str = "rc",
        decision_timeout_s: float = 600.0,
        query_timeout_s: float = 10.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.names = StreamNames.for_prefix(prefix)
        self.prefix = prefix
        self.decision_timeout_s = decision_timeout_s
        self.query_timeout_s = query_timeout_s

    def decision_subject(self, request_id: str) -> str:
        return f"{self.prefix}.out.decision.{request_id}"

    async def last_decision(self, request_id: str) -> dict[str, Any] | None:
        """The latest decision stored for ``request_id``, or ``None``."""
        try:
            raw = await self.js.get_last_msg(
                self.names.out_stream, self.decision_subject(request_id)
            )
        except NotFoundError:
            return None
        decision: dict[str, Any] = orjson.loads(raw.data or b"{}")
        return decision

    async def command(
        self, verb: str, body: dict[str, Any], *, request_id: str, final: bool = True
    ) -> dict[str, Any]:
        """Send a command (idempotently) and return its final decision (with ``final``
        false: its first decision, pending or final)."""
        inbox: anyio.abc.ObjectSendStream[dict[str, Any]]
        inbox, decisions = anyio.create_memory_object_stream[dict[str, Any]](16)

        async def on_decision(msg: Msg) -> None:
            with contextlib.suppress(anyio.WouldBlock, orjson.JSONDecodeError):
                inbox.send_nowait(orjson.loads(msg.data))

        sub = await self.nc.subscribe(self.decision_subject(request_id), cb=on_decision)
        try:
            known = await self.last_decision(request_id)
            if known is not None and (known.get("phase") == "final" or not final):
                return known
            if known is None:
                payload = {"v": 1, "request_id": request_id, **body}
                await self.js.publish(
                    f"{self.prefix}.in.cmd.{verb}",
                    orjson.dumps(payload),
                    headers={"Nats-Msg-Id": f"garm:{request_id}"},
                    timeout=self.query_timeout_s,
                )
            return await self._await_final(decisions, request_id, verb, final=final)
        finally:
            inbox.close()
            await sub.unsubscribe()

    async def _await_final(
        self,
        decisions: anyio.abc.ObjectReceiveStream[dict[str, Any]],
        request_id: str,
        verb: str,
        *,
        final: bool,
    ) -> dict[str, Any]:
        try:
            with anyio.fail_after(self.decision_timeout_s):
                async for decision in decisions:
                    if decision.get("phase") == "final" or not final:
                        return decision
                    logger.info(
                        "garm.decision_pending",
                        request_id=request_id,
                        victims=[v.get("instance") for v in decision.get("victims") or ()],
                    )
        except TimeoutError:
            pass
        raise ProviderError(
            f"no final decision for {verb} {request_id} within {self.decision_timeout_s:g} s; "
            "is `reconciler run` running?"
        )

    async def query(self, name: str, body: dict[str, Any]) -> Any:
        """A query's ``result``; a ``not-found`` error returns ``None``."""
        deadline = anyio.current_time() + self.query_timeout_s
        subject = f"{self.prefix}.query.{name}"
        delay = 0.05
        while True:
            remaining = deadline - anyio.current_time()
            try:
                msg = await self.nc.request(
                    subject, orjson.dumps(body), timeout=max(0.2, min(remaining, 5.0))
                )
            except (NoRespondersError, NatsTimeoutError):
                reply = None
            else:
                reply = orjson.loads(msg.data)
                if reply.get("ok"):
                    return reply.get("result")
                error = reply.get("error") or {}
                if error.get("code") == "not-found":
                    return None
                if error.get("code") not in _RETRYABLE_QUERY_ERRORS:
                    raise ProviderError(
                        f"query {name} failed: {error.get('code')}: {error.get('message')}"
                    )
            if anyio.current_time() + delay >= deadline:
                what = "no replica answered" if reply is None else "caches not synced"
                raise ProviderError(
                    f"query {name}: {what} within {self.query_timeout_s:g} s; "
                    "is `reconciler run` running?"
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
