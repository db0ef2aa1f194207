"""The pipeline: consume → fold → commit → ack. Every replica folds the IN stream, in
order, into its SQLite store through one (:class:`Pipeline`), and so does the replay.

Rules (docs/architecture.md, "The pipeline", and rules 3 and 7):

- A batch of deliveries is decoded and folded in stream order into the in-memory state,
  then written in one store transaction together with its journal, its outputs (the
  outbox) and the applied sequence; only then are its messages acknowledged (good ones
  acked, bad ones terminated). A crash anywhere loses nothing: on restart the consumer
  starts again after the committed position, and a message at or below it is acked
  without being folded.
- Folding and writing are pipelined: batch *n + 1* is fetched and folded while batch *n*
  is written by the store's writer, and handed over the moment the writer is free (no
  queue, :data:`PIPELINE_DEPTH` 0). While the writer is busy, whatever arrives is folded
  into the batch in hand (up to :data:`MERGE_LIMIT` fetches of ``batch``), so it is
  committed with it, in one transaction, instead of waiting for a transaction of its
  own: the busier the bus, the larger the batches and the fewer the commits (and the
  fewer pages written per input). The state may run ahead of the store by those two
  batches; :attr:`Pipeline.committed_seq` is what is durable. A batch is folded
  :data:`FOLD_CHUNK` deliveries at a time, with a turn of the event loop in between,
  so that the writer's reply (and with it the next commit), acks and queries never wait
  for the fold of a whole batch.
- Bad input (too large, not JSON, wrong subject or schema, domain errors) becomes a dead
  letter in the same batch's outbox, in stream order among the decisions, and leaves the
  state untouched. So does an input on which the fold itself fails (a bug): the state is
  reloaded from the store, the batch is folded again up to that input, and the input is
  dead-lettered as ``domain`` with the error. An input whose decision or command would be
  too large for the bus (:class:`~reconciler.core.fold.OutputTooLarge`) is dropped the
  same way and dead-lettered as ``too-large``: nothing the store commits is an output
  the server refuses to carry, so the outbox never stalls on one. A replay meets the
  same error at the same input and does the same, so decisions still reproduce byte for
  byte.
- Every committed batch is announced to the commit listeners (the leader's workers) with
  its effects: the keys it touched and whether it wrote outputs.
- The pipeline is *synced* once the committed position reaches the stream's last sequence
  as seen at start: the replica's caches are synced, as the ``health`` query
  (``caches_synced``) and the metrics (``rc_caches_synced``) say; queries answer
  ``cache-not-ready`` before.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from reconciler.bus.decoder import BadInput, Decoder, dead_letter_output
from reconciler.bus.input_consumer import Delivery, InputConsumer
from reconciler.core.fold import OutputTooLarge, fold_input
from reconciler.core.messages import (
    DEAD_LETTER_HEAD,
    DECISION_HEAD,
    EXEC_HEAD,
    UNPREFIXED,
    DeadLetter,
    DeadLetterReason,
    DeadLetterSubject,
    Decision,
    DeleteCommand,
    ExecSubject,
    parse_exec_command,
)
from reconciler.core.state import Effects, State
from reconciler.store.sqlite import Batch, Store, encode_batch

__all__ = [
    "MERGE_LIMIT",
    "PIPELINE_DEPTH",
    "Commit",
    "CommitListener",
    "FoldedBatch",
    "Pipeline",
    "fold_deliveries",
]

logger = structlog.get_logger(__name__)

#: folded batches that may queue for the writer besides the one handed over
PIPELINE_DEPTH = 0
#: how large (in fetches of ``batch``) the batch in hand may grow while the writer is busy
MERGE_LIMIT = 2
#: deliveries folded between two turns of the event loop (a few milliseconds of work):
#: the writer's reply, acks and queries are not kept waiting for a whole batch's fold
FOLD_CHUNK = 64
#: decision outcomes logged at debug (the others, at info)
_ROUTINE = frozenset({"admitted", "claimed", "ok", "authorized"})


@dataclass(frozen=True, slots=True)
class Commit:
    """What one committed batch did, as told to the commit listeners."""

    applied_seq: int
    fx: Effects
    inputs: int
    dead_letters: int
    #: the inputs folded, with their stream times (the fleet metrics' lifecycle waits)
    deliveries: Sequence[Delivery] = ()


CommitListener = Callable[[Commit], None]


@dataclass(slots=True)
class FoldedBatch:
    """Deliveries folded into the state, ready to be written and acknowledged."""

    applied_seq: int
    fx: Effects = field(default_factory=Effects)
    #: folded and to ack; already-applied redeliveries to ack; bad ones to terminate
    good: list[Delivery] = field(default_factory=list)
    stale: list[Delivery] = field(default_factory=list)
    bad: list[Delivery] = field(default_factory=list)
    batch: Batch | None = None
    #: every delivery of the batch, in order (folded again if a later fold fails)
    deliveries: list[Delivery] = field(default_factory=list)

    @property
    def advanced(self) -> bool:
        return bool(self.good or self.bad)

    def merge(self, later: FoldedBatch) -> None:
        """Take in the batch folded right after this one: one batch, one commit."""
        self.applied_seq = later.applied_seq
        self.fx.extend(later.fx)
        self.good.extend(later.good)
        self.stale.extend(later.stale)
        self.bad.extend(later.bad)
        self.deliveries.extend(later.deliveries)


class FoldFailed(Exception):
    """The fold raised on one input (a bug); the state may be half-changed."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(f"fold failed at delivery {index}: {cause!r}")
        self.index = index
        self.cause = cause


#: why a poisoned input is dead-lettered: its reason and sentence
Poison = tuple[DeadLetterReason, str]
_INTERNAL: Poison = ("domain", "internal error: the fold failed on this input")


def poison_of(cause: Exception) -> Poison:
    """How an input the fold raised on is dead-lettered: ``too-large`` for one whose
    decision or command would be too large to carry, ``domain`` for a bug."""
    if isinstance(cause, OutputTooLarge):
        return "too-large", str(cause)
    return _INTERNAL


def fold_deliveries(
    state: State,
    deliveries: list[Delivery],
    decoder: Decoder,
    *,
    prefix: str,
    poisoned: Mapping[int, Poison] | None = None,
) -> FoldedBatch:
    """Decode and fold ``deliveries`` into ``state``; dead-letter bad ones.

    ``poisoned`` are stream sequences known to make the fold fail, with how to
    dead-letter them (:func:`poison_of`): dead-lettered without folding. Raises
    :class:`FoldFailed` when the fold fails on another one.
    """
    out = FoldedBatch(applied_seq=state.applied_seq, deliveries=list(deliveries))
    fx = out.fx
    for index, d in enumerate(deliveries):
        seq = d.stream_seq
        if seq <= state.applied_seq:
            out.stale.append(d)
            continue
        poison = poisoned.get(seq) if poisoned else None
        if poison is not None:
            _dead_letter(state, fx, d, *poison)
            out.bad.append(d)
            continue
        decoded = decoder.decode(d.subject, d.data, prefix=prefix)
        if isinstance(decoded, BadInput):
            _dead_letter(state, fx, d, decoded.reason, decoded.error)
            out.bad.append(d)
            continue
        try:
            fold_input(state, seq, d.timestamp, decoded.input, fx)
        except Exception as exc:
            raise FoldFailed(index, exc) from exc
        out.good.append(d)
    out.applied_seq = state.applied_seq
    return out


def _dead_letter(
    state: State, fx: Effects, d: Delivery, reason: DeadLetterReason, error: str
) -> None:
    fx.outputs.append(dead_letter_output(d.subject, d.stream_seq, d.data, reason, error))
    fx.notes.append((d.stream_seq, f"dead-lettered ({reason}): {error}"))
    state.applied_seq = d.stream_seq


class Pipeline:
    """Consume → fold → commit → ack, for one replica."""

    def __init__(
        self,
        *,
        store: Store,
        state: State,
        consumer: InputConsumer,
        decoder: Decoder,
        prefix: str,
        explain: bool = True,
    ) -> None:
        self.store = store
        self.explain = explain
        self.state = state
        self.consumer = consumer
        self.decoder = decoder
        self.prefix = prefix
        self.committed_seq = state.applied_seq
        self.head_at_start = 0
        self.synced = anyio.Event()
        self._listeners: list[CommitListener] = []
        self._in_flight = 0
        self._drained = anyio.Event()
        self._drained.set()
        self._poisoned: dict[int, Poison] = {}
        self._stop = anyio.Event()
        self._fetch_scope: anyio.CancelScope | None = None
        #: the writer waits for a batch; the reader waits for it or for deliveries
        self._writer_waiting = False
        self._reader_wake = anyio.Event()
        consumer.on_arrival = self._wake_reader
        self._log = logger.bind(consumer=consumer.durable)
        # plain counters, read by the metrics collector at scrape time
        self.folded = 0
        self.batches = 0
        self.commit_seconds = 0.0
        self.decisions = 0
        self.commands = 0
        self.dead_letters: Counter[str] = Counter()

    # ------------------------------------------------------------------ wiring

    def add_listener(self, listener: CommitListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: CommitListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def stop(self) -> None:
        """Finish the batch in hand, commit and ack it, then return from :meth:`run`."""
        self._stop.set()
        self._wake_reader()
        if self._fetch_scope is not None:
            self._fetch_scope.cancel()  # waiting for messages: nothing is in hand

    # --------------------------------------------------------------------- run

    async def run(self, *, head: int | None = None) -> None:
        """Consume until :meth:`stop`. ``head`` is the stream's last sequence at start."""
        self.head_at_start = head if head is not None else await self.consumer.stream_last_seq()
        self._check_synced()
        send, receive = anyio.create_memory_object_stream[FoldedBatch](PIPELINE_DEPTH)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._writer, receive)
            async with send:
                await self._reader(send)

    async def _reader(self, send: ObjectSendStream[FoldedBatch]) -> None:
        pending: FoldedBatch | None = None
        while not self._stop.is_set():
            took_nothing = False
            if pending is None:
                with anyio.CancelScope() as scope:
                    self._fetch_scope = scope
                    deliveries = await self.consumer.fetch()
                self._fetch_scope = None
                if scope.cancel_called or not deliveries:
                    continue
                pending = await self._fold(deliveries)
            elif self._may_grow(pending):
                # the writer is busy: what came meanwhile joins the batch in hand
                more = await self.consumer.fetch_buffered(limit=self._room(pending))
                if more:
                    pending = await self._fold_more(pending, more)
                took_nothing = not more
            if self._writer_waiting:
                await self._hand_over(send, pending)
                pending = None
                continue
            self._reader_wake = anyio.Event()
            # Never loop again without awaiting something that yields: when nothing came of
            # what looked buffered, wait for the writer or a delivery like when nothing is.
            more_to_take = not took_nothing and self._may_grow(pending) and self.consumer.buffered
            if not self._writer_waiting and not more_to_take:
                await self._reader_wake.wait()
        if pending is not None:  # stopping: the batch in hand is committed all the same
            await self._hand_over(send, pending)

    def _wake_reader(self) -> None:
        self._reader_wake.set()

    def _room(self, pending: FoldedBatch) -> int:
        """How many more deliveries the batch in hand may take: it grows to
        :data:`MERGE_LIMIT` fetches of ``batch`` at most, never past."""
        return MERGE_LIMIT * self.consumer.batch - len(pending.deliveries)

    def _may_grow(self, pending: FoldedBatch) -> bool:
        return self._room(pending) > 0

    async def _hand_over(self, send: ObjectSendStream[FoldedBatch], folded: FoldedBatch) -> None:
        if folded.advanced:
            folded.batch = encode_batch(self.state, folded.fx, applied_seq=folded.applied_seq)
        self._in_flight += 1
        if self._drained.is_set():
            self._drained = anyio.Event()
        await send.send(folded)

    def _fold_once(self, deliveries: list[Delivery]) -> FoldedBatch:
        return fold_deliveries(
            self.state,
            deliveries,
            self.decoder,
            prefix=self.prefix,
            poisoned=self._poisoned,
        )

    async def _fold(self, deliveries: list[Delivery]) -> FoldedBatch:
        """Fold ``deliveries`` :data:`FOLD_CHUNK` at a time, letting the loop run in
        between (the writer's reply, acks, queries), as one batch."""
        folded = await self._fold_whole(deliveries[:FOLD_CHUNK])
        for start in range(FOLD_CHUNK, len(deliveries), FOLD_CHUNK):
            await anyio.lowlevel.checkpoint()
            folded = await self._fold_more(folded, deliveries[start : start + FOLD_CHUNK])
        return folded

    async def _fold_whole(self, deliveries: list[Delivery]) -> FoldedBatch:
        while True:
            try:
                return self._fold_once(deliveries)
            except FoldFailed as failure:
                await self._recover(deliveries[failure.index], failure.cause)

    async def _fold_more(self, pending: FoldedBatch, more: list[Delivery]) -> FoldedBatch:
        """Fold ``more`` into the batch in hand. If the fold fails, the state reloaded
        from the store no longer has ``pending`` either: both are folded again."""
        for start in range(0, len(more), FOLD_CHUNK):
            chunk = more[start : start + FOLD_CHUNK]
            if start:
                await anyio.lowlevel.checkpoint()
            try:
                later = self._fold_once(chunk)
            except FoldFailed as failure:
                await self._recover(chunk[failure.index], failure.cause)
                return await self._fold(pending.deliveries + more[start:])
            pending.merge(later)
        return pending

    async def _recover(self, culprit: Delivery, cause: Exception) -> None:
        """Drop the half-changed state: reload the committed one, remember the culprit."""
        if isinstance(cause, OutputTooLarge):  # bad input, not a bug
            self._log.warning(
                "fold.output_too_large",
                stream_seq=culprit.stream_seq,
                subject=culprit.subject,
                error=str(cause),
            )
        else:
            self._log.error(
                "fold.failed",
                stream_seq=culprit.stream_seq,
                subject=culprit.subject,
                error=repr(cause),
                exc_info=cause,
            )
        await self._drained.wait()
        self.state = await self.store.load_state(
            decision_retention_s=self.state.decision_retention_s
        )
        self._poisoned[culprit.stream_seq] = poison_of(cause)

    async def _writer(self, receive: ObjectReceiveStream[FoldedBatch]) -> None:
        async with receive:
            while True:
                self._writer_waiting = True
                self._wake_reader()
                try:
                    folded = await receive.receive()
                except anyio.EndOfStream:
                    return
                finally:
                    self._writer_waiting = False
                await self._commit(folded)
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._drained.set()

    async def _commit(self, folded: FoldedBatch) -> None:
        if folded.batch is not None:
            started = time.perf_counter()
            written = await self.store.write(folded.batch)
            self.commit_seconds += time.perf_counter() - started
            if not written:
                self._log.warning("commit.not_ahead", applied_seq=folded.applied_seq)
            self.committed_seq = max(self.committed_seq, folded.applied_seq)
            self.batches += 1
            self.folded += len(folded.good)
            self._announce(folded)
        # After the announcement, which wakes the outbox publisher: the ack then waits in
        # the connection's buffer for the publisher's outputs, and both go out in one
        # socket write. Terms first: the ack is cumulative and would make a later term a
        # no-op.
        await self.consumer.term(folded.bad)
        await self.consumer.ack(folded.deliveries)
        if folded.batch is not None:
            self._check_synced()

    def _announce(self, folded: FoldedBatch) -> None:
        """Tell the commit listeners (and the log) what a committed batch did."""
        self._poisoned = {
            seq: why for seq, why in self._poisoned.items() if seq > self.committed_seq
        }
        self._count(folded)
        if self.explain:
            self._explain(folded)
        commit = Commit(
            applied_seq=folded.applied_seq,
            fx=folded.fx,
            inputs=len(folded.good) + len(folded.bad),
            dead_letters=len(folded.bad),
            deliveries=folded.good,
        )
        for listener in tuple(self._listeners):
            listener(commit)

    def _check_synced(self) -> None:
        if not self.synced.is_set() and self.committed_seq >= self.head_at_start:
            self.synced.set()
            self._log.info("caches.synced", applied_seq=self.committed_seq)

    def _count(self, folded: FoldedBatch) -> None:
        for out in folded.fx.outputs:
            subject = out.subject
            if subject.startswith(DECISION_HEAD):
                self.decisions += 1
            elif subject.startswith(EXEC_HEAD):
                self.commands += 1
            elif subject.startswith(DEAD_LETTER_HEAD):
                self.dead_letters[subject[len(DEAD_LETTER_HEAD) :]] += 1

    def _explain(self, folded: FoldedBatch) -> None:
        """Log the committed batch's decisions with their reasons, its dead letters and
        its executor commands. Refusals, pending admissions and errors are ``info``, the
        routine ones (admitted, claimed, ok, authorized) ``debug``: at a thousand
        decisions a second, the line per admission costs more than the admission.

        A batch of inputs that were already on the stream when this replica started (it
        catches up: a follower, or a restart) was explained when it was first decided, so
        all of it is logged at ``debug`` only."""
        log = self._log
        routine = log.is_enabled_for(logging.DEBUG)
        catching_up = not self.synced.is_set() and folded.applied_seq <= self.head_at_start
        if catching_up and not routine:
            return
        info = log.debug if catching_up else log.info
        warning = log.debug if catching_up else log.warning
        for out in folded.fx.outputs:
            subject = out.subject
            if subject.startswith(DECISION_HEAD):
                if out.outcome in _ROUTINE and not routine:
                    continue  # not parsed: routine, and not logged at this level
                decision = Decision.parse(out.payload)
                outcome = decision.outcome
                if outcome in _ROUTINE and not routine:
                    continue
                lease = decision.lease
                (log.debug if outcome in _ROUTINE else info)(
                    "decision",
                    request_id=decision.request_id,
                    verb=decision.verb,
                    phase=decision.phase,
                    outcome=outcome,
                    reason=decision.reason,
                    detail=decision.detail,
                    instance=lease.instance if lease is not None else None,
                    host=lease.host if lease is not None else None,
                    lease_id=lease.lease_id if lease is not None else None,
                    victims=[v.instance for v in decision.victims or ()] or None,
                    input_seq=decision.input_seq,
                )
                continue
            route = UNPREFIXED.parse_output(subject)
            if isinstance(route, DeadLetterSubject):
                letter = DeadLetter.parse(route.reason, out.payload)
                warning(
                    "dead_letter",
                    reason=letter.reason,
                    subject=letter.subject,
                    stream_seq=letter.stream_seq,
                    error=letter.error,
                )
            elif isinstance(route, ExecSubject):
                command = parse_exec_command(route.verb, out.payload)
                info(
                    "executor_command",
                    command_id=command.command_id,
                    host=command.host,
                    instance=command.instance,
                    reason=command.reason if isinstance(command, DeleteCommand) else None,
                )
        if not routine:
            return
        for seq, note in folded.fx.notes:
            log.debug("fold.note", input_seq=seq, note=note)
