"""Frames that arrive in the same read as the WebSocket upgrade response are not lost.

ws4py reads the upgrade response in 128-byte pieces and used to parse whatever followed
it at once, before the adapter's stream to the event loop existed, so a lifecycle event
sent together with the response was dropped. Incus 6.0 sends a ``keepalive`` ping right
after the upgrade; a server may as well send an event. Here a tiny server on a unix
socket writes the upgrade response, the ping and an event in one ``sendall``, and the
event must come out of the adapter's stream.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from reconciler.incus.events import LifecycleStream, _EventSocket, _pump

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
EVENT = {
    "type": "lifecycle",
    "timestamp": "2026-12-04T10:00:00.000000000Z",
    "metadata": {"action": "instance-created", "source": "/1.0/instances/c1", "name": "c1"},
    "project": "default",
}


def _frame(opcode: int, payload: bytes) -> bytes:
    """An unmasked, final server frame."""
    if len(payload) < 126:
        return bytes([0x80 | opcode, len(payload)]) + payload
    return bytes([0x80 | opcode, 126]) + len(payload).to_bytes(2, "big") + payload


def _serve_once(listener: socket.socket, extra: bytes) -> None:
    conn, _ = listener.accept()
    with conn:
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        response = (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        conn.sendall(response + extra)  # one write: the client's first read holds it all
        conn.recv(4096)  # until the client closes


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ws-") as directory:
        yield Path(directory) / "events.sock"


@pytest.mark.parametrize("with_ping", [True, False], ids=["ping-then-event", "event-only"])
async def test_an_event_sent_with_the_upgrade_response_reaches_the_stream(
    socket_path: Path, with_ping: bool
) -> None:
    second = {**EVENT, "timestamp": "2026-12-04T10:00:01.000000000Z"}
    extra = b"".join(
        [
            _frame(0x9, b"keepalive") if with_ping else b"",
            _frame(0x1, json.dumps(EVENT).encode()),
            _frame(0x1, json.dumps(second).encode()),
        ]
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(1)
    server = threading.Thread(target=_serve_once, args=(listener, extra), daemon=True)
    server.start()
    try:
        ws = _EventSocket(f"ws+unix://{socket_path}")
        ws.resource = "/1.0/events?type=lifecycle"
        await anyio.to_thread.run_sync(ws.connect)
        send, receive = anyio.create_memory_object_stream[dict[str, object]](16)
        ws.send_stream = send
        stream = LifecycleStream(receive, host="h")
        got: list[dict[str, object]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pump, ws, send, stream)
            with anyio.fail_after(5):
                while len(got) < 2:
                    got.append(await receive.receive())
            ws.interrupt()
            tg.cancel_scope.cancel()
        receive.close()
    finally:
        listener.close()
        server.join(timeout=5)
    assert got == [EVENT, second]
