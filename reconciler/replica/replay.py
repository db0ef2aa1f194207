"""Replay for audit: fold the IN stream into a fresh store and compare with the OUT stream.

Rules (docs/architecture.md, rule 2):

- The stream is folded from its first message by exactly the code ``reconciler run``
  uses (:class:`~reconciler.replica.caches.Caches`: decoding, dead letters, the fold,
  the store), into a fresh database (in memory unless a path is given), up to the IN
  stream's last sequence as seen at start. Nothing is published and nothing is acked on
  the live consumer: replay uses a consumer of its own, deleted afterwards.
- Every output with a ``Nats-Msg-Id`` (decisions, executor commands, dead letters,
  config rejections) is compared with the OUT stream, read up to its last sequence once
  the fold is done. Status messages carry no id and are not compared; outputs that name
  an input after the replayed range (``input_seq`` / ``stream_seq`` in their payload)
  are left out, since the live reconciler decided them after the replay began.
- A divergence is one of: ``mismatch`` (same id, other bytes), ``unexpected`` (on the
  bus, not produced by the replay), ``missing`` (produced by the replay, not on the bus).
  Any divergence fails the replay. On a busy stream the newest outputs may not be
  published yet and show as ``missing``: replay an idle stream, or again.
- A stream that no longer starts at sequence 1 (aged out by ``max_age``) is replayed from
  a snapshot (:mod:`reconciler.replica.snapshots`): the oldest one from which the stored
  inputs continue without a gap, verified by its digest (a mismatch is refused), written
  into the fresh store; the fold starts after it and the report says so
  (``snapshot_seq``). ``from_snapshot`` asks for that even when the stream is whole.
  Outputs of the inputs the snapshot covers are not compared (they were decided before
  it): those naming an input at or below it, and executor commands (which name no
  input) for a lease the snapshot already holds, or that neither the snapshot nor the
  replay knows (evicted before it), unless the replay produced them too. Without a
  usable snapshot, an aged-out stream cannot be replayed: :class:`ReplayError`.
"""

from __future__ import annotations

import datetime as dt
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from reconciler.bus.codec import Decoder
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.consumer import InputConsumer
from reconciler.bus.publisher import MSG_ID
from reconciler.bus.streams import StreamNames
from reconciler.core.retention import DEFAULT_DECISION_RETENTION_S
from reconciler.core.state import State
from reconciler.replica.caches import Caches, Commit
from reconciler.replica.snapshots import SnapshotBucket, snapshot_for_replay, stream_identity
from reconciler.store.digest import state_digest
from reconciler.store.snapshot import DecodedSnapshot, SnapshotError, restore_batch
from reconciler.store.sqlite import Store

__all__ = ["Divergence", "ReplayError", "ReplayReport", "replay", "replay_into"]

logger = structlog.get_logger(__name__)

Kind = Literal["mismatch", "unexpected", "missing"]


class ReplayError(RuntimeError):
    """The stream cannot be replayed (the message says why)."""


@dataclass(frozen=True, slots=True)
class Divergence:
    kind: Kind
    msg_id: str
    subject: str
    expected: bytes | None
    found: bytes | None


@dataclass(slots=True)
class ReplayReport:
    first_seq: int
    last_seq: int
    inputs: int
    dead_letters: int
    outputs: int
    compared: int
    digest: str
    divergences: list[Divergence] = field(default_factory=list)
    #: the snapshot the fold started from (its applied sequence), 0 when from seq 1
    snapshot_seq: int = 0
    snapshot_digest: str | None = None
    #: wall seconds of each part: ``snapshot`` (fetch and verify), ``fold``, ``compare``
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.divergences


async def replay(
    opts: ConnectOptions,
    *,
    prefix: str = "rc",
    db: Path | None = None,
    batch: int = 1000,
    decision_retention_s: int | None = DEFAULT_DECISION_RETENTION_S,
    from_snapshot: bool = False,
) -> ReplayReport:
    """Connect, replay, compare; see the module's rules."""
    nc = await connect(opts)
    try:
        return await replay_into(
            nc,
            prefix=prefix,
            db=db,
            batch=batch,
            decision_retention_s=decision_retention_s,
            from_snapshot=from_snapshot,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()


#: how long reading the OUT stream may go without a message before the rest is missing
COMPARE_STALL_S = 30.0


async def replay_into(
    nc: Client,
    *,
    prefix: str = "rc",
    db: Path | None = None,
    batch: int = 1000,
    decision_retention_s: int | None = DEFAULT_DECISION_RETENTION_S,
    from_snapshot: bool = False,
) -> ReplayReport:
    """Replay over an open connection, folding with the replicas' ``--decision-retention``
    (the state, and so the digest, depends on it)."""
    names = StreamNames.for_prefix(prefix)
    js = nc.jetstream()
    try:
        info = (await js.stream_info(names.in_stream)).state
        await js.stream_info(names.out_stream)
    except NotFoundError as exc:
        raise ReplayError(f"no streams {names.in_stream}/{names.out_stream}: {exc}") from exc
    first, last = int(info.first_seq or 0), int(info.last_seq or 0)
    if db is not None and await anyio.Path(db).exists():
        raise ReplayError(f"{db} exists: replay folds into a fresh database")
    snapshot: DecodedSnapshot | None = None
    clock = time.perf_counter()
    if last and (first > 1 or from_snapshot):
        try:
            identity = await stream_identity(js, names.in_stream)
            snapshot = await snapshot_for_replay(
                SnapshotBucket(js, prefix, identity), stream_first=first, stream_last=last
            )
        except SnapshotError as exc:
            aged = f"inputs 1..{first - 1} have aged out (max_age), and " if first > 1 else ""
            raise ReplayError(
                f"{names.in_stream} starts at seq {first}: {aged}{exc}, so the state "
                f"cannot be rebuilt"
            ) from exc
    # taken before the fold, which goes on in the snapshot's state
    snapshot_seq = snapshot.state.applied_seq if snapshot is not None else 0
    before = _BeforeSnapshot(snapshot) if snapshot is not None else None
    produced: dict[str, tuple[str, bytes]] = {}
    seconds = {"snapshot": time.perf_counter() - clock}
    clock = time.perf_counter()
    state, inputs, dead = await _fold_stream(
        nc,
        js,
        names,
        db=db,
        last=last,
        batch=batch,
        produced=produced,
        retention=decision_retention_s,
        snapshot=snapshot,
    )
    report = ReplayReport(
        first_seq=(snapshot_seq + 1 if snapshot else first) if last else 0,
        last_seq=last,
        inputs=inputs,
        dead_letters=dead,
        outputs=len(produced),
        compared=0,
        digest=state_digest(state),
        snapshot_seq=snapshot_seq,
        snapshot_digest=snapshot.digest if snapshot else None,
        seconds=seconds,
    )
    seconds["fold"] = time.perf_counter() - clock
    clock = time.perf_counter()
    if before is not None:
        before.replayed = set(state.leases)
    out_last = int((await js.stream_info(names.out_stream)).state.last_seq or 0)
    since = await _tail_start(js, names, snapshot_seq, last) if snapshot is not None else None
    await _compare(
        js,
        names,
        out_last=out_last,
        produced=produced,
        report=report,
        before=before,
        since=since,
    )
    seconds["compare"] = time.perf_counter() - clock
    return report


#: how much earlier than the first replayed input the output stream is read from
_CLOCK_MARGIN = dt.timedelta(seconds=1)


async def _tail_start(
    js: JetStreamContext, names: StreamNames, snapshot_seq: int, last: int
) -> dt.datetime | None:
    """When the first input after the snapshot was stored, less a margin: every output
    of the replayed inputs is on the OUT stream after that (the same server stamps both),
    so the comparison need not read what was decided long before the snapshot."""
    if snapshot_seq >= last:
        return None
    try:
        first = await js.get_msg(names.in_stream, seq=snapshot_seq + 1)
    except NotFoundError:
        return None
    return first.time - _CLOCK_MARGIN if first.time is not None else None


class _BeforeSnapshot:
    """Which outputs on the bus the snapshot's inputs made (see the module's rules)."""

    def __init__(self, snapshot: DecodedSnapshot) -> None:
        self.seq = snapshot.state.applied_seq
        self.leases = set(snapshot.state.leases)
        #: the leases of the replayed state (set once the fold is done)
        self.replayed: set[str] = set()

    def covers(self, payload: bytes) -> bool:
        input_seq = _input_seq(payload)
        if input_seq:
            return input_seq <= self.seq
        lease_id = _lease_id(payload)
        if lease_id is None:
            return False
        return lease_id in self.leases or lease_id not in self.replayed


async def _fold_stream(
    nc: Client,
    js: JetStreamContext,
    names: StreamNames,
    *,
    db: Path | None,
    last: int,
    batch: int,
    produced: dict[str, tuple[str, bytes]],
    retention: int | None = DEFAULT_DECISION_RETENTION_S,
    snapshot: DecodedSnapshot | None = None,
) -> tuple[State, int, int]:
    consumer = InputConsumer(
        nc, js, stream=names.in_stream, durable=f"replay-{secrets.token_hex(6)}", batch=batch
    )
    async with await Store.open(db if db is not None else ":memory:") as store:
        start = State(decision_retention_s=retention)
        if snapshot is not None:
            await store.write(restore_batch(snapshot))
            start = snapshot.state
            start.decision_retention_s = retention  # configuration: the replicas' value
            logger.info(
                "replay.from_snapshot",
                applied_seq=start.applied_seq,
                digest=snapshot.digest,
                leases=len(start.leases),
            )
        caches = Caches(
            store=store,
            state=start,
            consumer=consumer,
            decoder=Decoder(),
            prefix=names.prefix,
            explain=False,
        )
        counts = {"inputs": 0, "dead": 0}

        def collect(commit: Commit) -> None:
            counts["inputs"] += commit.inputs
            counts["dead"] += commit.dead_letters
            for out in commit.fx.outputs:
                if out.msg_id is not None and out.msg_id not in produced:
                    produced[out.msg_id] = (out.subject, out.payload)
            if commit.applied_seq >= last:
                caches.stop()

        caches.add_listener(collect)
        try:
            await consumer.start(from_seq=start.applied_seq + 1)
            if last > start.applied_seq:
                await caches.run(head=last)
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.close()
                try:
                    await js.delete_consumer(names.in_stream, consumer.durable)
                except Exception as exc:
                    logger.warning("replay.consumer_not_deleted", error=repr(exc))
        return caches.state, counts["inputs"], counts["dead"]


async def _compare(
    js: JetStreamContext,
    names: StreamNames,
    *,
    out_last: int,
    produced: dict[str, tuple[str, bytes]],
    report: ReplayReport,
    before: _BeforeSnapshot | None = None,
    since: dt.datetime | None = None,
) -> None:
    seen: set[str] = set()
    head = f"{names.prefix}."
    if out_last > 0:
        sub = await js.pull_subscribe(
            names.out_subjects,
            stream=names.out_stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                deliver_policy=api.DeliverPolicy.ALL
                if since is None
                else api.DeliverPolicy.BY_START_TIME,
                opt_start_time=since,
                inactive_threshold=60.0,
            ),
        )
        try:
            seq = 0
            stalled = 0.0  # seconds without a message: a busy or failing-over cluster
            while seq < out_last:
                try:
                    msgs = await sub.fetch(1000, timeout=2.0)
                except (TimeoutError, NatsTimeoutError):
                    # the stream has up to out_last: what is not here yet is slow, not
                    # missing (giving up at once reported it as divergences)
                    stalled += 2.0
                    if stalled >= COMPARE_STALL_S:
                        break
                    continue
                stalled = 0.0
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq > out_last:
                        break
                    msg_id = (msg.headers or {}).get(MSG_ID)
                    if msg_id is None:
                        continue
                    subject = msg.subject.removeprefix(head)
                    expected = produced.get(msg_id)
                    if expected is None and _input_seq(msg.data) > report.last_seq:
                        continue  # decided live after the replayed range
                    if expected is None and before is not None and before.covers(msg.data):
                        continue  # decided before the snapshot the replay started from
                    report.compared += 1
                    seen.add(msg_id)
                    if expected is None:
                        report.divergences.append(
                            Divergence("unexpected", msg_id, subject, None, msg.data)
                        )
                    elif expected[1] != msg.data or expected[0] != subject:
                        report.divergences.append(
                            Divergence("mismatch", msg_id, subject, expected[1], msg.data)
                        )
        finally:
            await sub.unsubscribe()
    for msg_id, (subject, payload) in produced.items():
        if msg_id not in seen:
            report.divergences.append(Divergence("missing", msg_id, subject, payload, None))


def _lease_id(payload: bytes) -> str | None:
    """The lease an executor command names, if any."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    lease_id = body.get("lease_id") if isinstance(body, dict) else None
    return lease_id if isinstance(lease_id, str) else None


def _input_seq(payload: bytes) -> int:
    """The input sequence an output names (decisions, rejections, dead letters), or 0."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(body, dict):
        return 0
    seq = body.get("input_seq", body.get("stream_seq", 0))
    return seq if isinstance(seq, int) else 0
