"""Many publishes as one write: the NATS protocol lines of a batch, handed to nats-py at once.

nats-py's ``Client.publish`` does, per message, what a batch needs once: the connection
checks, a subject check by regular expression, headers rebuilt from a dict (with a
regular expression per key), a command appended to the pending buffer, and a flush
request (an ``asyncio.Future`` and a queue put whenever the flusher is idle, which it
is between batches). :class:`Wire` builds the ``HPUB`` lines of a whole batch itself,
byte for byte what ``Client.publish`` would send, and gives nats-py the lot as one
pending command and one flush request.

The hand-over uses internals of nats-py's ``Client``, fenced in
:mod:`reconciler.bus.nats_internals` (:func:`~reconciler.bus.nats_internals.send_batch`,
:func:`~reconciler.bus.nats_internals.flush_soon`); :func:`supported` says whether the
client at hand has them, and callers fall back on ``Client.publish`` when it has not.
Everything else (buffering while reconnecting, the flusher's socket writes) stays
nats-py's.
"""

from __future__ import annotations

import asyncio
import re

from nats import errors
from nats.aio.client import Client

from reconciler.bus import nats_internals
from reconciler.core.messages import MSG_ID

__all__ = ["LazyFlush", "Wire", "supported"]

_INVALID_SUBJECT = re.compile(r"[ \t\r\n]")
_HEADER_LINE = b"NATS/1.0\r\n"
_MSG_ID = f"{MSG_ID}: ".encode()


def supported(nc: Client) -> bool:
    """Whether ``nc`` has the internals :class:`Wire` and :class:`LazyFlush` need."""
    return nats_internals.writes_batches(nc)


class Wire:
    """The protocol lines of one batch of publishes, sent with :meth:`send`."""

    __slots__ = ("_parts", "_payload_bytes", "count", "max_payload")

    def __init__(self, nc: Client) -> None:
        self._parts: list[bytes] = []
        self._payload_bytes = 0
        self.count = 0
        self.max_payload = nc.max_payload

    def add(self, subject: str, payload: bytes, reply: str, msg_id: str | None) -> None:
        """One publish of ``payload`` on ``subject`` with ``reply``, and a
        ``Nats-Msg-Id`` header when ``msg_id`` is given. Raises nats-py's own errors
        for what ``Client.publish`` refuses (a bad subject, a payload over the limit)."""
        if not subject or _INVALID_SUBJECT.search(subject) or _INVALID_SUBJECT.search(reply):
            raise errors.BadSubjectError
        size = len(payload)
        if size > self.max_payload:
            raise errors.MaxPayloadError
        if msg_id is None:
            line = f"PUB {subject} {reply} {size}\r\n" if reply else f"PUB {subject} {size}\r\n"
            self._parts.append(line.encode())
        else:
            value = msg_id.strip().replace("\r", " ").replace("\n", " ")
            header = b"%s%s%s\r\n\r\n" % (_HEADER_LINE, _MSG_ID, value.encode())
            head = len(header)
            self._parts.append(f"HPUB {subject} {reply} {head} {head + size}\r\n".encode())
            self._parts.append(header)
        self._parts.append(payload)
        self._parts.append(b"\r\n")
        self._payload_bytes += size
        self.count += 1

    async def send(self, nc: Client, *, flush: bool = True) -> None:
        """Hand every publish added to ``nc`` as one pending command, and have it
        flushed (unless ``flush`` is false: then it leaves with the connection's next
        flush, see :class:`LazyFlush`). Raises like ``Client.publish`` when the
        connection refuses."""
        if not self.count:
            return
        data = b"".join(self._parts)
        await nats_internals.send_batch(
            nc, data, count=self.count, payload_bytes=self._payload_bytes, flush=flush
        )
        self._parts = []


class LazyFlush:
    """Flushes a connection's buffer ``within_s`` after :meth:`request`, unless another
    publish flushed it meanwhile. For messages that may wait a few milliseconds (status):
    they leave in the same socket write as the next decisions and acks instead of one
    write (and one wake-up of nats-server) each."""

    __slots__ = ("_handle", "nc", "within_s")

    def __init__(self, nc: Client, *, within_s: float = 0.02) -> None:
        self.nc = nc
        self.within_s = within_s
        self._handle: asyncio.TimerHandle | None = None

    def request(self) -> None:
        if self._handle is None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_later(self.within_s, self._flush)

    def cancel(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()

    def _flush(self) -> None:
        self._handle = None
        nats_internals.flush_soon(self.nc)
