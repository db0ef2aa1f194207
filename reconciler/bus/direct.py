"""Messages of a subscription handed to a plain function as soon as they are parsed.

nats-py turns every message it receives into a ``Msg`` (its header block parsed into a
dict line by line), puts it on the subscription's queue, and a task of the subscription
awaits the callback, one coroutine per message. For the inboxes that carry this job's
bulk (the IN stream's pull deliveries, the publish acknowledgements, the replay's reads
of both streams) that is most of what receiving a message costs.
:func:`subscribe_direct` calls a plain function instead, from the connection's reader,
with the subject, the reply subject, the payload and the raw header block.

Rules:

- The subscription itself is nats-py's (``Client.subscribe``): the ``SUB`` line, the
  ``sid``, re-subscribing after a reconnect and ``UNSUB`` stay its own. Only the
  hand-over differs.
- The hand-over goes through nats-py internals, fenced in
  :mod:`reconciler.bus.nats_internals` (:func:`~reconciler.bus.nats_internals.message_router`:
  one routing wrapper per client, in place of the method the protocol parser awaits for
  every message, handing every other subscription's messages on unchanged).
  :func:`supported` says whether the client at hand has them; without them the handler
  is called from an ordinary callback, with the header block rebuilt.
- A handler runs on the connection's reader: it must be quick, must not block, and may
  not raise (what it raises is logged and the message dropped). Nothing is queued for
  it, so nothing is dropped as a slow consumer either: callers bound what can arrive by
  what they asked for (pull requests, publishes awaiting an answer).
- :func:`parse_headers` reads a header block as nats-py does (``Status`` and
  ``Description`` from an inline status line, then ``Name: Value`` lines, the last of a
  repeated name winning).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reconciler.bus import nats_internals
from reconciler.bus.nats_internals import MessageRouter

__all__ = [
    "DirectHandler",
    "DirectSubscription",
    "header_value",
    "parse_headers",
    "status_of",
    "subscribe_direct",
    "supported",
]

logger = structlog.get_logger(__name__)

#: what a direct subscription's messages are handed to: ``(subject, reply, data,
#: headers)``, the header block raw (``b"NATS/1.0..."``) or ``None``
DirectHandler = Callable[[str, str, bytes, bytes | None], None]

_HEADER_LINE = b"NATS/1.0"
_CRLF = b"\r\n"


def supported(nc: Client) -> bool:
    """Whether ``nc`` has the internals a direct hand-over needs (see the rules)."""
    return nats_internals.routes_messages(nc)


class DirectSubscription:
    """A subscription whose messages go to a plain function; see :func:`subscribe_direct`."""

    def __init__(self, sub: Subscription, routes: MessageRouter | None, sid: int | None) -> None:
        self._sub = sub
        self._routes = routes
        self._sid = sid
        #: whether messages are handed over directly (else through a nats-py callback)
        self.direct = routes is not None

    async def unsubscribe(self) -> None:
        """Stop the hand-over, then unsubscribe (nats-py's own ``UNSUB``)."""
        if self._routes is not None and self._sid is not None:
            self._routes.pop(self._sid, None)
        await self._sub.unsubscribe()


async def subscribe_direct(
    nc: Client, subject: str, handler: DirectHandler, *, direct: bool | None = None
) -> DirectSubscription:
    """Subscribe to ``subject``, handing each message to ``handler`` (see the rules).
    ``direct=False`` takes nats-py's ordinary callback path even where the direct one
    is supported (what happens without the internals; tests use it)."""
    routes = (
        nats_internals.message_router(nc, _call) if direct is not False and supported(nc) else None
    )

    async def through_nats_py(msg: Msg) -> None:
        _call(handler, msg.subject, msg.reply or "", msg.data, _header_block(msg.headers))

    sub = await nc.subscribe(subject, cb=through_nats_py)
    sid = nats_internals.subscription_id(sub)
    if routes is not None and sid is not None:
        routes[sid] = handler
    else:
        routes = None
    return DirectSubscription(sub, routes, sid)


def _call(
    handler: DirectHandler, subject: str, reply: str, data: bytes, headers: bytes | None
) -> None:
    try:
        handler(subject, reply, data, headers)
    except Exception as exc:  # the connection's reader must go on
        logger.error("direct.handler_failed", subject=subject, error=repr(exc))


def _header_block(headers: dict[str, str] | None) -> bytes | None:
    """The header block of a message nats-py parsed (the fallback path)."""
    if not headers:
        return None
    fields = dict(headers)
    status, description = fields.pop("Status", None), fields.pop("Description", None)
    first = _HEADER_LINE
    if status is not None:
        first += f" {status}".encode() + (f" {description}".encode() if description else b"")
    lines = [first] + [f"{k}: {v}".encode() for k, v in fields.items()]
    return _CRLF.join(lines) + _CRLF + _CRLF


def status_of(headers: bytes | None) -> str | None:
    """The inline status of a header block (``"404"`` of ``NATS/1.0 404 No Messages``),
    or ``None`` for an ordinary message."""
    if not headers or headers[len(_HEADER_LINE) : len(_HEADER_LINE) + 1] != b" ":
        return None
    return parse_headers(headers).get("Status")


def header_value(headers: bytes | None, name: str) -> str | None:
    """One field of a header block (:func:`parse_headers`), or ``None``."""
    if not headers:
        return None
    # the usual block is one field: a search says whether it can be there at all
    if name.encode() not in headers:
        return None
    return parse_headers(headers).get(name)


def parse_headers(headers: bytes | None) -> dict[str, str]:
    """The fields of a header block, as nats-py reads them (see the rules)."""
    out: dict[str, str] = {}
    if not headers or not headers.startswith(_HEADER_LINE):
        return out
    first, _, rest = headers.partition(_CRLF)
    inline = first[len(_HEADER_LINE) :].strip()
    if inline:
        status, _, description = inline.partition(b" ")
        if status.isdigit():
            out["Status"] = status.decode()
        if description.strip():
            out["Description"] = description.strip().decode("utf-8", "replace")
    for line in rest.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key = name.strip()
        if not key or not key.isascii() or len(key.split()) != 1:
            continue  # nats-py skips a name it cannot read, or one with spaces in it
        out[key.decode()] = value.strip().decode("utf-8", "replace")
    return out
