"""Replay for audit: fold the IN stream afresh and compare with the OUT stream.

Rules (docs/architecture.md, rule 2):

- The stream is folded from its first message by exactly the code ``reconciler run``
  uses (:func:`~reconciler.replica.pipeline.fold_deliveries`: decoding, dead letters, the
  fold), up to the IN stream's last sequence as seen at start. Without ``db`` the fold
  runs in memory and nothing is written (no store is read afterwards); with ``db`` it
  runs through :class:`~reconciler.replica.pipeline.Pipeline` and a fresh store at that
  path, as ``reconciler run`` does. If the fold fails on an input (a bug), the live line
  reloaded its state from its store and dead-lettered that input: the in-memory fold
  then starts again through the pipeline and a store in memory, which do exactly that.
  Nothing is published and nothing is acked: the streams are read by consumers of the
  replay's own, without acks, deleted afterwards (:mod:`reconciler.replay.readers`;
  in a child process when the replay knows how to connect).
- Every output with a ``Nats-Msg-Id`` (decisions, executor commands, dead letters,
  config rejections) is compared with the OUT stream, read alongside the fold and up to
  its last sequence as seen once the fold is done (asked again once reached, until it
  stays put). Status messages carry no id and are
  not compared; outputs that name an input after the replayed range (``input_seq`` /
  ``stream_seq`` in their payload) are left out, since the live reconciler decided them
  after the replay began.
- A divergence is one of: ``mismatch`` (same id, other bytes), ``unexpected`` (on the
  bus, not produced by the replay), ``missing`` (produced by the replay, not on the bus).
  Any divergence fails the replay. An output an older release published is not a
  mismatch when its bytes are exactly what that release wrote: the replay's without the
  fields registered as added since (:mod:`reconciler.core.compat`); the report counts
  those by addition (``older``). On a busy stream the newest outputs may not be
  published yet and show as ``missing``: replay an idle stream, or again.
- A stream that no longer starts at sequence 1 (aged out by ``max_age``) is replayed from
  a snapshot (:mod:`reconciler.replica.snapshot_bucket`): the oldest one from which the stored
  inputs continue without a gap, verified by its digest (a mismatch is refused); the fold
  starts in its state, after its position (with ``db``, it is written into the fresh
  store first), and the report says so (``snapshot_seq``). ``from_snapshot`` asks for
  that even when the stream is whole.
  Outputs of the inputs the snapshot covers are not compared (they were decided before
  it): those naming an input at or below it, and executor commands (which name no
  input) for a lease the snapshot already holds, or that neither the snapshot nor the
  replay knows (evicted before it), unless the replay produced them too. Without a
  usable snapshot, an aged-out stream cannot be replayed: :class:`ReplayError`.
"""

from __future__ import annotations

import datetime as dt
import gc
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import anyio
import anyio.lowlevel
import orjson
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.decoder import Decoder
from reconciler.bus.input_consumer import Delivery, InputConsumer
from reconciler.bus.streams import StreamNames
from reconciler.core.compat import judge
from reconciler.core.messages import DEFAULT_PREFIX
from reconciler.core.retention import DEFAULT_DECISION_RETENTION_S
from reconciler.core.state import State
from reconciler.replay.readers import (
    READ_CHUNK,
    LocalReaders,
    ReaderError,
    ReaderProcess,
)
from reconciler.replica.collector import StateCollector
from reconciler.replica.pipeline import Commit, FoldFailed, Pipeline, fold_deliveries
from reconciler.replica.snapshot_bucket import SnapshotBucket, snapshot_for_replay, stream_identity
from reconciler.store.digest import state_digest
from reconciler.store.snapshot_format import DecodedSnapshot, SnapshotError, restore_batch
from reconciler.store.sqlite import Store

__all__ = [
    "Divergence",
    "FoldProgress",
    "ReplayError",
    "ReplayReport",
    "replay",
    "replay_into",
]

logger = structlog.get_logger(__name__)

Kind = Literal["mismatch", "unexpected", "missing"]


class ReplayError(RuntimeError):
    """The stream cannot be replayed (the message says why)."""


class FoldProgress(Protocol):
    """Told how far the fold is (inputs folded of those to fold), and when it is done
    (``reconciler replay`` draws it on a terminal: :mod:`reconciler.cli.progress`)."""

    def update(self, count: int, total: int | None = None) -> None: ...

    def done(self) -> None: ...


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
    #: (the state digest and the rest of the OUT stream, then the comparison)
    seconds: dict[str, float] = field(default_factory=dict)
    #: outputs an older release wrote, equal once the fields added since are taken
    #: out: how many lacked each addition (:attr:`~reconciler.core.compat.Addition.name`)
    older: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.divergences


async def replay(
    opts: ConnectOptions,
    *,
    prefix: str = DEFAULT_PREFIX,
    db: Path | None = None,
    batch: int = 1000,
    decision_retention_s: int | None = DEFAULT_DECISION_RETENTION_S,
    from_snapshot: bool = False,
    progress: FoldProgress | None = None,
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
            connect_opts=opts,
            progress=progress,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()


async def replay_into(
    nc: Client,
    *,
    prefix: str = DEFAULT_PREFIX,
    db: Path | None = None,
    batch: int = 1000,
    decision_retention_s: int | None = DEFAULT_DECISION_RETENTION_S,
    from_snapshot: bool = False,
    connect_opts: ConnectOptions | None = None,
    progress: FoldProgress | None = None,
) -> ReplayReport:
    """Replay over an open connection, folding with the replicas' ``--decision-retention``
    (the state, and so the digest, depends on it). With ``connect_opts`` (how ``nc`` was
    connected), the OUT stream is read by a child process on a connection of its own."""
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
    bucket: SnapshotBucket | None = None
    clock = time.perf_counter()
    chunk = max(batch, READ_CHUNK)
    outputs: LocalReaders | ReaderProcess | None = None
    #: where the readers' inputs were started, if before the fold (``None``: by it)
    inputs_from: int | None = None
    collector = _FoldCollector()
    try:
        async with anyio.create_task_group() as tg:
            try:
                if last and (first > 1 or from_snapshot):
                    try:
                        identity = await stream_identity(js, names.in_stream)
                        bucket = SnapshotBucket(js, prefix, identity)
                        # the OUT stream is read while the snapshot is fetched and the tail
                        # folded, from the oldest candidate's tail on (a newer one's is later)
                        usable = [
                            seq for seq in await bucket.positions() if first - 1 <= seq <= last
                        ]
                        if usable:
                            since = await _tail_start(js, names, usable[0], last)
                            outputs = _readers(nc, js, names, connect_opts, chunk, since)
                            tg.start_soon(outputs.run)
                            if db is None:
                                # and the tail's inputs too: those at or below the
                                # snapshot taken (a newer one, if this is refused) are
                                # skipped by the fold as already applied
                                await outputs.start_inputs(usable[0] + 1, last)
                                inputs_from = usable[0] + 1
                        snapshot = await snapshot_for_replay(
                            bucket, stream_first=first, stream_last=last
                        )
                    except SnapshotError as exc:
                        aged = (
                            f"inputs 1..{first - 1} have aged out (max_age), and "
                            if first > 1
                            else ""
                        )
                        raise ReplayError(
                            f"{names.in_stream} starts at seq {first}: {aged}{exc}, so the state "
                            f"cannot be rebuilt"
                        ) from exc
                if outputs is None:
                    outputs = _readers(nc, js, names, connect_opts, chunk, None)
                    tg.start_soon(outputs.run)
                # taken before the fold, which goes on in the snapshot's state
                snapshot_seq = snapshot.state.applied_seq if snapshot is not None else 0
                before = _BeforeSnapshot(snapshot) if snapshot is not None else None
                collector.freeze()
                produced: dict[str, tuple[str, bytes]] = {}
                seconds = {"snapshot": time.perf_counter() - clock}
                clock = time.perf_counter()
                folded: tuple[State, int, int] | None = None
                if db is None:
                    try:
                        folded = await _fold_in_memory(
                            names,
                            last=last,
                            readers=outputs,
                            produced=produced,
                            retention=decision_retention_s,
                            snapshot=snapshot,
                            inputs_from=inputs_from,
                            after_batch=collector.notify,
                            progress=progress,
                        )
                    except FoldFailed as failure:
                        # a bug in the fold: the live line reloaded its state from the store
                        # and dead-lettered the input; the replay does exactly that, with it
                        logger.warning("replay.fold_failed", error=repr(failure.cause))
                        produced.clear()
                        if snapshot is not None:
                            assert bucket is not None
                            snapshot = await bucket.fetch(snapshot_seq)
                if folded is None:
                    folded = await _fold_stream(
                        nc,
                        js,
                        names,
                        db=db,
                        last=last,
                        batch=batch,
                        produced=produced,
                        retention=decision_retention_s,
                        snapshot=snapshot,
                        progress=progress,
                    )
                state, inputs, dead = folded
                if progress is not None:
                    progress.done()
                seconds["fold"] = time.perf_counter() - clock
                clock = time.perf_counter()
                if before is not None:
                    before.replayed = set(state.leases)
                outputs.until(int((await js.stream_info(names.out_stream)).state.last_seq or 0))
                # the digest is computed while the reader takes the rest of the OUT stream
                report = ReplayReport(
                    first_seq=(snapshot_seq + 1 if snapshot else first) if last else 0,
                    last_seq=last,
                    inputs=inputs,
                    dead_letters=dead,
                    outputs=len(produced),
                    compared=0,
                    digest=state_digest(
                        state, known=snapshot.lease_encodings if snapshot else None
                    ),
                    snapshot_seq=snapshot_seq,
                    snapshot_digest=snapshot.digest if snapshot else None,
                    seconds=seconds,
                )
                await outputs.done.wait()
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # the OUT stream's reader runs in a task group: its own errors, or the fold's,
        # come out as themselves
        leaves = _leaves(group)
        failed = [e for e in leaves if isinstance(e, ReaderError)]
        if failed and len(failed) == len(leaves):  # the reader, and whatever waited on it
            raise ReplayError(str(failed[0])) from failed[0]
        if len(leaves) == 1:
            raise leaves[0] from leaves[0].__cause__
        raise
    finally:
        collector.restore()
        if outputs is not None:  # inputs started before a snapshot that was refused
            with anyio.CancelScope(shield=True):
                await outputs.close_inputs()
    assert outputs is not None
    _compare(outputs, produced=produced, report=report, before=before)
    seconds["compare"] = time.perf_counter() - clock
    return report


#: inputs the replay folds between two turns of its event loop, in which it takes in what
#: its reader child sent meanwhile (a frame of 1,000 inputs crosses the pipe in several
#: reads, one a turn: folded whole, the fold waited for most frames)
_FOLD_SLICE = 250

#: allocations between two collections of the youngest generation during the fold
#: (CPython: 700); what ``reconciler run --gc-threshold`` sets by default, and why
#: (:mod:`reconciler.replica.collector`)
FOLD_GC_THRESHOLD = 10_000


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions of ``group`` and of the groups nested in it."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


class _FoldCollector:
    """The garbage collector as a replica runs it (:mod:`reconciler.replica.collector`),
    for the replay's length: a young generation of :data:`FOLD_GC_THRESHOLD`,
    :meth:`freeze` once the snapshot is decoded (or the fold starts from nothing), which
    moves its objects (no cycles: refcounting frees what the fold replaces) out of every
    later collection, and :meth:`notify` after each folded batch, which freezes what the
    state gained at most once a second, so that a long replay's growing state is never
    scanned in full. :meth:`restore` undoes it all; nothing is frozen if the caller froze
    objects itself.

    Freezing takes no time (the generations' lists are spliced into the permanent one);
    no collection runs first (it took 0.2 s after a snapshot of 50,000 rows): whatever
    cyclic garbage is frozen with the snapshot is collected after :meth:`restore`. Until
    :meth:`freeze` the collector is off: the snapshot's decoding pauses it anyway, and
    turned on at its end it would at once collect the young generation, every object
    the decoding made (0.03 s for 50,000 rows), just before they are frozen."""

    def __init__(self) -> None:
        self._thresholds = gc.get_threshold()
        self._frozen = False
        self._enabled = gc.isenabled()
        gc.disable()
        self._state = StateCollector(full_every_s=0)
        young, middle, oldest = self._thresholds
        gc.set_threshold(max(young, FOLD_GC_THRESHOLD), middle, oldest)

    def freeze(self) -> None:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            self._frozen = True
        if self._enabled:
            gc.enable()

    def notify(self) -> None:
        if self._frozen:
            self._state.notify(None)

    def restore(self) -> None:
        if self._enabled:
            gc.enable()
        gc.set_threshold(*self._thresholds)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False


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


async def _fold_in_memory(
    names: StreamNames,
    *,
    last: int,
    readers: LocalReaders | ReaderProcess,
    produced: dict[str, tuple[str, bytes]],
    retention: int | None = DEFAULT_DECISION_RETENTION_S,
    snapshot: DecodedSnapshot | None = None,
    inputs_from: int | None = None,
    after_batch: Callable[[], None] = lambda: None,
    progress: FoldProgress | None = None,
) -> tuple[State, int, int]:
    """The pipeline's fold (:func:`~reconciler.replica.pipeline.fold_deliveries`:
    decoding, dead letters, the fold), without the store nobody reads afterwards.
    ``inputs_from``: the readers' inputs were started there already (at or before the
    state's position). Raises :class:`FoldFailed` where the fold fails (the caller folds
    again with a store, as the live line did)."""
    state = _start_state(snapshot, retention)
    decoder = Decoder()
    prefix = names.prefix
    inputs = dead = 0
    start = state.applied_seq
    try:
        if state.applied_seq >= last:
            return state, 0, 0
        if inputs_from is None:
            await readers.start_inputs(state.applied_seq + 1, last)
        else:
            assert inputs_from <= state.applied_seq + 1, "inputs started after the state"
        while (frame := await readers.take_inputs()) is not None:
            for at in range(0, len(frame), _FOLD_SLICE):
                deliveries = [
                    Delivery(subject, data, seq, ts, delivered, "")
                    for subject, data, seq, delivered, ts in frame[at : at + _FOLD_SLICE]
                ]
                folded = fold_deliveries(state, deliveries, decoder, prefix=prefix)
                inputs += len(folded.good) + len(folded.bad)
                dead += len(folded.bad)
                for out in folded.fx.outputs:
                    if out.msg_id is not None and out.msg_id not in produced:
                        produced[out.msg_id] = (out.subject, out.payload)
                after_batch()
                if progress is not None:
                    progress.update(state.applied_seq - start, last - start)
                # the loop takes in what the readers got meanwhile (the child's frames)
                await anyio.lowlevel.checkpoint()
    finally:
        await readers.close_inputs()
    return state, inputs, dead


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
    progress: FoldProgress | None = None,
) -> tuple[State, int, int]:
    consumer = InputConsumer(
        nc, js, stream=names.in_stream, durable=f"replay-{secrets.token_hex(6)}", batch=batch
    )
    async with await Store.open(db if db is not None else ":memory:") as store:
        if snapshot is not None:
            await store.write(restore_batch(snapshot))
        start = _start_state(snapshot, retention)
        pipeline = Pipeline(
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
            if progress is not None:
                progress.update(commit.applied_seq - start.applied_seq, last - start.applied_seq)
            if commit.applied_seq >= last:
                pipeline.stop()

        pipeline.add_listener(collect)
        try:
            await consumer.start(from_seq=start.applied_seq + 1)
            if last > start.applied_seq:
                await pipeline.run(head=last)
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.close()
                try:
                    await js.delete_consumer(names.in_stream, consumer.durable)
                except Exception as exc:
                    logger.warning("replay.consumer_not_deleted", error=repr(exc))
        return pipeline.state, counts["inputs"], counts["dead"]


def _readers(
    nc: Client,
    js: JetStreamContext,
    names: StreamNames,
    connect_opts: ConnectOptions | None,
    chunk: int,
    since: dt.datetime | None,
) -> LocalReaders | ReaderProcess:
    """The streams' readers: in a child process when the replay knows how to connect."""
    if connect_opts is not None:
        return ReaderProcess(connect_opts, names, chunk=chunk, since=since)
    return LocalReaders(nc, js, names, chunk=chunk, since=since)


def _compare(
    outputs: LocalReaders | ReaderProcess,
    *,
    produced: dict[str, tuple[str, bytes]],
    report: ReplayReport,
    before: _BeforeSnapshot | None = None,
) -> None:
    seen: set[str] = set()
    relative = outputs.subjects.relative
    out_last = outputs.last or 0
    divergences = report.divergences
    compared = 0
    for seq, msg_id, full_subject, data in outputs.found:
        if seq > out_last:
            break
        expected = produced.get(msg_id)
        if expected is None:
            if _input_seq(data) > report.last_seq:
                continue  # decided live after the replayed range
            if before is not None and before.covers(data):
                continue  # decided before the snapshot the replay started from
        compared += 1
        seen.add(msg_id)
        subject = relative(full_subject) or full_subject
        if expected is None:
            divergences.append(Divergence("unexpected", msg_id, subject, None, data))
        elif expected[1] != data or expected[0] != subject:
            lacked = judge(subject, expected[1], data) if expected[0] == subject else None
            if lacked is None:
                divergences.append(Divergence("mismatch", msg_id, subject, expected[1], data))
            for addition in lacked or ():
                report.older[addition.name] = report.older.get(addition.name, 0) + 1
    report.compared = compared
    for msg_id, (subject, payload) in produced.items():
        if msg_id not in seen:
            divergences.append(Divergence("missing", msg_id, subject, payload, None))


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


def _start_state(snapshot: DecodedSnapshot | None, retention: int | None) -> State:
    """Where a fold of the tail starts: the snapshot's state (with the replicas'
    retention, which is configuration) or an empty one."""
    if snapshot is None:
        return State(decision_retention_s=retention)
    state = snapshot.state
    state.decision_retention_s = retention
    logger.info(
        "replay.from_snapshot",
        applied_seq=state.applied_seq,
        digest=snapshot.digest,
        leases=len(state.leases),
    )
    return state
