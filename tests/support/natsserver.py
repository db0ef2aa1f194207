"""A real nats-server for tests, with fault injection.

:func:`start_nats_server` picks, in order:

1. ``RC_TEST_NATS_URL`` set: that external server (shared, so fault injection skips the
   test and tests should use unique prefixes);
2. a ``nats-server`` binary (``RC_TEST_NATS_SERVER``, ``PATH``, or ``/usr/sbin``): a fresh
   process on a random loopback port with JetStream in a temporary store directory;
3. Docker through testcontainers' NATS module (pause/resume only);

and otherwise skips the test. Every server is stopped at teardown, and at interpreter exit
if a teardown never ran.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

__all__ = ["NatsServer", "expect_reconnect", "start_nats_server"]

BINARY_FALLBACKS = ("/usr/sbin/nats-server", "/usr/local/bin/nats-server")
START_TIMEOUT_S = 10.0
#: the test server accepts payloads up to 4 MiB, so that 2 MiB inputs reach the reconciler
MAX_PAYLOAD = 4 * 1024 * 1024
STOP_TIMEOUT_S = 5.0

_live: set[NatsServer] = set()


class NatsServer:
    """A NATS server under test. ``url`` stays the same across restarts."""

    url: str
    shared = False  # True when other tests use the same server
    supports_faults = False  # kill/stop/start/restart work

    def kill(self) -> None:
        """SIGKILL the server: no flush, no goodbye to clients."""
        self._unsupported("kill")

    def stop(self) -> None:
        """Shut the server down gracefully (it flushes JetStream)."""
        self._unsupported("stop")

    def start(self) -> None:
        """Start a stopped or killed server again, on the same port and store."""
        self._unsupported("start")

    def restart(self, *, graceful: bool = True) -> None:
        """Stop (or kill) and start again: same port, same store, so JetStream state survives."""
        if graceful:
            self.stop()
        else:
            self.kill()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing is answered."""
        self._unsupported("pause")

    def resume(self) -> None:
        """Unfreeze a paused server (SIGCONT)."""
        self._unsupported("resume")

    def close(self) -> None:
        """Release the server for good (teardown)."""
        _live.discard(self)

    def _unsupported(self, what: str) -> None:
        pytest.skip(f"{what}() is not possible with {type(self).__name__}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class NatsProcess(NatsServer):
    """A ``nats-server`` child process: ``-a 127.0.0.1 -p <port> -js -sd <dir>``, with a
    config file that raises ``max_payload`` to :data:`MAX_PAYLOAD`."""

    supports_faults = True

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.store_dir = workdir / "store"
        self.log_path = workdir / "nats-server.log"
        self.port: int | None = None  # chosen by the server at first start, then kept
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._starts = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        self._starts += 1
        ports_dir = self.workdir / f"ports-{self._starts}"
        ports_dir.mkdir()
        config = self.workdir / "nats-server.conf"
        # room for the contract's "payload over 1 MiB" dead letters (the default is 1 MiB)
        config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
        args = [
            self.binary,
            "-c", str(config),
            "-a", "127.0.0.1",
            "-p", str(self.port if self.port is not None else -1),
            "-js", "-sd", str(self.store_dir),
            "--ports_file_dir", str(ports_dir),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._paused = False
        _live.add(self)
        deadline = time.monotonic() + START_TIMEOUT_S
        port = self._wait_for_port(ports_dir, deadline)
        self._wait_until_accepting(port, deadline)
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"

    def kill(self) -> None:
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        self._signal_and_wait(signal.SIGTERM)

    def pause(self) -> None:
        proc = self._require_running()
        proc.send_signal(signal.SIGSTOP)
        self._paused = True
        _wait_for_threads(proc.pid, stopped=True)  # signals arrive asynchronously

    def resume(self) -> None:
        proc = self._require_running()
        proc.send_signal(signal.SIGCONT)
        self._paused = False
        _wait_for_threads(proc.pid, stopped=False)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal_and_wait(signal.SIGTERM)
        super().close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ internals

    def _require_running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc

    def _signal_and_wait(self, signum: signal.Signals) -> None:
        proc = self._require_running()
        if self._paused and signum != signal.SIGKILL:
            proc.send_signal(signal.SIGCONT)  # a stopped process would hold SIGTERM pending
        self._paused = False
        proc.send_signal(signum)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

    def _wait_for_port(self, ports_dir: Path, deadline: float) -> int:
        proc = self._require_started()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {proc.returncode}:\n{self.log_tail()}")
            for path in ports_dir.glob(f"*_{proc.pid}.ports"):
                with contextlib.suppress(ValueError, OSError):  # half-written file
                    ports = json.loads(path.read_text())
                    url = str(ports["nats"][0])
                    return int(url.rsplit(":", 1)[1])
            time.sleep(0.01)
        self._abort()
        raise RuntimeError(f"nats-server did not report its port:\n{self.log_tail()}")

    def _wait_until_accepting(self, port: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    if sock.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.01)
        self._abort()
        raise RuntimeError(f"nats-server is not accepting on {port}:\n{self.log_tail()}")

    def _require_started(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None
        return self._proc

    def _abort(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _wait_for_threads(pid: int, *, stopped: bool, within_s: float = 2.0) -> None:
    """Wait until every thread of ``pid`` is (or is no longer) stopped; Linux /proc only."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        time.sleep(0.05)
        return
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for stat in tasks.glob("*/stat"):
            with contextlib.suppress(OSError):  # a thread that just exited
                # "pid (comm) S ...": the state follows the last ")".
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all((state in "tT") == stopped for state in states):
            return
        time.sleep(0.002)
    raise RuntimeError(f"nats-server {pid} did not {'stop' if stopped else 'continue'}")


class ExternalNats(NatsServer):
    """A server someone else runs (``RC_TEST_NATS_URL``); faults skip the test."""

    shared = True

    def __init__(self, url: str) -> None:
        self.url = url


class NatsDockerContainer(NatsServer):
    """testcontainers' NATS container with JetStream; only pause and resume."""

    def __init__(self) -> None:
        from testcontainers.community.nats import NatsContainer

        self._container: Any = NatsContainer().with_command("-js -sd /data")
        self._container.start()
        _live.add(self)
        self.url = str(self._container.nats_uri())

    def pause(self) -> None:
        self._container.get_wrapped_container().pause()

    def resume(self) -> None:
        self._container.get_wrapped_container().unpause()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._container.stop()
        super().close()


def find_binary() -> str | None:
    explicit = os.environ.get("RC_TEST_NATS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("nats-server")
    if found:
        return found
    return next((path for path in BINARY_FALLBACKS if os.access(path, os.X_OK)), None)


def _docker_works() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env()
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@contextlib.contextmanager
def start_nats_server(workdir: Path | None = None) -> Iterator[NatsServer]:
    """A started server, closed on exit; skips the test when no way to run one exists."""
    server: NatsServer
    url = os.environ.get("RC_TEST_NATS_URL")
    binary = find_binary()
    owned_dir: tempfile.TemporaryDirectory[str] | None = None
    if url:
        server = ExternalNats(url)
    elif binary is not None:
        if workdir is None:
            owned_dir = tempfile.TemporaryDirectory(prefix="nats-test-")
            workdir = Path(owned_dir.name)
        process = NatsProcess(binary, workdir)
        try:
            process.start()
        except BaseException:
            process.close()
            raise
        server = process
    elif _docker_works():
        server = NatsDockerContainer()
    else:
        pytest.skip("no nats-server: install one, or set RC_TEST_NATS_URL, or run Docker")
    try:
        yield server
    finally:
        server.close()
        if owned_dir is not None:
            owned_dir.cleanup()


@contextlib.asynccontextmanager
async def expect_reconnect(nc: Client, *, within_s: float = 5.0) -> AsyncIterator[None]:
    """Wait, after the body (a restart), until ``nc`` has reconnected.

    A request sent before the client notices the old connection is gone is written to a
    dead socket and lost (nats-py then waits for its full timeout), so tests that restart
    the server wait for the reconnect before talking to it again.
    """
    before = nc.stats["reconnects"]
    yield
    with anyio.fail_after(within_s):
        # nats-py offers no reconnect event on a client it did not configure: poll.
        while nc.stats["reconnects"] <= before or not nc.is_connected:  # noqa: ASYNC110
            await anyio.sleep(0.01)


@atexit.register
def _close_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            if isinstance(server, NatsProcess) and server.running:
                server.kill()
            else:
                server.close()
