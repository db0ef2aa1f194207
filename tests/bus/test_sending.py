"""Publishing one message (reconciler.bus.sending), as a secured deployment needs it
(CONTRACT.md, "Security and deployment options"): sized with its headers before sending,
and retried through a missing stream with the same Nats-Msg-Id."""

from __future__ import annotations

import anyio
import pytest
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError

from reconciler.bus.sending import PayloadTooLarge, encoded_size, publish
from reconciler.bus.streams import StreamNames, ensure_streams


def test_headers_count_against_max_payload() -> None:
    assert encoded_size(b"x" * 10, None) == 10
    # NATS/1.0\r\n + "Nats-Msg-Id: a\r\n" + \r\n + payload
    assert encoded_size(b"x" * 10, {"Nats-Msg-Id": "a"}) == 10 + 16 + 12


async def test_a_message_over_max_payload_is_refused_before_sending(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, StreamNames.for_prefix("rc"))
    limit = nc.max_payload
    headers_size = encoded_size(b"", {"Nats-Msg-Id": "big"})
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        # the payload alone fits (nats-py would send it); with the header it does not
        await publish(js, "rc.in.cmd.admit", b"x" * (limit - headers_size + 1), msg_id="big")
    assert nc.is_connected
    ack = await publish(js, "rc.in.cmd.admit", b"x" * (limit - headers_size), msg_id="big")
    assert ack.seq == 1 and not ack.duplicate


async def test_a_publish_waits_for_its_stream_and_keeps_its_msg_id(nc: Client) -> None:
    js = nc.jetstream()
    names = StreamNames.for_prefix("late")
    with pytest.raises(NoStreamResponseError):
        await publish(js, "late.in.cmd.admit", b"{}", msg_id="once", retry_for_s=0.2)
    async with anyio.create_task_group() as tg:
        first: list[int] = []

        async def send() -> None:
            first.append((await publish(js, "late.in.cmd.admit", b"{}", msg_id="once")).seq)

        tg.start_soon(send)
        await anyio.sleep(0.5)  # retrying: no stream yet
        assert not first
        await ensure_streams(js, names)
    again = await publish(js, "late.in.cmd.admit", b"{}", msg_id="once")
    assert again.duplicate and again.seq == first[0]
    assert (await js.stream_info(names.in_stream)).state.messages == 1
