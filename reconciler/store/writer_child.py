"""The store's writer process itself (see :mod:`reconciler.store.writer` for its rules).

``python -m reconciler.store.writer_child <db>``: takes the database's writer lock,
serves ``write`` and ``mark`` requests from stdin in order with one reply each on
stdout, checkpoints the WAL on a thread of its own (:func:`checkpoints`), and stops when
stdin closes.
It imports the standard library and :mod:`reconciler.store.transactions` only, so it
stays a small process (the parent imports this module for the frame format).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pickle
import signal
import sqlite3
import struct
import sys
import threading
from typing import IO, Any

from reconciler.store.errors import StoreError
from reconciler.store.transactions import mark_published, write_batch

__all__ = [
    "CHECKPOINT_EVERY_S",
    "FRAME_HEADER",
    "WAL_TRUNCATE_BYTES",
    "checkpoint",
    "checkpoint_connection",
    "checkpoints",
    "main",
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


#: bytes the WAL file is truncated to when a checkpoint resets it
WAL_SIZE_LIMIT = 16 * 1024 * 1024


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA synchronous = NORMAL")
    # the WAL file keeps the size of its largest burst otherwise: a service that runs
    # for years gets it back to this after each checkpoint that resets it
    conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    return conn


#: a WAL file larger than this after a passive checkpoint is truncated by a blocking one
WAL_TRUNCATE_BYTES = 4 * WAL_SIZE_LIMIT
#: how long that blocking checkpoint waits for the writer's transaction in hand, then for
#: readers of older frames (it gives up, to try again a period later, past this)
TRUNCATE_WAIT_MS = 250


def checkpoints(path: str, stop: threading.Event) -> None:
    """WAL checkpoints beside the commits, until ``stop``.

    Each period a passive checkpoint copies what it can into the database file without
    waiting for anyone. SQLite starts writing the WAL from its beginning again only once
    a checkpoint has copied all of it and no reader needs it, so under a writer that
    never pauses (a backlog being folded) the passive checkpoints never catch up and the
    file only grows: 800 MB in the soak of ``scripts/bench``, 40 MB a second. When the
    file is past :data:`WAL_TRUNCATE_BYTES` after a passive checkpoint, a ``TRUNCATE`` checkpoint
    follows: it waits (at most :data:`TRUNCATE_WAIT_MS`) for the transaction in hand,
    copies the few frames the passive one left while the next commit waits, and
    truncates the file to nothing. A reader still on old frames makes it give up
    (busy) until the next period; nothing is lost either way."""
    conn = checkpoint_connection(path)
    try:
        while not stop.wait(CHECKPOINT_EVERY_S):
            try:
                checkpoint(conn, path)
            except sqlite3.Error as exc:  # busy with another checkpointer: next time
                print(f"store writer: checkpoint skipped: {exc}", file=sys.stderr)
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    finally:
        conn.close()


def checkpoint_connection(path: str) -> sqlite3.Connection:
    """A connection for :func:`checkpoint`: it waits at most :data:`TRUNCATE_WAIT_MS`."""
    conn = _connect(path)
    conn.execute(f"PRAGMA busy_timeout = {TRUNCATE_WAIT_MS}")
    return conn


def checkpoint(
    conn: sqlite3.Connection, path: str, *, truncate_bytes: int = WAL_TRUNCATE_BYTES
) -> bool:
    """One period of :func:`checkpoints`: passive, then ``TRUNCATE`` if the WAL is still
    past ``truncate_bytes``. Whether the WAL was truncated."""
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    if _size(f"{path}-wal") <= truncate_bytes:
        return False
    ((busy, _, _),) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return not busy


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _serve(conn: sqlite3.Connection, requests: IO[bytes], replies: IO[bytes]) -> None:
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
    lock_fd = os.open(f"{path}.writer-lock", os.O_CREAT | os.O_RDWR | os.O_APPEND, 0o600)
    with open(lock_fd, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a previous writer finishes first
        try:
            conn = _connect(path)
            conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpoint thread's job
        except sqlite3.Error as exc:
            _reply(replies, ("error", f"cannot open {path}: {exc}"))
            return 1
        stop = threading.Event()
        checkpointer = threading.Thread(
            target=checkpoints, args=(path, stop), name="checkpoint", daemon=True
        )
        checkpointer.start()
        _reply(replies, ("ready", os.getpid()))
        try:
            _serve(conn, requests, replies)
        finally:
            stop.set()
            checkpointer.join(timeout=30)
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
