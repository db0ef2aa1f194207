"""The NATS connection (reconciler.bus.connection): URLs, options, logs, retries,
reconnects, against the real nats-server of the ``nats_server`` fixture."""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import socket
import warnings
from pathlib import Path

import anyio
import anyio.abc
import pytest
from structlog.testing import capture_logs

from reconciler.bus.connection import ConnectOptions, connect, parse_urls, shown_urls
from tests.support.natsserver import NatsProcess, NatsServer, expect_reconnect, start_nats_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_parse_urls() -> None:
    assert parse_urls("nats://a:4222") == ("nats://a:4222",)
    assert parse_urls("nats://a:4222, nats://b:4222 nats://c:1") == (
        "nats://a:4222",
        "nats://b:4222",
        "nats://c:1",
    )
    with pytest.raises(ValueError):
        parse_urls(" , ")
    assert ConnectOptions(urls="nats://a,nats://b").urls == ("nats://a", "nats://b")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ConnectOptions(password="secret")


async def test_connect_logs_and_reconnects_after_a_restart(nats_server: NatsServer) -> None:
    opts = ConnectOptions.from_url(nats_server.url, name="test-conn", reconnect_wait_s=0.1)
    with capture_logs() as logs:
        client = await connect(opts)
        try:
            assert client.is_connected
            async with expect_reconnect(client):
                nats_server.restart()
            await client.flush(timeout=2)
        finally:
            await client.close()
    events = [e["event"] for e in logs]
    assert events[0] == "nats.connected"
    assert "nats.disconnected" in events
    assert "nats.reconnected" in events
    assert events[-1] == "nats.closed"


async def test_connect_keeps_retrying_until_the_initial_timeout() -> None:
    opts = ConnectOptions.from_url(
        f"nats://127.0.0.1:{free_port()}",
        reconnect_wait_s=0.05,
        connect_timeout_s=0.2,
        initial_timeout_s=0.5,
    )
    with capture_logs() as logs, anyio.fail_after(3), pytest.raises(TimeoutError):
        await connect(opts)
    assert sum(e["event"] == "nats.error" for e in logs) >= 2  # it did retry


async def test_connect_waits_for_a_server_that_starts_later(tmp_path: Path) -> None:
    if os.environ.get("RC_TEST_NATS_URL"):
        pytest.skip("needs a server this test controls")
    with start_nats_server(tmp_path) as server:
        assert isinstance(server, NatsProcess)
        server.kill()
        opts = ConnectOptions.from_url(server.url, reconnect_wait_s=0.05, connect_timeout_s=0.5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, _start_later, server)
            with anyio.fail_after(5):
                client = await connect(opts)
        try:
            assert client.is_connected
        finally:
            await client.close()


def _start_later(server: NatsServer) -> None:
    import time

    time.sleep(0.3)
    server.start()


@pytest.mark.skipif(importlib.util.find_spec("nkeys") is not None, reason="nkeys is installed")
async def test_creds_without_nkeys_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="nkeys"):
        await connect(ConnectOptions(creds_file=str(tmp_path / "user.creds")))


def test_connect_options_never_show_the_password_in_their_repr() -> None:
    from reconciler.bus.connection import ConnectOptions

    opts = ConnectOptions(user="bridge", password="s3cret-hunter2")
    assert "s3cret-hunter2" not in repr(opts) and "bridge" in repr(opts)


async def test_a_server_that_hangs_up_before_its_info_leaves_no_socket_open(
    tmp_path: Path,
) -> None:
    """While reconnecting, a listener that accepts and hangs up at once (a node going
    down behind a proxy or load balancer, a port forward whose target is gone) fails
    each attempt before the server's INFO; every such socket is closed before the next
    attempt, none left to the garbage collector (nats-py drops it unclosed)."""
    if os.environ.get("RC_TEST_NATS_URL"):
        pytest.skip("needs a server this test controls")
    hangups = 0

    async def hang_up(stream: anyio.abc.SocketStream) -> None:
        nonlocal hangups
        hangups += 1
        await stream.aclose()

    with start_nats_server(tmp_path) as server:
        assert isinstance(server, NatsProcess)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        opts = ConnectOptions(
            urls=(server.url, f"nats://127.0.0.1:{port}"),
            reconnect_wait_s=0.05,
            connect_timeout_s=0.5,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with listener, anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, hang_up)
                client = await connect(opts)
                try:
                    async with expect_reconnect(client, within_s=10):
                        server.kill()
                        with anyio.fail_after(5):
                            while hangups < 4:  # noqa: ASYNC110 - a counter
                                await anyio.sleep(0.02)
                        server.start()
                    await client.flush(timeout=2)
                finally:
                    await client.close()
                tg.cancel_scope.cancel()
            gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("http://127.0.0.1:4222", "http:// is not a NATS scheme"),
        ("nats://127.0.0.1: 4222", "the port is not a number"),
        ("nats://u:secret@127.0.0.1:99999", "the port is not a number"),
        ("nats://local host:4222", "has no scheme where the other URLs have one"),
        ("nats://-bad-:4222", "is not a host name or an IP address"),
        ("nats://127.0.0.1:4222/path", "has no path"),
    ],
)
def test_a_url_that_cannot_be_a_servers_is_refused_before_connecting(
    value: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)) as refused:
        parse_urls(value)
    assert "secret" not in str(refused.value)


def test_good_urls_pass_and_are_shown_without_credentials() -> None:
    urls = parse_urls("nats://u:pw@a.example:4222, tls://[::1]:4443 ws://b/ws")
    assert urls == ("nats://u:pw@a.example:4222", "tls://[::1]:4443", "ws://b/ws")
    assert parse_urls("localhost:4222,127.0.0.1") == ("localhost:4222", "127.0.0.1")
    assert shown_urls(urls) == "nats://a.example:4222, tls://[::1]:4443, ws://b/ws"
