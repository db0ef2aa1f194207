"""TLS never falls back to plaintext (CONTRACT.md, Additions, "Security defaults").

Against real nats-server processes that trace every protocol line they receive: a
``tls://`` URL or any TLS option, pointed at a server without TLS, fails at once with
one sentence, and the server never sees a ``CONNECT`` (so no user, no password); a
server that offers TLS without requiring it is spoken to in TLS; a client that loses
its TLS server and finds a plain one on the same address does not send it anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from reconciler.bus.connection import ConnectOptions, ConnectRefused, connect
from reconciler.bus.nats_internals import guards_tls
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


def _tls_config(secrets: Path, *, allow_non_tls: bool = False) -> str:
    return (
        f'tls {{ cert_file: "{secrets / "nats-1.pem"}", key_file: "{secrets / "nats-1-key.pem"}", '
        f'ca_file: "{secrets / "ca.pem"}" }}\n'
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
