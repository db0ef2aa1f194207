"""A local nats-server with JetStream, started for the demo and benchmarks.

Rules:

- The binary is ``$RC_NATS_SERVER``, else ``nats-server`` on ``PATH``, else Debian's
  ``/usr/sbin/nats-server``; without one, :class:`NatsServerNotFound` says how to get it.
- The server listens on a free loopback port chosen by itself (``-p -1``, learned from its
  ports file), keeps JetStream in a directory of its own, and accepts payloads up to
  ``max_payload`` (so the contract's "over 1 MiB" dead letters can be shown).
- :func:`embedded_nats` stops it (SIGTERM, then SIGKILL) when the block ends, whatever
  happened inside.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EmbeddedNats", "NatsServerNotFound", "embedded_nats", "find_nats_server"]

_FALLBACKS = ("/usr/sbin/nats-server", "/usr/local/bin/nats-server")


class NatsServerNotFound(RuntimeError):
    """No nats-server binary on this machine."""


def find_nats_server() -> str:
    explicit = os.environ.get("RC_NATS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("nats-server")
    if found:
        return found
    for path in _FALLBACKS:
        if os.access(path, os.X_OK):
            return path
    raise NatsServerNotFound(
        "no nats-server binary: install it (Debian: apt-get install nats-server), "
        "set RC_NATS_SERVER, or pass --nats-url of a running server"
    )


@dataclass(frozen=True, slots=True)
class EmbeddedNats:
    url: str
    pid: int
    store_dir: Path
    log_path: Path


@contextlib.contextmanager
def embedded_nats(
    *, workdir: Path | None = None, max_payload: int = 4 * 1024 * 1024, start_timeout_s: float = 10
) -> Iterator[EmbeddedNats]:
    """Run a nats-server with JetStream for the duration of the block."""
    binary = find_nats_server()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rc-nats-")))
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "nats-server.conf"
        config.write_text(f"max_payload: {max_payload}\n")
        ports = workdir / "ports"
        ports.mkdir(exist_ok=True)
        log_path = workdir / "nats-server.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [binary, "-c", str(config), "-a", "127.0.0.1", "-p", "-1", "-js",
                 "-sd", str(workdir / "jetstream"), "--ports_file_dir", str(ports)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            url = _wait_for_url(proc, ports, log_path, deadline=time.monotonic() + start_timeout_s)
            yield EmbeddedNats(
                url=url, pid=proc.pid, store_dir=workdir / "jetstream", log_path=log_path
            )
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_for_url(
    proc: subprocess.Popen[bytes], ports: Path, log_path: Path, *, deadline: float
) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"nats-server exited with {proc.returncode}:\n{tail}")
        for path in ports.glob(f"*_{proc.pid}.ports"):
            with contextlib.suppress(ValueError, OSError, KeyError, IndexError):
                return str(json.loads(path.read_text())["nats"][0])
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"nats-server did not start within the timeout; see {log_path}")
