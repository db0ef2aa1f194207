"""Progress of long work on a terminal (:mod:`reconciler.cli.progress`): drawn when
standard error is a terminal (a real pseudo-terminal here), never into a pipe or a file;
``reconciler replay`` and ``reconciler audit`` end to end on a real nats-server."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import pytest

from reconciler.cli.progress import Progress
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def terminal() -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A pseudo-terminal: its follower side as a text stream, and the leader's fd."""
    leader, follower = pty.openpty()
    stream = open(follower, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    try:
        yield stream, leader
    finally:
        stream.close()
        os.close(leader)


def drain(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the follower closed: nothing more
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_sees_count_rate_and_time_left() -> None:
    clock = Clock()
    with terminal() as (stream, leader):
        progress = Progress("replay", unit="inputs", total=10_000, stream=stream, clock=clock)
        assert progress.enabled
        clock.now += 2.0
        progress.update(2_000)
        clock.now += 0.1
        progress.update(2_100)  # too soon after the last: not drawn
        clock.now += 2.0
        progress.update(4_000)
        clock.now += 1.0
        progress.update(5_000)
        progress.done()
        shown = drain(leader)
    lines = shown.split("\r")
    assert "replay: 2,000/10,000 inputs (20%), 1,000/s, 0:08 left\x1b[K" in lines
    assert not any("2,100" in line for line in lines)
    assert "replay: 4,000/10,000 inputs (40%), 976/s, 0:06 left\x1b[K" in lines
    # the terminal turns the last line's newline into "\r\n"
    assert lines[-2:] == ["replay: 5,000 inputs in 0:05, 980/s\x1b[K", "\n"]


def test_a_pipe_or_a_file_sees_nothing(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as stream:
        progress = Progress("audit", unit="messages", total=10, stream=stream)
        assert not progress.enabled
        progress.update(5)
        progress.done()
    assert (tmp_path / "err").read_text() == ""


def run_on_terminal(args: list[str]) -> tuple[int, str, str]:
    """``reconciler ARGS`` with standard error on a terminal: exit code, stdout, stderr."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reconciler.cli", *args],
            stdout=subprocess.PIPE,
            stderr=follower,
            stdin=subprocess.DEVNULL,
        )
        os.close(follower)
        shown: list[str] = []
        while proc.poll() is None:
            shown.append(drain(leader))
        shown.append(drain(leader))
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        proc.stdout.close()
        return proc.wait(), out, "".join(shown)
    finally:
        os.close(leader)


def run_on_pipe(args: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "reconciler.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def decided(url: str, db: Path) -> None:
    """A replica decided 300 admissions: a stream to replay, a lease to audit."""

    async def main() -> None:
        nc = await nats.connect(url, connect_timeout=2)
        try:
            bus = BusClient(nc)
            async with running_replica(fast_config(url, db)):
                await bus.send(
                    b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
                    b.pool("web", cpu=1, memory_mib=1024, disk_gib=10),
                    *(b.admit(f"r{i}", "web", f"vm-{i}", job=f"job-{i}") for i in range(300)),
                )
                await bus.decision("r299", within_s=30)
        finally:
            await nc.close()

    anyio.run(main)


def test_replay_and_audit_show_progress_on_a_terminal_only(nats_url: str, tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    decided(nats_url, db)
    replay = ["replay", "--nats-url", nats_url, "--log-level", "error"]
    code, out, err = run_on_terminal(replay)
    assert code == 0, out + err
    # the last line says how many, how fast, how long (intermediate lines are throttled)
    assert "replay: 302 inputs in 0:0" in err and "/s" in err, err
    assert "302 folded" in out
    code, out, err = run_on_pipe(replay)
    assert code == 0 and "302 folded" in out
    assert "replay:" not in err and "\r" not in err

    audit = ["audit", "job-7", "--db", str(db), "--nats-url", nats_url, "--log-level", "error"]
    code, out, err = run_on_terminal(audit)
    assert code == 0, out + err
    assert "audit:" in err and "OUT stream messages in" in err, err
    assert "vm-7" in out
    code, out, err = run_on_pipe(audit)
    assert code == 0 and "vm-7" in out
    assert "audit:" not in err and "\r" not in err
