"""The schema of the store, as a forward-only list of migrations.

A database records its version in ``schema_version``. Opening it applies, in order and
each in its own ``BEGIN IMMEDIATE`` transaction together with the new version number,
every migration above that version; a crash mid-way leaves the database at the last
completed version, and the next open carries on. A database whose version is above
:data:`LATEST` was written by a newer reconciler: it is refused
(:class:`SchemaTooNew`), never downgraded or written.

To change the schema, append a :class:`Migration`; never edit a released one. A step is
one SQL statement, or an async function of the connection for data migrations.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiosqlite

from reconciler.store.errors import SchemaTooNew
from reconciler.store.outbox_rows import pack_outputs

Step = str | Callable[[aiosqlite.Connection], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    summary: str
    steps: tuple[Step, ...]


_V1 = (
    "CREATE TABLE hosts (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE pools (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE classes (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE gpu_profiles (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE gpu_policies (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    """CREATE TABLE leases (
        lease_id TEXT PRIMARY KEY,
        instance TEXT NOT NULL,
        host TEXT NOT NULL,
        pool TEXT NOT NULL,
        state TEXT NOT NULL,
        job TEXT,
        data TEXT NOT NULL
    )""",
    "CREATE INDEX leases_instance ON leases (instance)",
    "CREATE INDEX leases_host ON leases (host)",
    "CREATE INDEX leases_pool ON leases (pool)",
    "CREATE INDEX leases_state ON leases (state)",
    "CREATE INDEX leases_job ON leases (job)",
    """CREATE TABLE decisions (
        request_id TEXT PRIMARY KEY,
        verb TEXT NOT NULL,
        phase TEXT NOT NULL,
        msg_id TEXT NOT NULL,
        payload BLOB NOT NULL,
        lease_id TEXT
    )""",
    "CREATE TABLE jobs (job TEXT PRIMARY KEY, lease_id TEXT NOT NULL)",
    """CREATE TABLE journal (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        input_seq INTEGER NOT NULL,
        lease_id TEXT NOT NULL,
        event TEXT NOT NULL,
        from_state TEXT,
        to_state TEXT NOT NULL
    )""",
    "CREATE INDEX journal_lease ON journal (lease_id)",
    """CREATE TABLE outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        input_seq INTEGER NOT NULL,
        subject TEXT NOT NULL,
        msg_id TEXT,
        payload BLOB NOT NULL,
        sent INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX outbox_sent ON outbox (sent, id)",
    """CREATE TABLE position (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        applied_seq INTEGER NOT NULL
    )""",
    "INSERT INTO position (id, applied_seq) VALUES (1, 0)",
)

_V2 = (
    # audit: "which decisions named this lease", "what did input N do to leases"
    "CREATE INDEX decisions_lease ON decisions (lease_id)",
    "CREATE INDEX journal_input ON journal (input_seq)",
    # the journal is an append-only record: refuse edits inside the database itself
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
       BEGIN SELECT RAISE(ABORT, 'the journal is append-only'); END""",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
       BEGIN SELECT RAISE(ABORT, 'the journal is append-only'); END""",
)

_V3 = (
    # every output of every input at or below published_seq is on the bus: a batch folded
    # again at or below it (a lagging replica catching up) writes no outbox rows
    "ALTER TABLE position ADD COLUMN published_seq INTEGER NOT NULL DEFAULT 0",
    "CREATE INDEX outbox_input ON outbox (input_seq)",
)


async def _outbox_by_batch(conn: aiosqlite.Connection) -> None:
    """Move the unsent rows of the per-output outbox into one row per batch."""
    await conn.execute(
        "CREATE TABLE outbox_batches (input_seq INTEGER PRIMARY KEY, outputs BLOB NOT NULL)"
    )
    rows = await conn.execute_fetchall(
        "SELECT input_seq, subject, msg_id, payload FROM outbox WHERE sent = 0 ORDER BY id"
    )
    batches: dict[int, list[tuple[str, str | None, bytes]]] = {}
    for input_seq, subject, msg_id, payload in rows:
        batches.setdefault(int(input_seq), []).append((subject, msg_id, bytes(payload)))
    await conn.executemany(
        "INSERT INTO outbox_batches (input_seq, outputs) VALUES (?, ?)",
        [(seq, pack_outputs(outputs)) for seq, outputs in sorted(batches.items())],
    )
    await conn.execute("DROP TABLE outbox")


_V4 = (
    # one outbox row per batch (its outputs packed), not one per output: a batch of 500
    # admissions wrote, re-read and deleted 500 rows and their two indexes
    _outbox_by_batch,
    # leases are looked up by instance and job (audit); host, pool and state are in memory
    "DROP INDEX leases_host",
    "DROP INDEX leases_pool",
    "DROP INDEX leases_state",
)

_V5 = (
    # retention (docs/long-lived.md): the stream second of a request's final decision
    # and of a lease's release, from which the fold counts before evicting them
    "ALTER TABLE decisions ADD COLUMN final_at INTEGER",
    "ALTER TABLE leases ADD COLUMN released_at INTEGER",
    # a final decision's second is in its payload; a release's is not recorded anywhere,
    # so leases released before this version count from the upgrade
    """UPDATE decisions SET final_at = CAST(strftime('%s',
        substr(json_extract(CAST(payload AS TEXT), '$.decided_at'), 1, 19)) AS INTEGER)
       WHERE phase = 'final'""",
    """UPDATE leases SET released_at = CAST(strftime('%s', 'now') AS INTEGER)
       WHERE state = 'released'""",
    # the journal's stream second per row, for --journal-retention; rows written before
    # this version get the time of the upgrade, so they are kept a full retention more
    "ALTER TABLE journal ADD COLUMN at INTEGER NOT NULL DEFAULT 0",
    "DROP TRIGGER journal_no_update",
    "UPDATE journal SET at = CAST(strftime('%s', 'now') AS INTEGER)",
    """CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
       BEGIN SELECT RAISE(ABORT, 'the journal is append-only'); END""",
    # rows older than this (epoch seconds) were pruned; 0: nothing ever was
    "ALTER TABLE position ADD COLUMN journal_pruned_before INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE position ADD COLUMN journal_pruned_rows INTEGER NOT NULL DEFAULT 0",
    # still append-only, except that retention may delete rows older than the pruned mark
    # it has recorded first
    "DROP TRIGGER journal_no_delete",
    """CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
       WHEN old.at >= (SELECT journal_pruned_before FROM position WHERE id = 1)
       BEGIN SELECT RAISE(ABORT, 'the journal is append-only (only retention prunes it)'); END""",
)

_V6 = (
    # the warm hit ratio (docs/operations.md, "Metrics"): claim-warm decisions on a known
    # pool, summed per pool and outcome by every batch that decides some. Not state: the
    # fold never reads it, and it is in neither the digest nor a snapshot
    """CREATE TABLE warm_claims (
        pool TEXT PRIMARY KEY,
        claimed INTEGER NOT NULL DEFAULT 0,
        no_warm INTEGER NOT NULL DEFAULT 0
    )""",
)

_V7 = (
    # the admission queue (reconciler.core.waiting): one row per waiting request, its
    # entity's encoding, until it is admitted, times out or is cancelled
    "CREATE TABLE waiting (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
    # tenants (config kind tenant): their pools, quotas, weights and cohorts
    "CREATE TABLE tenants (name TEXT PRIMARY KEY, data TEXT NOT NULL)",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "entities, journal, outbox, position", _V1),
    Migration(2, "audit indexes; append-only journal triggers", _V2),
    Migration(3, "published position of the outbox", _V3),
    Migration(4, "outbox by batch; fewer lease indexes", _V4),
    Migration(5, "retention: decision and release times, journal time and pruning", _V5),
    Migration(6, "warm claims per pool (the warm hit ratio)", _V6),
    Migration(7, "the admission queue and tenants", _V7),
)

#: the schema version this code writes
LATEST = MIGRATIONS[-1].version


async def schema_version(conn: aiosqlite.Connection) -> int:
    """The version recorded in the database; 0 for a database without our schema."""
    async with conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ) as cur:
        exists = await cur.fetchone() is not None
    if not exists:
        return 0
    async with conn.execute("SELECT max(version) FROM schema_version") as cur:
        row = await cur.fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


async def migrate(
    conn: aiosqlite.Connection,
    *,
    migrations: Sequence[Migration] | None = None,
    target: int | None = None,
    where: str = "database",
) -> int:
    """Bring the database up to ``target`` (default: the last migration); its version.

    ``conn`` must be in autocommit mode (``isolation_level=None``): each migration runs
    in its own explicit transaction.
    """
    plan = tuple(MIGRATIONS if migrations is None else migrations)
    _check_plan(plan)
    latest = plan[-1].version
    target = latest if target is None else target
    current = await schema_version(conn)
    if current > latest:
        raise SchemaTooNew(
            f"{where} has schema version {current}, but this reconciler only knows versions "
            f"up to {latest}: run a newer reconciler (the database was not changed)"
        )
    for migration in plan:
        if current < migration.version <= target:
            await _apply(conn, migration)
            current = migration.version
    return current


def _check_plan(plan: Sequence[Migration]) -> None:
    versions = [m.version for m in plan]
    if not versions or versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"migrations must be numbered 1, 2, 3, … in order, not {versions}")


async def _apply(conn: aiosqlite.Connection, migration: Migration) -> None:
    await conn.execute("BEGIN IMMEDIATE")
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for step in migration.steps:
            if isinstance(step, str):
                await conn.execute(step)
            else:
                await step(conn)
        await conn.execute("DELETE FROM schema_version")
        await conn.execute("INSERT INTO schema_version (version) VALUES (?)", (migration.version,))
        await conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            await conn.execute("ROLLBACK")
        raise


__all__ = [
    "LATEST",
    "MIGRATIONS",
    "Migration",
    "Step",
    "migrate",
    "schema_version",
]
