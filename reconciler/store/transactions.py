"""The store's write transactions, as plain ``sqlite3`` functions.

They run wherever the writing connection lives: on aiosqlite's thread (``Store`` with
the in-process writer) or in the writer process (:mod:`reconciler.store.writer`). Both
run exactly this code, so a batch means the same rows either way. Nothing here imports
aiosqlite or the core: the writer process starts in a few tens of milliseconds.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from reconciler.store.errors import StoreError

__all__ = [
    "ADVANCE",
    "INSERT_OUTBOX",
    "Writes",
    "mark_published",
    "scalar",
    "transaction",
    "write_batch",
]

#: (constant statement, parameter rows) in write order: the body of one batch
Writes = Sequence[tuple[str, Sequence[tuple[Any, ...]]]]

INSERT_OUTBOX = "INSERT INTO outbox_batches (input_seq, outputs) VALUES (?, ?)"
#: moves the position forward, or matches no row when the batch is not ahead of it
ADVANCE = "UPDATE position SET applied_seq = ? WHERE id = 1 AND applied_seq < ?"


@contextmanager
def transaction(conn: sqlite3.Connection, *, mode: str = "IMMEDIATE") -> Iterator[None]:
    """One transaction: committed on exit, rolled back on error."""
    if conn.in_transaction:  # left open by a failed COMMIT or ROLLBACK: discard it
        conn.execute("ROLLBACK")
    conn.execute(f"BEGIN {mode}")
    try:
        yield
        if conn.in_transaction:  # the body may have rolled back on purpose
            conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def scalar(conn: sqlite3.Connection, sql: str) -> int:
    row = conn.execute(sql).fetchone()
    if row is None:
        raise StoreError("the position row is missing")
    return int(row[0])


def write_batch(conn: sqlite3.Connection, applied_seq: int, writes: Writes) -> bool:
    """Write one encoded batch with the position ``applied_seq``; ``False``, and nothing
    written, when the batch is not ahead of the stored position. A batch at or below the
    published position writes no outbox row: its outputs are on the bus already."""
    seq = applied_seq
    with transaction(conn):
        if conn.execute(ADVANCE, (seq, seq)).rowcount != 1:
            conn.execute("ROLLBACK")  # not ahead of the position: write nothing
            return False
        for statement, params in writes:
            if statement == INSERT_OUTBOX:
                published = scalar(conn, "SELECT published_seq FROM position WHERE id = 1")
                if seq <= published:
                    continue
            conn.executemany(statement, params)
    return True


def mark_published(conn: sqlite3.Connection, input_seq: int) -> int:
    """Move the published position forward to ``input_seq`` and delete the outbox rows
    at or below it; how many went."""
    with transaction(conn):
        conn.execute(
            "UPDATE position SET published_seq = ? WHERE id = 1 AND published_seq < ?",
            (input_seq, input_seq),
        )
        cur = conn.execute("DELETE FROM outbox_batches WHERE input_seq <= ?", (input_seq,))
        return max(cur.rowcount, 0)
