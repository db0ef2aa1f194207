"""Many publishes as one write: the NATS protocol lines of a batch, handed to nats-py at once.

nats-py's ``Client.publish`` does, per message, what a batch needs once: the connection
checks, a subject check by regular expression, headers rebuilt from a dict (with a
regular expression per key), a command appended to the pending buffer, and a flush
request (an ``asyncio.Future`` and a queue put whenever the flusher is idle, which it
is between batches). :class:`Wire` builds the ``HPUB`` lines of a whole batch itself,
byte for byte what ``Client.publish`` would send, and gives nats-py the lot as one
pending command and one flush request.

It uses two internals of nats-py's ``Client`` (``_send_command`` and
``_flush_pending``, unchanged since 2.2); :func:`supported` says whether the client at
hand has them, and callers fall back on ``Client.publish`` when it has not. Everything
else (buffering while reconnecting, the flusher's socket writes) stays nats-py's.
"""

from __future__ import annotations

import re
from typing import Any

from nats import errors
from nats.aio.client import Client

__all__ = ["Wire", "supported"]

_INVALID_SUBJECT = re.compile(r"[ \t\r\n]")
_HEADER_LINE = b"NATS/1.0\r\n"


def supported(nc: Client) -> bool:
    """Whether ``nc`` has the internals :class:`Wire` hands its commands to."""
    return callable(getattr(nc, "_send_command", None)) and callable(
        getattr(nc, "_flush_pending", None)
    )


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
            self._parts.append(f"PUB {subject} {reply} {size}\r\n".encode())
        else:
            value = msg_id.strip().replace("\r", " ").replace("\n", " ")
            header = b"%sNats-Msg-Id: %s\r\n\r\n" % (_HEADER_LINE, value.encode())
            head = len(header)
            self._parts.append(f"HPUB {subject} {reply} {head} {head + size}\r\n".encode())
            self._parts.append(header)
        self._parts.append(payload)
        self._parts.append(b"\r\n")
        self._payload_bytes += size
        self.count += 1

    async def send(self, nc: Client) -> None:
        """Hand every publish added to ``nc`` as one pending command, and have it
        flushed. Raises like ``Client.publish`` when the connection refuses."""
        if not self.count:
            return
        if nc.is_closed:
            raise errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise errors.ConnectionDrainingError
        data = b"".join(self._parts)
        client: Any = nc  # the two internals (see the module's doc)
        if not nc.is_connected:
            limit = client._max_pending_size
            if limit <= 0 or len(data) + client._pending_data_size > limit:
                raise errors.OutboundBufferLimitError
        self._parts = []
        nc.stats["out_msgs"] += self.count
        nc.stats["out_bytes"] += self._payload_bytes
        await client._send_command(data)
        queue = client._flush_queue
        if queue is not None and queue.empty():
            await client._flush_pending()
