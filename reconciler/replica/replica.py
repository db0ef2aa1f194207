"""One replica of ``reconciler run``: its pipeline, queries and leader election, over one store.

Rules (docs/architecture.md, "The exactly-once path"):

- Start-up, in order: connect to NATS, create or reconcile the streams and the leader
  bucket, open and migrate the store, load its state, refuse a store that is *ahead* of
  the input stream (the stream was recreated: the store is of another history), start
  the input consumer after the committed position, then run the pipeline, answer queries
  and campaign for leadership, all at once.
- The pipeline runs on every replica for the process's lifetime. The leader's work runs
  only while this replica holds the leader key: the outbox publisher first (the leader
  is *ready* once the unsent outbox is on the bus), then, once the pipeline is synced,
  the status reporter, the warm-pool reconciler and the live verification of suspect
  leases (on the Incus hosts of ``RunConfig.incus``). Losing the key cancels that work at
  once.
- A follower learns from the leader key how far the outbox is published and prunes its
  own outbox accordingly.
- :meth:`Replica.run` returns after ``stop`` is set: the pipeline finishes and commits the
  batch in hand, a leader publishes what is committed and resigns its key, and every
  connection is closed.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo

from reconciler.bus.connection import ConnectOptions, ConnectRefused, connect
from reconciler.bus.decoder import Decoder
from reconciler.bus.input_consumer import InputConsumer
from reconciler.bus.streams import (
    DEFAULT_DUPLICATE_WINDOW_S,
    DEFAULT_LEADER_TTL_S,
    DEFAULT_MAX_AGE_S,
    StreamNames,
    StreamSetupError,
    ensure_streams,
)
from reconciler.bus.violations import PermissionViolation
from reconciler.core.messages import DEFAULT_PREFIX, MAX_PAYLOAD_BYTES, Output
from reconciler.core.retention import DEFAULT_DECISION_RETENTION_S
from reconciler.incus.endpoints import IncusEndpoint
from reconciler.replica.collector import FULL_EVERY_S, StateCollector
from reconciler.replica.fleet_metrics import FleetWatch
from reconciler.replica.leader import LeaderElection, Leadership
from reconciler.replica.outbox_publisher import OutboxPublisher
from reconciler.replica.pipeline import Pipeline
from reconciler.replica.query_responder import QueryResponder
from reconciler.replica.queue_stats import QueueStats
from reconciler.replica.queue_timer import QueueTimer
from reconciler.replica.reservation_reaper import (
    DEFAULT_JOURNAL_RETENTION_S,
    DEFAULT_RESERVATION_TIMEOUT_S,
    ReservationReaper,
)
from reconciler.replica.snapshot_bucket import (
    SnapshotBucket,
    SnapshotPublisher,
    identity_of,
    restore_newest,
)
from reconciler.replica.status_reporter import StatusReporter
from reconciler.replica.topup import WarmPoolReconciler
from reconciler.replica.verify import IncusPresence, SuspectVerifier
from reconciler.store.sqlite import Store

if TYPE_CHECKING:
    from reconciler.core.state import State
    from reconciler.incus.client import IncusHost
    from reconciler.observe.endpoints import MetricsServer

__all__ = ["Replica", "RunConfig", "StartupError", "default_replica_name"]

logger = structlog.get_logger(__name__)


#: how long a stopping leader waits for publishes cut short to reach the input stream
#: before it asks for the stream's end again (:meth:`Replica._fold_to_the_stream_end`)
_STREAM_END_SETTLE_S = 0.1


class StartupError(RuntimeError):
    """The replica cannot start on what it found (the message says what to do)."""


def default_replica_name() -> str:
    """The host name, as a consumer-name-safe token."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64].strip("-")
    return name or "replica"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything ``reconciler run`` is configured with."""

    nats: ConnectOptions = field(default_factory=ConnectOptions)
    db: Path = Path("reconciler.db")
    prefix: str = DEFAULT_PREFIX
    replica: str = field(default_factory=default_replica_name)
    workers: int = 2
    batch: int = 500
    #: where commits run: a child process (off the event loop's GIL) or a thread
    store_writer: Literal["process", "thread"] = "process"
    status_debounce_s: float = 1.0
    status_progress_interval_s: float = 10.0
    live_get_timeout_s: float = 5.0
    #: a warm VM not ready this long after its admission is released (and asked again)
    warm_boot_timeout_s: float = 600.0
    #: retention (docs/long-lived.md): decided request ids and released leases are
    #: evicted this long (stream time) after their final decision or release; the store
    #: prunes lease history older than ``journal_retention_s``; a cold lease still
    #: reserved ``reservation_timeout_s`` after its admission is released
    decision_retention_s: int | None = DEFAULT_DECISION_RETENTION_S
    journal_retention_s: int | None = DEFAULT_JOURNAL_RETENTION_S
    reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S
    leader_ttl_s: float = DEFAULT_LEADER_TTL_S
    max_age_s: float = DEFAULT_MAX_AGE_S
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S
    #: replicas of the streams and the bucket when this replica creates them
    stream_replicas: int = 1
    metrics_addr: str | None = None
    #: one series per host as well as the fleet's aggregates (``--metrics-per-host``)
    metrics_per_host: bool = False
    #: after loading the store, move every live object into the garbage collector's
    #: permanent generation (``gc.freeze``): full collections then never scan the loaded
    #: state again (100,000 leases: ~100 ms a full collection otherwise). A process
    #: policy: ``reconciler run`` sets it; a process with several replicas (tests) not.
    #: What the state gains is frozen after commits too, and once every
    #: ``gc_full_every_s`` (0: never) everything is thawed and collected in full
    #: (:mod:`reconciler.replica.collector`).
    freeze_loaded_state: bool = False
    gc_full_every_s: float = FULL_EVERY_S
    #: the Incus hosts the leader may ask about suspect leases (live GETs)
    incus: tuple[IncusEndpoint, ...] = ()
    #: the leader snapshots the state this often (0: never); a replica with an empty
    #: store starts from the newest snapshot (``reconciler.replica.snapshot_bucket``)
    snapshot_interval_s: float = 3600.0
    snapshot_keep: int = 3

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.replica):
            raise ValueError(f"replica name must be 1-64 of [A-Za-z0-9_-], not {self.replica!r}")
        if self.workers < 1 or self.batch < 1 or self.stream_replicas < 1:
            raise ValueError("workers, batch and stream_replicas must be >= 1")
        if self.snapshot_interval_s < 0 or self.snapshot_keep < 1:
            raise ValueError("snapshot_interval_s must be >= 0 and snapshot_keep >= 1")
        for name in (
            "status_debounce_s",
            "status_progress_interval_s",
            "live_get_timeout_s",
            "warm_boot_timeout_s",
            "reservation_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


class Replica:
    """One running replica. Build it, then ``await run(stop=...)``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.names = StreamNames.for_prefix(config.prefix)
        self.started = anyio.Event()
        self.leader_ready = False
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.collector: StateCollector | None = None
        self.election: LeaderElection | None = None
        self.queries: QueryResponder | None = None
        #: the admission queue's counters (every replica folds, so every replica counts)
        self.queue_metrics = QueueStats()
        self.metrics: MetricsServer | None = None  # aiohttp, loaded only when asked for
        #: the fleet's counters and histograms (kept whether metrics are served or not)
        self.fleet: FleetWatch | None = None
        self._head = 0
        self._stream_identity = ""
        self._published = 0
        self._status_published = 0
        self._publisher: OutboxPublisher | None = None
        self._reporter: StatusReporter | None = None
        #: the leader's command issuers (warm pools, verifier, reaper), cancelled on a stop
        self._commands: anyio.CancelScope | None = None
        self._stopping = False
        self.incus: dict[str, IncusHost] = {}
        if config.incus:  # pylxd is loaded only when there are hosts to ask
            from reconciler.incus.client import IncusHost

            self.incus = {ep.host: IncusHost(ep) for ep in config.incus}
        self._log = logger.bind(replica=config.replica, prefix=config.prefix)

    # ------------------------------------------------------------------- run

    async def run(self, *, stop: anyio.Event) -> None:
        cfg = self.config
        try:
            nc = await connect(replace(cfg.nats, name=f"reconciler-{cfg.replica}"))
        except ConnectRefused as exc:
            raise StartupError(str(exc)) from None
        self.nc = nc
        try:
            if nc.max_payload < MAX_PAYLOAD_BYTES:
                raise StartupError(
                    f"the NATS server's max_payload is {nc.max_payload} bytes, less than the "
                    f"{MAX_PAYLOAD_BYTES} an input or a decision may take: set max_payload "
                    "to at least 1MB in its configuration"
                )
            js = nc.jetstream()
            self.js = js
            try:
                await ensure_streams(
                    js,
                    self.names,
                    max_age_s=cfg.max_age_s,
                    duplicate_window_s=cfg.duplicate_window_s,
                    leader_ttl_s=cfg.leader_ttl_s,
                    replicas=cfg.stream_replicas,
                )
            except StreamSetupError as exc:
                raise StartupError(str(exc)) from None
            writer_process = cfg.store_writer == "process"
            async with await Store.open(
                cfg.db,
                writer_process=writer_process,
                journal_retention_s=cfg.journal_retention_s,
            ) as store:
                self.store = store
                await self._run_with(nc, js, store, stop)
        finally:
            with anyio.CancelScope(shield=True):
                await nc.close()
                for host in self.incus.values():
                    await host.aclose()

    async def _run_with(
        self, nc: Client, js: JetStreamContext, store: Store, stop: anyio.Event
    ) -> None:
        cfg = self.config
        state = await store.load_state(decision_retention_s=cfg.decision_retention_s)
        info = await js.stream_info(self.names.in_stream)
        # read once: a leader taking over during a failover must not depend on the server
        self._stream_identity = identity_of(info)
        if state.applied_seq == 0 and await self._start_from_snapshot(js, store, info) is not None:
            # loaded back as any store is, with this replica's retention
            state = await store.load_state(decision_retention_s=cfg.decision_retention_s)
        collector: StateCollector | None = None
        if cfg.freeze_loaded_state:
            # the state's objects form no cycles (refcounting frees what the fold
            # replaces): frozen, no collection scans them (reconciler.replica.collector)
            collector = StateCollector(full_every_s=cfg.gc_full_every_s)
            collector.loaded(leases=len(state.leases))
        info = await js.stream_info(self.names.in_stream)
        self._head = int(info.state.last_seq or 0)
        if state.applied_seq > self._head:
            raise StartupError(
                f"store {cfg.db} has applied up to seq {state.applied_seq}, but stream "
                f"{self.names.in_stream} ends at seq {self._head}: the stream was recreated. "
                f"Move the store away to rebuild it from the stream."
            )
        consumer = InputConsumer(
            nc,
            js,
            stream=self.names.in_stream,
            durable=self.names.replica_consumer(cfg.replica),
            batch=cfg.batch,
        )
        try:
            await consumer.start(from_seq=state.applied_seq + 1)
        except PermissionViolation as exc:
            raise StartupError(f"cannot start the input consumer: {exc}") from None
        pipeline = Pipeline(
            store=store, state=state, consumer=consumer, decoder=Decoder(), prefix=cfg.prefix
        )
        self.pipeline = pipeline
        self.collector = collector
        if collector is not None:
            pipeline.add_listener(collector.notify)
        self.fleet = FleetWatch(state=lambda: pipeline.state, warm_claims=await store.warm_claims())
        pipeline.add_listener(self.fleet.notify)
        pipeline.add_listener(self.queue_metrics.notify)
        self.election = LeaderElection(
            js, bucket=self.names.leader_bucket, holder=cfg.replica, ttl_s=cfg.leader_ttl_s
        )
        self.queries = QueryResponder(
            nc=nc, pipeline=pipeline, prefix=cfg.prefix, health=self.health
        )
        await self.queries.start()
        if cfg.metrics_addr:
            from reconciler.replica.metrics import replica_metrics_server

            self.metrics = replica_metrics_server(
                addr=cfg.metrics_addr,
                runtime=self,
                health=self.health,
                per_host=cfg.metrics_per_host,
            )
            await self.metrics.start()
        self._log.info(
            "replica.started",
            db=str(cfg.db),
            applied_seq=state.applied_seq,
            stream_last_seq=self._head,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.election.run, self._lead, self._follow, name="election")
                if collector is not None:
                    tg.start_soon(collector.run, name="gc")

                async def stopper() -> None:
                    await stop.wait()
                    self._stopping = True
                    self._log.info("replica.stopping")
                    commands = self._commands
                    if commands is not None:  # leading: issue nothing more, decide the rest
                        commands.cancel()
                        await self._fold_to_the_stream_end(pipeline, js)
                    pipeline.stop()

                tg.start_soon(stopper, name="stopper")
                self.started.set()
                await pipeline.run(head=self._head)
                await self._publish_what_is_committed()
                tg.cancel_scope.cancel()  # the leader resigns on its way out
        finally:
            with anyio.CancelScope(shield=True):
                await self.queries.stop()
                await consumer.close()
                if self.metrics is not None:
                    await self.metrics.stop()
            self._log.info("replica.stopped", applied_seq=pipeline.committed_seq)

    async def _start_from_snapshot(
        self, js: JetStreamContext, store: Store, info: StreamInfo
    ) -> State | None:
        """An empty store starts from the newest snapshot, if there is one."""
        first, last = int(info.state.first_seq or 0), int(info.state.last_seq or 0)
        if last == 0:
            return None
        bucket = SnapshotBucket(js, self.config.prefix, self._stream_identity)
        try:
            snapshot = await restore_newest(bucket, store, stream_last=last, stream_first=first)
        except Exception as exc:  # the bucket unreadable: not allowed, or no stream leader
            if first > 1:
                raise StartupError(
                    f"store {self.config.db} is empty and stream {self.names.in_stream} starts "
                    f"at seq {first}, but the snapshots in {bucket.name} cannot be read: "
                    f"{exc or type(exc).__name__}"
                ) from None
            # the whole stream is there: a snapshot only saves time
            self._log.warning(
                "snapshot.unavailable", bucket=bucket.name, error=str(exc) or type(exc).__name__
            )
            return None
        if snapshot is None and first > 1:
            raise StartupError(
                f"store {self.config.db} is empty and stream {self.names.in_stream} starts at "
                f"seq {first} (inputs 1..{first - 1} aged out), but {bucket.name} holds no "
                f"valid snapshot at or after seq {first - 1}: the state cannot be rebuilt"
            )
        return snapshot.state if snapshot is not None else None

    # ---------------------------------------------------------------- leader

    async def _lead(self, leadership: Leadership) -> None:
        pipeline, store, js, nc = self.pipeline, self.store, self.js, self.nc
        assert pipeline is not None and store is not None and js is not None and nc is not None
        cfg = self.config
        leadership.published_seq = await store.published_seq()
        publisher = OutboxPublisher(
            store=store,
            nc=nc,
            prefix=cfg.prefix,
            on_published=self._decisions_published,
        )
        reporter = StatusReporter(
            pipeline=pipeline,
            nc=nc,
            prefix=cfg.prefix,
            debounce_s=cfg.status_debounce_s,
            progress_interval_s=cfg.status_progress_interval_s,
            workers=cfg.workers,
        )
        warm = WarmPoolReconciler(
            pipeline=pipeline,
            js=js,
            prefix=cfg.prefix,
            interval_s=cfg.status_progress_interval_s,
            boot_timeout_s=cfg.warm_boot_timeout_s,
        )
        reaper = ReservationReaper(
            pipeline=pipeline,
            js=js,
            prefix=cfg.prefix,
            timeout_s=cfg.reservation_timeout_s,
            interval_s=cfg.status_progress_interval_s,
        )
        queue_timer = QueueTimer(pipeline=pipeline, js=js, prefix=cfg.prefix)
        verifier = SuspectVerifier(
            pipeline=pipeline,
            js=js,
            prefix=cfg.prefix,
            probes={name: IncusPresence(host) for name, host in self.incus.items()},
            live_get_timeout_s=cfg.live_get_timeout_s,
            workers=cfg.workers,
            interval_s=cfg.status_progress_interval_s,
        )
        snapshots = SnapshotPublisher(
            store=store,
            bucket=SnapshotBucket(
                js,
                cfg.prefix,
                self._stream_identity,
                replicas=cfg.stream_replicas,
            ),
            interval_s=cfg.snapshot_interval_s,
            keep=cfg.snapshot_keep,
        )
        self._publisher, self._reporter = publisher, reporter
        pipeline.add_listener(publisher.notify)
        try:
            async with anyio.create_task_group() as tg:
                drained = anyio.Event()
                tg.start_soon(publisher.run, leadership, drained, name="outbox")
                await drained.wait()
                await pipeline.synced.wait()
                pipeline.add_listener(reporter.notify)
                pipeline.add_listener(warm.notify)
                pipeline.add_listener(verifier.notify)
                pipeline.add_listener(reaper.notify)
                pipeline.add_listener(queue_timer.notify)
                tg.start_soon(reporter.run, name="status")
                commands = anyio.CancelScope()

                async def issue_commands() -> None:
                    with commands:
                        async with anyio.create_task_group() as issuers:
                            issuers.start_soon(warm.run, name="warm-pools")
                            issuers.start_soon(verifier.run, name="verify")
                            issuers.start_soon(reaper.run, name="reservations")
                            issuers.start_soon(queue_timer.run, name="queue-timer")

                if not self._stopping:  # elected while stopping: only publish
                    self._commands = commands
                    tg.start_soon(issue_commands, name="commands")
                if cfg.snapshot_interval_s > 0:
                    tg.start_soon(snapshots.run, name="snapshots")
                self.leader_ready = True
                self._log.info("leader.ready", published_seq=leadership.published_seq)
        finally:
            self.leader_ready = False
            self._commands = None
            pipeline.remove_listener(publisher.notify)
            pipeline.remove_listener(reporter.notify)
            pipeline.remove_listener(warm.notify)
            pipeline.remove_listener(verifier.notify)
            pipeline.remove_listener(reaper.notify)
            pipeline.remove_listener(queue_timer.notify)
            self._published += publisher.published
            self._status_published += reporter.published
            self._publisher = self._reporter = None

    async def _fold_to_the_stream_end(
        self, pipeline: Pipeline, js: JetStreamContext, within_s: float = 5.0
    ) -> None:
        """A leader that stops has cancelled its command issuers; before it stops folding
        it folds the input stream up to its end, so that the commands it issued itself
        (top-ups, releases, verifications) are decided, and their outputs published, by it
        rather than left undecided until the next start.

        A command whose publish was under way when its issuer was cancelled may reach the
        stream after the end was asked for (a clustered stream stores it once its peers
        agree, and answers the stream's info meanwhile): the end is asked for again after
        each fold up to it and a short settling time, until it stays where it was."""
        with anyio.move_on_after(within_s) as waited:
            end = -1
            while True:
                try:
                    info = await js.stream_info(self.names.in_stream)
                except Exception as exc:  # no answer: stop with what is folded
                    self._log.info("replica.stream_end_unknown", error=repr(exc))
                    return
                found = int(info.state.last_seq or 0)
                if found == end:
                    break
                end = found
                while pipeline.committed_seq < end:  # noqa: ASYNC110 (the caches' own progress)
                    await anyio.sleep(0.02)
                await anyio.sleep(_STREAM_END_SETTLE_S)
        if waited.cancelled_caught:
            self._log.warning(
                "replica.stopping_behind",
                applied_seq=pipeline.committed_seq,
                within_s=within_s,
                why="the inputs up to the stream's end were not all folded in time",
            )

    async def _publish_what_is_committed(self, within_s: float = 5.0) -> None:
        """On a graceful stop, a leader puts its last commits on the bus before resigning,
        so that its successor has nothing to send again (it would be deduplicated anyway)."""
        election, publisher = self.election, self._publisher
        leading = election.leading if election is not None else None
        if leading is None or publisher is None:
            return
        with anyio.move_on_after(within_s):
            try:
                await publisher.flush(leading)
            except Exception as exc:
                self._log.warning("leader.final_publish_failed", error=repr(exc))

    async def _follow(self, published_seq: int) -> None:
        store = self.store
        assert store is not None
        if published_seq > await store.published_seq():
            pruned = await store.mark_published_through(published_seq)
            self._log.debug("follower.outbox_pruned", published_seq=published_seq, rows=pruned)

    # ---------------------------------------------------------------- health

    async def health(self) -> dict[str, Any]:
        """The ``health`` query's result (docs/interface.md), with additions: this replica's
        name, whether it leads, and ``published_seq`` (every output of every input up to
        it is on the bus)."""
        pipeline = self.pipeline
        head = self._head
        if self.js is not None:
            try:
                with anyio.fail_after(1.0):
                    info = await self.js.stream_info(self.names.in_stream)
                head = self._head = max(self._head, int(info.state.last_seq or 0))
            except Exception as exc:
                self._log.debug("health.stream_info_failed", error=repr(exc))
        return {
            "cache_ready": pipeline is not None,
            "caches_synced": pipeline is not None and pipeline.synced.is_set(),
            "leader_ready": self.leader_ready,
            "applied_seq": pipeline.committed_seq if pipeline is not None else 0,
            "stream_last_seq": head,
            "replica": self.config.replica,
            "leader": self.election is not None and self.election.leading is not None,
            "published_seq": await self._published_seq(),
        }

    async def _published_seq(self) -> int:
        """How far every output is known to be on the bus (the leader's own count)."""
        election = self.election
        leading = election.leading if election is not None else None
        if leading is not None:
            return leading.published_seq
        return await self.store.published_seq() if self.store is not None else 0

    def _decisions_published(self, outputs: list[Output]) -> None:
        """The decision latency of what the leader published, once synced: the batches
        of a catch-up are old inputs whose decisions were published long ago."""
        pipeline = self.pipeline
        if self.fleet is not None and pipeline is not None and pipeline.synced.is_set():
            self.fleet.published(outputs)

    def fleet_state(self) -> tuple[State | None, FleetWatch | None]:
        """The folded state and the fleet's counters, for the metrics collector."""
        return (self.pipeline.state if self.pipeline else None), self.fleet

    def facts(self) -> dict[str, Any]:
        """Counters for the metrics collector."""
        pipeline = self.pipeline
        publisher, reporter = self._publisher, self._reporter
        return {
            "applied": pipeline.committed_seq if pipeline else 0,
            "head": self._head,
            "synced": int(pipeline is not None and pipeline.synced.is_set()),
            "leader": int(self.election is not None and self.election.leading is not None),
            "leader_ready": int(self.leader_ready),
            "folded": pipeline.folded if pipeline else 0,
            "batches": pipeline.batches if pipeline else 0,
            "commit_seconds": pipeline.commit_seconds if pipeline else 0.0,
            "dead_letters": dict(pipeline.dead_letters) if pipeline else {},
            "decisions": pipeline.decisions if pipeline else 0,
            "commands": pipeline.commands if pipeline else 0,
            "published": self._published + (publisher.published if publisher else 0),
            "status": self._status_published + (reporter.published if reporter else 0),
            "queries": self.queries.answered if self.queries else 0,
            "restarts": pipeline.consumer.restarts if pipeline else 0,
            "queue": self.queue_metrics,
        }
