"""The SQLite store: folded state, lease journal, outbox and stream position.

One batch of folded inputs is one ``BEGIN IMMEDIATE … COMMIT`` (docs/architecture.md, rule 3):
the rows of every entity the batch changed (read from the state; a changed entity that
is no longer in the state is deleted; a lease changing does not change its host's or
pool's row), the journal of its lease transitions, its outputs in the outbox, and the
applied stream sequence. The position only moves forward: a batch at or below it
writes nothing and :meth:`Store.write` returns ``False``, which is what makes a
redelivered batch harmless.

Rules of this module:

- Every public method is a coroutine on one connection, serialised by a lock, so a
  publisher marking the outbox sent never interleaves with a commit's transaction.
- Rows are encoded before the write lock is taken; each table is written with one
  ``executemany`` of a constant statement (sqlite3 caches the prepared statement).
- Driver errors and undecodable rows become :class:`StoreError` (``raise … from``).
- Entities are JSON (:mod:`reconciler.store.codec`) in a ``data`` column, with the
  columns an operator queries by (lease state, host, pool, job…) beside it, indexed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

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
    Tenant,
)
from reconciler.core.state import DecisionRecord, Effects, State
from reconciler.core.waiting import Waiting
from reconciler.store.codec import CodecError, decode, encode
from reconciler.store.database import Database, check_worker_api, create_private
from reconciler.store.errors import StoreError
from reconciler.store.migrations import LATEST, migrate
from reconciler.store.migrations import schema_version as read_schema_version
from reconciler.store.outbox_rows import pack_outputs, unpack_outputs
from reconciler.store.transactions import (
    INSERT_OUTBOX,
    PRUNE_JOURNAL,
    mark_published,
    scalar,
    transaction,
    write_batch,
)
from reconciler.store.writer import WriterProcess

#: the entities keyed by name: (``State`` attribute, ``Effects`` attribute naming the
#: changed ones, table, entity class)
_NAMED: tuple[tuple[str, str, str, type[Any]], ...] = (
    ("hosts", "host_rows", "hosts", Host),
    ("pools", "pool_rows", "pools", Pool),
    ("classes", "classes", "classes", ResourceClass),
    ("profiles", "profiles", "gpu_profiles", GpuProfile),
    ("policies", "policies", "gpu_policies", GpuPolicy),
    ("waiting", "waiting", "waiting", Waiting),
    ("tenants", "tenants", "tenants", Tenant),
)

_UPSERT_NAMED = (
    "INSERT INTO {table} (name, data) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET data = excluded.data"
)
_DELETE_NAMED = "DELETE FROM {table} WHERE name = ?"
_UPSERT_LEASE = (
    "INSERT INTO leases (lease_id, instance, host, pool, state, job, data, released_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (lease_id) DO UPDATE SET "
    "instance = excluded.instance, host = excluded.host, pool = excluded.pool, "
    "state = excluded.state, job = excluded.job, data = excluded.data, "
    "released_at = excluded.released_at"
)
_DELETE_LEASE = "DELETE FROM leases WHERE lease_id = ?"
_UPSERT_DECISION = (
    "INSERT INTO decisions (request_id, verb, phase, msg_id, payload, lease_id, final_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO UPDATE SET "
    "verb = excluded.verb, phase = excluded.phase, msg_id = excluded.msg_id, "
    "payload = excluded.payload, lease_id = excluded.lease_id, final_at = excluded.final_at"
)
_DELETE_DECISION = "DELETE FROM decisions WHERE request_id = ?"
_UPSERT_JOB = (
    "INSERT INTO jobs (job, lease_id) VALUES (?, ?) "
    "ON CONFLICT (job) DO UPDATE SET lease_id = excluded.lease_id"
)
_DELETE_JOB = "DELETE FROM jobs WHERE job = ?"
_INSERT_JOURNAL = (
    "INSERT INTO journal (input_seq, lease_id, event, from_state, to_state, at) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_ADD_WARM_CLAIMS = (
    "INSERT INTO warm_claims (pool, claimed, no_warm) VALUES (?, ?, ?) "
    "ON CONFLICT (pool) DO UPDATE SET claimed = claimed + excluded.claimed, "
    "no_warm = no_warm + excluded.no_warm"
)
_DECISION_COLUMNS = "request_id, verb, phase, msg_id, payload, lease_id, final_at"


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One output waiting to be published (``msg_id`` is its ``Nats-Msg-Id``), and the
    batch (its last input sequence) it belongs to."""

    input_seq: int
    subject: str
    msg_id: str | None
    payload: bytes


@dataclass(frozen=True, slots=True)
class OutboxSnapshot:
    """Unpublished outputs read in one transaction with the position they belong to.

    ``rows`` are every unpublished output of every batch up to ``through_seq``, in
    order: once they are on the bus, :meth:`Store.mark_published_through`
    ``(through_seq)`` is exact. When ``complete``, ``through_seq`` is the applied
    position (nothing else is unpublished); otherwise more batches wait.
    """

    applied_seq: int
    through_seq: int
    rows: list[OutboxRow]
    complete: bool


@dataclass(frozen=True, slots=True)
class Batch:
    """One folded batch, encoded: what :meth:`Store.write` puts in one transaction.

    Built by :func:`encode_batch` synchronously, so it is a snapshot: the caller may go
    on folding into the same state while the batch is being written.
    """

    applied_seq: int
    #: (constant statement, parameter rows) in write order
    writes: tuple[tuple[str, tuple[tuple[Any, ...], ...]], ...]
    #: the latest stream second of its journal rows (0: none), for journal retention
    journal_at: int = 0


def encode_batch(state: State, fx: Effects, *, applied_seq: int) -> Batch:
    """The rows of one batch: every entity ``fx`` names as changed (hosts and pools by
    ``host_rows`` and ``pool_rows``: a lease on them changes nothing of their rows), read
    from ``state`` (deleted when ``state`` no longer has it), its transitions, its
    outputs for the outbox (the fold's and the dead letters, in stream order), and the
    position ``applied_seq``."""
    writes: list[tuple[str, tuple[tuple[Any, ...], ...]]] = []

    def add(statement: str, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            writes.append((statement, tuple(rows)))

    for attr, changed, table, _ in _NAMED:
        source: dict[Any, Any] = getattr(state, attr)
        touched: Iterable[str] = sorted(getattr(fx, changed))
        upserts: list[tuple[Any, ...]] = []
        deletes: list[tuple[Any, ...]] = []
        for name in touched:
            entity = source.get(name)
            if entity is None:
                deletes.append((name,))
            else:
                upserts.append((name, _json(entity, table, name)))
        add(_UPSERT_NAMED.format(table=table), upserts)
        add(_DELETE_NAMED.format(table=table), deletes)

    leases: list[tuple[Any, ...]] = []
    gone: list[tuple[Any, ...]] = []
    jobs: set[JobId] = set()
    for lease_id in sorted(fx.leases):
        lease = state.leases.get(lease_id)
        if lease is None:
            gone.append((lease_id,))
            continue
        leases.append(
            (
                lease.lease_id,
                lease.instance,
                lease.host,
                lease.pool,
                lease.state.value,
                lease.job,
                _json(lease, "leases", lease_id),
                state.released_at.get(lease_id),
            )
        )
        if lease.job is not None:
            jobs.add(lease.job)
    add(_UPSERT_LEASE, leases)
    add(_DELETE_LEASE, gone)

    # Jobs by diff. A job is bound in the fold only together with a lease that carries
    # it and is touched in the same step, and a binding never changes afterwards; it is
    # unbound only when retention evicts its lease, which names the job in ``fx.jobs``.
    # So the jobs of the touched leases and ``fx.jobs`` cover every binding this batch
    # can have made or unmade (O(batch), not O(all jobs)): their rows are rewritten from
    # the state, or deleted when unbound.
    jobs |= fx.jobs
    bound = [(job, state.jobs[job]) for job in sorted(jobs) if job in state.jobs]
    unbound = [(job,) for job in sorted(jobs) if job not in state.jobs]
    add(_UPSERT_JOB, bound)
    add(_DELETE_JOB, unbound)

    decisions: list[tuple[Any, ...]] = []
    undecided: list[tuple[Any, ...]] = []
    for request_id in sorted(fx.decisions):
        record = state.decisions.get(request_id)
        if record is None:
            undecided.append((request_id,))
        else:
            decisions.append(
                (
                    record.request_id,
                    record.verb,
                    record.phase,
                    record.msg_id,
                    record.payload,
                    record.lease_id,
                    record.final_at,
                )
            )
    add(_UPSERT_DECISION, decisions)
    add(_DELETE_DECISION, undecided)

    add(
        _INSERT_JOURNAL,
        [
            (t.input_seq, t.lease_id, t.event, t.from_state, t.to_state, t.at)
            for t in fx.transitions
        ],
    )
    if fx.warm_claims:
        add(_ADD_WARM_CLAIMS, _warm_claim_rows(fx.warm_claims))
    outputs = [(o.subject, o.msg_id, o.payload) for o in fx.outputs]
    if outputs:
        add(INSERT_OUTBOX, [(applied_seq, pack_outputs(outputs))])
    journal_at = max((t.at for t in fx.transitions), default=0)
    return Batch(applied_seq=applied_seq, writes=tuple(writes), journal_at=journal_at)


def _warm_claim_rows(claims: Iterable[tuple[str, str]]) -> list[tuple[Any, ...]]:
    """``(pool, claimed, no_warm)`` increments of a batch's claim-warm decisions."""
    sums: dict[str, list[int]] = {}
    for pool, outcome in claims:
        row = sums.setdefault(pool, [0, 0])
        row[0 if outcome == "claimed" else 1] += 1
    return [(pool, claimed, missed) for pool, (claimed, missed) in sorted(sums.items())]


def _decision(row: Sequence[Any]) -> DecisionRecord:
    request_id, verb, phase, _msg_id, payload, lease_id, final_at = row
    return DecisionRecord(
        request_id=RequestId(request_id),
        verb=verb,
        phase=phase,
        payload=bytes(payload),
        lease_id=LeaseId(lease_id) if lease_id is not None else None,
        final_at=int(final_at) if final_at is not None else None,
    )


class Store(Database):
    """An open store. Use :meth:`open`; close it with :meth:`close` or ``async with``."""

    label = "store"

    # ---------------------------------------------------------------- lifetime

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        writer_process: bool = False,
        journal_retention_s: int | None = None,
    ) -> Store:
        """Open (creating if needed) and migrate the database at ``path``.

        With ``writer_process``, commits and outbox marks run in a child process
        (:mod:`reconciler.store.writer`), off this process's GIL; reads stay here. The
        open returns once that writer holds the database (a writer of a previous
        replica has finished). Needs a file, not ``:memory:``.

        With ``journal_retention_s``, every write also prunes the lease journal of rows
        that much stream time older than the batch (see
        :func:`~reconciler.store.transactions.prune_journal`); without, it keeps all.

        Raises :class:`SchemaTooNew` for a database of a newer reconciler, and
        :class:`StoreError` for anything that is not a usable database.
        """
        path = Path(path)
        if writer_process and str(path) == ":memory:":
            raise StoreError("a writer process needs a database file, not :memory:")
        create_private(path)
        # autocommit mode: every transaction below is an explicit BEGIN … COMMIT
        connecting = aiosqlite.connect(path, isolation_level=None)
        try:
            conn = await connecting
        except sqlite3.Error as exc:
            await _worker_stopped(connecting)
            raise StoreError(f"cannot open store {path}: {exc}") from exc
        try:
            check_worker_api(conn)
            # before anything is written: another program's database stays as it is
            await _check_replica_store(conn, path, any_version=True)
            await cls._configure(conn, path)
            await migrate(conn, where=f"store {path}")
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open store {path}: {exc}") from exc
            raise
        store = cls(conn, path)
        store.journal_retention_s = journal_retention_s
        if writer_process:
            try:
                # this connection only reads now: the writer keeps the write-side cache
                await conn.execute("PRAGMA cache_size = -2048")
                store._writer = await WriterProcess.start(path)
            except BaseException:
                await store.close()
                raise
        return store

    @classmethod
    async def open_readonly(cls, path: str | Path) -> Store:
        """Open an existing replica's store only to read it (``status``, ``audit``).

        Nothing is created, migrated or written. Raises :class:`StoreError` for a file
        that is missing, not a database, not a replica's store (another program's
        database) or at another schema version than this reconciler's.
        """
        path = Path(path)
        if not path.is_file():
            raise StoreError(f"no store at {path}")
        connecting = aiosqlite.connect(
            f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None
        )
        try:
            conn = await connecting
        except sqlite3.Error as exc:
            await _worker_stopped(connecting)
            raise StoreError(f"cannot open store {path} read-only: {exc}") from exc
        try:
            check_worker_api(conn)
            await conn.execute("PRAGMA busy_timeout = 5000")
            await _check_replica_store(conn, path)
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot read store {path}: {exc}") from exc
            raise
        return cls(conn, path)

    def __init__(self, conn: aiosqlite.Connection, path: Path) -> None:
        super().__init__(conn, path)
        self._writer: WriterProcess | None = None
        #: see :meth:`open`
        self.journal_retention_s: int | None = None

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid, when commits run in one."""
        return self._writer.pid if self._writer is not None else None

    async def close(self) -> None:
        """Close the writer process (it finishes what it has) and the connection."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                await writer.close()
        finally:
            await super().close()

    @staticmethod
    async def _configure(conn: aiosqlite.Connection, path: Path) -> None:
        # WAL + synchronous=NORMAL: a commit is durable against a crash of the process
        # (the WAL is written before COMMIT returns; only the fsync is deferred to the
        # checkpoint), and readers never block the writer. Only a power loss or an OS
        # crash can drop the last commits, and then nothing is lost either: those
        # batches were never acknowledged, so JetStream redelivers them, and the
        # forward-only position makes folding them again exact. FULL would add an fsync
        # per batch for no gain in what survives.
        async with conn.execute("PRAGMA journal_mode = WAL") as cur:
            row = await cur.fetchone()
        mode = str(row[0]).lower() if row is not None else ""
        if mode != "wal" and str(path) != ":memory:":
            raise StoreError(f"store {path}: cannot use WAL mode (journal_mode is {mode!r})")
        await conn.execute("PRAGMA synchronous = NORMAL")
        await conn.execute("PRAGMA busy_timeout = 5000")
        # A batch of 500 admissions dirties ~1 MiB of pages: an 8 MiB cache keeps several
        # batches' worth (a larger one grows the process by its size as the store grows,
        # for no measurable gain), and checkpoint (the only fsync under NORMAL) every
        # ~16 MiB of WAL, not every 4 MiB.
        await conn.execute("PRAGMA cache_size = -8192")
        await conn.execute("PRAGMA wal_autocheckpoint = 4000")
        # the WAL would keep the size of its largest burst: truncated back after a reset
        await conn.execute("PRAGMA journal_size_limit = 16777216")

    # ------------------------------------------------------------------ writes

    async def write(self, batch: Batch) -> bool:
        """Write one encoded batch (:func:`encode_batch`) atomically, with its position
        ``batch.applied_seq``: the batch's outbox row records it. ``False``, and nothing
        written, when that is at or below the stored position (a redelivered batch).

        For pipelining: ``batch = encode_batch(...)`` right after folding, then fold the
        next batch while ``write(batch)`` runs on the database thread, in one hop.

        A batch at or below the published position (see :meth:`mark_published_through`)
        writes no outbox row: its outputs are already on the bus, and publishing them
        again after the bus's duplicate window would double them.
        """
        writes = batch.writes
        retention = self.journal_retention_s
        if retention is not None and batch.journal_at > 0:
            slack = max(1, min(3600, retention // 100))
            writes = (*writes, (PRUNE_JOURNAL, ((batch.journal_at - retention, slack),)))
        if self._writer is not None:
            return await self._writer.write(batch.applied_seq, writes)
        return await self.call(
            lambda conn: write_batch(conn, batch.applied_seq, writes),
            f"commit up to seq {batch.applied_seq}",
        )

    async def mark_published_through(self, input_seq: int) -> int:
        """Record that every output of every input up to ``input_seq`` is on the bus.

        The published position only moves forward; the outbox rows (batches) at or below
        it are deleted, and later batches at or below it write none. How many went.
        """
        if self._writer is not None:
            return await self._writer.mark_published(input_seq)
        return await self.call(lambda conn: mark_published(conn, input_seq), "mark published")

    # ------------------------------------------------------------------- reads

    async def applied_seq(self) -> int:
        """The last stream sequence whose batch is committed (0 for a new store)."""
        async with self.using("read position") as conn:
            return await self._applied_seq(conn)

    @staticmethod
    async def _applied_seq(conn: aiosqlite.Connection) -> int:
        async with conn.execute("SELECT applied_seq FROM position WHERE id = 1") as cur:
            row = await cur.fetchone()
        if row is None:
            raise StoreError("the position row is missing")
        return int(row[0])

    async def published_seq(self) -> int:
        """The input sequence up to which every output is known to be on the bus."""
        async with self.using("read published position") as conn:
            return await self._published_seq(conn)

    @staticmethod
    async def _published_seq(conn: aiosqlite.Connection) -> int:
        async with conn.execute("SELECT published_seq FROM position WHERE id = 1") as cur:
            row = await cur.fetchone()
        if row is None:
            raise StoreError("the position row is missing")
        return int(row[0])

    async def schema_version(self) -> int:
        async with self.using("read schema version") as conn:
            return await read_schema_version(conn)

    async def load_state(self, *, decision_retention_s: int | None = None) -> State:
        """The state as committed, derived indexes rebuilt (``State.reindex``), to be
        folded on with ``decision_retention_s`` (see ``State``)."""
        async with self.using("load state") as conn:
            # one read transaction: a consistent snapshot even with other writers
            await conn.execute("BEGIN")
            try:
                state = State(
                    applied_seq=await self._applied_seq(conn),
                    decision_retention_s=decision_retention_s,
                )
                for attr, _, table, cls in _NAMED:
                    target: dict[Any, Any] = getattr(state, attr)
                    sql = f"SELECT name, data FROM {table} ORDER BY name"
                    for name, data in await conn.execute_fetchall(sql):
                        target[name] = _decode(cls, data, table, name)
                sql = "SELECT lease_id, data, released_at FROM leases ORDER BY lease_id"
                for lease_id, data, released_at in await conn.execute_fetchall(sql):
                    state.leases[LeaseId(lease_id)] = _decode(Lease, data, "leases", lease_id)
                    if released_at is not None:
                        state.released_at[LeaseId(lease_id)] = int(released_at)
                sql = f"SELECT {_DECISION_COLUMNS} FROM decisions ORDER BY request_id"
                for row in await conn.execute_fetchall(sql):
                    record = _decision(row)
                    state.decisions[record.request_id] = record
                sql = "SELECT job, lease_id FROM jobs ORDER BY job"
                for job, lease_id in await conn.execute_fetchall(sql):
                    state.jobs[JobId(job)] = LeaseId(lease_id)
            finally:
                await conn.execute("COMMIT")
        state.reindex()
        return state

    async def outbox_snapshot(self, limit: int = 200) -> OutboxSnapshot:
        """The unpublished outputs of up to ``limit`` batches, oldest first, with the
        position, read consistently in one hop (see :class:`OutboxSnapshot`)."""

        def read(conn: sqlite3.Connection) -> OutboxSnapshot:
            with transaction(conn, mode="DEFERRED"):
                applied = scalar(conn, "SELECT applied_seq FROM position WHERE id = 1")
                batches = conn.execute(
                    "SELECT input_seq, outputs FROM outbox_batches ORDER BY input_seq LIMIT ?",
                    (limit,),
                ).fetchall()
            rows = [
                OutboxRow(int(seq), subject, msg_id, payload)
                for seq, blob in batches
                for subject, msg_id, payload in unpack_outputs(bytes(blob))
            ]
            complete = len(batches) < limit
            through = applied if complete else int(batches[-1][0])
            return OutboxSnapshot(
                applied_seq=applied, through_seq=through, rows=rows, complete=complete
            )

        return await self.call(read, "read outbox")

    async def journal_pruned(self) -> tuple[int, int]:
        """``(before, rows)``: journal rows of stream time before second ``before`` were
        pruned by ``--journal-retention``, ``rows`` of them in all; ``(0, 0)`` if none."""
        async with (
            self.using("read journal pruning") as conn,
            conn.execute(
                "SELECT journal_pruned_before, journal_pruned_rows FROM position WHERE id = 1"
            ) as cur,
        ):
            row = await cur.fetchone()
        if row is None:
            raise StoreError("the position row is missing")
        return int(row[0]), int(row[1])

    async def warm_claims(self) -> dict[str, tuple[int, int]]:
        """Claim-warm decisions per pool since this store began: ``(claimed, no_warm)``
        (a store started from a snapshot counts from the snapshot)."""
        async with self.using("read warm claims") as conn:
            rows = await conn.execute_fetchall(
                "SELECT pool, claimed, no_warm FROM warm_claims ORDER BY pool"
            )
        return {str(pool): (int(claimed), int(missed)) for pool, claimed, missed in rows}

    async def lease_history(self, lease_id: str) -> list[dict[str, Any]]:
        """The journal of one lease, in order: ``input_seq, event, from_state, to_state``."""
        async with self.using("read lease history") as conn:
            rows = await conn.execute_fetchall(
                "SELECT input_seq, event, from_state, to_state FROM journal "
                "WHERE lease_id = ? ORDER BY id",
                (lease_id,),
            )
        return [
            {"input_seq": seq, "event": event, "from_state": src, "to_state": dst}
            for seq, event, src, dst in rows
        ]

    async def find_leases(self, identifier: str) -> list[Lease]:
        """Every lease (active or released) that ``identifier`` names, oldest first: as
        lease id, instance name, bound job, or the request id of a decision."""
        async with self.using("find leases") as conn:
            rows = await conn.execute_fetchall(
                "SELECT lease_id, data FROM leases WHERE lease_id = ?1 OR instance = ?1 "
                "OR job = ?1 OR lease_id IN (SELECT lease_id FROM jobs WHERE job = ?1) "
                "OR lease_id IN (SELECT lease_id FROM decisions WHERE request_id = ?1)",
                (identifier,),
            )
        leases = [_decode(Lease, data, "leases", lease_id) for lease_id, data in rows]
        return sorted(leases, key=lambda le: (le.admitted_seq, le.lease_id))

    async def decisions_for(
        self, *, lease_id: str | None = None, request_id: str | None = None
    ) -> list[DecisionRecord]:
        """The latest decisions naming a lease, or the one of a request id."""
        if (lease_id is None) == (request_id is None):
            raise TypeError("decisions_for() takes exactly one of lease_id, request_id")
        column, key = ("lease_id", lease_id) if lease_id is not None else ("request_id", request_id)
        async with self.using("read decisions") as conn:
            rows = await conn.execute_fetchall(
                f"SELECT {_DECISION_COLUMNS} FROM decisions WHERE {column} = ? ORDER BY request_id",
                (key,),
            )
        return [_decision(row) for row in rows]


_REPLICA_TABLES = frozenset({"hosts", "pools", "leases", "decisions", "journal", "position"})


async def _check_replica_store(
    conn: aiosqlite.Connection, path: Path, *, any_version: bool = False
) -> None:
    """Raise :class:`StoreError` unless ``conn`` is a replica's store of this schema.

    With ``any_version`` (a replica opening its store to migrate it), an empty database
    (a new store) and a store of any schema version pass: only another program's
    database is refused, before anything is written into it."""
    rows = await conn.execute_fetchall("SELECT name FROM sqlite_master WHERE type = 'table'")
    tables = {str(row[0]) for row in rows}
    if any_version and not tables:
        return
    version = await read_schema_version(conn)
    if version == 0 or not _REPLICA_TABLES.issubset(tables):
        missing = ", ".join(sorted(_REPLICA_TABLES - tables)) or "schema_version"
        what = (
            "give `reconciler run` a new file or its own store"
            if any_version
            else "give the --db of `reconciler run`"
        )
        raise StoreError(
            f"{path} is not a reconciler replica's store (it has no {missing} table); "
            f"{what} (left untouched)"
        )
    if version != LATEST and not any_version:
        newer = "a newer" if version > LATEST else "an older"
        raise StoreError(
            f"store {path} has schema version {version}, this reconciler reads {LATEST}: "
            f"it was written by {newer} reconciler (start this version's `reconciler run` "
            "on it once to migrate an older store; left untouched)"
        )


async def _worker_stopped(conn: aiosqlite.Connection) -> None:
    """Wait for the worker thread of a connection that failed to connect.

    aiosqlite stops that thread without waiting for it; if the event loop closed
    before the thread's last callback, the thread would die on "Event loop is closed".
    """
    thread = getattr(conn, "_thread", None)
    if isinstance(thread, threading.Thread) and thread.is_alive():
        await asyncio.to_thread(thread.join, 5.0)


def _json(entity: object, table: str, key: str) -> str:
    try:
        return encode(entity).decode()
    except TypeError as exc:  # orjson.JSONEncodeError: an unsupported type, a huge int
        raise StoreError(f"cannot encode {table} {key!r}: {exc}") from exc


def _decode(cls: type[Any], data: str | bytes, table: str, key: str) -> Any:
    try:
        return decode(cls, data)
    except CodecError as exc:
        raise StoreError(f"cannot decode {table} row {key!r}: {exc}") from exc


__all__ = ["Batch", "OutboxRow", "OutboxSnapshot", "Store", "encode_batch"]
