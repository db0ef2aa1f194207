"""The one pull reader (reconciler/bus/reader.py), against a real nats-server."""

from __future__ import annotations

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bus.consumers import (
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
from tests.support.bus import stream_with_inputs
from tests.support.natsserver import NatsServer, expect_reconnect

pytestmark = pytest.mark.timeout(30)

NAMES = StreamNames.for_prefix("rc")


async def _read(reader: PullReader, n: int, *, within_s: float = 5.0) -> list[int]:
    """The stream sequences of the next ``n`` deliveries."""
    seqs: list[int] = []
    with anyio.fail_after(within_s):
        while len(seqs) < n:
            if not reader.buffered:
                await reader.wait()
            seqs += [parse_ack_subject(m[1])[0] for m in reader.pop_buffered(n - len(seqs))]
    return seqs


def test_ack_subjects_of_both_forms_give_sequence_deliveries_and_time() -> None:
    assert parse_ack_subject("$JS.ACK.RC_IN.c1.2.41.40.1764669600123456789.7") == (
        41,
        2,
        1764669600123456789,
    )
    assert parse_ack_subject("$JS.ACK.hub.ACCHASH.RC_IN.c1.1.9.9.1764669600000000001.0.x") == (
        9,
        1,
        1764669600000000001,
    )
    for bad in ("_INBOX.abc", "$JS.ACK.too.short", ""):
        with pytest.raises(ValueError):
            parse_ack_subject(bad)


def test_timestamps_keep_all_nine_digits() -> None:
    assert rfc3339_nanos(1764669600123456789) == "2025-12-02T10:00:00.123456789Z"
    assert rfc3339_nanos(1764669600000000000) == "2025-12-02T10:00:00.000000000Z"
    assert rfc3339_nanos(0) == "1970-01-01T00:00:00.000000000Z"


def test_the_pending_count_comes_from_the_ack_subject() -> None:
    assert pending_of("$JS.ACK.RC_OUT.c1.1.9.9.1764669600000000001.17") == 17
    assert pending_of("$JS.ACK.hub.ACCHASH.RC_OUT.c1.1.9.9.1764669600000000001.4.x") == 4
    assert pending_of("_INBOX.abc") == 0


async def test_requests_are_made_ahead_and_no_further(nc: Client) -> None:
    bus = await stream_with_inputs(nc, 30)
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
    bus = await stream_with_inputs(nc, 0)
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
    bus = await stream_with_inputs(nc, 2)
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
    bus = await stream_with_inputs(nc, 3)
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


async def test_verdicts_are_plain_publishes_to_the_ack_subject(nc: Client) -> None:
    bus = await stream_with_inputs(nc, 3)
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
