"""The producer's client: commands and their decisions, queries, config, over one NATS
connection. What GARM's provider, the command line (``cmd``, ``query``, ``apply``), the
demo and the benchmark use to talk to the reconciler, as any producer would.

Rules:

- Every input is published as every component of the project publishes one
  (:func:`reconciler.bus.sending.publish`: size-checked, retried for ``retry_for_s``),
  on the contract's subject (:mod:`reconciler.core.messages`). A command carries
  ``Nats-Msg-Id`` ``<origin>:<request_id>`` (who sends it: :class:`Origin`), a config
  item an id of its content: publishing one again inside the stream's duplicate window
  stores nothing new. No stream to publish to is :class:`NoStream`.
- A command's decisions are waited for on a subscription made *before* the command is
  published (:meth:`ReconcilerClient.watch`), and the decision already stored on the OUT
  stream is read from there (:meth:`ReconcilerClient.last_decision`): a retried call
  finds what an earlier, killed one was answered. :meth:`ReconcilerClient.command` sends
  a command only when nothing is stored for its request id yet, then waits through
  ``pending`` decisions (a preemption waiting for its victims) for the final one; the
  whole wait is bounded, and a missing final decision is :class:`NoDecision`, never a
  guess.
- A producer that creates instances itself (GARM's provider) reports a create or start
  that failed for good with :meth:`ReconcilerClient.report_failure`, as the executor
  does: the lease is released at once, with the error as its fault.
- :meth:`ReconcilerClient.ask` asks a query once; :meth:`ReconcilerClient.query` asks
  until a replica with synced caches answers, within a bound (:class:`NoReplica` then),
  and turns ``not-found`` into ``None`` and any other error into :class:`QueryFailed`.
- It holds no secret: payloads carry identities only.

Layer: it uses ``reconciler.bus`` and ``reconciler.core``; ``reconciler.garm`` and
``reconciler.cli`` use it. (The leader's own workers publish their commands through
``reconciler.bus.sending`` too, without waiting for decisions: the caches see them.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError, NotFoundError

from reconciler.bus.sending import publish
from reconciler.bus.streams import StreamNames
from reconciler.core.messages import (
    CACHE_NOT_READY,
    DEFAULT_PREFIX,
    NOT_FOUND,
    ConfigRejected,
    Decision,
    MessageError,
    Origin,
    QueryReply,
    clip,
    command_msg_id,
    config_msg_id,
    failure_msg_id,
)

__all__ = [
    "ClientError",
    "ConfigRejections",
    "DecisionWatch",
    "NoDecision",
    "NoReplica",
    "NoStream",
    "QueryFailed",
    "ReconcilerClient",
]

logger = structlog.get_logger(__name__)

#: query errors worth asking again for: a replica still catching up
_RETRYABLE_QUERY_ERRORS = (CACHE_NOT_READY,)


class ClientError(Exception):
    """The reconciler could not be talked to as asked."""


class NoStream(ClientError):
    """No stream captures the subject published to (``reconciler run`` never started
    with this prefix, or the NATS server is another one)."""

    def __init__(self, stream: str, subject: str) -> None:
        super().__init__(f"no stream {stream} captures {subject}")
        self.stream = stream
        self.subject = subject


class NoDecision(ClientError):
    """No final decision arrived within the wait."""

    def __init__(self, request_id: str, within_s: float) -> None:
        super().__init__(f"no final decision for {request_id} within {within_s:g} s")
        self.request_id = request_id
        self.within_s = within_s


class NoReplica(ClientError):
    """No replica answered a query: none responded, none in time, or none synced."""

    def __init__(self, message: str, *, responders: bool) -> None:
        super().__init__(message)
        #: whether any replica listens at all (it may be slow or catching up)
        self.responders = responders


class QueryFailed(ClientError):
    """A replica answered a query with an error."""

    def __init__(self, name: str, code: str | None, message: str | None) -> None:
        super().__init__(f"query {name} failed: {code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Published:
    """What the IN stream said of one input: its sequence, and whether it had it."""

    subject: str
    seq: int
    duplicate: bool


class DecisionWatch:
    """The decisions of one request id, as they arrive (see
    :meth:`ReconcilerClient.watch`)."""

    def __init__(
        self, client: ReconcilerClient, request_id: str, arrivals: ObjectReceiveStream[Decision]
    ) -> None:
        self.client = client
        self.request_id = request_id
        self._arrivals = arrivals

    async def final(
        self,
        *,
        within_s: float,
        stored: Decision | None = None,
        first: bool = False,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> Decision:
        """The final decision (with ``first``: the first one, pending or final), starting
        from ``stored`` (a decision read before the wait), each decision seen handed to
        ``on_decision`` on the way; :class:`NoDecision` after ``within_s`` seconds."""
        if stored is not None:
            if on_decision is not None:
                on_decision(stored)
            if stored.final or first:
                return stored
        try:
            with anyio.fail_after(within_s):
                async for decision in self._arrivals:
                    if on_decision is not None:
                        on_decision(decision)
                    if decision.final or first:
                        return decision
        except TimeoutError:
            pass
        raise NoDecision(self.request_id, within_s)


class ConfigRejections:
    """Config rejections as they arrive (see :meth:`ReconcilerClient.config_rejections`)."""

    def __init__(self, arrivals: ObjectReceiveStream[ConfigRejected]) -> None:
        self._arrivals = arrivals

    async def of(self, input_seqs: set[int], *, within_s: float) -> list[ConfigRejected]:
        """The rejections of the inputs ``input_seqs`` that arrive within ``within_s``."""
        found: list[ConfigRejected] = []
        with anyio.move_on_after(within_s):
            async for rejected in self._arrivals:
                if rejected.input_seq in input_seqs:
                    found.append(rejected)
        return found


class ReconcilerClient:
    """Talks to the reconciler over ``nc``; see the module's rules.

    ``origin`` names the sender in its commands' message ids; ``publish_timeout_s``
    bounds the wait for the IN stream's acknowledgement (``None``: nats-py's default),
    ``retry_for_s`` how long a publish is retried while no stream answers (0: once)."""

    def __init__(
        self,
        nc: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        origin: Origin,
        publish_timeout_s: float | None = None,
        retry_for_s: float = 0.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.names = StreamNames.for_prefix(prefix)
        self.subjects = self.names.subjects
        self.origin = origin
        self.publish_timeout_s = publish_timeout_s
        self.retry_for_s = retry_for_s

    # ------------------------------------------------------------------ inputs

    async def publish_input(
        self, subject: str, payload: bytes, *, msg_id: str | None = None
    ) -> Published:
        """Publish one input (any bytes: the reconciler dead-letters bad ones)."""
        try:
            ack = await publish(
                self.js,
                subject,
                payload,
                msg_id=msg_id,
                timeout_s=self.publish_timeout_s,
                retry_for_s=self.retry_for_s,
            )
        except (NoStreamResponseError, NoRespondersError):
            raise NoStream(self.names.in_stream, subject) from None
        return Published(subject, int(ack.seq), bool(ack.duplicate))

    async def send(self, verb: str, payload: Mapping[str, Any]) -> Published:
        """Publish the command ``payload`` (with its ``v`` and ``request_id``) as
        ``verb``, without waiting for its decision."""
        return await self.publish_input(
            self.subjects.command(verb),
            orjson.dumps(payload),
            msg_id=command_msg_id(self.origin, str(payload["request_id"])),
        )

    async def report_failure(
        self,
        *,
        host: str,
        instance: str,
        project: str,
        lease_id: str,
        action: str,
        error: str,
    ) -> Published:
        """Report what could not be done to a lease's instance, for good (``action``:
        ``create``, ``start`` or ``delete``), as the host's ``failure`` input: the fold
        releases a lease whose create or start failed, with the error as its fault."""
        payload = {
            "v": 1,
            "host": host,
            "instance": instance,
            "project": project,
            "lease_id": lease_id,
            "action": action,
            "error": clip(error) or "failed",
        }
        return await self.publish_input(
            self.subjects.host_input(host, "failure"),
            orjson.dumps(payload),
            msg_id=failure_msg_id(lease_id, action),
        )

    async def publish_config(self, kind: str, name: str, payload: dict[str, Any]) -> Published:
        """Publish one config item (a pool, a class, a GPU profile or policy), with a
        message id of its content."""
        return await self.publish_input(
            self.subjects.config_input(kind, name),
            orjson.dumps(payload),
            msg_id=config_msg_id(kind, name, payload),
        )

    # --------------------------------------------------------------- decisions

    async def last_decision(self, request_id: str) -> Decision | None:
        """The latest decision the OUT stream holds for ``request_id``, or ``None``."""
        try:
            raw = await self.js.get_last_msg(
                self.names.out_stream, self.subjects.decision(request_id)
            )
        except NotFoundError:
            return None
        return Decision.parse(raw.data) if raw.data else None

    @contextlib.asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[DecisionWatch]:
        """Subscribed to ``request_id``'s decisions for the life of the block: made before
        its command is published, so that no decision is missed."""
        arrivals: ObjectSendStream[Decision]
        arrivals, receive = anyio.create_memory_object_stream[Decision](16)

        async def on_decision(msg: Msg) -> None:
            with contextlib.suppress(anyio.WouldBlock, MessageError):
                arrivals.send_nowait(Decision.parse(msg.data))

        sub = await self.nc.subscribe(self.subjects.decision(request_id), cb=on_decision)
        try:
            yield DecisionWatch(self, request_id, receive)
        finally:
            arrivals.close()
            receive.close()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):  # a closed connection: nothing to undo
                    await sub.unsubscribe()

    async def command(
        self,
        verb: str,
        payload: Mapping[str, Any],
        *,
        within_s: float,
        first: bool = False,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> Decision:
        """Send a command idempotently and return its final decision (with ``first``:
        its first, pending or final). The decision stored for its request id, if any,
        answers without sending it again."""
        request_id = str(payload["request_id"])
        async with self.watch(request_id) as watch:
            known = await self.last_decision(request_id)
            if known is not None and (known.final or first):
                return known
            if known is None:
                await self.send(verb, payload)
            return await watch.final(
                within_s=within_s, stored=known, first=first, on_decision=on_decision
            )

    # ----------------------------------------------------------------- queries

    async def ask(self, name: str, body: Any, *, timeout_s: float) -> QueryReply:
        """Ask query ``name`` once. :class:`NoReplica` when none answers in
        ``timeout_s`` (``responders`` false: none listens); a reply that is no JSON
        object raises :class:`~reconciler.core.messages.MessageError`."""
        subject = self.subjects.query(name)
        try:
            msg = await self.nc.request(subject, orjson.dumps(body), timeout=timeout_s)
        except NoRespondersError:
            raise NoReplica(f"no replica answers {subject}", responders=False) from None
        except NatsTimeoutError:
            raise NoReplica(
                f"no reply on {subject} within {timeout_s:g} s", responders=True
            ) from None
        return QueryReply.parse(msg.data)

    async def query(self, name: str, body: Any, *, within_s: float) -> Any:
        """A query's ``result``, asked until a synced replica answers within ``within_s``;
        ``None`` for ``not-found``. :class:`QueryFailed` for another error,
        :class:`NoReplica` when no replica answered in time."""
        deadline = anyio.current_time() + within_s
        delay = 0.05
        while True:
            remaining = deadline - anyio.current_time()
            try:
                reply: QueryReply | None = await self.ask(
                    name, body, timeout_s=max(0.2, min(remaining, 5.0))
                )
            except NoReplica:
                reply = None
            if reply is not None:
                if reply.ok:
                    return reply.result
                if reply.code == NOT_FOUND:
                    return None
                if reply.code not in _RETRYABLE_QUERY_ERRORS:
                    raise QueryFailed(name, reply.code, reply.message)
            if anyio.current_time() + delay >= deadline:
                what = "no replica answered" if reply is None else "caches not synced"
                raise NoReplica(
                    f"query {name}: {what} within {within_s:g} s; is `reconciler run` running?",
                    responders=reply is not None,
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def health(self, *, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """A replica's ``health`` result, or ``None`` when none answered it."""
        try:
            reply = await self.ask("health", {}, timeout_s=timeout_s)
        except (NoReplica, MessageError):
            return None
        result = reply.result if reply.ok else None
        return result if isinstance(result, dict) else None

    async def wait_applied(self, seq: int, *, within_s: float, every_s: float = 0.2) -> bool:
        """Whether a replica reports (``health``) having applied input ``seq`` within
        ``within_s`` seconds."""
        with anyio.move_on_after(within_s):
            while True:
                found = await self.health()
                if found is not None and int(found.get("applied_seq") or 0) >= seq:
                    return True
                await anyio.sleep(every_s)
        return False

    # ------------------------------------------------------------------ config

    @contextlib.asynccontextmanager
    async def config_rejections(self) -> AsyncIterator[ConfigRejections]:
        """Subscribed to config rejections for the life of the block (made before the
        config is published, so that none is missed)."""
        arrivals: ObjectSendStream[ConfigRejected]
        arrivals, receive = anyio.create_memory_object_stream[ConfigRejected](math.inf)

        async def on_rejection(msg: Msg) -> None:
            with contextlib.suppress(anyio.WouldBlock, MessageError):
                arrivals.send_nowait(ConfigRejected.parse(msg.data))

        sub = await self.nc.subscribe(self.subjects.config_rejections, cb=on_rejection)
        try:
            yield ConfigRejections(receive)
        finally:
            arrivals.close()
            receive.close()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
