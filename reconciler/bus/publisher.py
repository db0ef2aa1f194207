"""Publishing outputs to the OUT stream: pipelined, deduplicated, confirmed.

Rules:

- An output's subject carries no prefix (``out.decision.r1``); it is published on
  ``<prefix>.<subject>``. An output with a ``msg_id`` carries it as ``Nats-Msg-Id``, so
  publishing it again inside the stream's duplicate window stores nothing new: that is
  what makes "publish, crash, publish again" exactly once.
- :func:`publish_outputs` sends a whole batch before waiting for any acknowledgement
  (JetStream's async publish), then waits for every one, all within ``timeout_s``. It
  returns only when the stream stored (or deduplicated) every output; on anything else
  it raises :class:`PublishError` and the caller publishes the batch again later.
- A JetStream API error answers the publish with an error, which nats-py's async publish
  does not always surface: the overall timeout is what bounds a batch, never an await
  without one. Publishes with conditional headers (expected sequences) are not made
  here; the leader bucket uses awaited publishes for those.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import anyio
from nats.js import JetStreamContext, api

__all__ = ["PublishError", "Publishable", "publish_outputs"]

MSG_ID = "Nats-Msg-Id"


class PublishError(Exception):
    """A batch of outputs was not confirmed by the stream; publish it again later."""


class Publishable(Protocol):
    """What can be published: the fold's ``Output`` and the store's outbox rows."""

    @property
    def subject(self) -> str: ...

    @property
    def msg_id(self) -> str | None: ...

    @property
    def payload(self) -> bytes: ...


async def publish_outputs(
    js: JetStreamContext,
    outputs: Sequence[Publishable],
    *,
    prefix: str,
    timeout_s: float = 10.0,
) -> list[api.PubAck]:
    """Publish ``outputs`` in order and wait until the stream confirmed each of them."""
    if not outputs:
        return []
    pending: list[asyncio.Future[api.PubAck]] = []
    try:
        with anyio.fail_after(timeout_s):
            for out in outputs:
                headers = {MSG_ID: out.msg_id} if out.msg_id is not None else None
                pending.append(
                    await js.publish_async(f"{prefix}.{out.subject}", out.payload, headers=headers)
                )
            return [await future for future in pending]
    except TimeoutError as exc:
        confirmed = sum(1 for f in pending if f.done() and not f.cancelled())
        raise PublishError(
            f"{len(outputs) - confirmed} of {len(outputs)} outputs not confirmed "
            f"within {timeout_s} s"
        ) from exc
    except Exception as exc:
        raise PublishError(f"publishing {len(outputs)} outputs failed: {exc!r}") from exc
    finally:
        for future in pending:
            if not future.done():
                future.cancel()  # releases nats-py's pending-publish slot
            elif not future.cancelled():
                future.exception()  # retrieved: reported above, not again by asyncio
