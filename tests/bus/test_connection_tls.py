"""TLS never falls back to plaintext (CONTRACT.md, Additions, "Security defaults").

Against real nats-server processes that trace every protocol line they receive: a
``tls://`` URL or any TLS option, pointed at a server without TLS, fails at once with
one sentence, and the server never sees a ``CONNECT`` (so no user, no password); a
server that offers TLS without requiring it is spoken to in TLS; a client that loses
its TLS server and finds a plain one on the same address does not send it anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import orjson
import pytest

from reconciler.bus.connection import ConnectOptions, ConnectRefused, connect, tls_context
from reconciler.bus.nats_internals import guards_tls
from reconciler.bus.tls_probe import hangup_cause
from tests.support.cluster import _free_ports, make_credentials
from tests.support.natsserver import find_binary

pytestmark = pytest.mark.timeout(60)

PASSWORD = "pw-never-on-the-wire-7d1c"


class TracedServer:
    """One nats-server on a loopback port with ``-V`` (every received line traced)."""

    def __init__(self, workdir: Path, port: int, config: str) -> None:
        binary = find_binary()
        if binary is None:
            pytest.skip("no nats-server binary")
        self.port = port
        self.log = workdir / f"nats-{port}-{time.monotonic_ns()}.log"
        conf = workdir / f"nats-{port}.conf"
        conf.write_text(f"listen: 127.0.0.1:{port}\n{config}\n")
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf), "-V", "-D", "-l", str(self.log)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not (self.log.exists() and "Server is ready" in self.log.read_text()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"nats-server did not start: {self.text()}")
            time.sleep(0.02)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tls-secrets")
    make_credentials(out)
    return out


@pytest.fixture
def plain_server(tmp_path: Path) -> Iterator[TracedServer]:
    """A server without TLS and with a password user, as a careless deployment has."""
    server = TracedServer(
        tmp_path,
        _free_ports(1)[0],
        f"authorization {{ user: u, password: {PASSWORD} }}",
    )
    yield server
    server.stop()


def _tls_config(secrets: Path, *, allow_non_tls: bool = False, verify: bool = False) -> str:
    return (
        f'tls {{ cert_file: "{secrets / "nats-1.pem"}", key_file: "{secrets / "nats-1-key.pem"}", '
        f'ca_file: "{secrets / "ca.pem"}"{", verify: true" if verify else ""} }}\n'
        + ("allow_non_tls: true\n" if allow_non_tls else "")
        + f"authorization {{ user: u, password: {PASSWORD} }}"
    )


def _assert_nothing_sent(server: TracedServer) -> None:
    log = server.text()
    assert "CONNECT" not in log, log
    assert PASSWORD not in log


@pytest.mark.parametrize(
    ("scheme", "with_ca"),
    [("tls", True), ("tls", False), ("nats", True)],
    ids=["tls-url-and-ca", "tls-url-only", "nats-url-and-ca"],
)
async def test_a_plain_server_is_refused_before_any_credential(
    plain_server: TracedServer, secrets: Path, scheme: str, with_ca: bool
) -> None:
    opts = ConnectOptions(
        urls=(f"{scheme}://127.0.0.1:{plain_server.port}",),
        user="u",
        password=PASSWORD,
        tls_ca_file=str(secrets / "ca.pem") if with_ca else None,
    )
    started = time.monotonic()
    with pytest.raises(ConnectRefused) as refused:
        await connect(opts)
    assert time.monotonic() - started < 2.0  # at once, not after retries
    message = str(refused.value)
    assert "does not offer TLS" in message
    assert PASSWORD not in message
    await anyio.sleep(0.2)  # anything the client wrote would be traced by now
    _assert_nothing_sent(plain_server)
    assert "Client connection created" in plain_server.text()  # it did reach the server


def test_the_cli_refuses_a_plain_server_in_one_line(
    plain_server: TracedServer, secrets: Path, tmp_path: Path
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RC_")}
    result = subprocess.run(
        [
            sys.executable, "-m", "reconciler.cli", "query", "health",
            "--nats-url", f"tls://127.0.0.1:{plain_server.port}",
            "--tls-ca", str(secrets / "ca.pem"),
            "--nats-user", "u", "--nats-password-file", str(password_file),
        ],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "does not offer TLS" in lines[0]
    assert "Traceback" not in result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    _assert_nothing_sent(plain_server)


async def test_a_server_that_allows_plaintext_is_still_spoken_to_in_tls(
    tmp_path: Path, secrets: Path
) -> None:
    server = TracedServer(tmp_path, _free_ports(1)[0], _tls_config(secrets, allow_non_tls=True))
    try:
        nc = await connect(
            ConnectOptions(
                urls=(f"tls://localhost:{server.port}",),
                user="u",
                password=PASSWORD,
                tls_ca_file=str(secrets / "ca.pem"),
                initial_timeout_s=5,
            )
        )
        try:
            await nc.flush()
        finally:
            await nc.close()
        log = server.text()
        assert "TLS handshake complete" in log, log
        assert "CONNECT" in log
    finally:
        server.stop()


async def test_a_reconnection_to_a_plain_server_sends_it_nothing(
    tmp_path: Path, secrets: Path
) -> None:
    port = _free_ports(1)[0]
    tls_server = TracedServer(tmp_path, port, _tls_config(secrets))
    nc = await connect(
        ConnectOptions(
            urls=(f"tls://localhost:{port}",),
            user="u",
            password=PASSWORD,
            tls_ca_file=str(secrets / "ca.pem"),
            reconnect_wait_s=0.1,
            initial_timeout_s=5,
        )
    )
    try:
        await nc.flush()
        tls_server.stop()
        plain = TracedServer(tmp_path, port, f"authorization {{ user: u, password: {PASSWORD} }}")
        try:
            with anyio.fail_after(10):  # the client tried it at least twice
                while plain.text().count("Client connection created") < 2:  # noqa: ASYNC110 - a log file
                    await anyio.sleep(0.05)
            assert not nc.is_connected
            _assert_nothing_sent(plain)
        finally:
            plain.stop()
    finally:
        await nc.close()


def test_a_plain_websocket_url_with_tls_options_is_a_usage_error(secrets: Path) -> None:
    with pytest.raises(ValueError, match="wss://"):
        ConnectOptions(urls=("ws://127.0.0.1:1",), tls_ca_file=str(secrets / "ca.pem"))


def test_the_installed_nats_py_still_has_the_hook_the_guard_needs() -> None:
    assert guards_tls()


def test_every_kind_of_tls_intent_requires_tls() -> None:
    assert ConnectOptions(urls=("tls://a:1",)).requires_tls
    assert ConnectOptions(urls=("nats://a:1", "tls://b:1")).requires_tls
    assert ConnectOptions(urls=("nats://a:1",), tls_ca_file="ca.pem").requires_tls
    assert ConnectOptions(
        urls=("nats://a:1",), tls_cert_file="c.pem", tls_key_file="k.pem"
    ).requires_tls
    assert not ConnectOptions(urls=("nats://a:1",)).requires_tls


# ------------------------------------------- a refused client certificate, alert or not


@pytest.fixture(scope="module")
def strangers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Credentials of another deployment: client certificates no server here trusts."""
    out = tmp_path_factory.mktemp("tls-strangers")
    make_credentials(out)
    return out


@pytest.fixture
def verifying_server(tmp_path: Path, secrets: Path) -> Iterator[TracedServer]:
    """A real nats-server that requires a client certificate signed by its CA."""
    server = TracedServer(tmp_path, _free_ports(1)[0], _tls_config(secrets, verify=True))
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("client", "expected"),
    # the alert's name varies with the server's Go version
    [
        ("stranger", "UNKNOWN_CA|BAD_CERTIFICATE"),
        ("none", "CERTIFICATE_REQUIRED|BAD_CERTIFICATE|HANDSHAKE_FAILURE"),
        ("own", None),
    ],
)
async def test_the_probe_reads_a_real_servers_verdict_every_time(
    verifying_server: TracedServer,
    secrets: Path,
    strangers: Path,
    client: str,
    expected: str | None,
) -> None:
    """Written to nothing after its handshake, the real server's alert is never lost to a
    reset (connecting as nats-py does loses it in most attempts on a loaded machine)."""
    certs = {"stranger": strangers, "none": None, "own": secrets}[client]
    context = tls_context(
        str(secrets / "ca.pem"),
        None if certs is None else str(certs / "producer.pem"),
        None if certs is None else str(certs / "producer-key.pem"),
    )
    url = f"tls://127.0.0.1:{verifying_server.port}"
    for _ in range(1 if expected is None else 20):
        started = time.monotonic()
        cause = await hangup_cause(url, context, 0.5)
        if expected is None:
            assert cause is None  # accepted: the server waits for a CONNECT that never comes
            assert time.monotonic() - started >= 0.5
        else:
            assert isinstance(cause, ssl.SSLError)
            assert re.search(expected, str(cause)), cause
    _assert_nothing_sent(verifying_server)


class AlertLosingServer:
    """A NATS server's TLS edge with the worst timing of a loaded machine.

    It sends ``INFO``, shakes hands in TLS 1.3 over memory buffers (so that it, not the
    kernel, decides when its bytes leave), and refuses the client's certificate (its CA
    trusts none). Then, as a real server's kernel does when a client's ``CONNECT``
    arrives after the refusal: a client that wrote on after its handshake gets a reset,
    the alert lost; a client that wrote nothing gets the alert, then a clean close."""

    def __init__(self, secrets: Path, strangers: Path) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(secrets / "nats-1.pem", secrets / "nats-1-key.pem")
        self.context.load_verify_locations(strangers / "ca.pem")  # trusts none of ours
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.resets = 0
        self.alerts = 0
        self.handlers: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await self._serve(reader, writer)
        except ConnectionError:
            pass  # the client hung up first: nats-py gave up on this attempt
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "alert-losing", "version": "2.9.10", "proto": 1,
                "max_payload": 1048576, "tls_required": True, "tls_verify": True}  # fmt: skip
        writer.write(b"INFO " + orjson.dumps(info) + b"\r\n")
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.context.wrap_bio(incoming, outgoing, server_side=True)
        while True:
            try:
                tls.do_handshake()
            except ssl.SSLWantReadError:
                writer.write(outgoing.read())
                data = await reader.read(65536)
                if not data:
                    return
                incoming.write(data)
            except ssl.SSLError:
                break
        alert = outgoing.read()
        # the refusal came at the client's Certificate record; its CertificateVerify
        # and Finished follow in two more: anything beyond is application data
        wrote_on = _tls_records(incoming.read()) > 2
        if not wrote_on:
            with contextlib.suppress(TimeoutError):
                wrote_on = bool(await asyncio.wait_for(reader.read(65536), 0.3))
        if wrote_on:
            self.resets += 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.alerts += 1
            writer.write(alert)
            await writer.drain()


def _tls_records(data: bytes) -> int:
    """How many TLS records ``data`` holds (each: type, version, 2-byte length, body)."""
    count = 0
    while len(data) >= 5:
        data = data[5 + struct.unpack(">H", data[3:5])[0] :]
        count += 1
    return count


async def test_a_refused_certificate_whose_alert_is_lost_is_still_named_at_once(
    secrets: Path, strangers: Path
) -> None:
    """Every attempt of nats-py's ends in a reset here; the probe, which writes nothing
    after its handshake, reads the alert, and the first connection fails at once saying
    why (it used to retry until its timeout, or forever for a daemon, logging resets)."""
    edge = AlertLosingServer(secrets, strangers)
    server = await asyncio.start_server(edge.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for initial_timeout_s in (10.0, None):
            opts = ConnectOptions(
                urls=(f"tls://127.0.0.1:{port}",),
                tls_ca_file=str(secrets / "ca.pem"),
                tls_cert_file=str(secrets / "producer.pem"),
                tls_key_file=str(secrets / "producer-key.pem"),
                reconnect_wait_s=0.1,
                initial_timeout_s=initial_timeout_s,
            )
            resets = edge.resets
            with anyio.fail_after(8), pytest.raises(ConnectRefused) as refused:
                await connect(opts)
            assert "refused our TLS client certificate" in str(refused.value)
            assert edge.resets > resets  # nats-py's attempts never saw the alert
        assert edge.alerts >= 1  # the probe did
    finally:
        server.close()
        await server.wait_closed()
        with anyio.fail_after(5):  # every attempt's handler has ended
            await asyncio.gather(*edge.handlers, return_exceptions=True)


async def test_a_server_that_never_finishes_the_tls_handshake_is_given_up_at_the_timeout() -> None:
    """The initial timeout cancels nats-py in the middle of its TLS upgrade; closing that
    client must not wait for ever (nats-py's close waits for a confirmation that asyncio
    gives the TLS layer, not the stream nats-py still holds)."""
    hung: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "mute", "version": "2.9.10", "proto": 1,
                "max_payload": 1048576, "tls_required": True}  # fmt: skip
        writer.write(b"INFO " + orjson.dumps(info) + b"\r\n")
        hung.append(writer)  # then silence: the client's ClientHello is never answered

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        opts = ConnectOptions(
            urls=(f"tls://127.0.0.1:{port}",),
            reconnect_wait_s=0.1,
            connect_timeout_s=30.0,  # the TLS upgrade is still waiting when we give up
            initial_timeout_s=0.5,
        )
        started = time.monotonic()
        with anyio.fail_after(45), pytest.raises(TimeoutError, match="no NATS server reachable"):
            await connect(opts)
        assert time.monotonic() - started < 20  # not held by the close
        assert hung
    finally:
        for writer in hung:
            writer.close()
        server.close()
        await server.wait_closed()
