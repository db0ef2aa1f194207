"""The one pull reader: deliveries of a JetStream pull consumer, asked for ahead and
buffered as they come, in the order the server sends them.

Every reader of a stream in the project is one of these: the replica's input consumer
(:class:`~reconciler.bus.input_consumer.InputConsumer`), the replay's readers of both streams
(:class:`~reconciler.replay.readers.StreamReader`) and the executor's fetch loop
(:mod:`reconciler.executor.executor`). What each makes of the order (gap-free by stream
sequence, by consumer sequence, or not at all) is its own; the consumers they read are
configured in :mod:`reconciler.bus.consumers`.

Rules:

- The pull loop is the reader's own, not nats-py's ``fetch`` (which awaits each message
  through a fresh ``wait_for`` task): pull requests of ``batch`` messages expiring after
  ``expires_s``, answered on an inbox of the reader's own whose deliveries a direct
  subscription (:mod:`reconciler.bus.direct`) buffers. Requests are made ahead
  (``ahead`` batches buffered or owed), so the next deliveries are already on their way
  while the caller works on the last ones, never a round trip behind.
- A status reply (404, 408, 409) ends its request; the server says how many messages
  the request still owed (``Nats-Pending-Messages``), or, without that header, all are
  taken as ended. A request that outlives its expiry by :data:`REQUEST_GRACE_S` without
  an answer is taken as ended too (nats-server 2.9 drops a request that expires just as
  a message comes in without its 408), and more are asked for.
- The reader is *broken*, and must be bound again, when a pull request is refused (409:
  the consumer deleted, leadership moved, a server limit), when the client reconnected
  (the server forgot the pull requests), or when no answer at all came ``stall_s``
  after a request's expiry (a known nats-py stall after reconnects). :attr:`broken` says
  why; what was buffered may be read, and each kind of reader decides whether to.
- Binding again subscribes a new inbox; deliveries still coming to an older one are
  dropped (a generation number tells them apart).
- Verdicts (``+ACK``, ``+TERM``, ``-NAK``, ``+WPI``) are plain publishes to a delivery's
  ack subject (:func:`reply`), best effort: a verdict lost with the connection costs a
  redelivery, which every reader handles.
- Where a delivery sits comes from its ack subject (:func:`parse_ack_subject`), and when
  it was stored, in nanoseconds, rendered as RFC 3339 UTC with nine fractional digits
  (:func:`rfc3339_nanos`): the same text on every replica and in every replay.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections import deque
from collections.abc import Callable, Iterable
from functools import lru_cache

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.direct import DirectSubscription, parse_headers, status_of, subscribe_direct

__all__ = [
    "ACK",
    "NAK",
    "PROGRESS",
    "REQUEST_GRACE_S",
    "TERM",
    "PullReader",
    "RawMessage",
    "parse_ack_subject",
    "pending_of",
    "reply",
    "rfc3339_nanos",
]

logger = structlog.get_logger(__name__)

#: a delivery as received: subject, ack subject, payload, raw header block (or ``None``)
RawMessage = tuple[str, str, bytes, bytes | None]

#: the verdicts a delivery's ack subject takes
ACK = b"+ACK"
TERM = b"+TERM"
NAK = b"-NAK"
#: "still working on it": the server restarts the delivery's ack wait
PROGRESS = b"+WPI"

#: status codes that end a pull request: no messages, expired, refused (409: max waiting,
#: consumer deleted, leadership change); 100 (heartbeats) does not
_REQUEST_OVER = frozenset({"404", "408", "409"})
#: a pull request is taken as over this long after its expiry even if the server said
#: nothing (see PullReader._forget_expired)
REQUEST_GRACE_S = 0.2


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


def pending_of(reply: str) -> int:
    """How many messages the consumer had left to deliver after this one (the ack
    subject's last count; 0 when it is not an ack subject)."""
    tokens = reply.split(".")
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        pending = tokens[8]
    elif len(tokens) >= 12 and tokens[0] == "$JS" and tokens[1] == "ACK":
        pending = tokens[10]
    else:
        return 0
    return int(pending) if pending.isdigit() else 0


@lru_cache(maxsize=4096)
def _second(seconds: int) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def rfc3339_nanos(timestamp_ns: int) -> str:
    """``1764669600123456789`` → ``"2025-12-02T10:00:00.123456789Z"``."""
    seconds, nanos = divmod(timestamp_ns, 1_000_000_000)
    return f"{_second(seconds)}.{nanos:09d}Z"


async def reply(nc: Client, ack_subjects: Iterable[str], verdict: bytes) -> None:
    """Send ``verdict`` to each ack subject. Raises what ``Client.publish`` raises."""
    for subject in ack_subjects:
        await nc.publish(subject, verdict)


class PullReader:
    """Deliveries of one pull consumer of ``stream``, asked for ahead and buffered (see
    the module's rules). :meth:`bind` it to a consumer, :meth:`wait` for deliveries,
    :meth:`pop_buffered` them."""

    def __init__(
        self,
        nc: Client,
        *,
        stream: str,
        batch: int,
        ahead: int,
        expires_s: float = 1.0,
        stall_s: float = 5.0,
    ) -> None:
        if batch < 1 or ahead < 1 or expires_s <= 0 or stall_s <= 0:
            raise ValueError("batch, ahead, expires_s and stall_s must be > 0")
        self._nc = nc
        self.stream = stream
        self.batch = batch
        self.ahead = ahead
        self.expires_s = expires_s
        self.stall_s = stall_s
        #: the consumer bound to ("" before the first bind)
        self.consumer = ""
        self._sub: DirectSubscription | None = None
        #: deliveries not handed out yet, and how many the open pull requests still owe
        self._buffer: deque[RawMessage] = deque()
        self._owed = 0
        #: when each pull request still thought open is over for sure (its expiry, plus
        #: REQUEST_GRACE_S), oldest first
        self._open: deque[float] = deque()
        self._arrived = anyio.Event()
        #: called whenever a delivery is buffered
        self.on_arrival: Callable[[], None] | None = None
        self._inbox = ""
        self._pull = ""
        self._reconnects_seen = 0
        #: which subscription is current: a delivery to an earlier one is dropped
        self._generation = 0
        #: why the reader must be bound again, if it must
        self.broken: str | None = None

    # ------------------------------------------------------------------ binding

    @property
    def bound(self) -> bool:
        return self._sub is not None

    async def bind(self, consumer: str) -> None:
        """Read ``consumer`` (which must exist) from now on, on a new inbox: whatever was
        buffered or asked for before is dropped."""
        await self.unbind()
        self.consumer = consumer
        self._buffer.clear()
        self._owed = 0
        self._open.clear()
        self._generation += 1
        self._inbox = self._nc.new_inbox()
        # bounded by the pull requests made ahead, not by a queue
        self._sub = await subscribe_direct(
            self._nc, self._inbox, functools.partial(self._on_message, self._generation)
        )
        self._pull = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{self.stream}.{consumer}"
        self.broken = None
        self._reconnects_seen = self._nc.stats["reconnects"]

    async def unbind(self) -> None:
        """Stop receiving (the consumer itself stays)."""
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a dead connection: nothing to undo
                logger.debug("consumer.unsubscribe_failed", stream=self.stream, error=repr(exc))

    def needs_binding(self) -> bool:
        """Whether the reader is broken (see the rules: the client reconnecting breaks it
        too) or was never bound."""
        if self.broken is None and self._nc.stats["reconnects"] != self._reconnects_seen:
            self.broken = "client reconnected"
        return self.broken is not None or self._sub is None

    # ------------------------------------------------------------------ reading

    @property
    def buffered(self) -> int:
        """Deliveries received and not taken yet."""
        return len(self._buffer)

    def pop_buffered(self, n: int) -> list[RawMessage]:
        """Up to ``n`` buffered deliveries, oldest first, without waiting."""
        buffer = self._buffer
        return [buffer.popleft() for _ in range(min(n, len(buffer)))]

    def wake(self) -> None:
        """Have a :meth:`wait` return at once."""
        self._arrived.set()

    async def wait(self) -> None:
        """Until deliveries are buffered, a pull request ended, :meth:`wake` was called,
        or the requests stalled (then :attr:`broken` says so). Asks for more first. A
        request that outlives its expiry without a word is taken as over, and more are
        asked for. Raises what ``Client.publish`` raises (the connection closed)."""
        self._arrived = anyio.Event()
        await self.pull_ahead()
        give_up = anyio.current_time() + self.expires_s + self.stall_s
        while not self._buffer:
            until = min(self._open[0], give_up) if self._open else give_up
            with anyio.move_on_after(max(0.0, until - anyio.current_time())):
                await self._arrived.wait()
            if self._arrived.is_set():
                return
            if anyio.current_time() >= give_up:
                self.broken = self.broken or "fetch stalled"
                return
            await self.pull_ahead()

    async def pull_ahead(self) -> None:
        """Ask for more until ``ahead`` batches are buffered or owed."""
        self._forget_expired()
        limit = self.ahead * self.batch
        while len(self._buffer) + self._owed < limit:
            request = {"batch": self.batch, "expires": int(self.expires_s * 1e9)}
            self._owed += self.batch
            self._open.append(anyio.current_time() + self.expires_s + REQUEST_GRACE_S)
            await self._nc.publish(self._pull, orjson.dumps(request), reply=self._inbox)

    def _forget_expired(self) -> None:
        """Requests past their expiry owe nothing more, whether or not the server said so
        (nats-server 2.9 drops a request that expires just as a message comes in without
        its 408): the messages still owed are at most what the open ones asked for."""
        if self._open:
            now = anyio.current_time()
            if self._open[0] <= now:
                while self._open and self._open[0] <= now:
                    self._open.popleft()
                self._owed = min(self._owed, len(self._open) * self.batch)

    def _on_message(
        self, generation: int, subject: str, reply: str, data: bytes, headers: bytes | None
    ) -> None:
        """The inbox's handler (bus/direct.py): buffer deliveries; a status ends its
        request."""
        if generation != self._generation:
            return  # to an inbox no longer read
        status = status_of(headers)
        if status is None:
            self._buffer.append((subject, reply, data, headers))
            self._owed = max(0, self._owed - 1)
            if self.on_arrival is not None:
                self.on_arrival()
        elif status in _REQUEST_OVER:
            fields = parse_headers(headers)
            if status == "409":
                # refused: the consumer was deleted, leadership moved, a limit was hit;
                # never the case in normal operation, and binding again mends each of them
                description = fields.get("Description")
                logger.warning(
                    "consumer.pull_refused",
                    stream=self.stream,
                    consumer=self.consumer,
                    status=status,
                    description=description,
                )
                self.broken = self.broken or f"pull request refused: {description}"
            left = fields.get("Nats-Pending-Messages")
            if left and left.isdigit():
                self._owed = max(0, self._owed - int(left))
                if self._open:
                    self._open.popleft()  # requests expire in the order they were made
            else:
                self._owed = 0
                self._open.clear()
        self._arrived.set()
