"""The input consumer (reconciler.bus.input_consumer: ordered, gap-free, restartable), against a
real nats-server."""

from __future__ import annotations

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bus.input_consumer import LOOKAHEAD, InputConsumer
from reconciler.bus.streams import StreamNames
from tests.support.bus import BusClient
from tests.support.natsserver import NatsServer, expect_reconnect

pytestmark = pytest.mark.timeout(30)

NAMES = StreamNames.for_prefix("rc")


async def publish(bus: BusClient, n: int) -> None:
    for i in range(n):
        await bus.send_raw(f"rc.in.cmd.x{i}", b"{}")


async def started_consumer(
    nc: Client, *, messages: int, batch: int, from_seq: int, fetch_timeout_s: float
) -> tuple[BusClient, InputConsumer]:
    """``messages`` inputs on the IN stream and a consumer started at ``from_seq``."""
    bus = BusClient(nc)
    await bus.ensure_streams()
    await publish(bus, messages)
    consumer = InputConsumer(
        nc, bus.js, stream="RC_IN", durable="c", batch=batch, fetch_timeout_s=fetch_timeout_s
    )
    await consumer.start(from_seq=from_seq)
    return bus, consumer


async def take(consumer: InputConsumer, n: int) -> list[int]:
    """The sequences of the next ``n`` deliveries (or more, the last fetch's whole
    batch): fetch() hands out what is buffered as soon as anything is."""
    seqs: list[int] = []
    with anyio.fail_after(5):
        while len(seqs) < n:
            seqs += [d.stream_seq for d in await consumer.fetch()]
    return seqs


async def test_deliveries_come_in_order_from_the_start_sequence(nc: Client) -> None:
    _, consumer = await started_consumer(nc, messages=30, batch=7, from_seq=11, fetch_timeout_s=0.3)
    seqs: list[int] = []
    while len(seqs) < 20:
        got = await consumer.fetch()
        assert got, "the stream has 30 messages"
        seqs += [d.stream_seq for d in got]
        await consumer.ack(got)
    assert seqs == list(range(11, 31))
    assert await consumer.fetch() == []  # nothing more: a quiet timeout
    first = got[0]
    assert first.delivered == 1 and first.timestamp.endswith("Z") and len(first.timestamp) == 30
    # restarting at an earlier sequence delivers it again, in order
    await consumer.start(from_seq=29)
    assert await take(consumer, 2) == [29, 30]
    assert consumer.restarts == 2
    await consumer.close()


async def test_the_next_batches_are_requested_before_the_caller_asks(nc: Client) -> None:
    _, consumer = await started_consumer(nc, messages=40, batch=5, from_seq=1, fetch_timeout_s=1)
    first = await consumer.fetch()
    assert first and first[0].stream_seq == 1
    # while the caller holds (and never acks) what it took, LOOKAHEAD batches come in
    with anyio.fail_after(5):
        while consumer.buffered + len(first) < 5 + LOOKAHEAD * 5:
            await anyio.sleep(0.01)
            if len(first) < 5:
                first += await consumer.fetch_buffered()
    assert len(first) == 5 and consumer.buffered == LOOKAHEAD * 5
    await anyio.sleep(0.2)
    assert consumer.buffered == LOOKAHEAD * 5  # no more than that is asked for
    # handing deliveries out asks for more: every message arrives once, in order
    seqs = [d.stream_seq for d in first]
    with anyio.fail_after(5):
        while len(seqs) < 40:
            seqs += [d.stream_seq for d in await consumer.fetch()]
    assert seqs == list(range(1, 41))
    await consumer.close()


async def test_what_is_buffered_is_handed_out_up_to_a_limit(nc: Client) -> None:
    # the pipeline grows a batch in hand to MERGE_LIMIT fetches and never past it
    _, consumer = await started_consumer(nc, messages=20, batch=5, from_seq=1, fetch_timeout_s=1)
    seqs = [d.stream_seq for d in await consumer.fetch()]
    with anyio.fail_after(5):
        while consumer.buffered < 5:  # noqa: ASYNC110 - the lookahead fills the buffer
            await anyio.sleep(0.01)
    got = await consumer.fetch_buffered(limit=3)
    assert [d.stream_seq for d in got] == [seqs[-1] + 1, seqs[-1] + 2, seqs[-1] + 3]
    assert len(await consumer.fetch_buffered(limit=50)) <= 5  # never more than a batch
    await consumer.close()


async def test_a_refused_pull_restarts_the_consumer_at_once(nc: Client) -> None:
    bus, consumer = await started_consumer(nc, messages=2, batch=5, from_seq=1, fetch_timeout_s=5)
    assert await take(consumer, 2) == [1, 2]
    # the durable is deleted under a waiting pull request (an operator, a bug): the
    # server ends the request with 409 "Consumer Deleted"
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer.fetch)
        await anyio.sleep(0.2)
        await bus.js.delete_consumer("RC_IN", "c")
    await publish(bus, 1)
    with anyio.fail_after(3):  # not the watchdog's fetch_timeout_s + grace (10 s)
        got = await consumer.fetch()
        while not got:
            got = await consumer.fetch()
    assert [d.stream_seq for d in got] == [3]
    assert consumer.restarts == 2
    await consumer.close()


async def test_the_consumer_restarts_itself_after_a_reconnect(
    nc: Client, nats_server: NatsServer
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the NATS server cannot be restarted here")
    # batches of one: fetch() hands out what is buffered as soon as anything is, so
    # larger batches would make how many are taken before the restart a race
    bus, consumer = await started_consumer(nc, messages=5, batch=1, from_seq=1, fetch_timeout_s=0.3)
    assert await take(consumer, 3) == [1, 2, 3]  # taken, never acked
    with anyio.fail_after(5):
        while consumer.buffered < 2:  # noqa: ASYNC110 - the lookahead brings 4 and 5
            await anyio.sleep(0.01)
    async with expect_reconnect(nc):
        nats_server.restart()
    # what was buffered belongs to the broken stream: nothing looks ready to take, so a
    # caller looping "while buffered: fetch_buffered()" cannot spin without yielding
    assert consumer.buffered == 0
    assert await consumer.fetch_buffered() == []
    await publish(bus, 1)
    assert await take(consumer, 3) == [4, 5, 6]  # from where it stood, without waiting for ack_wait
    assert consumer.restarts == 2
    await consumer.close()
