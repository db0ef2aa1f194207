"""Incus's lifecycle event stream, from pylxd's ``client.events()`` (ws4py) in a thread.

Rules:

- **Every project.** pylxd's ``events()`` asks ``/1.0/events?type=lifecycle`` only,
  which Incus answers with the *default* project's events; the stream adds
  ``all-projects=true``.
- **No Origin header.** The WebSocket client excludes ``Origin``: over a unix socket
  ws4py would send ``Origin: ws+unix://localhost`` and Incus (≥ 6.23) refuses the
  handshake with 403 (:class:`~reconciler.incus.errors.EventStreamRefused`).
- **Verbatim.** Each event is the JSON object Incus sent, decoded, unchanged; events
  that are not ``lifecycle`` are dropped.
- **Backpressure, not loss.** The ws4py thread hands events to the loop through a bounded
  anyio stream and blocks when the consumer lags; nothing is dropped inside the adapter.
- **Nothing read with the handshake is lost.** ws4py reads the upgrade response in
  128-byte pieces and parses whatever came after it at once, before the stream to the
  loop exists (Incus 6.0 sends a ``keepalive`` ping right after the upgrade, so that
  piece usually holds a frame). Those bytes are kept in ws4py's own read buffer instead
  and parsed by the reading thread, like every later frame.
- **A lost stream is loud.** When the server closes, the connection breaks, or nothing
  at all (not even a ping, which Incus sends every 10 s) arrives for ``idle_timeout_s``,
  iteration raises :class:`~reconciler.incus.errors.EventStreamLost`; the caller
  reconnects with backoff (and should re-list instances: events in the gap are gone).
- **Clean exit.** Leaving the ``async with`` sends a close frame, shuts the socket down
  and joins the thread; no socket or thread outlives the block.
- **The server is checked as the REST calls check it.** ws4py verifies nothing by itself;
  over ``wss://`` the stream takes the endpoint's ``verify``: a certificate file pins
  the server (its certificate must be that one, as pylxd pins it for the REST calls),
  ``True`` verifies it and its name against the CA bundle requests uses, ``False``
  checks nothing. A server that fails the check is refused before any event is read
  (:class:`~reconciler.incus.errors.EventStreamRefused`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from pylxd.client import EventType
from requests.utils import DEFAULT_CA_BUNDLE_PATH
from ws4py.client import WebSocketBaseClient
from ws4py.exc import HandshakeError

from reconciler.incus.errors import EventStreamLost, EventStreamRefused, IncusUnavailable

__all__ = ["LifecycleStream", "open_lifecycle_stream"]

Event = dict[str, Any]


def _pinned_fingerprint(path: str) -> bytes:
    with open(path, "rb") as pem:
        return x509.load_pem_x509_certificate(pem.read()).fingerprint(hashes.SHA256())


def _tls_options(
    ssl_options: dict[str, Any] | None, verify: bool | str
) -> tuple[dict[str, Any], bytes | None]:
    """ws4py's ``ssl_options`` for ``verify``, and the pinned certificate's fingerprint."""
    options = dict(ssl_options or {})
    if isinstance(verify, str):
        return options, _pinned_fingerprint(verify)
    if verify:
        bundle = (
            os.environ.get("REQUESTS_CA_BUNDLE")
            or os.environ.get("CURL_CA_BUNDLE")
            or DEFAULT_CA_BUNDLE_PATH
        )
        options.update(cert_reqs=ssl.CERT_REQUIRED, ca_certs=bundle)
    return options, None


class _EventSocket(WebSocketBaseClient):  # type: ignore[misc]
    """ws4py client: no Origin header, records activity, hands events to the loop."""

    def __init__(
        self,
        url: str,
        ssl_options: dict[str, str] | None = None,
        *,
        host: str = "",
        verify: bool | str = True,
    ) -> None:
        options, self._pinned = _tls_options(ssl_options, verify)
        if not url.startswith("wss://"):
            options, self._pinned = dict(ssl_options or {}), None
        super().__init__(url, ssl_options=options, exclude_headers=["origin"])
        self.host_name = host
        self.last_activity = time.monotonic()
        self.send_stream: MemoryObjectSendStream[Event] | None = None
        self.close_code: int | None = None
        self._handshaking = False

    def connect(self) -> None:
        self._handshaking = True
        try:
            super().connect()
        finally:
            self._handshaking = False
        if self._pinned is not None:
            seen = self.sock.getpeercert(binary_form=True) or b""
            if hashlib.sha256(seen).digest() != self._pinned:
                raise EventStreamRefused(
                    self.host_name,
                    "the server's certificate is not the pinned one (the endpoint's verify "
                    "file): refusing its events",
                )

    def close_connection(self) -> None:
        """ws4py's, which skips ``close()`` when ``shutdown()`` raises: after
        :meth:`interrupt` shut the socket down, an SSL socket's second shutdown raises,
        and the descriptor leaked until garbage collection."""
        sock = self.sock
        try:
            super().close_connection()
        finally:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()

    def process(self, data: bytes) -> bool:
        self.last_activity = time.monotonic()
        if self._handshaking:  # bytes after the upgrade response: for the reading thread
            self.buf += data
            return True
        return bool(super().process(data))

    def received_message(self, message: Any) -> None:
        event = json.loads(message.data.decode("utf-8"))
        if isinstance(event, dict) and event.get("type") == "lifecycle" and self.send_stream:
            anyio.from_thread.run(self.send_stream.send, event)

    def closed(self, code: int, reason: Any = None) -> None:
        self.close_code = code

    def interrupt(self) -> None:
        """From any thread: say goodbye if possible, then unblock the reading thread."""
        sock = self.sock
        if sock is None:
            return
        with contextlib.suppress(Exception):
            self.close()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class LifecycleStream:
    """An async iterator of lifecycle events; raises EventStreamLost when the stream ends."""

    def __init__(self, receive: MemoryObjectReceiveStream[Event], *, host: str) -> None:
        self._receive = receive
        self._host = host
        self.lost_reason: str | None = None

    def __aiter__(self) -> LifecycleStream:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise EventStreamLost(self._host, self.lost_reason or "event stream closed") from None


def _open(client: Any, *, host: str, verify: bool | str, connect_timeout_s: float) -> _EventSocket:
    """In a worker thread: make the ws4py client through pylxd and do the handshake."""
    ws: _EventSocket = client.events(
        websocket_client=functools.partial(_EventSocket, host=host, verify=verify),
        event_types={EventType.Lifecycle},
    )
    ws.resource = f"{ws.resource}&all-projects=true"
    ws.sock.settimeout(connect_timeout_s)
    try:
        ws.connect()
    except BaseException:
        ws.close_connection()
        raise
    return ws


@contextlib.asynccontextmanager
async def open_lifecycle_stream(
    client: Any,
    *,
    host: str,
    connect_timeout_s: float,
    idle_timeout_s: float,
    buffer: int,
    verify: bool | str = True,
) -> AsyncIterator[LifecycleStream]:
    """Connect to ``/1.0/events`` of pylxd ``client`` and stream its lifecycle events;
    over ``wss://``, the server is checked as ``verify`` says (see the module's rules)."""
    try:
        ws = await anyio.to_thread.run_sync(
            lambda: _open(client, host=host, verify=verify, connect_timeout_s=connect_timeout_s),
            limiter=anyio.CapacityLimiter(1),
        )
    except HandshakeError as exc:
        raise EventStreamRefused(host, f"events handshake refused: {exc}") from exc
    except ssl.SSLCertVerificationError as exc:
        raise EventStreamRefused(host, f"events: the server's certificate: {exc}") from exc
    except OSError as exc:
        raise IncusUnavailable(host, f"events: {exc}") from exc
    send, receive = anyio.create_memory_object_stream[Event](buffer)
    ws.send_stream = send
    stream = LifecycleStream(receive, host=host)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pump, ws, send, stream)
        tg.start_soon(_watchdog, ws, stream, idle_timeout_s, tg)
        try:
            yield stream
        finally:
            receive.close()
            ws.interrupt()
            tg.cancel_scope.cancel()


async def _pump(
    ws: _EventSocket, send: MemoryObjectSendStream[Event], stream: LifecycleStream
) -> None:
    """Run ws4py's blocking read loop in its own thread until the stream ends."""
    try:
        with send:
            await anyio.to_thread.run_sync(ws.run, limiter=anyio.CapacityLimiter(1))
            if stream.lost_reason is None:
                stream.lost_reason = f"closed by the server (code {ws.close_code})"
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the consumer left: the thread stopped on our close
    except Exception as exc:
        if stream.lost_reason is None:
            stream.lost_reason = f"{type(exc).__name__}: {exc}"


async def _watchdog(
    ws: _EventSocket, stream: LifecycleStream, idle_s: float, tg: TaskGroup
) -> None:
    """End a silent stream: no frame, not even a ping, for ``idle_s`` seconds."""
    while True:
        silent = time.monotonic() - ws.last_activity
        if silent >= idle_s:
            stream.lost_reason = f"no frame for {silent:.1f} s (idle timeout {idle_s} s)"
            ws.interrupt()
            return
        await anyio.sleep(min(idle_s - silent, max(idle_s / 4, 0.05)))
