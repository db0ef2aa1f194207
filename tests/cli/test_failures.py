"""Every expected failure of the ``reconciler`` programs is one line and exit status 1,
run as the operator runs them (``python -m reconciler.cli``, a real nats-server, real
SQLite files): a store ahead of its stream or of a newer schema, a refused
authentication, a file that is not a database or not a replica's store (left
untouched), a held writer lock (at once, naming the holder), URLs that cannot be a NATS
server's (before connecting), Ctrl-C (``interrupted``), ``--debug`` for the traceback,
and ``replay``'s partial ``--db`` removed when it is interrupted."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import click
import pytest

from reconciler.cli.failures import run_cli
from reconciler.core.state import Effects, State
from reconciler.store.sqlite import Store
from tests.bus.test_connection_tls import TracedServer
from tests.support import builders as b
from tests.support.bus import BusClient
from tests.support.cluster import _free_ports
from tests.support.folding import commit
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.timeout(90)

RECONCILER = [sys.executable, "-m", "reconciler.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RC_")}


def reconciler(
    *args: str, timeout: float = 30, level: str = "error"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RECONCILER, *args, "--log-level", level],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def one_line(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The one line ``result`` printed on stderr, after checking it failed with
    ``status``, without a traceback."""
    assert result.returncode == status, result
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A replica's store that has applied up to seq 99."""
    db = tmp_path / "rc.db"

    async def ahead() -> None:
        async with await Store.open(db) as opened:
            await commit(opened, State(applied_seq=99), Effects(), applied_seq=99)

    anyio.run(ahead)
    return db


def test_a_store_ahead_of_its_stream(nats_url: str, store: Path) -> None:
    line = one_line(reconciler("run", "--nats-url", nats_url, "--db", str(store)))
    assert line.startswith("Error: store ") and "has applied up to seq 99" in line
    assert "Move the store away" in line


def test_a_schema_too_new(nats_url: str, store: Path) -> None:
    conn = sqlite3.connect(store)
    with conn:
        conn.execute("INSERT INTO schema_version VALUES (999)")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # into the file itself
    conn.close()
    before = store.read_bytes()
    line = one_line(reconciler("run", "--nats-url", nats_url, "--db", str(store)))
    assert "has schema version 999" in line and "run a newer reconciler" in line
    assert store.read_bytes() == before


@pytest.mark.parametrize("kind", ["garbage", "foreign", "executor"])
def test_run_refuses_a_file_that_is_not_a_replicas_store_untouched(
    nats_url: str, tmp_path: Path, kind: str
) -> None:
    (tmp_path / "files").mkdir()
    db = tmp_path / "files" / f"{kind}.db"
    if kind == "garbage":
        db.write_bytes(b"not a database at all\n" * 100)
    else:
        with sqlite3.connect(db) as conn:
            table = "finished (id TEXT PRIMARY KEY)" if kind == "executor" else "t (x)"
            conn.execute(f"CREATE TABLE {table}")
    before = db.read_bytes()
    line = one_line(reconciler("run", "--nats-url", nats_url, "--db", str(db)))
    if kind == "garbage":
        assert line == f"Error: cannot open store {db}: file is not a database"
    else:
        assert f"{db} is not a reconciler replica's store" in line and "left untouched" in line
    assert db.read_bytes() == before
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]


def test_a_held_writer_lock_is_reported_at_once_with_the_holders_pid(
    nats_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "rc.db"
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        first = subprocess.Popen(
            [*RECONCILER, "run", "--nats-url", nats_url, "--db", str(db), "--replica", "a"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        deadline = time.monotonic() + 30
        while b"pipeline.started" not in log.read_bytes() and b"leader." not in log.read_bytes():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        started = time.monotonic()
        second = reconciler("run", "--nats-url", nats_url, "--db", str(db), "--replica", "b")
        took = time.monotonic() - started
        line = one_line(second)
        assert line == (
            f"Error: store {db} is in use by another `reconciler run` (PID {first.pid}): "
            "stop it first, or give this replica a --db of its own"
        )
        assert took < 30  # not the 60 s a writer of a killed replica is waited for
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:4222", "http:// is not a NATS scheme"),
        ("nats://127.0.0.1: 4222", "the port is not a number"),
        ("nats://local host:4222", "has no scheme where the other URLs have one"),
    ],
)
def test_urls_are_checked_before_connecting(tmp_path: Path, url: str, problem: str) -> None:
    for args in (["run", "--db", str(tmp_path / "rc.db")], ["query", "health"]):
        # a connection tried would log its failures (nats.error) as warnings
        line = one_line(reconciler(*args, "--nats-url", url, level="warning"))
        assert line.startswith("Error: --nats-url (RC_NATS_URL): ") and problem in line
    assert not (tmp_path / "rc.db").exists()


def test_a_refused_authentication(tmp_path: Path) -> None:
    server = TracedServer(tmp_path, _free_ports(1)[0], "authorization { user: u, password: pw }")
    try:
        url = f"nats://u:wrong@127.0.0.1:{server.port}"
        for args in (["run", "--db", str(tmp_path / "rc.db")], ["query", "health"]):
            line = one_line(reconciler(*args, "--nats-url", url))
            assert line.startswith("Error: ") and "uthorization" in line, line
            assert "wrong" not in line
    finally:
        server.stop()


def _interruptible(args: list[str]) -> subprocess.Popen[str]:
    """``reconciler <args>`` with SIGINT handled as at a terminal (a shell's background
    job would ignore it)."""
    return subprocess.Popen(
        [*RECONCILER, *args, "--log-level", "error"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("command", [["run", "--db", "{tmp}/rc.db"], ["query", "health"]])
def test_ctrl_c_while_connecting_is_interrupted(tmp_path: Path, command: list[str]) -> None:
    unreachable = f"nats://127.0.0.1:{_free_ports(1)[0]}"
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    proc = _interruptible([*args, "--nats-url", unreachable])
    time.sleep(2.5)  # started, connecting (and retrying)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["interrupted"]


def test_ctrl_c_during_replay_removes_its_db_and_prints_no_child_traceback(
    nats_server: NatsServer, nats_url: str, tmp_path: Path
) -> None:
    async def fill() -> None:
        import nats

        nc = await nats.connect(nats_url)
        try:
            bus = BusClient(nc)
            await bus.ensure_streams()
            await bus.send(b.pool("web", cpu=1, memory_mib=1024, disk_gib=10))
            await bus.send_many([b.admit(f"r{i}", "web", f"vm-{i}") for i in range(3000)])
        finally:
            await nc.close()

    anyio.run(fill)
    (tmp_path / "files").mkdir()
    db = tmp_path / "files" / "replayed.db"
    proc = _interruptible(["replay", "--nats-url", nats_url, "--db", str(db)])
    deadline = time.monotonic() + 30
    while not db.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    nats_server.pause()  # the replay is folding: it now waits for the server
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        nats_server.resume()
    assert proc.returncode == 130, stderr
    # the reader child may warn of the paused server: a log line, never a traceback
    assert stderr.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert sorted(p.name for p in db.parent.iterdir()) == []


def test_debug_shows_the_traceback(nats_url: str, tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    db.write_bytes(b"not a database at all\n" * 100)
    for debug in (["--debug"], []):
        result = subprocess.run(
            [*RECONCILER, "run", "--nats-url", nats_url, "--db", str(db), *debug],
            capture_output=True,
            text=True,
            timeout=30,
            env={**_env(), **({} if debug else {"RC_DEBUG": "1"})},
        )
        assert result.returncode == 1
        assert "Traceback (most recent call last)" in result.stderr
        assert "StoreError: cannot open store" in result.stderr


def test_a_bug_is_one_line_that_asks_for_debug(capsys: pytest.CaptureFixture[str]) -> None:
    @click.command()
    def broken() -> None:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [KeyError("x")])

    with pytest.raises(SystemExit) as exited:
        run_cli(broken, [])
    assert exited.value.code == 1
    line = capsys.readouterr().err.strip()
    assert line == (
        "Error: unexpected KeyError: 'x' (a bug: run again with --debug or RC_DEBUG=1 for "
        "the traceback, and report it)"
    )


def test_a_usage_error_keeps_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    @click.command()
    @click.option("--n", type=int)
    def counted(n: int) -> None:
        del n

    with pytest.raises(SystemExit) as exited:
        run_cli(counted, ["--n", "x"])
    assert exited.value.code == 2
    assert "'x' is not a valid integer" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_rc_debug(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("RC_DEBUG", raising=False)
    yield
