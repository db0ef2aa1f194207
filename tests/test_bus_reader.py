"""The one pull reader (reconciler/bus/reader.py) and the consumers it reads
(reconciler/bus/consumers.py), against a real nats-server."""

from __future__ import annotations

import anyio
import pytest
from click.testing import CliRunner
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.consumers import (
    Ensured,
    ensure_executor_consumer,
    executor_consumer_name,
    first_seq_since,
    input_consumer,
    replay_reader,
)
from reconciler.bus.reader import (
    ACK,
    PullReader,
    parse_ack_subject,
    pending_of,
    reply,
    rfc3339_nanos,
)
from reconciler.bus.streams import StreamNames
from tests.bus import BusClient
from tests.natsserver import NatsServer, expect_reconnect

pytestmark = pytest.mark.timeout(30)

NAMES = StreamNames.for_prefix("rc")


async def _stream_of(nc: Client, n: int) -> BusClient:
    bus = BusClient(nc)
    await bus.ensure_streams()
    for i in range(n):
        await bus.send_raw(f"rc.in.cmd.x{i}", b"{}")
    return bus


async def _read(reader: PullReader, n: int, *, within_s: float = 5.0) -> list[int]:
    """The stream sequences of the next ``n`` deliveries."""
    seqs: list[int] = []
    with anyio.fail_after(within_s):
        while len(seqs) < n:
            if not reader.buffered:
                await reader.wait()
            seqs += [parse_ack_subject(m[1])[0] for m in reader.pop_buffered(n - len(seqs))]
    return seqs


def test_ack_subjects_and_timestamps() -> None:
    assert parse_ack_subject("$JS.ACK.RC_IN.c1.2.41.40.1764669600123456789.7") == (
        41,
        2,
        1764669600123456789,
    )
    assert pending_of("$JS.ACK.RC_OUT.c1.1.9.9.1764669600000000001.17") == 17
    assert pending_of("$JS.ACK.hub.ACCHASH.RC_OUT.c1.1.9.9.1764669600000000001.4.x") == 4
    assert pending_of("_INBOX.abc") == 0
    assert rfc3339_nanos(1764669600000000001) == "2025-12-02T10:00:00.000000001Z"


async def test_requests_are_made_ahead_and_no_further(nc: Client) -> None:
    bus = await _stream_of(nc, 30)
    await bus.js.add_consumer("RC_IN", config=replay_reader("r", start_seq=1))
    reader = PullReader(nc, stream="RC_IN", batch=4, ahead=3)
    await reader.bind("r")
    assert await _read(reader, 1) == [1]
    with anyio.fail_after(5):
        while reader.buffered < 3 * 4 - 1:  # noqa: ASYNC110 - the requests made ahead
            await anyio.sleep(0.01)
    await anyio.sleep(0.2)
    assert reader.buffered == 3 * 4 - 1  # three requests of four, one delivery taken
    assert await _read(reader, 29) == list(range(2, 31))
    await reader.unbind()


async def test_an_expired_request_ends_the_wait_without_breaking_the_reader(nc: Client) -> None:
    bus = await _stream_of(nc, 0)
    await bus.js.add_consumer("RC_IN", config=replay_reader("r"))
    reader = PullReader(nc, stream="RC_IN", batch=10, ahead=1, expires_s=0.2)
    await reader.bind("r")
    started = anyio.current_time()
    with anyio.fail_after(5):
        await reader.wait()  # the request's 408
    assert reader.buffered == 0 and reader.broken is None
    assert anyio.current_time() - started < 2
    await bus.send_raw("rc.in.cmd.late", b"{}")
    assert await _read(reader, 1) == [1]
    await reader.unbind()


async def test_a_deleted_consumer_breaks_the_reader_and_binding_again_mends_it(
    nc: Client,
) -> None:
    bus = await _stream_of(nc, 2)
    await bus.js.add_consumer("RC_IN", config=replay_reader("r", start_seq=1))
    reader = PullReader(nc, stream="RC_IN", batch=5, ahead=1, expires_s=5)
    await reader.bind("r")
    assert await _read(reader, 2) == [1, 2]
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader.wait)
        await anyio.sleep(0.2)
        await bus.js.delete_consumer("RC_IN", "r")  # 409 "Consumer Deleted"
    assert reader.broken is not None and "refused" in reader.broken
    assert reader.needs_binding()
    await bus.js.add_consumer("RC_IN", config=replay_reader("r2", start_seq=2))
    await reader.bind("r2")
    assert not reader.needs_binding()
    assert await _read(reader, 1) == [2]
    await reader.unbind()


async def test_a_reconnect_breaks_the_reader_and_an_old_inbox_is_not_read(
    nc: Client, nats_server: NatsServer
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the NATS server cannot be restarted here")
    bus = await _stream_of(nc, 3)
    await bus.js.add_consumer("RC_IN", config=replay_reader("r", start_seq=1))
    reader = PullReader(nc, stream="RC_IN", batch=1, ahead=1, expires_s=0.3)
    await reader.bind("r")
    assert await _read(reader, 1) == [1]
    async with expect_reconnect(nc):
        nats_server.restart()
    assert reader.needs_binding() and reader.broken == "client reconnected"
    old_inbox = reader._inbox
    await bus.js.add_consumer("RC_IN", config=replay_reader("r2", start_seq=2))
    await reader.bind("r2")
    # a late delivery to the inbox of before is dropped, not mixed with the new ones
    await nc.publish(old_inbox, b"late", reply="$JS.ACK.RC_IN.r.1.9.9.1764669600000000000.0")
    await nc.flush()
    assert await _read(reader, 2) == [2, 3]
    await reader.unbind()


async def test_the_input_consumer_is_configured_as_documented(nc: Client) -> None:
    bus = await _stream_of(nc, 5)
    info = await bus.js.add_consumer(
        "RC_IN", config=input_consumer("RC_IN-a", from_seq=3, batch=500, ack_wait_s=60)
    )
    config = info.config
    assert config.durable_name == "RC_IN-a" and config.opt_start_seq == 3
    assert config.ack_policy == api.AckPolicy.ALL and config.max_ack_pending == 4000
    assert config.mem_storage and config.num_replicas in (0, 1)
    assert info.num_pending == 3


async def test_executor_consumers_catch_up_on_the_last_hour_however_they_are_made(
    nc: Client, nats_url: str
) -> None:
    """The executor and ``reconciler provision`` make the same consumer: a command decided
    before it existed is delivered (the last hour's), an older one is not."""
    from reconciler.cli.main import cli

    bus = BusClient(nc)
    await bus.ensure_streams()
    for host in ("h1", "h2"):
        await bus.js.publish(f"rc.out.exec.{host}.c1", b"{}")

    async def ensure(ack_wait_s: float, max_in_hand: int) -> Ensured:
        return await ensure_executor_consumer(
            nc,
            bus.js,
            stream=NAMES.out_stream,
            prefix="rc",
            host="h1",
            ack_wait_s=ack_wait_s,
            max_in_hand=max_in_hand,
            catch_up_s=3600.0,
        )

    assert await ensure(120.0, 64) is Ensured.CREATED
    args = ["provision", "--nats-url", nats_url, "--executor-host", "h2"]
    done = await anyio.to_thread.run_sync(lambda: CliRunner().invoke(cli, args))
    assert done.exit_code == 0, done.output
    by_executor = await bus.js.consumer_info("RC_OUT", executor_consumer_name("h1"))
    by_provision = await bus.js.consumer_info("RC_OUT", executor_consumer_name("h2"))
    assert by_executor.num_pending == by_provision.num_pending == 1
    mine, theirs = by_executor.config, by_provision.config
    for field in ("ack_policy", "ack_wait", "max_ack_pending", "max_deliver", "deliver_policy"):
        assert getattr(mine, field) == getattr(theirs, field), field
    assert mine.opt_start_seq == 1 and theirs.opt_start_seq == 2
    # ensured again: as it is, or updated to the executor's settings
    assert await ensure(120.0, 64) is Ensured.UNCHANGED
    assert await ensure(30.0, 8) is Ensured.UPDATED
    updated = (await bus.js.consumer_info("RC_OUT", executor_consumer_name("h1"))).config
    assert updated.ack_wait == 30.0 and updated.max_ack_pending == 8


async def test_the_catch_up_probe_finds_the_first_command_of_the_window(nc: Client) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    await bus.js.publish("rc.out.exec.h1.c0", b"{}")  # 1
    await bus.js.publish("rc.out.decision.r", b"{}")  # 2: not a command of h1
    await anyio.sleep(1.2)
    await bus.js.publish("rc.out.exec.h2.c1", b"{}")  # 3: another host's
    await bus.js.publish("rc.out.exec.h1.c2", b"{}")  # 4
    probe = {"stream": "RC_OUT", "filter_subject": "rc.out.exec.h1.>"}
    assert await first_seq_since(nc, bus.js, **probe, seconds=3600) == 1
    assert await first_seq_since(nc, bus.js, **probe, seconds=1.0) == 4
    nothing = {"stream": "RC_OUT", "filter_subject": "rc.out.exec.h9.>"}
    assert await first_seq_since(nc, bus.js, **nothing, seconds=3600) == 5
    assert [c.name for c in await bus.js.consumers_info("RC_OUT")] == []  # probes deleted


async def test_verdicts_are_plain_publishes_to_the_ack_subject(nc: Client) -> None:
    bus = await _stream_of(nc, 3)
    config = input_consumer("c", from_seq=1, batch=10, ack_wait_s=60)
    await bus.js.add_consumer("RC_IN", config=config)
    reader = PullReader(nc, stream="RC_IN", batch=10, ahead=1)
    await reader.bind("c")
    with anyio.fail_after(5):
        while reader.buffered < 3:
            await reader.wait()
    last = reader.pop_buffered(3)[-1]
    await reply(nc, [last[1]], ACK)  # cumulative: acknowledges all three
    await nc.flush()
    with anyio.fail_after(5):
        while (await bus.js.consumer_info("RC_IN", "c")).num_ack_pending:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    await reader.unbind()
