"""Publishes written as one command (reconciler/bus/wire.py) arrive as nats-py's own do."""

from __future__ import annotations

import anyio
import pytest
from nats import errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from reconciler.bus.wire import LazyFlush, Wire, supported

pytestmark = pytest.mark.timeout(30)


async def received(nc: Client, subject: str, count: int, send: object) -> list[Msg]:
    got: list[Msg] = []
    done = anyio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(msg)
        if len(got) == count:
            done.set()

    sub = await nc.subscribe(f"{subject}.>", cb=on_msg)
    await nc.flush()
    await send()  # type: ignore[operator]
    with anyio.fail_after(5):
        await done.wait()
    await sub.unsubscribe()
    return got


async def test_a_wire_batch_arrives_like_client_publishes(nc: Client) -> None:
    assert supported(nc)
    messages = [
        ("w.decision.r1", b'{"a":1}', "_R.1", "out:r1"),
        ("w.exec.h1.c1", b"", "_R.2", None),
        ("w.dlq.schema", b"x" * 5000, "_R.3", "dlq:7"),
    ]

    async def by_client() -> None:
        for subject, payload, reply, msg_id in messages:
            headers = {"Nats-Msg-Id": msg_id} if msg_id else None
            await nc.publish(subject, payload, reply=reply, headers=headers)

    async def by_wire() -> None:
        wire = Wire(nc)
        for subject, payload, reply, msg_id in messages:
            wire.add(subject, payload, reply, msg_id)
        await wire.send(nc)

    ours = await received(nc, "w", 3, by_wire)
    theirs = await received(nc, "w", 3, by_client)
    assert [(m.subject, m.reply, m.data, m.headers) for m in ours] == [
        (m.subject, m.reply, m.data, m.headers) for m in theirs
    ]
    assert ours[0].headers == {"Nats-Msg-Id": "out:r1"} and ours[1].headers is None


async def test_a_wire_refuses_what_publish_refuses(nc: Client) -> None:
    wire = Wire(nc)
    for bad in ("", "a b", "a\r\nPUB x 1"):
        with pytest.raises(errors.BadSubjectError):
            wire.add(bad, b"", "_R.1", None)
    with pytest.raises(errors.MaxPayloadError):
        wire.add("w.big", b"x" * (nc.max_payload + 1), "_R.1", None)
    wire.add("w.ok", b"", "_R.1", None)
    await nc.close()
    with pytest.raises(errors.ConnectionClosedError):
        await wire.send(nc)


async def test_an_unflushed_batch_leaves_with_the_lazy_flush(nc: Client) -> None:
    lazy = LazyFlush(nc, within_s=0.05)

    async def by_wire() -> None:
        wire = Wire(nc)
        wire.add("w.status.host.h1", b"{}", "", None)
        await wire.send(nc, flush=False)
        lazy.request()
        lazy.request()  # one flush for both requests

    started = anyio.current_time()
    got = await received(nc, "w", 1, by_wire)
    assert got[0].subject == "w.status.host.h1" and got[0].reply == "" and got[0].data == b"{}"
    assert anyio.current_time() - started < 2
