"""The executor's memory: which commands it finished, and how, in a small SQLite file.

Rules:

- A command is *finished* once the executor will never act on its ``command_id`` again:
  it was carried out (``created``, ``deleted``, ``absent``), Incus refused it
  (``rejected``), retries were exhausted (``gave-up``), or it was overtaken by the
  deletion of its lease (``superseded``). :meth:`ExecutorStore.record` writes that
  durably *before* the message is acknowledged; a command id found here is acknowledged
  without acting, whether JetStream redelivered it (a crash between the Incus call and
  the ack) or a producer published it again past the stream's duplicate window.
- Commands refused before Incus (bad subject, schema, host or name) are not recorded:
  their ``command_id`` is not to be trusted, and they are terminated, never redelivered.
- Records older than the retention are pruned (:meth:`ExecutorStore.prune`); time is
  wall-clock seconds from the injected ``clock``.
- One connection, serialised by a lock; WAL with ``synchronous = FULL`` (a handful of
  writes per VM operation: an fsync each is cheap next to booting a VM, and a record
  must survive a power loss as surely as the VM it describes). Driver errors become
  :class:`~reconciler.store.errors.StoreError` with ``raise … from``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Self

import aiosqlite

from reconciler.store.database import Database, create_private
from reconciler.store.errors import StoreError

__all__ = ["DONE_OUTCOMES", "OUTCOMES", "ExecutorStore", "FinishedCommand"]

#: every outcome a finished command can have
OUTCOMES: Final = frozenset({"created", "deleted", "absent", "rejected", "gave-up", "superseded"})
#: outcomes that mean the command's effect holds in Incus
DONE_OUTCOMES: Final = frozenset({"created", "deleted", "absent"})
_SCHEMA_VERSION: Final = 1

_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS finished (
        command_id  TEXT PRIMARY KEY,
        verb        TEXT NOT NULL,
        host        TEXT NOT NULL,
        project     TEXT NOT NULL,
        instance    TEXT NOT NULL,
        lease_id    TEXT NOT NULL,
        outcome     TEXT NOT NULL,
        detail      TEXT NOT NULL,
        stream_seq  INTEGER NOT NULL,
        attempts    INTEGER NOT NULL,
        finished_at REAL NOT NULL
    ) WITHOUT ROWID
    """,
    "CREATE INDEX IF NOT EXISTS finished_by_lease ON finished (lease_id, verb)",
    "CREATE INDEX IF NOT EXISTS finished_by_time ON finished (finished_at)",
)


@dataclass(frozen=True, kw_only=True)
class FinishedCommand:
    """One finished command: what it was, how it ended, and when."""

    command_id: str
    verb: str
    host: str
    project: str
    instance: str
    lease_id: str
    outcome: str
    detail: str = ""
    stream_seq: int = 0
    attempts: int = 0
    finished_at: float = 0.0

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r} (one of {sorted(OUTCOMES)})")


_COLUMNS: Final = (
    "command_id, verb, host, project, instance, lease_id, outcome, detail, "
    "stream_seq, attempts, finished_at"
)


def _row(row: sqlite3.Row) -> FinishedCommand:
    return FinishedCommand(
        command_id=str(row[0]),
        verb=str(row[1]),
        host=str(row[2]),
        project=str(row[3]),
        instance=str(row[4]),
        lease_id=str(row[5]),
        outcome=str(row[6]),
        detail=str(row[7]),
        stream_seq=int(row[8]),
        attempts=int(row[9]),
        finished_at=float(row[10]),
    )


class ExecutorStore(Database):
    """An open executor database. Use :meth:`open`; close with :meth:`close` or ``async with``."""

    label = "executor database"

    def __init__(
        self, conn: aiosqlite.Connection, path: Path, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(conn, path)
        self._clock = clock

    @classmethod
    async def open(cls, path: str | Path, *, clock: Callable[[], float] = time.time) -> Self:
        """Open (creating if needed) the database at ``path``."""
        path = Path(path)
        create_private(path)
        try:
            conn = await aiosqlite.connect(path, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open executor database {path}: {exc}") from exc
        try:
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute("PRAGMA synchronous = FULL")
            await conn.execute("PRAGMA busy_timeout = 5000")
            async with conn.execute("PRAGMA user_version") as cur:
                row = await cur.fetchone()
            version = int(row[0]) if row is not None else 0
            if version > _SCHEMA_VERSION:
                raise StoreError(
                    f"executor database {path} has schema {version}, newer than this "
                    f"executor's {_SCHEMA_VERSION}; it is left as it is"
                )
            for statement in _SCHEMA:
                await conn.execute(statement)
            await conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open executor database {path}: {exc}") from exc
            raise
        return cls(conn, path, clock=clock)

    async def finished(self, command_id: str) -> FinishedCommand | None:
        """The record of ``command_id``, or ``None`` if it never finished."""
        async with (
            self.using("read a command") as conn,
            conn.execute(
                f"SELECT {_COLUMNS} FROM finished WHERE command_id = ?", (command_id,)
            ) as cur,
        ):
            row = await cur.fetchone()
        return None if row is None else _row(row)

    async def lease_deleted(self, *, host: str, lease_id: str) -> FinishedCommand | None:
        """A carried-out delete of ``lease_id``'s VM on ``host``, if one was recorded."""
        async with (
            self.using("read a lease's delete") as conn,
            conn.execute(
                f"SELECT {_COLUMNS} FROM finished WHERE lease_id = ? AND verb = 'delete' "
                "AND host = ? AND outcome IN ('deleted', 'absent') "
                "ORDER BY finished_at LIMIT 1",
                (lease_id, host),
            ) as cur,
        ):
            row = await cur.fetchone()
        return None if row is None else _row(row)

    async def record(self, done: FinishedCommand) -> FinishedCommand:
        """Write ``done`` durably (stamped with the clock when it has no time); the first
        record of a command id wins, and is returned."""
        if not done.finished_at:
            done = replace(done, finished_at=self._clock())
        async with self.using("record a command") as conn:
            await conn.execute(
                f"INSERT INTO finished ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (command_id) DO NOTHING",
                (
                    done.command_id,
                    done.verb,
                    done.host,
                    done.project,
                    done.instance,
                    done.lease_id,
                    done.outcome,
                    done.detail,
                    done.stream_seq,
                    done.attempts,
                    done.finished_at,
                ),
            )
            async with conn.execute(
                f"SELECT {_COLUMNS} FROM finished WHERE command_id = ?", (done.command_id,)
            ) as cur:
                row = await cur.fetchone()
        assert row is not None
        return _row(row)

    async def prune(self, *, retention_s: float) -> int:
        """Forget records finished more than ``retention_s`` ago; how many were dropped."""
        cutoff = self._clock() - retention_s
        async with self.using("prune") as conn:
            cur = await conn.execute("DELETE FROM finished WHERE finished_at < ?", (cutoff,))
            count = cur.rowcount
            await cur.close()
        return max(int(count), 0)

    async def count(self) -> int:
        """How many finished commands are remembered."""
        async with (
            self.using("count") as conn,
            conn.execute("SELECT count(*) FROM finished") as cur,
        ):
            row = await cur.fetchone()
        return int(row[0]) if row is not None else 0
