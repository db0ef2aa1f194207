"""The replica's input consumer: the IN stream, in stream order, gap-free.

A :class:`~reconciler.bus.reader.PullReader` over the consumer of
:func:`~reconciler.bus.consumers.input_consumer` (see :mod:`reconciler.bus.consumers`
for its settings).

Rules:

- The position of record is the store's applied sequence, not the consumer's ack floor.
  :meth:`InputConsumer.start` therefore (re)creates the durable consumer to deliver from
  a given stream sequence (``applied + 1``): a restart never waits for ``ack_wait`` to
  expire on what a dead process held, and a lost or restored database is caught up from
  exactly where it stands.
- Deliveries come in stream order without gaps. A gap (a message lost between server and
  client, a redelivery overtaking) is never folded over: :meth:`InputConsumer.fetch`
  drops the batch from the gap on and restarts the consumer at the missing sequence.
  A gap the stream itself has (messages aged out by ``max_age``, a purge) is accepted
  with a warning, since nothing can bring those messages back.
- A broken reader (a refused pull, a reconnect of the client, a stalled fetch: see
  :mod:`reconciler.bus.reader`) restarts the consumer at the next fetch, from the next
  sequence; what it had buffered is dropped. Trouble on the way (NATS unreachable, a
  restart refused) is logged and retried, never raised: the line waits for NATS instead
  of stopping.
- :meth:`InputConsumer.fetch` hands out what is buffered as soon as anything is, up to
  ``batch``; :data:`~reconciler.bus.consumers.INPUT_LOOKAHEAD` batches are asked for
  ahead, so the next deliveries are on their way while the caller folds.
- Time comes from the message's JetStream timestamp (nanoseconds, in the ack subject),
  rendered as RFC 3339 UTC with nine fractional digits: the same text on every replica
  and in every replay.
- Acks and terms are plain publishes to the ack subject; they are sent only after the
  caller committed what the messages caused. The consumer acknowledges cumulatively
  (``AckPolicy.ALL``): since deliveries are folded and committed in stream order, one
  ``+ACK`` of a committed batch's last delivery acknowledges the whole batch (and any
  redelivery below it) instead of one publish per input, which the server would also
  have to process. Dead-lettered inputs are still terminated one by one first (rare).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import anyio
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from reconciler.bus.consumers import INPUT_LOOKAHEAD, STALL_S, input_consumer
from reconciler.bus.reader import (
    ACK,
    TERM,
    PullReader,
    RawMessage,
    parse_ack_subject,
    reply,
    rfc3339_nanos,
)
from reconciler.bus.violations import guarded

__all__ = ["LOOKAHEAD", "Delivery", "InputConsumer"]

logger = structlog.get_logger(__name__)

#: batches asked for ahead of the caller (for the tests, which count them)
LOOKAHEAD = INPUT_LOOKAHEAD


@dataclass(slots=True, eq=False)
class Delivery:
    """One input message as delivered: where it sits in the stream and when it was stored.

    Treat it as read-only. It is not frozen only because a frozen dataclass is built
    field by field through ``object.__setattr__``, and one is built per input.
    """

    subject: str
    data: bytes
    stream_seq: int
    #: JetStream's storage time, RFC 3339 UTC with nanoseconds
    timestamp: str
    #: how many times the server has delivered it (1 the first time)
    delivered: int
    #: the ack subject
    reply: str


def _by_seq(d: Delivery) -> int:
    return d.stream_seq


class InputConsumer(PullReader):
    """A durable pull consumer over the IN stream that delivers in order, gap-free."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        stream: str,
        durable: str,
        batch: int = 500,
        fetch_timeout_s: float = 1.0,
        ack_wait_s: float = 60.0,
        watchdog_grace_s: float = STALL_S,
    ) -> None:
        if batch < 1 or fetch_timeout_s <= 0 or ack_wait_s <= 0 or watchdog_grace_s <= 0:
            raise ValueError("batch, fetch_timeout_s, ack_wait_s and watchdog_grace_s must be > 0")
        super().__init__(
            nc,
            stream=stream,
            batch=batch,
            ahead=LOOKAHEAD,
            expires_s=fetch_timeout_s,
            stall_s=watchdog_grace_s,
        )
        self._js = js
        self.durable = durable
        self.fetch_timeout_s = fetch_timeout_s
        self.ack_wait_s = ack_wait_s
        self._next_seq = 1
        self.restarts = 0
        self._log = logger.bind(stream=stream, consumer=durable)

    @property
    def next_seq(self) -> int:
        """The stream sequence the next delivery must have."""
        return self._next_seq

    async def start(self, *, from_seq: int) -> None:
        """(Re)create the durable consumer delivering from ``from_seq``, and bind to it."""
        if from_seq < 1:
            raise ValueError(f"from_seq must be >= 1, got {from_seq}")
        await self.unbind()
        api_prefix = f"{api.DEFAULT_PREFIX}.CONSUMER"
        with contextlib.suppress(NotFoundError):
            # a refused permission fails at once, naming the subject (not a timeout)
            await guarded(
                self._nc,
                functools.partial(self._js.delete_consumer, self.stream, self.durable),
                subjects=(f"{api_prefix}.DELETE.{self.stream}.{self.durable}",),
            )
        config = input_consumer(
            self.durable, from_seq=from_seq, batch=self.batch, ack_wait_s=self.ack_wait_s
        )
        await guarded(
            self._nc,
            functools.partial(self._js.add_consumer, self.stream, config=config),
            subjects=(f"{api_prefix}.CREATE.{self.stream}.{self.durable}",),
        )
        await self.bind(self.durable)
        self._next_seq = from_seq
        self.restarts += 1
        self._log.info("consumer.started", from_seq=from_seq)

    async def close(self) -> None:
        """Stop receiving; the durable consumer stays for the next start."""
        await self.unbind()

    async def fetch(self) -> list[Delivery]:
        """The next deliveries, in order from :attr:`next_seq`; ``[]`` when none came in
        ``fetch_timeout_s``. Restarts the consumer when the stream of deliveries broke.

        Never raises for trouble on the way (NATS unreachable, a restart refused): it
        logs, waits ``fetch_timeout_s`` and returns ``[]``, and the next call tries again.
        """
        if self.needs_binding() and not await self._restart(self.broken or "not started"):
            return []
        if not self._buffer:
            try:
                await self.wait()
            except Exception as exc:  # connection closed or draining
                self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
                self.broken = f"fetch failed: {exc!r}"
                await anyio.sleep(self.fetch_timeout_s)
                return []
        msgs = self.pop_buffered(self.batch)
        try:
            await self.pull_ahead()
            return await self._in_order(msgs)
        except Exception as exc:  # the next pull, or the gap check, could not reach NATS
            self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
            self.broken = f"fetch failed: {exc!r}"
            return []

    @property
    def buffered(self) -> int:
        """Deliveries received and not handed out yet, that :meth:`fetch_buffered` can hand
        out: 0 while the consumer needs a restart (those deliveries belong to a broken
        stream, and :meth:`fetch` will drop them). A caller may rely on it: while this is
        above 0, :meth:`fetch_buffered` hands something out or consumes the buffer, so a
        loop on it cannot spin without progress."""
        return 0 if self.needs_binding() else len(self._buffer)

    async def fetch_buffered(self, limit: int | None = None) -> list[Delivery]:
        """What is buffered, in order from :attr:`next_seq`, without waiting: ``[]`` when
        nothing is; at most ``batch`` deliveries, and at most ``limit`` when given. Asks the
        server for more as it hands deliveries out, so that they keep coming while the
        caller is busy. Never raises, like :meth:`fetch`; a consumer that needs a restart
        is left for :meth:`fetch`."""
        if self.needs_binding():
            return []
        try:
            msgs = self.pop_buffered(self.batch if limit is None else min(self.batch, limit))
            await self.pull_ahead()
            return await self._in_order(msgs) if msgs else []
        except Exception as exc:  # connection closed or draining, or the gap check failed
            self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
            self.broken = f"fetch failed: {exc!r}"
            return []

    async def _restart(self, why: str) -> bool:
        self._log.info("consumer.restart", why=why, at_seq=self._next_seq)
        try:
            with anyio.fail_after(self.fetch_timeout_s + self.stall_s):
                await self.start(from_seq=self._next_seq)
        except Exception as exc:
            self._log.warning("consumer.restart_failed", error=repr(exc), at_seq=self._next_seq)
            await anyio.sleep(self.fetch_timeout_s)
            return False
        return True

    async def _in_order(self, msgs: list[RawMessage]) -> list[Delivery]:
        out: list[Delivery] = []
        for msg in msgs:
            reply_to = msg[1]
            try:
                seq, delivered, ts = parse_ack_subject(reply_to)
            except ValueError:
                self._log.warning("consumer.not_a_delivery", reply=reply_to)
                continue
            if seq < self._next_seq:
                # already folded (a late redelivery): the caller acks it without folding
                out.append(self._delivery(msg, seq, delivered, ts))
                continue
            if seq > self._next_seq and not await self._gap_is_in_stream(seq):
                self._log.warning("consumer.gap", expected=self._next_seq, got=seq)
                self.broken = "gap in deliveries"
                return out
            out.append(self._delivery(msg, seq, delivered, ts))
            self._next_seq = seq + 1
        return out

    async def _gap_is_in_stream(self, seq: int) -> bool:
        """True when the stream itself no longer has ``next_seq .. seq-1``."""
        info = await self._js.stream_info(self.stream)
        first = int(info.state.first_seq or 0)
        if first >= seq:
            self._log.warning(
                "consumer.messages_gone",
                missing_from=self._next_seq,
                missing_to=seq - 1,
                stream_first_seq=first,
            )
            return True
        return False

    @staticmethod
    def _delivery(msg: RawMessage, seq: int, delivered: int, ts: int) -> Delivery:
        return Delivery(
            subject=msg[0],
            data=msg[2],
            stream_seq=seq,
            timestamp=rfc3339_nanos(ts),
            delivered=delivered,
            reply=msg[1],
        )

    async def ack(self, deliveries: list[Delivery]) -> None:
        """Acknowledge deliveries whose effects are committed, and every delivery below
        the last of them (the policy is cumulative): the caller commits in stream order,
        so whatever lies below a committed delivery is committed too."""
        if deliveries:
            await self._reply([max(deliveries, key=_by_seq)], ACK)

    async def term(self, deliveries: list[Delivery]) -> None:
        """Terminate deliveries (bad input, dead-lettered): never redelivered."""
        await self._reply(deliveries, TERM)

    async def _reply(self, deliveries: list[Delivery], verdict: bytes) -> None:
        # Best effort: the store's position, not the ack, decides what is folded next,
        # so an ack lost with the connection costs nothing but a redelivery skipped later.
        try:
            await reply(self._nc, (d.reply for d in deliveries), verdict)
        except Exception as exc:
            self._log.warning("consumer.ack_failed", error=repr(exc), count=len(deliveries))

    async def stream_last_seq(self) -> int:
        """The stream's last sequence right now (0 when empty)."""
        info = await self._js.stream_info(self.stream)
        return int(info.state.last_seq or 0)
