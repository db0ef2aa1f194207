"""Publishing inputs to JetStream the way every component should: sized, retried, refused
clearly.

Rules:

- Header plus payload over the server's ``max_payload`` is refused here, before sending,
  with :class:`PayloadTooLarge`: nats-py checks only the payload, and the server closes
  the connection over the sum (nats-py then stays closed).
- ``NoStreamResponseError`` (no stream, or no stream leader: a few seconds during a
  cluster failover) is retried with a backoff that doubles up to ``max_backoff_s``, for
  ``retry_for_s`` at most, with the *same* ``Nats-Msg-Id``: a retry of a message the
  stream stored after all is answered ``duplicate`` and stores nothing new. A publish
  whose acknowledgement timed out (a node lost mid-publish) is retried the same way,
  but only when it has a ``Nats-Msg-Id``: without one, a retry could store it twice. An answer
  ``duplicate`` with sequence 0 (nats-server 2.10.14 to 2.10.x during a leadership
  change, for a message never stored) is retried as a failure.
- A permissions violation raises :class:`~reconciler.bus.violations.PermissionViolation`
  at once (see :mod:`reconciler.bus.violations`) instead of a timeout.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NoStreamResponseError

from reconciler.bus.nats_internals import client_of
from reconciler.bus.violations import guarded
from reconciler.core.messages import MSG_ID

__all__ = ["PayloadTooLarge", "check_size", "encoded_size", "publish"]

logger = structlog.get_logger(__name__)

_HEADER_LINE = len(b"NATS/1.0\r\n")


class PayloadTooLarge(ValueError):
    """A message the server would refuse (and close the connection for)."""


def encoded_size(payload: bytes, headers: Mapping[str, str] | None) -> int:
    """Bytes the server counts against ``max_payload``: headers as sent, plus payload."""
    if not headers:
        return len(payload)
    size = _HEADER_LINE + 2  # the status line and the blank line that ends the headers
    for key, value in headers.items():
        size += len(key.encode()) + 2 + len(value.encode()) + 2
    return size + len(payload)


def check_size(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str] | None) -> None:
    """Raise :class:`PayloadTooLarge` when the server would refuse the message."""
    limit = nc.max_payload
    size = encoded_size(payload, headers)
    if limit and size > limit:
        raise PayloadTooLarge(
            f"a message of {size} bytes (headers and payload) on {subject!r} exceeds the "
            f"NATS server's max_payload of {limit} bytes: not sent"
        )


async def publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    retry_for_s: float = 30.0,
    max_backoff_s: float = 2.0,
) -> api.PubAck:
    """Publish to a stream and await its acknowledgement; see the module's rules.

    ``timeout_s`` bounds each attempt (``None``: the JetStream context's own timeout);
    ``retry_for_s=0`` makes one attempt, for a caller that retries in a loop of its own."""
    nc = client_of(js)
    sent = dict(headers or {})
    if msg_id is not None:
        sent[MSG_ID] = msg_id
    check_size(nc, subject, payload, sent)
    delay = 0.05
    deadline = anyio.current_time() + retry_for_s
    while True:
        try:
            ack = await guarded(
                nc,
                lambda: js.publish(subject, payload, timeout=timeout_s, headers=sent or None),
                subjects=(subject,),
            )
            if ack.duplicate and not ack.seq:
                raise NoStreamResponseError(description="duplicate with sequence 0")
            return ack
        except (NoStreamResponseError, NatsTimeoutError) as exc:
            # a timeout may hide a message stored after all: sent again only with an id
            if anyio.current_time() + delay > deadline or (
                isinstance(exc, NatsTimeoutError) and msg_id is None
            ):
                raise
            logger.info(
                "publish.retrying", subject=subject, why=repr(exc), retry_in_s=round(delay, 3)
            )
        await anyio.sleep(delay)
        delay = min(delay * 2, max_backoff_s)
