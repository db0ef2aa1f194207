"""Messages handed to a plain function (reconciler/bus/direct.py) arrive as nats-py's own do.

Both paths run against a real nats-server: the direct hand-over and nats-py's ordinary
callback (what a client without the internals gets). Header blocks are read as nats-py
reads them (its own reader is the reference).
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from reconciler.bus.direct import (
    header_value,
    parse_headers,
    status_of,
    subscribe_direct,
    supported,
)

pytestmark = pytest.mark.timeout(30)

Got = tuple[str, str, bytes, dict[str, str]]


async def through(nc: Client, *, direct: bool, send: object, count: int) -> list[Got]:
    got: list[Got] = []
    done = anyio.Event()

    def handler(subject: str, reply: str, data: bytes, headers: bytes | None) -> None:
        got.append((subject, reply, data, parse_headers(headers)))
        if len(got) == count:
            done.set()

    sub = await subscribe_direct(nc, "d.>", handler, direct=direct)
    assert sub.direct is direct
    await nc.flush()
    await send()  # type: ignore[operator]
    with anyio.fail_after(5):
        await done.wait()
    await sub.unsubscribe()
    return got


async def test_direct_and_callback_hand_over_the_same_messages(nc: Client) -> None:
    assert supported(nc)

    async def send() -> None:
        await nc.publish("d.a", b'{"x":1}', reply="_R.1", headers={"Nats-Msg-Id": "out:1"})
        await nc.publish("d.b.c", b"", headers={"K": "v", "Other": "w x"})
        await nc.publish("d.e", b"y" * 70_000)

    direct = await through(nc, direct=True, send=send, count=3)
    plain = await through(nc, direct=False, send=send, count=3)
    assert direct == plain
    assert direct[0] == ("d.a", "_R.1", b'{"x":1}', {"Nats-Msg-Id": "out:1"})
    assert direct[1][3] == {"K": "v", "Other": "w x"}
    assert direct[2][2] == b"y" * 70_000 and direct[2][3] == {}


async def test_a_pull_requests_status_reaches_the_handler(nc: Client) -> None:
    """An expired pull request's 408 (a status line with headers) comes to the handler."""
    js = nc.jetstream()
    await js.add_stream(name="D", subjects=["dd.>"])
    await js.add_consumer("D", config=api.ConsumerConfig(durable_name="c"))
    for direct in (True, False):
        statuses: list[tuple[str | None, dict[str, str]]] = []
        done = anyio.Event()

        def handler(subject: str, reply: str, data: bytes, headers: bytes | None) -> None:
            statuses.append((status_of(headers), parse_headers(headers)))  # noqa: B023
            done.set()  # noqa: B023

        inbox = nc.new_inbox()
        sub = await subscribe_direct(nc, inbox, handler, direct=direct)
        await nc.publish(
            "$JS.API.CONSUMER.MSG.NEXT.D.c", b'{"batch":5,"expires":50000000}', reply=inbox
        )
        with anyio.fail_after(5):
            await done.wait()
        await sub.unsubscribe()
        status, fields = statuses[0]
        assert status == "408", statuses
        assert fields["Status"] == "408" and fields.get("Nats-Pending-Messages") == "5"


async def test_other_subscriptions_and_a_failing_handler_leave_the_reader_running(
    nc: Client,
) -> None:
    seen: list[Msg] = []

    async def on_plain(msg: Msg) -> None:
        seen.append(msg)

    plain = await nc.subscribe("p.>", cb=on_plain)

    def broken(subject: str, reply: str, data: bytes, headers: bytes | None) -> None:
        raise RuntimeError("a bug in a handler")

    sub = await subscribe_direct(nc, "b.>", broken)
    await nc.publish("b.1", b"lost")
    await nc.publish("p.1", b"kept")
    with anyio.fail_after(5):
        while not seen:  # noqa: ASYNC110 - a plain subscription's callback
            await anyio.sleep(0.01)
    assert seen[0].data == b"kept"
    await sub.unsubscribe()
    await nc.publish("b.2", b"after")  # no route, no subscription: dropped quietly
    await nc.flush()
    await plain.unsubscribe()
    assert not nc.is_closed


def test_header_blocks_read_like_nats_py() -> None:
    blocks = [
        b"NATS/1.0\r\nNats-Msg-Id: out:r1\r\n\r\n",
        b"NATS/1.0 404 No Messages\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 500\r\n"
        b"Nats-Pending-Bytes: 0\r\n\r\n",
        b"NATS/1.0 503\r\n\r\n",
        b"NATS/1.0\r\nA:b\r\nA: c\r\nbad name: x\r\nno colon\r\n\r\n",
    ]
    for block in blocks:
        assert parse_headers(block) == nats_py_headers(block), block
    assert status_of(blocks[0]) is None and status_of(blocks[1]) == "404"
    assert header_value(blocks[0], "Nats-Msg-Id") == "out:r1"
    assert header_value(blocks[1], "Nats-Msg-Id") is None
    assert header_value(None, "Nats-Msg-Id") is None


_token = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"))


@settings(max_examples=200, deadline=None)
@given(
    fields=st.lists(
        st.tuples(_token.filter(bool), st.text(st.characters(blacklist_categories=["Cc", "Cs"]))),
        max_size=4,
    ),
    status=st.none() | st.sampled_from(["404", "408", "409", "503"]),
    description=st.sampled_from(["", "No Messages", "Request Timeout"]),
)
def test_any_header_block_reads_like_nats_py(
    fields: list[tuple[str, str]], status: str | None, description: str
) -> None:
    if status is not None and fields and not description:
        # what nats-server never sends, and nats-py misreads (the fields as a description)
        description = "Request Timeout"
    first = b"NATS/1.0"
    if status is not None:
        first += f" {status}".encode() + (f" {description}".encode() if description else b"")
    lines = [first] + [f"{k}: {v}".encode() for k, v in fields]
    block = b"\r\n".join(lines) + b"\r\n\r\n"
    assert parse_headers(block) == nats_py_headers(block)


def nats_py_headers(block: bytes) -> dict[str, str]:
    """nats-py's own reading of a header block (the reference)."""

    async def read() -> dict[str, str]:
        return await Client()._process_headers(block) or {}

    return anyio.run(read)
