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
    "PRUNE_JOURNAL",
    "Writes",
    "mark_published",
    "prune_journal",
    "scalar",
    "transaction",
    "write_batch",
]

#: (constant statement, parameter rows) in write order: the body of one batch
Writes = Sequence[tuple[str, Sequence[tuple[Any, ...]]]]

INSERT_OUTBOX = "INSERT INTO outbox_batches (input_seq, outputs) VALUES (?, ?)"
#: not a statement: the marker of a batch's journal pruning step, whose one parameter row
#: is ``(before, slack)``: journal rows of stream time before second ``before`` go, once
#: the oldest is ``slack`` seconds older than that (pruning then runs in bursts, not a
#: few rows every batch)
PRUNE_JOURNAL = "-- prune journal"
#: journal rows read, and deleted at most, by one batch's pruning
PRUNE_WINDOW = 5000
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
            if statement == PRUNE_JOURNAL:
                for before, slack in params:
                    prune_journal(conn, int(before), slack=int(slack))
                continue
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


def prune_journal(conn: sqlite3.Connection, before: int, *, slack: int = 0) -> int:
    """Delete journal rows of stream time before second ``before`` (``--journal-retention``),
    oldest first, at most :data:`PRUNE_WINDOW` of them; how many went.

    Runs inside a batch's transaction. The oldest row is looked at first (one row): the
    usual batch has nothing to prune and reads nothing more. Rows are appended in stream
    order, so the old ones are the first: only the first window is read, never the whole
    journal; a backlog goes a window per batch. The pruned mark (``position``) moves
    first: the journal's trigger refuses to delete a row at or after it, and ``reconciler
    audit`` reports it.
    """
    oldest = conn.execute("SELECT at FROM journal ORDER BY id LIMIT 1").fetchone()
    if oldest is None or int(oldest[0]) >= before - slack:
        return 0
    conn.execute(
        "UPDATE position SET journal_pruned_before = max(journal_pruned_before, ?) WHERE id = 1",
        (before,),
    )
    cur = conn.execute(
        "DELETE FROM journal WHERE id IN (SELECT id FROM "
        "(SELECT id, at FROM journal ORDER BY id LIMIT ?) WHERE at < ?)",
        (PRUNE_WINDOW, before),
    )
    pruned = max(cur.rowcount, 0)
    conn.execute(
        "UPDATE position SET journal_pruned_rows = journal_pruned_rows + ? WHERE id = 1",
        (pruned,),
    )
    return pruned
