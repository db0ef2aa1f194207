"""The store's writer process itself (see :mod:`reconciler.store.writer` for its rules).

``python -m reconciler.store.writer_child <db>``: takes the database's writer lock,
serves ``write`` and ``mark`` requests from stdin in order with one reply each on
stdout, checkpoints the WAL on a thread of its own (:func:`checkpoints`), and stops when
stdin closes.
It imports the standard library and :mod:`reconciler.store.transactions` only, so it
stays a small process (the parent imports this module for the frame format).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pickle
import signal
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from reconciler.store.errors import StoreError
from reconciler.store.transactions import mark_published, write_batch

__all__ = [
    "CHECKPOINT_EVERY_S",
    "FRAME_HEADER",
    "WAL_FINISH_BYTES",
    "checkpoint",
    "checkpoints",
    "main",
    "take_writer_lock",
]

#: how often the child checkpoints the WAL (passively, beside the commits)
CHECKPOINT_EVERY_S = 1.0
#: each frame on the pipes: its length, then a pickle
FRAME_HEADER = struct.Struct(">I")
#: the writer's page cache: the pages a batch's upserts walk (the parent keeps its own
#: for reads)
CACHE_KIB = 2048
#: after a request this large, freed memory is handed back to the system
TRIM_AFTER_BYTES = 256 * 1024
#: the C library this process already has (its own symbols): glibc's malloc_trim, if any
_LIBC = ctypes.CDLL(None)


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = stream.read(size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _reply(stream: IO[bytes], message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA synchronous = NORMAL")
    # no journal_size_limit: it truncates the WAL file in the commit that starts it
    # over, and cutting 100 MB off a file took that commit 15 to 40 ms (see checkpoints)
    return conn


#: a WAL file larger than this after a passive checkpoint is finished with the writer held
WAL_FINISH_BYTES = 64 * 1024 * 1024
#: a WAL file larger than this is truncated once the writer has been idle for
#: :data:`IDLE_S`
WAL_IDLE_BYTES = 16 * 1024 * 1024
IDLE_S = 1.0
#: how long the truncating checkpoint waits for readers of the WAL (then next period)
TRUNCATE_WAIT_MS = 100


class WriterGate:
    """What the checkpoints need from the writer: :meth:`transaction` holds ``lock`` for
    each of its transactions, and says when the last one ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ended = time.monotonic()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock:
            try:
                yield
            finally:
                self._ended = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the last transaction ended (call it holding ``lock``)."""
        return time.monotonic() - self._ended


def checkpoints(path: str, stop: threading.Event, gate: WriterGate) -> None:
    """WAL checkpoints beside the commits, until ``stop``.

    Each period a passive checkpoint copies into the database file what was committed,
    without waiting for anyone. SQLite writes the WAL from its beginning again only when
    a write transaction begins with every frame copied; but a writer that commits every
    millisecond (1,000 commands a second: 14 pages a command, 57 MB of WAL a second)
    always adds frames while the checkpoint copies, so that moment never comes and the
    file grows for as long as the load lasts: 800 MB in the soak of ``scripts/bench``.

    So when the file is past :data:`WAL_FINISH_BYTES` after a passive checkpoint, a
    second one runs holding the gate, between two of the writer's transactions: it
    copies only what was committed during the first (3 to 6 ms at 1,000 commands a
    second), and the next transaction starts the WAL over. The file keeps its size and
    is written again from its start: under load it stays near that threshold plus a
    period's writes. Once the writer has been idle for :data:`IDLE_S`, a file past
    :data:`WAL_IDLE_BYTES` is truncated (a ``TRUNCATE`` checkpoint, holding the gate). A
    truncating checkpoint under load would hold every commit for its fsync and its
    truncation, 35 to 45 ms each second at 1,000 commands a second (a p99 of 40 ms).
    A reader still on old frames keeps the WAL going until a later period; nothing is
    lost either way."""
    conn = _connect(path)
    conn.execute(f"PRAGMA busy_timeout = {TRUNCATE_WAIT_MS}")
    try:
        while not stop.wait(CHECKPOINT_EVERY_S):
            try:
                checkpoint(conn, path, gate)
            except sqlite3.Error as exc:  # busy with another checkpointer: next time
                print(f"store writer: checkpoint skipped: {exc}", file=sys.stderr)
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    finally:
        conn.close()


def checkpoint(
    conn: sqlite3.Connection,
    path: str,
    gate: WriterGate,
    *,
    finish_bytes: int = WAL_FINISH_BYTES,
    idle_bytes: int = WAL_IDLE_BYTES,
    idle_s: float = IDLE_S,
) -> str:
    """One period of :func:`checkpoints`; what it did: ``passive``; ``finished`` (every
    frame copied with the writer held: its next transaction starts the WAL over);
    ``truncated`` (the writer idle, the WAL file cut to nothing)."""
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    size = _size(f"{path}-wal")
    if size > finish_bytes:
        with gate.lock:
            ((busy, log, copied),) = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        return "finished" if not busy and log == copied else "passive"
    if size > idle_bytes:
        with gate.lock:
            if gate.idle_for() >= idle_s:
                ((busy, _, _),) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                return "passive" if busy else "truncated"
    return "passive"


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _serve(
    conn: sqlite3.Connection, requests: IO[bytes], replies: IO[bytes], gate: WriterGate
) -> None:
    while True:
        header = _read_exactly(requests, FRAME_HEADER.size)
        if header is None:
            return
        body = _read_exactly(requests, FRAME_HEADER.unpack(header)[0])
        if body is None:
            return
        request = pickle.loads(body)
        failure: str | None = None
        try:
            with gate.transaction():  # one at a time, between the checkpoints' own
                if request[0] == "write":
                    result: object = write_batch(conn, request[1], request[2])
                elif request[0] == "mark":
                    result = mark_published(conn, request[1])
                else:
                    raise ValueError(f"unknown request {request[0]!r}")
        except (sqlite3.Error, StoreError, ValueError) as exc:
            result, failure = None, str(exc)
        big = len(body) >= TRIM_AFTER_BYTES
        del request, body
        if big:
            _trim()
        _reply(replies, ("error", failure) if failure is not None else ("ok", result))


def _trim() -> None:
    """Give the memory of a large batch's rows back to the system (glibc keeps freed
    small objects in its arenas otherwise, and the writer would stay as large as the
    largest batch it ever wrote); a no-op without glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def take_writer_lock(lock: IO[bytes]) -> int | None:
    """Take the writer lock on the open lock file ``lock`` and write into it the replica
    this writer serves (its parent: pid and start time); or the pid of the live replica
    whose writer holds it (``None`` once taken). A writer whose replica is gone (killed,
    its writer finishing the transaction in hand) is waited for: it lets go by itself."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = _holder(lock.read(128))
        if holder is not None and _started(holder[0]) == holder[1]:
            return holder[0]
        fcntl.flock(lock, fcntl.LOCK_EX)  # a previous writer finishes first
    replica = os.getppid()
    lock.seek(0)
    lock.truncate()
    lock.write(f"{replica} {_started(replica)}\n".encode())
    lock.flush()
    return None


def _holder(text: bytes) -> tuple[int, str] | None:
    """The replica's pid and start time written in a lock file (``None`` for an old
    or empty one)."""
    words = text.split()
    try:
        pid = int(words[0])
    except (IndexError, ValueError):
        return None
    return (pid, words[1].decode(errors="replace") if len(words) > 1 else "") if pid > 1 else None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (its start time in clock ticks since boot, from
    ``/proc``: a pid reused by another process has another), ``""`` where ``/proc`` is
    not there, ``None`` when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    except OSError:
        pass
    else:
        return stat.rsplit(b")", 1)[1].split()[19].decode()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's: alive
    return ""


def main(argv: list[str] | None = None) -> int:
    """The child: ``python -m reconciler.store.writer_child <db>``, spoken to on its pipes."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the reply pipe
    if len(args) != 1:
        _reply(replies, ("error", "usage: python -m reconciler.store.writer_child <db>"))
        return 2
    path = args[0]
    lock_fd = os.open(f"{path}.writer-lock", os.O_CREAT | os.O_RDWR, 0o600)
    with open(lock_fd, "r+b") as lock:
        holder = take_writer_lock(lock)
        if holder is not None:
            _reply(replies, ("busy", holder))
            return 1
        try:
            conn = _connect(path)
            conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpoint thread's job
        except sqlite3.Error as exc:
            _reply(replies, ("error", f"cannot open {path}: {exc}"))
            return 1
        stop = threading.Event()
        gate = WriterGate()
        checkpointer = threading.Thread(
            target=checkpoints, args=(path, stop, gate), name="checkpoint", daemon=True
        )
        checkpointer.start()
        _reply(replies, ("ready", os.getpid()))
        try:
            _serve(conn, requests, replies, gate)
        finally:
            stop.set()
            checkpointer.join(timeout=30)
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
