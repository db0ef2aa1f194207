"""The leader's outbox publisher against a real nats-server: batches in flight at once,
confirmed in commit order, and a failed or late round sent again without doubling."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from nats.aio.client import Client

from reconciler.core.messages import Output
from reconciler.core.state import Effects
from reconciler.replica.leader import Leadership
from reconciler.replica.outbox_publisher import OutboxPublisher
from reconciler.replica.pipeline import Commit
from reconciler.store import Store
from tests.support.bus import BusClient
from tests.support.executor import until
from tests.support.natsserver import NatsServer


def decision(request_id: str) -> Output:
    return Output(
        f"out.decision.{request_id}",
        f"decision:{request_id}:final",
        b'{"r":"%s"}' % request_id.encode(),
    )


def committed(seq: int, *outputs: Output) -> Commit:
    return Commit(applied_seq=seq, fx=Effects(outputs=list(outputs)), inputs=1, dead_letters=0)


@asynccontextmanager
async def publishing(
    nc: Client, tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[OutboxPublisher, Leadership]]:
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with await Store.open(tmp_path / "rc.db") as store:
        publisher = OutboxPublisher(store=store, nc=nc, prefix="rc", **options)
        leadership = Leadership(holder="test", since=0.0)
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            tg.start_soon(publisher.run, leadership, ready)
            await ready.wait()
            yield publisher, leadership
            tg.cancel_scope.cancel()


async def published_through(leadership: Leadership, seq: int) -> None:
    await until(lambda: leadership.published_seq >= seq)


async def test_a_batch_goes_out_before_the_ones_before_it_are_confirmed(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    async with publishing(nc, tmp_path) as (publisher, leadership):
        nats_server.pause()  # no confirmations for now
        try:
            publisher.notify(committed(1, decision("a"), decision("b")))
            await anyio.sleep(0.1)
            publisher.notify(committed(2, decision("c")))
            await anyio.sleep(0.1)
            assert len(publisher._rounds) == 2  # the second did not wait for the first
            assert leadership.published_seq == 0  # nothing counts before it is confirmed
        finally:
            nats_server.resume()
        await published_through(leadership, 2)
        assert publisher.published == 3
    outputs = await BusClient(nc).outputs()
    assert [o.msg_id for o in outputs] == [
        "decision:a:final",
        "decision:b:final",
        "decision:c:final",
    ]


async def test_a_late_round_is_sent_again_and_stored_once(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    async with publishing(nc, tmp_path, publish_timeout_s=0.3, max_backoff_s=0.2) as (
        publisher,
        leadership,
    ):
        nats_server.pause()
        try:
            publisher.notify(committed(1, decision("a")))
            publisher.notify(committed(2, decision("b")))
            await anyio.sleep(1.0)  # past the deadline: abandoned, and sent again
        finally:
            nats_server.resume()
        await published_through(leadership, 2)
        publisher.notify(committed(3, decision("c")))
        await published_through(leadership, 3)
    outputs = await BusClient(nc).outputs()
    assert [o.msg_id for o in outputs] == [
        "decision:a:final",
        "decision:b:final",
        "decision:c:final",
    ]


async def test_an_error_answer_is_retried_until_the_stream_takes_it(
    nc: Client, tmp_path: Path
) -> None:
    async with publishing(nc, tmp_path, max_backoff_s=0.2) as (publisher, leadership):
        js = nc.jetstream()
        await js.delete_stream("RC_OUT")  # publishes are now refused (no responders)
        publisher.notify(committed(1, decision("a")))
        await anyio.sleep(0.5)
        assert leadership.published_seq == 0
        await BusClient(nc).ensure_streams()
        await published_through(leadership, 1)
    outputs = await BusClient(nc).outputs()
    assert [o.msg_id for o in outputs] == ["decision:a:final"]
