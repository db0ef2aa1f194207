"""The store's writer process: the same rows as the in-process writer, one writer per
database, errors as StoreError, and a child that never outlives its parent's pipe."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sqlite3
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from reconciler.core.state import State
from reconciler.store import Store, StoreError
from reconciler.store.errors import StoreLocked
from reconciler.store.writer import PIPE_BYTES, WriterProcess
from reconciler.store.writer_child import WriterGate, checkpoint
from tests.store.test_sqlite import (
    FULL_STATE,
    MESSAGES,
    N,
    all_journal,
    all_outbox,
    assert_same_state,
)
from tests.support.folding import commit, fold_batch
from tests.support.repo import ROOT

#: the largest pipe an unprivileged process may ask for (Linux)
PIPE_MAX = int(Path("/proc/sys/fs/pipe-max-size").read_text()) if sys.platform == "linux" else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers signal 0: look at its state
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


async def _wait_gone(pid: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"writer process {pid} still runs after {within_s} s")
        await asyncio.sleep(0.05)


async def _commit_in_batches(db: Path, *, writer_process: bool) -> None:
    async with await Store.open(db, writer_process=writer_process) as store:
        state = State()
        for start in range(0, N, 7):
            end = min(start + 7, N)
            fx = fold_batch(state, MESSAGES[start:end])
            assert await commit(store, state, fx, applied_seq=end)
        await store.mark_published_through(N // 2)


async def test_the_writer_process_writes_what_the_thread_writes(tmp_path: Path) -> None:
    in_thread, in_child = tmp_path / "thread.db", tmp_path / "child.db"
    await _commit_in_batches(in_thread, writer_process=False)
    await _commit_in_batches(in_child, writer_process=True)
    assert all_outbox(in_child) == all_outbox(in_thread)
    assert all_journal(in_child) == all_journal(in_thread)
    async with await Store.open(in_child) as store:
        assert_same_state(await store.load_state(), FULL_STATE)
        assert await store.published_seq() == N // 2


async def test_commits_are_readable_at_once_and_positions_only_move_forward(
    tmp_path: Path,
) -> None:
    state = State()
    fx = fold_batch(state, MESSAGES[:10])
    async with await Store.open(tmp_path / "rc.db", writer_process=True) as store:
        assert store.writer_pid is not None
        assert await commit(store, state, fx, applied_seq=10)
        assert await store.applied_seq() == 10  # read on this process's own connection
        assert not await commit(store, state, fx, applied_seq=10)  # redelivered: no-op
        assert await store.mark_published_through(10) == 1
        assert await store.mark_published_through(5) == 0
        assert await store.published_seq() == 10


async def test_closing_the_store_ends_the_writer(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "rc.db", writer_process=True)
    pid = store.writer_pid
    assert pid is not None and _alive(pid)
    await store.close()
    await _wait_gone(pid)
    assert store.writer_pid is None


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="pipe sizes are Linux's")
async def test_a_whole_batch_fits_in_the_request_pipe(tmp_path: Path) -> None:
    writer = await WriterProcess.start(tmp_path / "rc.db")
    try:
        stdin = writer._proc.stdin
        assert stdin is not None
        size = fcntl.fcntl(stdin.get_extra_info("pipe").fileno(), fcntl.F_GETPIPE_SZ)
        assert size >= min(PIPE_BYTES, PIPE_MAX)
    finally:
        await writer.close()


async def test_a_memory_database_cannot_have_a_writer_process() -> None:
    with pytest.raises(StoreError, match="needs a database file"):
        await Store.open(":memory:", writer_process=True)


async def test_a_dead_writer_is_a_store_error_every_time_after(tmp_path: Path) -> None:
    state = State()
    fx = fold_batch(state, MESSAGES[:10])
    async with await Store.open(tmp_path / "rc.db", writer_process=True) as store:
        assert store.writer_pid is not None
        os.kill(store.writer_pid, signal.SIGKILL)
        with pytest.raises(StoreError, match="writer process exited"):
            await commit(store, state, fx, applied_seq=10)
        with pytest.raises(StoreError, match="writer process exited"):
            await store.mark_published_through(1)
        assert await store.applied_seq() == 0  # reads still work; nothing was written


async def test_a_cancelled_caller_leaves_the_writer_in_step(tmp_path: Path) -> None:
    """A leader stepping down cancels its outbox mark mid-exchange; the caches' next
    commit must still go through (it used to fail: "a request was interrupted")."""
    state = State()
    fx = fold_batch(state, MESSAGES[:10])
    async with await Store.open(tmp_path / "rc.db", writer_process=True) as store:
        assert await commit(store, state, fx, applied_seq=10)
        for seq in range(1, 6):
            marking = asyncio.ensure_future(store.mark_published_through(seq))
            await asyncio.sleep(0)  # the request is on the pipe, its reply not read
            marking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await marking
        fx = fold_batch(state, MESSAGES[10:20])
        assert await commit(store, state, fx, applied_seq=20)
        assert await store.applied_seq() == 20
        assert await store.published_seq() == 5  # the cancelled marks completed


async def test_a_failed_transaction_is_replied_and_the_writer_goes_on(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    state = State()
    fx = fold_batch(state, MESSAGES[:10])
    async with await Store.open(db, writer_process=True) as store:
        writer = store._writer
        assert writer is not None
        with pytest.raises(StoreError, match="no such table: nowhere"):
            await writer.write(3, [("INSERT INTO nowhere VALUES (?)", [(1,)])])
        assert await store.applied_seq() == 0  # rolled back whole, position included
        assert await commit(store, state, fx, applied_seq=10)
        assert await store.applied_seq() == 10


async def test_one_writer_per_database(tmp_path: Path) -> None:
    """A second writer of a store whose replica runs is refused at once, naming that
    replica; once the first lets go, another one starts."""
    db = tmp_path / "rc.db"
    async with await Store.open(db, writer_process=True):
        with pytest.raises(
            StoreLocked, match=rf"in use by another `reconciler run` \(PID {os.getpid()}\)"
        ):
            await WriterProcess.start(db, ready_timeout_s=30.0)
    second = await WriterProcess.start(db, ready_timeout_s=10.0)  # the first one is gone
    await second.close()


async def test_the_writer_of_a_killed_replica_is_waited_for(tmp_path: Path) -> None:
    """A lock whose replica is gone (its writer finishing the last transaction) is waited
    for, not refused: here a holder that names a pid no process has."""
    db = tmp_path / "rc.db"
    with open(f"{db}.writer-lock", "w+b") as held:  # noqa: ASYNC230 - a lock, held
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(b"999999999 1\n")
        held.flush()
        with pytest.raises(StoreError, match="did not start") as waited:
            await WriterProcess.start(db, ready_timeout_s=1.0)
        assert not isinstance(waited.value, StoreLocked)
    writer = await WriterProcess.start(db, ready_timeout_s=10.0)
    await writer.close()


async def test_the_writer_ignores_ctrl_c(tmp_path: Path) -> None:
    """SIGINT reaches a whole process group: the parent commits the batch in hand on its
    way out, so the writer must still be there."""
    state = State()
    fx = fold_batch(state, MESSAGES[:10])
    async with await Store.open(tmp_path / "rc.db", writer_process=True) as store:
        assert store.writer_pid is not None
        os.kill(store.writer_pid, signal.SIGINT)
        os.kill(store.writer_pid, signal.SIGTERM)
        await asyncio.sleep(0.2)
        assert await commit(store, state, fx, applied_seq=10)


async def test_the_writer_does_not_outlive_a_killed_parent(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from reconciler.store import Store

        async def main():
            store = await Store.open({str(db)!r}, writer_process=True)
            print(store.writer_pid, flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        writer_pid = int(await asyncio.wait_for(parent.stdout.readline(), 30))
        assert _alive(writer_pid)
    finally:
        parent.kill()
        await parent.wait()
    await _wait_gone(writer_pid)
    # and the database is free for the next replica's writer
    async with await Store.open(db, writer_process=True) as store:
        assert await store.applied_seq() == 0


async def test_the_writer_checkpoints_the_wal(tmp_path: Path) -> None:
    """Automatic checkpoints are off on the writer's connection; its own thread keeps the
    WAL from growing without bound."""
    db = tmp_path / "rc.db"
    async with await Store.open(db, writer_process=True) as store:
        state = State()
        fx = fold_batch(state, MESSAGES)
        assert await commit(store, state, fx, applied_seq=N)
        await asyncio.sleep(1.5)  # one checkpoint period
        # immutable: the database file alone, without the WAL: what was checkpointed
        with sqlite3.connect(f"file:{db}?immutable=1", uri=True) as probe:
            (applied,) = probe.execute("SELECT applied_seq FROM position").fetchone()
        assert applied == N


def _wal_database(path: Path, *, megabytes: int) -> sqlite3.Connection:
    """A WAL database at ``path`` whose writer never checkpoints, with ``megabytes`` of
    committed rows in its WAL (as the writer child's connection has them)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("CREATE TABLE rows (n INTEGER PRIMARY KEY, data BLOB)")
    for n in range(megabytes * 4):
        conn.execute("INSERT INTO rows (n, data) VALUES (?, ?)", (n, os.urandom(256 * 1024)))
    return conn


def _wal_bytes(path: Path) -> int:
    return path.with_name(path.name + "-wal").stat().st_size


def _wal_frames(conn: sqlite3.Connection) -> int:
    """Frames in the WAL since it last started over (a passive checkpoint says)."""
    return int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])


def test_a_wal_past_the_limit_starts_over_under_a_writer_that_never_pauses(
    tmp_path: Path,
) -> None:
    """A writer committing back to back always adds frames while a passive checkpoint
    copies, so the WAL never starts over and only grows; past the limit, the second
    checkpoint (between two of the writer's transactions) copies the rest, and the next
    transaction starts the WAL over, from the file's beginning. Nothing is lost."""
    db = tmp_path / "rc.db"
    writer = _wal_database(db, megabytes=8)
    gate = WriterGate()
    stop = threading.Event()
    written = [0]

    def write() -> None:  # as the writer child serves: one transaction at a time, gated
        while not stop.is_set():
            with gate.transaction():
                writer.execute(
                    "INSERT INTO rows (n, data) VALUES (?, ?)",
                    (10_000 + written[0], os.urandom(64 * 1024)),
                )
            written[0] += 1

    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    thread = threading.Thread(target=write)
    thread.start()
    try:
        # under the limit: passive only
        assert checkpoint(conn, str(db), gate, finish_bytes=64 << 20) == "passive"
        done = [checkpoint(conn, str(db), gate, finish_bytes=4 << 20) for _ in range(3)]
        assert "finished" in done
        seen = written[0]
        deadline = time.monotonic() + 10
        while written[0] < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    size = _wal_bytes(db)
    frames = _wal_frames(conn)
    conn.close()
    # started over: what the last transactions wrote, at the file's start
    assert size > 8 << 20 and frames * 4096 < size // 2, (size, frames)
    (count,) = writer.execute("SELECT count(*) FROM rows").fetchone()
    assert count == 8 * 4 + written[0]
    writer.close()


def test_an_idle_writers_large_wal_is_truncated(tmp_path: Path) -> None:
    """Once the writer is idle, a WAL past WAL_IDLE_BYTES is cut to nothing; not before."""
    db = tmp_path / "rc.db"
    writer = _wal_database(db, megabytes=4)
    gate = WriterGate()
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        with gate.transaction():  # a transaction just ended: not idle yet
            writer.execute("INSERT INTO rows (n, data) VALUES (-1, x'00')")
        assert checkpoint(conn, str(db), gate, idle_bytes=1 << 20, idle_s=60) == "passive"
        assert _wal_bytes(db) > 4 << 20
        assert checkpoint(conn, str(db), gate, idle_bytes=1 << 20, idle_s=0) == "truncated"
        assert _wal_bytes(db) == 0
        writer.execute("INSERT INTO rows (n, data) VALUES (-2, x'00')")
        assert writer.execute("SELECT count(*) FROM rows").fetchone() == (4 * 4 + 2,)
    finally:
        conn.close()
        writer.close()


def test_a_reader_of_old_frames_keeps_the_wal_until_a_later_period(tmp_path: Path) -> None:
    """A reader whose snapshot needs the WAL's frames keeps them: the checkpoint does not
    wait for it (nor holds the writer meanwhile), and the WAL starts over a period after
    the reader is done."""
    db = tmp_path / "rc.db"
    writer = _wal_database(db, megabytes=4)
    reader = sqlite3.connect(db, isolation_level=None)
    conn = sqlite3.connect(db, isolation_level=None)
    gate = WriterGate()
    try:
        reader.execute("BEGIN")
        (before,) = reader.execute("SELECT count(*) FROM rows").fetchone()
        writer.execute("INSERT INTO rows (n, data) VALUES (-1, x'00')")
        assert checkpoint(conn, str(db), gate, finish_bytes=1 << 20) == "passive"
        writer.execute("INSERT INTO rows (n, data) VALUES (-2, x'00')")
        assert _wal_frames(conn) > 1000  # kept going
        # the reader's snapshot is intact, then it ends
        assert reader.execute("SELECT count(*) FROM rows").fetchone() == (before,)
        reader.execute("COMMIT")
        assert checkpoint(conn, str(db), gate, finish_bytes=1 << 20) == "finished"
        writer.execute("INSERT INTO rows (n, data) VALUES (-3, x'00')")
        assert _wal_frames(conn) < 10  # started over
        assert writer.execute("SELECT count(*) FROM rows").fetchone() == (before + 3,)
    finally:
        conn.close()
        reader.close()
        writer.close()
