"""Snapshots of the folded state: canonical bytes, their digest and the applied sequence.

A snapshot lets a new replica (or a replay) start at sequence ``applied_seq + 1`` instead
of at 1, once the stream's oldest inputs have aged out.

Format (one JSON value per line, UTF-8):

- line 1, the header: ``{"format": "reconciler-snapshot/1", "applied_seq": N,
  "published_seq": P, "digest": D}``;
- then one line per row, tables in the order of :func:`reconciler.store.digest.
  state_digest` and rows in the order of their keys: ``["hosts", name, entity]`` (and
  ``pools``, ``classes``, ``profiles``, ``policies``, ``leases``), ``["decisions",
  request_id, verb, phase, lease_id, payload, final_at]`` (``payload`` as a string,
  ``final_at`` the second it became final, from which retention counts),
  ``["jobs", job, lease_id]``, ``["released_at", lease_id, second]`` for each released
  lease retention still keeps, ``["waiting", request_id, entity]`` and ``["tenants",
  name, entity]`` (only when there are any, as in the digest: the admission queue and
  the tenants), and ``["outbox", input_seq, blob]`` (base64) for the
  outputs not yet published at ``applied_seq`` (so a replica restored from it can publish
  them, should it lead).

Rules:

- The bytes are read from the store in one read transaction (:func:`write_snapshot`, run
  on the store's thread): the rows hold each entity's exact encoding already, so nothing
  is decoded and the event loop is not involved. The rows are written to a file as they
  are read (the header, known at the end, goes first by :class:`SnapshotReader`), so a
  snapshot of 100,000 leases does not hold its ~60 MB in memory twice.
- ``digest`` is :func:`~reconciler.store.digest.state_digest` of the state the snapshot
  describes (the figure ``reconciler replay`` prints), computed from the rows.
  :func:`decode_snapshot` rebuilds the state and computes it again, encoding every
  entity of the state it decoded (it keeps the leases' encodings, for the digest of a
  replay that goes on from this state): a snapshot whose digest does not match, or that
  is malformed, is refused (:class:`SnapshotError`), and nothing is written.
- :func:`restore_batch` turns a decoded snapshot into one store batch: every entity, every
  job binding, the unpublished outputs and the position, in one transaction.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import hashlib
import io
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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
    Tenant,
)
from reconciler.core.state import DecisionRecord, Effects, State
from reconciler.core.waiting import Waiting
from reconciler.store.codec import CodecError, from_builtins
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import _UPSERT_JOB, Batch, encode_batch
from reconciler.store.transactions import INSERT_OUTBOX, scalar, transaction

__all__ = [
    "FORMAT",
    "DecodedSnapshot",
    "Snapshot",
    "SnapshotError",
    "SnapshotReader",
    "decode_snapshot",
    "read_snapshot",
    "restore_batch",
    "snapshot_of_file",
    "write_snapshot",
]

FORMAT = "reconciler-snapshot/1"

#: (snapshot table, SQLite table, ``State`` attribute, entity class), in digest order
_ENTITIES: tuple[tuple[str, str, str, type[Any]], ...] = (
    ("hosts", "hosts", "hosts", Host),
    ("pools", "pools", "pools", Pool),
    ("classes", "classes", "classes", ResourceClass),
    ("profiles", "gpu_profiles", "profiles", GpuProfile),
    ("policies", "gpu_policies", "policies", GpuPolicy),
)


#: tables (snapshot table = SQLite table = ``State`` attribute) in the digest and the
#: snapshot only when they hold rows, in digest order
_OPTIONAL = ("waiting", "tenants")


class SnapshotError(ValueError):
    """A snapshot that is malformed or whose digest does not match its content."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One snapshot's bytes (``data``: the header line, then the rows), with what its
    header says. ``data`` is empty when the rows went to a file (:func:`write_snapshot`)."""

    applied_seq: int
    published_seq: int
    digest: str
    data: bytes = b""

    @property
    def header(self) -> bytes:
        """The first line of the snapshot, newline included."""
        fields = {
            "format": FORMAT,
            "applied_seq": self.applied_seq,
            "published_seq": self.published_seq,
            "digest": self.digest,
        }
        return orjson.dumps(fields) + b"\n"


class SnapshotReader(io.RawIOBase):
    """The bytes of a snapshot whose rows are in ``rows`` (a file at its start): its
    header, then the rows. For a streaming put into the object store."""

    def __init__(self, snapshot: Snapshot, rows: BinaryIO) -> None:
        super().__init__()
        self._head = snapshot.header
        self._rows = rows

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rows.read(len(view))
        view[: len(data)] = data
        return len(data)


@dataclass(slots=True)
class DecodedSnapshot:
    """A verified snapshot: the state (indexes rebuilt) and the unpublished outbox rows."""

    state: State
    published_seq: int
    digest: str
    outbox: list[tuple[int, bytes]] = field(default_factory=list)
    #: every lease of ``state`` with its encoding, as the verification digest computed
    #: it: a later :func:`~reconciler.store.digest.state_digest` of the state this one
    #: became (``known=``) reuses those of the leases still the same objects
    lease_encodings: dict[LeaseId, tuple[Lease, bytes]] = field(default_factory=dict)


# ------------------------------------------------------------------------------ write


def read_snapshot(conn: sqlite3.Connection) -> Snapshot:
    """The snapshot of what ``conn``'s store has committed, in memory."""
    rows = io.BytesIO()
    snapshot = write_snapshot(conn, rows)
    return Snapshot(
        applied_seq=snapshot.applied_seq,
        published_seq=snapshot.published_seq,
        digest=snapshot.digest,
        data=snapshot.header + rows.getvalue(),
    )


def write_snapshot(conn: sqlite3.Connection, sink: BinaryIO) -> Snapshot:
    """Write the rows of the snapshot of what ``conn``'s store has committed to ``sink``
    (one read transaction); the snapshot's header fields (``data`` empty)."""
    h = hashlib.sha256()
    dumps = orjson.dumps

    class _Lines:
        def append(self, line: bytes) -> None:
            sink.write(line)
            sink.write(b"\n")

    lines = _Lines()
    with transaction(conn, mode="DEFERRED"):
        applied = scalar(conn, "SELECT applied_seq FROM position WHERE id = 1")
        published = scalar(conn, "SELECT published_seq FROM position WHERE id = 1")
        h.update(b"applied_seq=%d\n" % applied)
        tables = [
            (name, f"SELECT name, data FROM {table} ORDER BY name")
            for name, table, _, _ in _ENTITIES
        ]
        tables.append(("leases", "SELECT lease_id, data FROM leases ORDER BY lease_id"))
        for name, sql in tables:
            h.update(b"[%s]\n" % name.encode())
            head = b'["' + name.encode() + b'",'
            for key, data in conn.execute(sql):
                raw = data.encode() if isinstance(data, str) else bytes(data)
                k = key.encode()
                h.update(k + b"=" + raw + b"\n")
                lines.append(head + dumps(key) + b"," + raw + b"]")
        h.update(b"[decisions]\n")
        sql = (
            "SELECT request_id, verb, phase, lease_id, payload, final_at FROM decisions "
            "ORDER BY request_id"
        )
        for request_id, verb, phase, lease_id, payload, final_at in conn.execute(sql):
            body = bytes(payload)
            h.update(f"{request_id}={verb}/{phase}/{lease_id}/{final_at}=".encode() + body + b"\n")
            row = ["decisions", request_id, verb, phase, lease_id, body.decode(), final_at]
            lines.append(dumps(row))
        h.update(b"[jobs]\n")
        for job, lease_id in conn.execute("SELECT job, lease_id FROM jobs ORDER BY job"):
            h.update(f"{job}={lease_id}\n".encode())
            lines.append(dumps(["jobs", job, lease_id]))
        h.update(b"[released_at]\n")
        sql = (
            "SELECT lease_id, released_at FROM leases WHERE released_at IS NOT NULL "
            "ORDER BY lease_id"
        )
        for lease_id, released_at in conn.execute(sql):
            h.update(f"{lease_id}={released_at}\n".encode())
            lines.append(dumps(["released_at", lease_id, released_at]))
        # the queue and the tenants only when there are any (older digests hold)
        for name in _OPTIONAL:
            rows = conn.execute(f"SELECT name, data FROM {name} ORDER BY name").fetchall()
            if rows:
                h.update(b"[%s]\n" % name.encode())
            for key, data in rows:
                raw = data.encode() if isinstance(data, str) else bytes(data)
                h.update(key.encode() + b"=" + raw + b"\n")
                lines.append(b'["' + name.encode() + b'",' + dumps(key) + b"," + raw + b"]")
        sql = "SELECT input_seq, outputs FROM outbox_batches WHERE input_seq > ? ORDER BY input_seq"
        for input_seq, blob in conn.execute(sql, (published,)):
            lines.append(dumps(["outbox", input_seq, base64.b64encode(bytes(blob)).decode()]))
    return Snapshot(applied_seq=applied, published_seq=published, digest=h.hexdigest())


def snapshot_of_file(path: Path, sink: BinaryIO) -> Snapshot:
    """:func:`write_snapshot` over a read-only connection of its own to the store file at
    ``path`` (for a worker thread: the store's own connection stays free)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        return write_snapshot(conn, sink)
    finally:
        conn.close()


# ------------------------------------------------------------------------------- read


def decode_snapshot(data: bytes) -> DecodedSnapshot:
    """The state ``data`` describes, verified; :class:`SnapshotError` when it cannot be
    trusted (malformed, of another format, or a digest that does not match)."""
    with _collector_paused():
        return _decode(data)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector off while a snapshot is decoded: every row leaves about ten
    new objects alive, so the young generation's collections would scan the growing
    state again and again (a quarter of the decode of 50,000 rows). The rows form no
    reference cycles, so nothing the collector would have freed is kept."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode(data: bytes) -> DecodedSnapshot:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise SnapshotError("empty snapshot")
    try:
        header = orjson.loads(lines[0])
    except orjson.JSONDecodeError as exc:
        raise SnapshotError(f"snapshot header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SnapshotError(f"not a {FORMAT} snapshot (header {lines[0][:120]!r})")
    applied, published, digest = (
        header.get("applied_seq"),
        header.get("published_seq"),
        header.get("digest"),
    )
    if (
        not isinstance(applied, int)
        or not isinstance(published, int)
        or not isinstance(digest, str)
    ):
        raise SnapshotError("snapshot header lacks applied_seq, published_seq or digest")
    state = State(applied_seq=applied)
    classes = {name: (attr, cls) for name, _, attr, cls in _ENTITIES}
    classes["leases"] = ("leases", Lease)
    classes["waiting"] = ("waiting", Waiting)
    classes["tenants"] = ("tenants", Tenant)
    out = DecodedSnapshot(state=state, published_seq=published, digest=digest)
    for number, line in enumerate(lines[1:], start=2):
        try:
            row = orjson.loads(line)
            _take(state, out, classes, row)
        except (orjson.JSONDecodeError, CodecError, TypeError, ValueError, KeyError) as exc:
            raise SnapshotError(f"snapshot line {number}: {exc}") from exc
    found = state_digest(state, record=out.lease_encodings)
    if found != digest:
        raise SnapshotError(
            f"snapshot at seq {applied} is refused: its digest is {digest}, "
            f"its content's is {found}"
        )
    state.reindex()
    return out


def _take(
    state: State,
    out: DecodedSnapshot,
    classes: dict[str, tuple[str, type[Any]]],
    row: Any,
) -> None:
    if type(row) is not list or not row:
        raise ValueError("not a snapshot row")
    table = row[0]
    if table == "decisions":  # most rows: checked inline, types exactly as written
        _, request_id, verb, phase, lease_id, payload, final_at = row
        if final_at is not None and type(final_at) is not int:
            raise ValueError("decision final_at is not an integer")
        if not (
            type(request_id) is str
            and type(verb) is str
            and type(phase) is str
            and type(payload) is str
            and (lease_id is None or type(lease_id) is str)
        ):
            raise TypeError(f"decision {str(request_id)[:80]!r}: a field is not a string")
        rid = RequestId(request_id)
        state.decisions[rid] = DecisionRecord(
            rid,
            verb,
            phase,
            payload.encode(),
            None if lease_id is None else LeaseId(lease_id),
            final_at,
        )
    elif table in classes:
        _, key, obj = row
        attr, cls = classes[table]
        target: dict[Any, Any] = getattr(state, attr)
        target[_text(key)] = from_builtins(cls, obj)
    elif table == "released_at":
        _, lease_id, at = row
        if not isinstance(at, int):
            raise ValueError("released_at is not an integer")
        state.released_at[LeaseId(_text(lease_id))] = at
    elif table == "jobs":
        _, job, lease_id = row
        state.jobs[JobId(_text(job))] = LeaseId(_text(lease_id))
    elif table == "outbox":
        _, input_seq, blob = row
        if not isinstance(input_seq, int):
            raise ValueError("outbox input_seq is not an integer")
        try:
            out.outbox.append((input_seq, base64.b64decode(_text(blob), validate=True)))
        except binascii.Error as exc:
            raise ValueError(f"outbox blob: {exc}") from exc
    else:
        raise ValueError(f"unknown snapshot table {table!r}")


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, not {type(value).__name__}")
    return value


def restore_batch(snapshot: DecodedSnapshot) -> Batch:
    """One batch that writes ``snapshot`` into an empty store."""
    state = snapshot.state
    fx = Effects(
        host_rows=set(state.hosts),
        pool_rows=set(state.pools),
        classes=set(state.classes),
        profiles=set(state.profiles),
        policies=set(state.policies),
        leases=set(state.leases),
        decisions=set(state.decisions),
        waiting=set(state.waiting),
        tenants=set(state.tenants),
    )
    batch = encode_batch(state, fx, applied_seq=state.applied_seq)
    writes = list(batch.writes)
    if state.jobs:
        writes.append((_UPSERT_JOB, tuple(sorted(state.jobs.items()))))
    if snapshot.outbox:
        writes.append((INSERT_OUTBOX, tuple(snapshot.outbox)))
    return Batch(applied_seq=state.applied_seq, writes=tuple(writes))
