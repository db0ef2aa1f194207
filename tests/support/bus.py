"""Talking to a running reconciler the way producers, GARM and auditors do: over the bus.

:class:`BusClient` publishes contract inputs to JetStream, reads outputs back from the
OUT stream (not from a live subscription, so nothing published before the test looked
is missed), and asks queries. :func:`running_replica` runs one in-process replica of
``reconciler run`` for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import KeyNotFoundError, NotFoundError, ServiceUnavailableError

from reconciler.bus.connection import ConnectOptions
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.replica.replica import Replica, RunConfig
from tests.support.builders import subject_of

Item = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class OutMsg:
    seq: int
    subject: str
    msg_id: str | None
    data: bytes

    def json(self) -> Any:
        return orjson.loads(self.data)


class BusClient:
    """A producer, observer and query client of one prefix."""

    def __init__(self, nc: Client, *, prefix: str = "rc") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.prefix = prefix
        self.names = StreamNames.for_prefix(prefix)

    async def ensure_streams(self) -> None:
        """Create the streams as ``reconciler run`` would, to publish before it starts."""
        await ensure_streams(self.js, self.names)

    # ----------------------------------------------------------------- inputs

    async def send(self, *items: Item, msg_ids: bool = True) -> list[int]:
        """Publish inputs in order; their stream sequences. Commands carry their
        ``request_id`` as ``Nats-Msg-Id`` unless ``msg_ids`` is false."""
        seqs = []
        for item in items:
            payload = item[1]
            rid = payload.get("request_id") if msg_ids else None
            seqs.append(
                await self.send_raw(
                    subject_of(item, prefix=self.prefix),
                    orjson.dumps(payload),
                    msg_id=f"in:{rid}" if rid else None,
                )
            )
        return seqs

    async def send_many(self, items: list[Item]) -> None:
        """Publish many inputs pipelined (JetStream async publish), each command with its
        ``request_id`` as ``Nats-Msg-Id``; returns once the stream confirmed them all."""
        futures = []
        for item in items:
            rid = item[1].get("request_id")
            futures.append(
                await self.js.publish_async(
                    subject_of(item, prefix=self.prefix),
                    orjson.dumps(item[1]),
                    headers={"Nats-Msg-Id": f"in:{rid}"} if rid else None,
                )
            )
        with anyio.fail_after(60):
            for future in futures:
                await future

    async def send_raw(self, subject: str, data: bytes, *, msg_id: str | None = None) -> int:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        ack = await self.js.publish(subject, data, headers=headers, timeout=5)
        return int(ack.seq)

    # ---------------------------------------------------------------- outputs

    async def outputs(self, subject: str | None = None) -> list[OutMsg]:
        """Every message of the OUT stream (optionally of one subject filter), in order."""
        return await self._read(self.names.out_stream, subject or self.names.out_subjects)

    async def inputs(self, subject: str | None = None) -> list[OutMsg]:
        """Every message of the IN stream (optionally of one subject filter), in order."""
        return await self._read(self.names.in_stream, subject or self.names.in_subjects)

    async def _read(self, stream: str, filter_subject: str) -> list[OutMsg]:
        try:
            info = await self.js.stream_info(stream)
        except NotFoundError:
            return []
        last = int(info.state.last_seq or 0)
        if last == 0:
            return []
        sub = await self.js.pull_subscribe(
            filter_subject,
            stream=stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                deliver_policy=api.DeliverPolicy.ALL,
                inactive_threshold=30.0,
            ),
        )
        found: list[OutMsg] = []
        try:
            while True:
                try:
                    msgs = await sub.fetch(1000, timeout=0.5)
                except (TimeoutError, NatsTimeoutError):
                    break
                for m in msgs:
                    found.append(
                        OutMsg(
                            seq=m.metadata.sequence.stream,
                            subject=m.subject,
                            msg_id=(m.headers or {}).get("Nats-Msg-Id"),
                            data=m.data,
                        )
                    )
                if found and found[-1].seq >= last:
                    break
        finally:
            await sub.unsubscribe()
        return found

    async def wait_inputs(
        self, subject: str, count: int = 1, *, within_s: float = 10.0
    ) -> list[OutMsg]:
        """The IN stream's messages of ``subject``, once there are at least ``count``."""
        with anyio.fail_after(within_s):
            while len(found := await self.inputs(subject)) < count:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        return found

    async def wait_outputs(
        self, subject: str, count: int = 1, *, within_s: float = 10.0
    ) -> list[OutMsg]:
        """The OUT stream's messages of ``subject``, once there are at least ``count``."""
        with anyio.fail_after(within_s):
            while len(found := await self.outputs(subject)) < count:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        return found

    async def last_output(self, subject: str) -> OutMsg | None:
        try:
            m = await self.js.get_last_msg(self.names.out_stream, subject)
        except NotFoundError:
            return None
        return OutMsg(
            seq=int(m.seq or 0),
            subject=m.subject or subject,
            msg_id=(m.headers or {}).get("Nats-Msg-Id"),
            data=m.data or b"",
        )

    async def decision(
        self, request_id: str, *, phase: str = "final", within_s: float = 10.0
    ) -> dict[str, Any]:
        """The decision of ``request_id`` in ``phase``, waiting for it to be published."""
        subject = f"{self.prefix}.out.decision.{request_id}"
        with anyio.fail_after(within_s):
            while True:
                found = await self.last_output(subject)
                if found is not None:
                    body = found.json()
                    if body["phase"] == phase:
                        assert isinstance(body, dict)
                        return body
                await anyio.sleep(0.02)

    async def wait_output(self, subject: str, *, within_s: float = 10.0) -> OutMsg:
        with anyio.fail_after(within_s):
            while True:
                found = await self.last_output(subject)
                if found is not None:
                    return found
                await anyio.sleep(0.02)

    # ---------------------------------------------------------------- queries

    async def query(self, name: str, request: Any = None, *, within_s: float = 5.0) -> Any:
        data = b"{}" if request is None else orjson.dumps(request)
        reply = await self.nc.request(f"{self.prefix}.query.{name}", data, timeout=within_s)
        return orjson.loads(reply.data)

    async def result(self, name: str, request: Any = None) -> Any:
        reply = await self.query(name, request)
        assert reply["ok"], reply
        return reply["result"]

    async def wait_caught_up(self, *, within_s: float = 15.0, leader: bool = True) -> None:
        """Until a replica's committed position reaches the stream's head and, with
        ``leader``, the leader has published every output up to it."""
        with anyio.fail_after(within_s):
            while True:
                with contextlib.suppress(NatsTimeoutError, NoRespondersError, TimeoutError):
                    health = (await self.query("health", within_s=1.0))["result"]
                    caught_up = (
                        health["caches_synced"]
                        and health["applied_seq"] >= health["stream_last_seq"]
                    )
                    published = health["leader_ready"] and (
                        health["published_seq"] >= health["applied_seq"]
                    )
                    if caught_up and (published or not leader):
                        return
                await anyio.sleep(0.02)


def fast_config(nats_url: str, db: Path, **overrides: Any) -> RunConfig:
    """A run configuration with test-friendly timings."""
    settings: dict[str, Any] = {
        "nats": ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.1, connect_timeout_s=1.0),
        "db": db,
        "replica": f"t{secrets.token_hex(3)}",
        "leader_ttl_s": 2.0,
        "status_debounce_s": 0.05,
        "status_progress_interval_s": 30.0,
    }
    settings.update(overrides)
    return RunConfig(**settings)


@contextlib.asynccontextmanager
async def running_replica(config: RunConfig, *, ready: bool = True) -> AsyncIterator[Replica]:
    """One replica of ``reconciler run`` for the block; stopped gracefully at its end.
    With ``ready``, waits until it leads with a drained outbox (a single replica does)."""
    replica = Replica(config)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(replica.run, stop=stop))
        with anyio.fail_after(15):
            await replica.started.wait()
            while ready and not replica.leader_ready:  # noqa: ASYNC110 - a flag, no event
                await anyio.sleep(0.01)
        try:
            yield replica
        finally:
            stop.set()


@dataclass(frozen=True, slots=True)
class Stamped:
    """A stream message's subject, ``Nats-Msg-Id`` and the stream's own timestamp."""

    subject: str
    msg_id: str | None
    at: float


#: how long pull requests answered "no responders" are sent again (see stream_messages)
UNANSWERED_PULLS_S = 10.0


async def stream_messages(js: Any, stream: str, subjects: str) -> list[Stamped]:
    """Every message of ``stream`` (an ephemeral consumer, no acks), in stream order.

    On a cluster, the server this client talks to may learn of the new consumer's
    interest in its pull requests after the consumer was created (it lives on another
    server, whose interest travels its own route): a pull request in between is
    answered 503, no responders, and nothing is delivered for it. Such requests are sent
    again for up to :data:`UNANSWERED_PULLS_S`."""
    sub = await js.pull_subscribe(
        subjects,
        stream=stream,
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL
        ),
    )
    out: list[Stamped] = []
    total = (await js.stream_info(stream)).state.messages
    unanswered_until = anyio.current_time() + UNANSWERED_PULLS_S
    try:
        while len(out) < total:
            try:
                fetched = await sub.fetch(1000, timeout=10)
            except ServiceUnavailableError:
                if anyio.current_time() > unanswered_until:
                    raise
                await anyio.sleep(0.1)
                continue
            for m in fetched:
                headers = m.headers or {}
                out.append(
                    Stamped(m.subject, headers.get("Nats-Msg-Id"), m.metadata.timestamp.timestamp())
                )
    finally:
        await sub.unsubscribe()
    return out


async def leader_holder(js: Any, *, bucket: str = "rc_leader", within_s: float = 60) -> str:
    """The replica holding the leader key (waiting through a lapse between holders)."""
    kv = await js.key_value(bucket)
    with anyio.fail_after(within_s):
        while True:
            try:
                entry = await kv.get("leader")
                holder = orjson.loads(entry.value or b"{}").get("holder")
                if holder:
                    return str(holder)
            except KeyNotFoundError:
                pass
            await anyio.sleep(0.2)


async def stream_with_inputs(nc: Client, count: int, *, prefix: str = "rc") -> BusClient:
    """The streams of ``prefix``, and ``count`` inputs on the IN stream that only take
    stream sequences (``<prefix>.in.cmd.x<i>``, ``{}``: dead letters if folded)."""
    bus = BusClient(nc, prefix=prefix)
    await bus.ensure_streams()
    for i in range(count):
        await bus.send_raw(f"{prefix}.in.cmd.x{i}", b"{}")
    return bus
