"""The SQLite journal: state, lease transitions, outbox and position in one transaction.

One batch of folded inputs is one ``BEGIN IMMEDIATE … COMMIT``: the rows of every
entity the batch touched, the journal of its lease transitions, its outputs in the
outbox, and the applied stream sequence. The position only moves forward: committing a
batch at or below it is a no-op, which is what makes a redelivered batch harmless.

WAL with ``synchronous=NORMAL``: a committed transaction survives a process crash
(SIGKILL); a power loss may drop the last transactions, which the bus then redelivers
because they were never acknowledged.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite
import orjson

from reconciler.core.model import (
    GpuPolicy,
    GpuProfile,
    Host,
    JobId,
    Lease,
    LeaseId,
    Pool,
    RequestId,
    ResourceClass,
)
from reconciler.core.state import DecisionRecord, Effects, Output, State
from reconciler.store.entities import dump, load

SCHEMA_VERSION = 1


class StoreError(Exception):
    """The database could not be opened, read or written."""


class SchemaTooNew(StoreError):
    """The database was written by a newer version of the reconciler."""


_V1 = """
CREATE TABLE hosts (name TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE pools (name TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE classes (name TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE gpu_profiles (name TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE gpu_policies (name TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE leases (
    lease_id TEXT PRIMARY KEY, instance TEXT NOT NULL, host TEXT NOT NULL,
    pool TEXT NOT NULL, state TEXT NOT NULL, job TEXT, data BLOB NOT NULL);
CREATE INDEX leases_instance ON leases(instance);
CREATE INDEX leases_host ON leases(host);
CREATE TABLE decisions (
    request_id TEXT PRIMARY KEY, verb TEXT NOT NULL, phase TEXT NOT NULL,
    msg_id TEXT NOT NULL, payload BLOB NOT NULL, lease_id TEXT);
CREATE INDEX decisions_lease ON decisions(lease_id);
CREATE TABLE jobs (job TEXT PRIMARY KEY, lease_id TEXT NOT NULL);
CREATE TABLE journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT, input_seq INTEGER NOT NULL,
    lease_id TEXT NOT NULL, event TEXT NOT NULL, from_state TEXT, to_state TEXT NOT NULL);
CREATE INDEX journal_lease ON journal(lease_id);
CREATE TABLE outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, input_seq INTEGER NOT NULL, subject TEXT NOT NULL,
    msg_id TEXT, payload BLOB NOT NULL, sent INTEGER NOT NULL DEFAULT 0);
CREATE INDEX outbox_unsent ON outbox(sent, id);
CREATE TABLE position (id INTEGER PRIMARY KEY CHECK (id = 1), applied_seq INTEGER NOT NULL);
INSERT INTO position (id, applied_seq) VALUES (1, 0);
"""

#: version -> the script that brings a database from version-1 to it
MIGRATIONS: dict[int, str] = {1: _V1}

_ENTITY_TABLES: tuple[tuple[str, str, type], ...] = (
    ("hosts", "hosts", Host),
    ("pools", "pools", Pool),
    ("classes", "classes", ResourceClass),
    ("profiles", "gpu_profiles", GpuProfile),
    ("policies", "gpu_policies", GpuPolicy),
)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    subject: str
    msg_id: str | None
    payload: bytes


def _blob(entity: Any) -> bytes:
    return orjson.dumps(dump(entity))


class Store:
    """An open journal database. Use :meth:`open`; close it (or ``async with``)."""

    def __init__(self, conn: aiosqlite.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path

    @classmethod
    async def open(cls, path: str | Path) -> Store:
        path = Path(path)
        try:
            conn = await aiosqlite.connect(path, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open journal {path}: {exc}") from exc
        store = cls(conn, path)
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")
            await store._migrate()
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open journal {path}: {exc}") from exc
            raise
        return store

    async def close(self) -> None:
        await self._conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------- migrations

    async def _migrate(self) -> None:
        conn = self._conn
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        async with conn.execute("SELECT max(version) FROM schema_version") as cur:
            row = await cur.fetchone()
        current = int(row[0]) if row and row[0] is not None else 0
        if current > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"journal {self.path} has schema version {current}; this reconciler knows "
                f"up to {SCHEMA_VERSION}: upgrade the reconciler"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            await conn.execute("BEGIN IMMEDIATE")
            try:
                await self._script(MIGRATIONS[version])
                await conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
                await conn.execute("COMMIT")
            except BaseException:
                await conn.execute("ROLLBACK")
                raise

    async def _script(self, script: str) -> None:
        # statement by statement: executescript() would commit the open transaction
        for statement in script.split(";"):
            if statement.strip():
                await self._conn.execute(statement)

    # ----------------------------------------------------------------- reads

    async def applied_seq(self) -> int:
        async with self._conn.execute("SELECT applied_seq FROM position WHERE id = 1") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def load_state(self) -> State:
        """The state as committed, with its derived indexes rebuilt."""
        try:
            state = State(applied_seq=await self.applied_seq())
            for attr, table, cls in _ENTITY_TABLES:
                target: dict[Any, Any] = getattr(state, attr)
                async with self._conn.execute(f"SELECT name, data FROM {table}") as cur:
                    async for name, data in cur:
                        target[name] = load(cls, orjson.loads(data))
            async with self._conn.execute("SELECT lease_id, data FROM leases") as cur:
                async for lease_id, data in cur:
                    state.leases[LeaseId(lease_id)] = load(Lease, orjson.loads(data))
            async with self._conn.execute(
                "SELECT request_id, verb, phase, msg_id, payload, lease_id FROM decisions"
            ) as cur:
                async for rid, verb, phase, msg_id, payload, lease_id in cur:
                    state.decisions[RequestId(rid)] = DecisionRecord(
                        RequestId(rid),
                        verb,
                        phase,
                        msg_id,
                        bytes(payload),
                        LeaseId(lease_id) if lease_id is not None else None,
                    )
            async with self._conn.execute("SELECT job, lease_id FROM jobs") as cur:
                async for job, lease_id in cur:
                    state.jobs[JobId(job)] = LeaseId(lease_id)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read journal {self.path}: {exc}") from exc
        state.reindex()
        return state

    async def lease_history(self, lease_id: str) -> list[dict[str, Any]]:
        async with self._conn.execute(
            "SELECT input_seq, event, from_state, to_state FROM journal "
            "WHERE lease_id = ? ORDER BY id",
            (lease_id,),
        ) as cur:
            rows = await cur.fetchall()
        return [
            {"input_seq": r[0], "event": r[1], "from_state": r[2], "to_state": r[3]} for r in rows
        ]

    async def unsent_outbox(self, limit: int = 1000) -> list[OutboxRow]:
        async with self._conn.execute(
            "SELECT id, subject, msg_id, payload FROM outbox WHERE sent = 0 ORDER BY id LIMIT ?",
            (limit,),
        ) as cur:
            rows = await cur.fetchall()
        return [OutboxRow(r[0], r[1], r[2], bytes(r[3])) for r in rows]

    async def mark_sent(self, ids: Sequence[int]) -> None:
        await self._conn.executemany("UPDATE outbox SET sent = 1 WHERE id = ?", [(i,) for i in ids])

    # ---------------------------------------------------------------- commit

    async def commit(
        self,
        state: State,
        fx: Effects,
        *,
        applied_seq: int,
        extra_outputs: Sequence[Output] = (),
    ) -> bool:
        """Write one batch atomically. False (and nothing written) when the batch is at
        or below the stored position."""
        conn = self._conn
        try:
            await conn.execute("BEGIN IMMEDIATE")
            try:
                if applied_seq <= await self.applied_seq():
                    await conn.execute("ROLLBACK")
                    return False
                await self._write(state, fx, applied_seq, extra_outputs)
                await conn.execute("COMMIT")
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot commit batch up to seq {applied_seq}: {exc}") from exc
        return True

    async def _write(
        self, state: State, fx: Effects, applied_seq: int, extra: Sequence[Output]
    ) -> None:
        conn = self._conn
        for attr, table, _ in _ENTITY_TABLES:
            touched: Iterable[Any] = getattr(fx, attr)
            source: dict[Any, Any] = getattr(state, attr)
            await self._upsert(table, [(k, _blob(source[k])) for k in touched if k in source])
            gone = [(k,) for k in touched if k not in source]
            if gone:
                await conn.executemany(f"DELETE FROM {table} WHERE name = ?", gone)
        leases = [state.leases[i] for i in fx.leases if i in state.leases]
        await conn.executemany(
            "INSERT OR REPLACE INTO leases (lease_id, instance, host, pool, state, job, data) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (le.lease_id, le.instance, le.host, le.pool, le.state.value, le.job, _blob(le))
                for le in leases
            ],
        )
        jobs = [(job, lid) for job, lid in state.jobs.items() if lid in fx.leases]
        await conn.executemany("INSERT OR REPLACE INTO jobs (job, lease_id) VALUES (?, ?)", jobs)
        await conn.executemany(
            "INSERT OR REPLACE INTO decisions (request_id, verb, phase, msg_id, payload, lease_id) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [
                (d.request_id, d.verb, d.phase, d.msg_id, d.payload, d.lease_id)
                for d in (state.decisions[r] for r in fx.decisions)
            ],
        )
        await conn.executemany(
            "INSERT INTO journal (input_seq, lease_id, event, from_state, to_state) "
            "VALUES (?, ?, ?, ?, ?)",
            [(t.input_seq, t.lease_id, t.event, t.from_state, t.to_state) for t in fx.transitions],
        )
        await conn.executemany(
            "INSERT INTO outbox (input_seq, subject, msg_id, payload) VALUES (?, ?, ?, ?)",
            [(applied_seq, o.subject, o.msg_id, o.payload) for o in (*fx.outputs, *extra)],
        )
        await conn.execute("UPDATE position SET applied_seq = ? WHERE id = 1", (applied_seq,))

    async def _upsert(self, table: str, rows: list[tuple[Any, bytes]]) -> None:
        if rows:
            await self._conn.executemany(
                f"INSERT OR REPLACE INTO {table} (name, data) VALUES (?, ?)", rows
            )


__all__ = ["OutboxRow", "SchemaTooNew", "Store", "StoreError"]
