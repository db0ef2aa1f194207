"""The nats-py internals this project relies on, fenced in one module.

nats-py 2.x has no public way to do four things this project needs. Each is done here
and nowhere else in the project; each has a check saying whether the installed nats-py
still has what it needs, and what happens without it is decided here (and tested, in
``tests/bus/test_nats_internals.py``):

- ``JetStreamContext._nc``, the client of a JetStream context: payload sizes are
  checked against its ``max_payload`` and its permission violations watched
  (:mod:`reconciler.bus.sending`, :mod:`reconciler.bus.streams`). Without it:
  :class:`UnsupportedNatsPy`, naming what is missing, when first needed (nats-py has
  kept it since 2.0).
- ``Client._send_command``, ``_flush_pending``, ``_flush_queue``,
  ``_pending_data_size`` and ``_max_pending_size``: a batch of publishes handed over as
  one command, with one flush request (:mod:`reconciler.bus.wire`), and a lazy flush.
  Without them (:func:`writes_batches` false): ``Client.publish`` per message, and a
  flush at once instead of a lazy one.
- ``Client._process_msg(sid, subject, reply, data, headers)`` and
  ``Subscription._id``: messages handed to a plain function by the connection's reader
  (:mod:`reconciler.bus.direct`). Without them (:func:`routes_messages` false): nats-py's
  own callback, with the header block rebuilt from its dict.
- ``Client._process_info(info, initial_connection)``, ``_current_server`` and
  ``_transport``: TLS that never falls back to plaintext (:class:`TlsOnlyClient`, used
  by :mod:`reconciler.bus.connection`). Without them (:func:`guards_tls` false): every
  connection that asks for TLS is refused before anything is sent, never risked in
  plaintext.
- ``Client._connect_to_server(server)`` and ``_transport``: a failed connection
  attempt's socket closed before the next attempt (:class:`TidyClient`, the base of
  every client :mod:`reconciler.bus.connection` makes). Without it
  (:func:`tidies_attempts` false): the method is simply not called, and such a socket
  is closed by the garbage collector, with a ``ResourceWarning``, as plain nats-py does.

Rules:

- Nothing outside this module names a nats-py attribute that starts with an underscore
  (a test checks it).
- The checks read the client (or its class) as it is, never the nats-py version number:
  a nats-py that renames an internal loses the fast path, not the function.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from nats import errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

__all__ = [
    "MessageRouter",
    "TidyClient",
    "TlsNotOffered",
    "TlsOnlyClient",
    "UnsupportedNatsPy",
    "client_of",
    "flush_soon",
    "guards_tls",
    "message_router",
    "routes_messages",
    "send_batch",
    "subscription_id",
    "tidies_attempts",
    "writes_batches",
]


class UnsupportedNatsPy(RuntimeError):
    """The installed nats-py lacks an internal this project cannot do without."""

    def __init__(self, missing: str) -> None:
        super().__init__(
            f"the installed nats-py has no {missing}, which this project relies on: "
            "install a nats-py the project supports (pip install -e .)"
        )


# ------------------------------------------------------------------ the context's client


def client_of(js: JetStreamContext) -> Client:
    """The client a JetStream context sends through (nats-py keeps it as ``_nc``)."""
    nc = getattr(js, "_nc", None)
    if not isinstance(nc, Client):
        raise UnsupportedNatsPy("JetStreamContext._nc (the context's client)")
    return nc


# ------------------------------------------------------------- publishes as one command


def writes_batches(nc: Client) -> bool:
    """Whether ``nc`` has the internals :func:`send_batch` and :func:`flush_soon` use."""
    return (
        inspect.iscoroutinefunction(getattr(nc, "_send_command", None))
        and inspect.iscoroutinefunction(getattr(nc, "_flush_pending", None))
        and hasattr(nc, "_flush_queue")
        and isinstance(getattr(nc, "_pending_data_size", None), int)
        and isinstance(getattr(nc, "_max_pending_size", None), int)
    )


async def send_batch(
    nc: Client, data: bytes, *, count: int, payload_bytes: int, flush: bool = True
) -> None:
    """Hand ``data`` (the protocol lines of ``count`` publishes, ``payload_bytes`` of
    payload) to ``nc`` as one pending command, and have it flushed unless ``flush`` is
    false. Raises what ``Client.publish`` raises when the connection refuses. Only for a
    client :func:`writes_batches` accepts."""
    if nc.is_closed:
        raise errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise errors.ConnectionDrainingError
    client: Any = nc
    if not nc.is_connected:
        limit = client._max_pending_size
        if limit <= 0 or len(data) + client._pending_data_size > limit:
            raise errors.OutboundBufferLimitError
    nc.stats["out_msgs"] += count
    nc.stats["out_bytes"] += payload_bytes
    await client._send_command(data)
    queue = client._flush_queue
    if flush and queue is not None and queue.empty():
        await client._flush_pending()


def flush_soon(nc: Client) -> None:
    """Have the flusher write ``nc``'s buffer if it is idle and something waits (what
    ``Client._flush_pending`` does, without a coroutine to await). Only for a client
    :func:`writes_batches` accepts."""
    client: Any = nc
    queue = client._flush_queue
    idle = queue is not None and queue.empty()
    if idle and client.is_connected and client._pending_data_size:
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(asyncio.get_running_loop().create_future())


# ------------------------------------------------------- messages handed over directly

#: a routed message: ``(subject, reply, data, headers)``, the header block raw or ``None``
RoutedHandler = Callable[[str, str, bytes, bytes | None], None]
#: a client's direct routes by subscription id
MessageRouter = dict[int, RoutedHandler]

#: where a client's routes are kept (an attribute of the client, set once)
_ROUTES = "_reconciler_direct_routes"
_PROCESS_PARAMETERS = ["sid", "subject", "reply", "data", "headers"]


def routes_messages(nc: Client) -> bool:
    """Whether ``nc`` has the internals :func:`message_router` needs."""
    process = getattr(nc, "_process_msg", None)
    if not callable(process) or not isinstance(getattr(nc, "stats", None), dict):
        return False
    try:
        parameters = list(inspect.signature(process).parameters)
    except (TypeError, ValueError):
        return False
    return parameters == _PROCESS_PARAMETERS and inspect.iscoroutinefunction(process)


def subscription_id(sub: Subscription) -> int | None:
    """The ``sid`` nats-py gave a subscription, or ``None`` when it keeps none."""
    sid = getattr(sub, "_id", None)
    return sid if isinstance(sid, int) else None


def message_router(
    nc: Client, call: Callable[[RoutedHandler, str, str, bytes, bytes | None], None]
) -> MessageRouter:
    """The client's table of routes by ``sid``: a message whose ``sid`` is in it goes,
    straight from the protocol parser, to ``call(handler, subject, reply, data,
    headers)``; every other message goes on to nats-py unchanged. The first call puts the
    routing wrapper in place of the client's ``_process_msg`` (with its ``call``). Only
    for a client :func:`routes_messages` accepts."""
    routes: MessageRouter | None = nc.__dict__.get(_ROUTES)
    if routes is not None:
        return routes
    table: MessageRouter = {}
    original: Callable[[int, bytes, bytes, bytes, bytes], Awaitable[None]] = nc._process_msg
    stats: dict[str, Any] = nc.stats

    async def process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handler = table.get(sid)
        if handler is None:
            await original(sid, subject, reply, data, headers)
            return
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        call(handler, subject.decode(), reply.decode(), data, headers or None)

    setattr(nc, "_process_msg", process_msg)  # noqa: B010 - an instance attribute
    setattr(nc, _ROUTES, table)
    return table


# ------------------------------------------------------- one socket per attempt


def tidies_attempts(client_class: type[Client] = Client) -> bool:
    """Whether ``client_class`` opens each connection attempt through the method
    :class:`TidyClient` overrides (in every nats-py 2.x)."""
    method = getattr(client_class, "_connect_to_server", None)
    return method is not None and inspect.iscoroutinefunction(method)


class TidyClient(Client):
    """A nats-py client that closes a failed attempt's socket before it opens the next.

    nats-py keeps one transport per client and opens each new connection in it. When an
    attempt failed after its TCP connect (a server that hung up before its ``INFO``: a
    node going down behind a proxy or a port forward; a refused ``CONNECT``), the
    reconnection loop goes on to the next server without closing that socket: the
    transport drops it, and only the garbage collector closes it, with a
    ``ResourceWarning``. The transport is closed here before every new connection (a
    no-op when nats-py closed it already). Where :func:`tidies_attempts` is false the
    override is never called: nats-py behaves as it does on its own."""

    async def _connect_to_server(self, s: Any) -> None:
        transport = getattr(self, "_transport", None)
        if transport is not None:
            transport.close()
        await super()._connect_to_server(s)


# ------------------------------------------------------------- TLS, never plaintext


class TlsNotOffered(errors.Error):
    """A server we must speak TLS to does not offer it (its ``INFO`` has neither
    ``tls_required`` nor ``tls_available``). Raised before ``CONNECT`` is written."""

    def __str__(self) -> str:
        return (
            "the server does not offer TLS, but TLS was asked for (a tls:// URL or "
            "--tls-ca/--tls-cert/--tls-key): nothing was sent to it; configure TLS on the "
            "server, or use a nats:// URL without TLS options"
        )


def guards_tls(client_class: type[Client] = Client) -> bool:
    """Whether ``client_class`` still reads a new connection's ``INFO`` through the
    method :class:`TlsOnlyClient` overrides (in every nats-py 2.x)."""
    method = getattr(client_class, "_process_info", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return False
    try:
        return "initial_connection" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class TlsOnlyClient(TidyClient):
    """A nats-py client that never speaks plaintext to a server.

    nats-py reads a server's ``INFO`` and hands it to ``_process_info`` (with
    ``initial_connection=True``) before it decides whether to start TLS and before it
    writes ``CONNECT`` with the credentials. This is the one place where nats-py lets us
    look at a new connection's ``INFO`` first: a server that allows TLS without requiring
    it is marked as requiring it (nats-py then upgrades), and one without TLS is refused.
    Build one only where :func:`guards_tls` is true.
    """

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        scheme = getattr(getattr(self._current_server, "uri", None), "scheme", "")
        if initial_connection and scheme not in ("ws", "wss") and not info.get("tls_required"):
            if not info.get("tls_available"):
                # hang up now: whatever nats-py does next (a cancelled connect, a retry)
                # must not find this socket open, let alone write to it
                transport = getattr(self, "_transport", None)
                if transport is not None:
                    transport.close()
                raise TlsNotOffered()
            info["tls_required"] = True  # nats-py upgrades the socket on this flag alone
        await super()._process_info(info, initial_connection=initial_connection)
