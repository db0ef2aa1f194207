"""The input side of the bus: one durable pull consumer over the IN stream, in stream order.

Rules:

- The position of record is the store's applied sequence, not the consumer's ack floor.
  :meth:`InputConsumer.start` therefore (re)creates the durable consumer to deliver from
  a given stream sequence (``applied + 1``): a restart never waits for ``ack_wait`` to
  expire on what a dead process held, and a lost or restored database is caught up from
  exactly where it stands. Since nothing of the consumer's own state is kept, it has
  one replica, in memory, even on an R3 stream: after a node dies it is recreated on a
  live one in seconds, where an R3 consumer first waits for its own leader election.
- Deliveries come in stream order without gaps. A gap (a message lost between server and
  client, a redelivery overtaking) is never folded over: :meth:`InputConsumer.fetch`
  drops the batch from the gap on and restarts the consumer at the missing sequence.
  A gap the stream itself has (messages aged out by ``max_age``, a purge) is accepted
  with a warning, since nothing can bring those messages back.
- :meth:`InputConsumer.fetch` is guarded by a watchdog: a fetch that outlives its own
  timeout by ``watchdog_grace_s`` (a known nats-py stall after reconnects) is abandoned
  and the consumer restarted. After the client reconnects, the next fetch restarts the
  consumer too, because the server forgot the pull requests it had. Trouble on the way
  (NATS unreachable, a restart refused) is logged and retried, never raised: the line
  waits for NATS instead of stopping.
- Time comes from the message's JetStream timestamp (nanoseconds, in the ack subject),
  rendered as RFC 3339 UTC with nine fractional digits: the same text on every replica
  and in every replay.
- Acks and terms are plain publishes to the ack subject; they are sent only after the
  caller committed what the messages caused. The consumer acknowledges cumulatively
  (``AckPolicy.ALL``): since deliveries are folded and committed in stream order, one
  ``+ACK`` of a committed batch's last delivery acknowledges the whole batch (and any
  redelivery below it) instead of one publish per input, which the server would also
  have to process. Dead-lettered inputs are still terminated one by one first (rare).
- The pull loop is the consumer's own, not nats-py's ``fetch`` (which awaits each message
  through a fresh ``wait_for`` task): pull requests of ``batch`` messages, expiring after
  ``fetch_timeout_s``, whose deliveries a subscription callback buffers;
  :meth:`InputConsumer.fetch` hands out what is buffered as soon as anything is. Requests
  are made ahead (:data:`LOOKAHEAD` batches buffered or owed), so the next deliveries are
  already on their way while the caller folds a batch, never a round trip behind. A
  status reply (404, 408, 409) ends its request; the server says how many messages the
  request still owed (``Nats-Pending-Messages``), or, without that header, all are
  taken as ended. A request that outlives its expiry by :data:`REQUEST_GRACE_S` without
  an answer is taken as ended too (nats-server 2.9 drops a request that expires just as
  a message comes in without its 408, which used to stall the line until the watchdog
  restarted the consumer, six seconds later). A 409 (the durable deleted, leadership
  moved, a server limit) also restarts the consumer at the next fetch, rather than after
  the watchdog's wait. The consumer's ``max_ack_pending`` leaves room for what the
  caller holds unacknowledged (two batches folding, two committing) besides the
  lookahead.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from reconciler.bus.direct import DirectSubscription, parse_headers, status_of, subscribe_direct
from reconciler.bus.violations import guarded

__all__ = [
    "Delivery",
    "InputConsumer",
    "parse_ack_subject",
    "rfc3339_nanos",
]

logger = structlog.get_logger(__name__)

_ACK = b"+ACK"
_TERM = b"+TERM"
#: status codes that end a pull request: no messages, expired, refused (409: max waiting,
#: consumer deleted, leadership change); 100 (heartbeats) does not
_REQUEST_OVER = frozenset({"404", "408", "409"})
#: batches asked for ahead of the caller: buffered plus still owed by pull requests
LOOKAHEAD = 2
#: a pull request is taken as over this long after its expiry even if the server said
#: nothing (see InputConsumer._forget_expired)
REQUEST_GRACE_S = 0.2
#: unacknowledged deliveries the server allows, in batches (lookahead plus what the caller
#: holds: a batch in hand grown by merging, and the one being committed)
ACK_PENDING_BATCHES = 8


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


def parse_ack_subject(reply: str) -> tuple[int, int, int]:
    """``(stream_seq, delivered, timestamp_ns)`` from a JetStream ack subject.

    Both forms are understood: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>
    .<ts>.<pending>`` and the newer one with domain and account hash after ``$JS.ACK``.
    """
    tokens = reply.split(".")
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        base = 4
    elif len(tokens) >= 12 and tokens[0] == "$JS" and tokens[1] == "ACK":
        base = 6
    else:
        raise ValueError(f"not a JetStream ack subject: {reply!r}")
    return int(tokens[base + 1]), int(tokens[base]), int(tokens[base + 3])


def _by_seq(d: Delivery) -> int:
    return d.stream_seq


@lru_cache(maxsize=4096)
def _second(seconds: int) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def rfc3339_nanos(timestamp_ns: int) -> str:
    """``1764669600123456789`` → ``"2025-12-02T10:00:00.123456789Z"``."""
    seconds, nanos = divmod(timestamp_ns, 1_000_000_000)
    return f"{_second(seconds)}.{nanos:09d}Z"


class InputConsumer:
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
        watchdog_grace_s: float = 5.0,
    ) -> None:
        if batch < 1 or fetch_timeout_s <= 0 or ack_wait_s <= 0 or watchdog_grace_s <= 0:
            raise ValueError("batch, fetch_timeout_s, ack_wait_s and watchdog_grace_s must be > 0")
        self._nc = nc
        self._js = js
        self.stream = stream
        self.durable = durable
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.ack_wait_s = ack_wait_s
        self.watchdog_grace_s = watchdog_grace_s
        self._sub: DirectSubscription | None = None
        #: messages delivered and not yet handed out (subject, ack subject, payload), and
        #: how many pull requests still owe
        self._buffer: deque[tuple[str, str, bytes]] = deque()
        self._owed = 0
        #: when each pull request still thought open is over for sure (its expiry, plus
        #: REQUEST_GRACE_S), oldest first
        self._open: deque[float] = deque()
        self._arrived = anyio.Event()
        #: called whenever a delivery is buffered (the caches wake their reader with it)
        self.on_arrival: Callable[[], None] | None = None
        self._inbox = ""
        self._pull = ""
        self._next_seq = 1
        self._reconnects_seen = 0
        #: why the consumer must be restarted before the next fetch, if it must
        self._broken: str | None = None
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
        await self._unbind()
        api_prefix = f"{api.DEFAULT_PREFIX}.CONSUMER"
        with contextlib.suppress(NotFoundError):
            # a refused permission fails at once, naming the subject (not a timeout)
            await guarded(
                self._nc,
                functools.partial(self._js.delete_consumer, self.stream, self.durable),
                subjects=(f"{api_prefix}.DELETE.{self.stream}.{self.durable}",),
            )
        config = api.ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=from_seq,
            ack_policy=api.AckPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=max(ACK_PENDING_BATCHES * self.batch, 1000),
            max_waiting=16,
            replay_policy=api.ReplayPolicy.INSTANT,
            # recreated at every start from the store's position: its own state needs no
            # replicas nor disk, and one replica is quicker to move off a dead node
            num_replicas=1,
            mem_storage=True,
        )
        await guarded(
            self._nc,
            functools.partial(self._js.add_consumer, self.stream, config=config),
            subjects=(f"{api_prefix}.CREATE.{self.stream}.{self.durable}",),
        )
        self._buffer.clear()
        self._owed = 0
        self._open.clear()
        self._inbox = self._nc.new_inbox()
        # bounded by the pull requests made ahead (LOOKAHEAD batches), not by a queue
        self._sub = await subscribe_direct(self._nc, self._inbox, self._on_message)
        self._pull = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        self._broken = None
        self._next_seq = from_seq
        self._reconnects_seen = self._nc.stats["reconnects"]
        self.restarts += 1
        self._log.info("consumer.started", from_seq=from_seq)

    async def close(self) -> None:
        """Stop receiving; the durable consumer stays for the next start."""
        await self._unbind()

    async def fetch(self) -> list[Delivery]:
        """The next deliveries, in order from :attr:`next_seq`; ``[]`` when none came in
        ``fetch_timeout_s``. Restarts the consumer when the stream of deliveries broke.

        Never raises for trouble on the way (NATS unreachable, a restart refused): it
        logs, waits ``fetch_timeout_s`` and returns ``[]``, and the next call tries again.
        """
        if self._needs_restart() and not await self._restart(self._broken or "not started"):
            return []
        if not self._buffer:
            try:
                await self._await_messages()
            except Exception as exc:  # connection closed or draining
                self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
                self._broken = f"fetch failed: {exc!r}"
                await anyio.sleep(self.fetch_timeout_s)
                return []
        msgs = [self._buffer.popleft() for _ in range(min(self.batch, len(self._buffer)))]
        try:
            await self._pull_ahead()
            return await self._in_order(msgs)
        except Exception as exc:  # the next pull, or the gap check, could not reach NATS
            self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
            self._broken = f"fetch failed: {exc!r}"
            return []

    @property
    def buffered(self) -> int:
        """Deliveries received and not handed out yet, that :meth:`fetch_buffered` can hand
        out: 0 while the consumer needs a restart (those deliveries belong to a broken
        stream, and :meth:`fetch` will drop them). A caller may rely on it: while this is
        above 0, :meth:`fetch_buffered` hands something out or consumes the buffer, so a
        loop on it cannot spin without progress."""
        return 0 if self._needs_restart() else len(self._buffer)

    def _needs_restart(self) -> bool:
        """Whether the stream of deliveries broke (a failed fetch, a gap, a refused pull,
        a reconnect of the client, which loses the pull requests) or never started."""
        if self._broken is None and self._nc.stats["reconnects"] != self._reconnects_seen:
            self._broken = "client reconnected"
        return self._broken is not None or self._sub is None

    async def fetch_buffered(self) -> list[Delivery]:
        """What is buffered, in order from :attr:`next_seq`, without waiting: ``[]`` when
        nothing is. Asks the server for more as it hands deliveries out, so that they
        keep coming while the caller is busy. Never raises, like
        :meth:`fetch`; a consumer that needs a restart is left for :meth:`fetch`."""
        if self._needs_restart():
            return []
        try:
            msgs = [self._buffer.popleft() for _ in range(min(self.batch, len(self._buffer)))]
            await self._pull_ahead()
            return await self._in_order(msgs) if msgs else []
        except Exception as exc:  # connection closed or draining, or the gap check failed
            self._log.warning("consumer.fetch_failed", error=repr(exc), at_seq=self._next_seq)
            self._broken = f"fetch failed: {exc!r}"
            return []

    async def _pull_ahead(self) -> None:
        """Ask for more until :data:`LOOKAHEAD` batches are buffered or owed."""
        self._forget_expired()
        while len(self._buffer) + self._owed < LOOKAHEAD * self.batch:
            request = {"batch": self.batch, "expires": int(self.fetch_timeout_s * 1e9)}
            self._owed += self.batch
            self._open.append(anyio.current_time() + self.fetch_timeout_s + REQUEST_GRACE_S)
            await self._nc.publish(self._pull, orjson.dumps(request), reply=self._inbox)

    def _forget_expired(self) -> None:
        """Requests past their expiry owe nothing more, whether or not the server said so
        (nats-server 2.9 drops a request that expires just as a message comes in without
        its 408): the messages still owed are at most what the open ones asked for."""
        now = anyio.current_time()
        if self._open and self._open[0] <= now:
            while self._open and self._open[0] <= now:
                self._open.popleft()
            self._owed = min(self._owed, len(self._open) * self.batch)

    async def _await_messages(self) -> None:
        """Wait until messages are buffered, or a pull request ended (expired), or the
        watchdog gave up on requests the server seems to have lost. A request that
        outlives its expiry without a word is taken as over, and more are asked for."""
        await self._pull_ahead()
        self._arrived = anyio.Event()
        give_up = anyio.current_time() + self.fetch_timeout_s + self.watchdog_grace_s
        while True:
            until = min(self._open[0], give_up) if self._open else give_up
            with anyio.move_on_after(max(0.0, until - anyio.current_time())):
                await self._arrived.wait()
            if self._arrived.is_set():
                return
            if anyio.current_time() >= give_up:
                self._broken = "fetch stalled"
                return
            await self._pull_ahead()

    def _on_message(self, subject: str, reply: str, data: bytes, raw: bytes | None) -> None:
        """The deliver subject's handler (bus/direct.py): buffer messages; a status ends
        the request."""
        status = status_of(raw)
        if status is None:
            self._buffer.append((subject, reply, data))
            self._owed = max(0, self._owed - 1)
            if self.on_arrival is not None:
                self.on_arrival()
        elif status in _REQUEST_OVER:
            headers = parse_headers(raw)
            if status == "409":
                # refused: the durable was deleted, leadership moved, a limit was hit;
                # never the case in normal operation, and a restart mends each of them
                description = headers.get("Description")
                self._log.warning("consumer.pull_refused", status=status, description=description)
                self._broken = self._broken or f"pull request refused: {description}"
            left = headers.get("Nats-Pending-Messages")
            if left and left.isdigit():
                self._owed = max(0, self._owed - int(left))
                if self._open:
                    self._open.popleft()  # requests expire in the order they were made
            else:
                self._owed = 0
                self._open.clear()
        self._arrived.set()

    async def _restart(self, why: str) -> bool:
        self._log.info("consumer.restart", why=why, at_seq=self._next_seq)
        try:
            with anyio.fail_after(self.fetch_timeout_s + self.watchdog_grace_s):
                await self.start(from_seq=self._next_seq)
        except Exception as exc:
            self._log.warning("consumer.restart_failed", error=repr(exc), at_seq=self._next_seq)
            await anyio.sleep(self.fetch_timeout_s)
            return False
        return True

    async def _in_order(self, msgs: list[tuple[str, str, bytes]]) -> list[Delivery]:
        out: list[Delivery] = []
        for msg in msgs:
            reply = msg[1]
            try:
                seq, delivered, ts = parse_ack_subject(reply)
            except ValueError:
                self._log.warning("consumer.not_a_delivery", reply=reply)
                continue
            if seq < self._next_seq:
                # already folded (a late redelivery): the caller acks it without folding
                out.append(self._delivery(msg, seq, delivered, ts))
                continue
            if seq > self._next_seq and not await self._gap_is_in_stream(seq):
                self._log.warning("consumer.gap", expected=self._next_seq, got=seq)
                self._broken = "gap in deliveries"
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
    def _delivery(msg: tuple[str, str, bytes], seq: int, delivered: int, ts: int) -> Delivery:
        subject, reply, data = msg
        return Delivery(
            subject=subject,
            data=data,
            stream_seq=seq,
            timestamp=rfc3339_nanos(ts),
            delivered=delivered,
            reply=reply,
        )

    async def ack(self, deliveries: list[Delivery]) -> None:
        """Acknowledge deliveries whose effects are committed, and every delivery below
        the last of them (the policy is cumulative): the caller commits in stream order,
        so whatever lies below a committed delivery is committed too."""
        if deliveries:
            await self._reply([max(deliveries, key=_by_seq)], _ACK)

    async def term(self, deliveries: list[Delivery]) -> None:
        """Terminate deliveries (bad input, dead-lettered): never redelivered."""
        await self._reply(deliveries, _TERM)

    async def _reply(self, deliveries: list[Delivery], verdict: bytes) -> None:
        # Best effort: the store's position, not the ack, decides what is folded next,
        # so an ack lost with the connection costs nothing but a redelivery skipped later.
        try:
            for d in deliveries:
                await self._nc.publish(d.reply, verdict)
        except Exception as exc:
            self._log.warning("consumer.ack_failed", error=repr(exc), count=len(deliveries))

    async def stream_last_seq(self) -> int:
        """The stream's last sequence right now (0 when empty)."""
        info = await self._js.stream_info(self.stream)
        return int(info.state.last_seq or 0)

    async def _unbind(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a dead connection: nothing to undo
                self._log.debug("consumer.unsubscribe_failed", error=str(exc))
