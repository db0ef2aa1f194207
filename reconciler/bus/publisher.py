"""Publishing outputs to the OUT stream: pipelined, deduplicated, confirmed.

Rules:

- An output's subject carries no prefix (``out.decision.r1``); it is published on
  ``<prefix>.<subject>``. An output with a ``msg_id`` carries it as ``Nats-Msg-Id``, so
  publishing it again inside the stream's duplicate window stores nothing new: that is
  what makes "publish, crash, publish again" exactly once.
- :meth:`OutputPublisher.publish` sends a whole batch before waiting for any
  acknowledgement, then waits for every one, all within ``timeout_s``. It returns only
  when the stream stored (or deduplicated) every output; on anything else (an error
  answer, no stream, a timeout) it raises :class:`PublishError` and the caller publishes
  the batch again later. :meth:`OutputPublisher.send` is its first half, for a caller
  that keeps several batches in flight: a :class:`Round` collects the confirmations.
- The publisher is lean on purpose, and its own rather than nats-py's async publish
  (which creates a ``wait_for`` task and a random token per message, and turns each
  answer into a dataclass): one reply subscription per publisher, replies numbered by a
  counter, answers parsed with orjson, and a batch's protocol lines handed to the
  connection as one command (:mod:`reconciler.bus.wire`). Publishes with conditional
  headers (expected sequences) are not made here; the leader bucket uses awaited
  publishes for those.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import orjson
from nats.aio.client import Client

from reconciler.bus.direct import DirectSubscription, status_of, subscribe_direct
from reconciler.bus.wire import Wire, supported
from reconciler.core.messages import MSG_ID, Subjects

__all__ = ["Ack", "OutputPublisher", "PublishError", "Publishable", "Round", "publish_outputs"]


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


@dataclass(frozen=True, slots=True)
class Ack:
    """The stream's answer to one publish."""

    stream: str
    seq: int
    duplicate: bool


#: how a JetStream PubAck starts (``{"stream":"RC_OUT","seq":7}``)
_PUB_ACK = b'{"stream":'


def _plain_pub_ack(data: bytes) -> bool:
    return data.startswith(_PUB_ACK) and b'"seq":' in data and b'"error"' not in data


def _ack(answer: Ack | bytes) -> Ack:
    if isinstance(answer, Ack):
        return answer
    parsed = orjson.loads(answer)
    return Ack(
        stream=str(parsed["stream"]),
        seq=int(parsed["seq"]),
        duplicate=bool(parsed.get("duplicate", False)),
    )


class Round:
    """The confirmations one batch of publishes waits for (see :meth:`OutputPublisher.send`)."""

    __slots__ = (
        "acks", "count", "deadline", "done", "error", "on_settled", "sent_on", "tokens", "waiting"
    )  # fmt: skip

    def __init__(
        self, count: int, *, deadline: float, on_settled: Callable[[], None] | None = None
    ) -> None:
        self.count = count
        #: each answer as read (an :class:`Ack`) or as received (a stream's PubAck JSON)
        self.acks: list[Ack | bytes | None] = [None] * count
        self.waiting = count
        self.error: str | None = None
        #: ``anyio.current_time()`` by which every confirmation is due
        self.deadline = deadline
        self.done = anyio.Event()
        self.on_settled = on_settled
        self.tokens: list[str] = []
        #: the connection's reconnect count when the round was sent
        self.sent_on = 0
        if count == 0:
            self.done.set()

    @property
    def confirmed(self) -> bool:
        """Every output stored (or deduplicated) by the stream."""
        return self.waiting == 0 and self.error is None

    def problem(self, now: float) -> str | None:
        """Why the round failed (an error answer, or late at ``now``), if it did."""
        if self.error is not None:
            return self.error
        if self.waiting and now > self.deadline:
            return f"{self.waiting} of {self.count} outputs not confirmed in time"
        return None

    def settle(self) -> None:
        self.done.set()
        if self.on_settled is not None:
            self.on_settled()


class OutputPublisher:
    """Publishes outputs on one NATS connection; see the module's rules."""

    def __init__(self, nc: Client, *, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self._inbox = ""
        self._sub: DirectSubscription | None = None
        self._numbers = itertools.count()
        #: reply token -> (round, index in the round)
        self._pending: dict[str, tuple[Round, int]] = {}
        self._wire = supported(nc)

    async def publish(
        self, outputs: Sequence[Publishable], *, timeout_s: float = 10.0
    ) -> list[Ack]:
        """Publish ``outputs`` in order and wait until the stream confirmed each of them."""
        if not outputs:
            return []
        round_ = await self.send(outputs, timeout_s=timeout_s)
        try:
            with anyio.move_on_after(max(0.0, round_.deadline - anyio.current_time())):
                await round_.done.wait()
            problem = round_.problem(anyio.current_time()) or (
                None if round_.confirmed else f"{round_.waiting} outputs not confirmed"
            )
        finally:
            self.forget(round_)
        if problem is not None:
            raise PublishError(problem)
        return [_ack(ack) for ack in round_.acks if ack is not None]

    async def send(
        self,
        outputs: Sequence[Publishable],
        *,
        timeout_s: float = 10.0,
        on_settled: Callable[[], None] | None = None,
    ) -> Round:
        """Publish ``outputs`` in order without waiting for their confirmations: the
        returned round collects them (``on_settled`` is called when it is complete or
        failed). Several rounds may be in flight; :meth:`forget` a round given up on.
        Raises :class:`PublishError` when the connection refuses the publishes."""
        round_ = Round(
            len(outputs), deadline=anyio.current_time() + timeout_s, on_settled=on_settled
        )
        if not outputs:
            return round_
        round_.sent_on = self.nc.stats["reconnects"]
        try:
            if self._sub is None:
                self._inbox = self.nc.new_inbox()
                self._sub = await subscribe_direct(self.nc, f"{self._inbox}.*", self._on_answer)
            if self._wire:
                # the whole round as one pending command and one flush (bus/wire.py)
                lines = Wire(self.nc)
                absolute, inbox, pending, tokens = (
                    self.subjects.absolute,
                    self._inbox,
                    self._pending,
                    [],
                )
                for index, out in enumerate(outputs):
                    token = str(next(self._numbers))
                    tokens.append(token)
                    pending[token] = (round_, index)
                    lines.add(absolute(out.subject), out.payload, f"{inbox}.{token}", out.msg_id)
                round_.tokens = tokens
                await lines.send(self.nc)
                return round_
            for index, out in enumerate(outputs):
                token = str(next(self._numbers))
                round_.tokens.append(token)
                self._pending[token] = (round_, index)
                headers = {MSG_ID: out.msg_id} if out.msg_id is not None else None
                await self.nc.publish(
                    self.subjects.absolute(out.subject),
                    out.payload,
                    reply=f"{self._inbox}.{token}",
                    headers=headers,
                )
        except Exception as exc:
            self.forget(round_)
            raise PublishError(f"publishing {len(outputs)} outputs failed: {exc!r}") from exc
        return round_

    def lost(self, round_: Round) -> str | None:
        """Why a round's missing confirmations will never come: the connection was
        re-established since it was sent (answers to the old connection are lost, and a
        node that died took its publishes with it), if it was."""
        if round_.waiting and self.nc.stats["reconnects"] != round_.sent_on:
            return f"{round_.waiting} of {round_.count} outputs unconfirmed across a reconnect"
        return None

    def forget(self, round_: Round) -> None:
        """Stop collecting a round's confirmations (done with it, or given up on)."""
        for token in round_.tokens:
            self._pending.pop(token, None)

    def _on_answer(self, subject: str, _reply: str, data: bytes, headers: bytes | None) -> None:
        """The answers' handler (bus/direct.py): one per publish, a stream's ack or why not."""
        found = self._pending.pop(subject[len(self._inbox) + 1 :], None)
        if found is None:
            return  # a late answer to a round that gave up
        round_, index = found
        status = status_of(headers)
        if status is not None:  # 503: no stream captures the subject
            round_.error = round_.error or f"no stream answered ({status})"
        elif _plain_pub_ack(data):
            # the usual answer: read only by publish(), when it returns the acks
            round_.acks[index] = data
        else:
            try:
                answer = orjson.loads(data)
                if "error" in answer:
                    round_.error = round_.error or f"the stream refused: {answer['error']}"
                else:
                    round_.acks[index] = Ack(
                        stream=str(answer["stream"]),
                        seq=int(answer["seq"]),
                        duplicate=bool(answer.get("duplicate", False)),
                    )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                round_.error = round_.error or f"unreadable answer {data[:200]!r}: {exc}"
        round_.waiting -= 1
        if round_.waiting == 0 or round_.error is not None:
            round_.settle()

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception:  # a dead connection: nothing to undo
                return


async def publish_outputs(
    nc: Client,
    outputs: Sequence[Publishable],
    *,
    prefix: str,
    timeout_s: float = 10.0,
) -> list[Ack]:
    """Publish ``outputs`` once with a publisher of their own (tools and tests)."""
    publisher = OutputPublisher(nc, prefix=prefix)
    try:
        return await publisher.publish(outputs, timeout_s=timeout_s)
    finally:
        await publisher.close()
