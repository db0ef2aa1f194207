"""``reconciler executor``: the reconciler's create and delete commands, carried out on Incus.

Rules (docs/interface.md, "Executor commands"):

- **One durable pull consumer per managed host** on the OUT stream, named
  ``executor-<host>`` and filtered to ``<prefix>.out.exec.<host>.>`` (nats-server 2.9: one
  filter subject per consumer), explicit acks, read by the project's pull reader
  (:class:`~reconciler.bus.reader.PullReader`). A consumer created for the first time
  (here, or by ``reconciler provision``: :mod:`reconciler.bus.consumers`) delivers the
  commands of the last ``catch_up_s`` seconds (0: only new ones), so an executor started
  after the reconciler still gets the creates it is waiting for, and a new executor on
  an old stream does not replay a month of history. Run one executor per host at a
  time.
- **Held until finished.** A fetched message is *held* until its command is finished;
  every held message gets ``in_progress`` every ``heartbeat_interval_s`` (a quarter of
  ``ack_wait_s`` by default), whether it runs, waits behind another command of its
  instance, or waits for a retry, so JetStream never redelivers it mid-work. A host has
  at most ``max_in_hand`` messages held (also the consumer's ``max_ack_pending``). A
  redelivery of a held message (after a NATS outage longer than ``ack_wait``) only
  replaces the handle the ack will use.
- **Refused before Incus**: a message that is too large, not JSON, on a wrong subject,
  fails its JSON Schema, names another host, or names an invalid instance
  (:mod:`reconciler.executor.commands`) is logged with the reason and
  terminated; it never reaches Incus.
- **One key per instance** (``host/project/instance``) on its host's keyed work queue:
  each instance has a FIFO of its commands, in stream order; a worker runs only its
  head, so one instance's commands run in order and never two at once, while
  ``workers`` instances of each host run in parallel. Hosts have their own queues and
  workers, so a host that does not answer never holds up the others.
- **Once per command id.** Before acting, the head's ``command_id`` is looked up in the
  executor's database (:mod:`reconciler.executor.records`); a finished one is
  acked without acting. Every outcome is recorded *before* the ack. A create whose
  lease's VM was already deleted is ``superseded`` (a create redelivered after a crash
  can arrive after the delete that followed it; it must not bring the VM back).
- **delete** = a GET (to log what was there), then
  :meth:`~reconciler.incus.client.IncusHost.destroy_instance`: forced stop tolerating
  "already stopped" and 404, then DELETE tolerating 404. A missing instance (or project)
  is done: ``absent``. **create** = the pool's image and profiles, the demand as limits
  and root size, GPUs by PCI address, the lease tags (``user.rc.lease-id``,
  ``user.rc.pool``, ``user.rc.kind`` = ``warm``); idempotent for the same lease; then
  start. Effects come back through the bridge as lifecycle events; only a failure is
  published by the executor itself (below).
- **Failures** are sorted by :func:`~reconciler.executor.commands.classify`:
  temporary ones (host unreachable, operation timed out, instance busy) are retried with
  the queue's per-key exponential backoff (``retry_base_s`` doubling up to
  ``retry_cap_s``) for as long as it takes; failures that may pass are retried up to
  ``max_attempts`` times, then recorded ``gave-up`` and terminated; a definite refusal by
  Incus is recorded ``rejected`` and terminated at once.
- **What fails for good comes back as an input**: before a ``rejected`` or ``gave-up``
  command is recorded, the executor publishes ``<prefix>.in.host.<host>.failure`` (the
  lease, the instance, the action that failed: ``create``, ``start`` or ``delete``, and
  Incus's error; ``Nats-Msg-Id`` ``failure:<lease>:<action>``), which the fold folds:
  a failed create or start releases its lease, a failed delete leaves it ``deleting``,
  each with its fault. A report that cannot be published within ``report_for_s`` is
  logged (``command.failure_unreported``); the lease then ends by the reconciler's
  timeouts, as it would without the report.
- **NATS trouble is waited out**, never raised: a reconnect (the server forgets pull
  requests), a refused pull or a stalled fetch rebinds the consumer; a missing stream, a
  failed fetch or a failed binding waits ``reconnect_wait_s`` first. What was delivered
  before is held all the same (its ack subject stays good). Acks lost with the
  connection cost a redelivery, which the database answers.
- **Shutdown** (``stop`` set): stop fetching, let the commands that are running finish
  and ack them, ``nak`` every held command not started (so the next executor gets them
  at once, in stream order), flush, close. Cancelling :meth:`Executor.run` instead
  abandons everything un-acked to JetStream's redelivery after ``ack_wait_s``.
- Structured logs say what was done and why: ``command.done`` (command id, verb, host,
  project, instance, lease, reason or pool, outcome, detail, attempts, duration),
  ``command.retry``, ``command.rejected``, ``command.gave_up``, ``command.refused``,
  ``command.duplicate``. The same are counted per host and verb
  (:mod:`reconciler.executor.metrics`) and, with ``metrics_addr``, served to Prometheus
  with ``/healthz`` and ``/readyz``.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import orjson
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.consumers import (
    EXECUTOR_AHEAD,
    EXECUTOR_CATCH_UP_S,
    STALL_S,
    ensure_executor_consumer,
    executor_consumer_name,
)
from reconciler.bus.reader import (
    ACK,
    NAK,
    PROGRESS,
    TERM,
    PullReader,
    RawMessage,
    parse_ack_subject,
    pending_of,
    reply,
)
from reconciler.bus.sending import publish
from reconciler.bus.streams import StreamNames
from reconciler.core.messages import DEFAULT_PREFIX, clip, failure_msg_id
from reconciler.executor.commands import (
    Command,
    CommandParser,
    CreateCommand,
    DeleteCommand,
    Refusal,
    Retry,
    classify,
    invalid_instance_name,
)
from reconciler.executor.metrics import CommandCounts, LiveFacts
from reconciler.executor.records import ExecutorStore, FinishedCommand
from reconciler.incus.client import (
    DEFAULT_OPERATION_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    IncusEndpoint,
    IncusHost,
)
from reconciler.incus.errors import IncusError, NotFound
from reconciler.observe.endpoints import parse_addr
from reconciler.work.queue import TemporaryError, WorkQueue, run_workers

if TYPE_CHECKING:
    from reconciler.observe.endpoints import MetricsServer

__all__ = ["Executor", "ExecutorConfig", "consumer_name"]

logger = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_RETENTION_S = 7 * 24 * 3600.0


#: the durable consumer of a host's commands (:mod:`reconciler.bus.consumers`)
consumer_name = executor_consumer_name


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """Everything ``reconciler executor`` is configured with (seconds for durations)."""

    endpoints: tuple[IncusEndpoint, ...]
    nats: ConnectOptions = field(default_factory=ConnectOptions)
    prefix: str = DEFAULT_PREFIX
    db: Path = Path("executor.db")
    #: instances worked on at once, per host
    workers: int = 4
    ack_wait_s: float = 120.0
    #: ``in_progress`` interval for held messages; ``None``: a quarter of ``ack_wait_s``
    heartbeat_s: float | None = None
    #: messages held per host at most (the consumer's ``max_ack_pending``)
    max_in_hand: int = 64
    fetch_batch: int = 16
    fetch_timeout_s: float = 1.0
    #: how long to wait before binding again after NATS trouble
    reconnect_wait_s: float = 2.0
    retry_base_s: float = 1.0
    retry_cap_s: float = 60.0
    #: attempts of a command whose failure may pass (not of temporary failures)
    max_attempts: int = 10
    retention_s: float = DEFAULT_RETENTION_S
    prune_interval_s: float = 3600.0
    #: a new consumer delivers the commands of the last ``catch_up_s`` (0: only new ones)
    catch_up_s: float = EXECUTOR_CATCH_UP_S
    #: the storage pool of created VMs' root disks
    storage_pool: str = "default"
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S
    #: concurrent Incus calls per host
    incus_concurrency: int = 4
    #: ``HOST:PORT`` for Prometheus ``/metrics``, ``/healthz`` and ``/readyz`` (off: None)
    metrics_addr: str | None = None
    #: how long publishing a failure report is retried while no stream answers
    report_for_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("the executor needs at least one Incus host")
        names = [e.host for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"a host is listed twice: {sorted(names)}")
        for name in names:
            problem = invalid_instance_name(name)
            if problem is not None:
                raise ValueError(f"host name {name!r} {problem}")
        StreamNames.for_prefix(self.prefix)  # validates the prefix
        positive = (
            "ack_wait_s",
            "fetch_timeout_s",
            "reconnect_wait_s",
            "retry_base_s",
            "retry_cap_s",
            "retention_s",
            "prune_interval_s",
            "request_timeout_s",
            "operation_timeout_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("workers", "max_in_hand", "fetch_batch", "max_attempts", "incus_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.retry_base_s > self.retry_cap_s:
            raise ValueError("retry_base_s must not exceed retry_cap_s")
        if self.catch_up_s < 0:
            raise ValueError("catch_up_s must be >= 0")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s < self.ack_wait_s:
            raise ValueError("heartbeat_s must be > 0 and shorter than ack_wait_s")
        if self.metrics_addr is not None:
            parse_addr(self.metrics_addr)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.ack_wait_s / 4

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(e.host for e in self.endpoints)


@dataclass(eq=False)
class _Held:
    """A fetched message whose command is not finished yet."""

    host: str
    stream_seq: int
    command: Command
    #: the ack subject of its newest delivery: where the verdict goes
    ack_subject: str
    delivered: int
    received: float
    started: float | None = None
    attempts: int = 0
    #: what the command does now: ``create`` then ``start`` for a create, ``delete``
    action: str = ""

    def log_fields(self) -> dict[str, Any]:
        return {**self.command.log_fields(), "stream_seq": self.stream_seq}


@dataclass(frozen=True, kw_only=True)
class _Verdict:
    """How a held command ends: recorded with ``outcome`` and acked, or terminated."""

    outcome: str
    detail: str
    reply: Literal["ack", "term"] = "ack"
    earlier: FinishedCommand | None = None  # set for a duplicate: nothing is recorded


class Executor:
    """Runs ``reconciler executor`` until ``stop`` is set (see the module's rules)."""

    def __init__(
        self,
        config: ExecutorConfig,
        *,
        store: ExecutorStore | None = None,
        parser: CommandParser | None = None,
    ) -> None:
        self.config = config
        self.names = StreamNames.for_prefix(config.prefix)
        self._parser = parser or CommandParser()
        self._given_store = store
        self._store: ExecutorStore | None = store
        self.hosts: dict[str, IncusHost] = {
            e.host: IncusHost(
                e,
                request_timeout_s=config.request_timeout_s,
                operation_timeout_s=config.operation_timeout_s,
                max_concurrent_calls=config.incus_concurrency,
            )
            for e in config.endpoints
        }
        self.queues: dict[str, WorkQueue[str]] = {
            host: WorkQueue(
                name=f"executor-{host}",
                backoff_base=config.retry_base_s,
                backoff_cap=config.retry_cap_s,
            )
            for host in config.hosts
        }
        self._held: dict[tuple[str, int], _Held] = {}
        self._held_per_host: Counter[str] = Counter()
        self._fifos: dict[str, deque[_Held]] = {}
        self._room = anyio.Event()
        self._bound: set[str] = set()
        #: set once every host's consumer is bound (the executor fetches commands)
        self.ready = anyio.Event()
        #: how many commands ended how: outcomes, ``duplicate``, ``refused``, ``retry``
        self.stats: Counter[str] = Counter()
        #: the same per host and verb, for Prometheus (:mod:`reconciler.executor.metrics`)
        self.counts = CommandCounts(config.hosts)
        self.metrics: MetricsServer | None = None  # aiohttp, loaded only when asked for
        #: the connection, while running (verdicts go out on it)
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None

    @property
    def store(self) -> ExecutorStore:
        if self._store is None:
            raise RuntimeError("the executor's database is open only while it runs")
        return self._store

    def held(self) -> int:
        """Messages held now (fetched, command not finished)."""
        return len(self._held)

    def live(self) -> LiveFacts:
        """What the executor holds now, per host (for the metrics and ``/readyz``)."""
        nc = self._nc
        return LiveFacts(
            nats_connected=nc is not None and nc.is_connected,
            held=dict(self._held_per_host),
            running={host: len(queue.processing()) for host, queue in self.queues.items()},
            bound=frozenset(self._bound),
        )

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, stop: anyio.Event | None = None) -> None:
        """Run until ``stop`` is set, then shut down gracefully (module rules)."""
        stop = stop or anyio.Event()
        config = self.config
        logger.info(
            "executor.starting",
            hosts=list(config.hosts),
            prefix=config.prefix,
            db=str(config.db),
            workers=config.workers,
            ack_wait_s=config.ack_wait_s,
        )
        if self._store is None:
            self._store = await ExecutorStore.open(config.db)
        nc: Client | None = None
        try:
            if config.metrics_addr is not None:
                from reconciler.executor.metrics import executor_metrics_server

                self.metrics = executor_metrics_server(addr=config.metrics_addr, executor=self)
                await self.metrics.start()
            nc = await _unless_stopped(stop, lambda: connect(config.nats))
            if nc is not None:
                self._nc = nc
                await self._serve(nc, stop)
        finally:
            with anyio.CancelScope(shield=True):
                if self.metrics is not None:
                    await self.metrics.stop()
                if nc is not None:
                    await _close(nc)
                for host in self.hosts.values():
                    await host.aclose()
                if self._given_store is None and self._store is not None:
                    await self._store.close()
                    self._store = None
        logger.info("executor.stopped", **{k: v for k, v in sorted(self.stats.items())})

    async def _serve(self, nc: Client, stop: anyio.Event) -> None:
        js = nc.jetstream()
        self._js = js
        async with anyio.create_task_group() as background:
            background.start_soon(self._heartbeats, name="executor-heartbeats")
            background.start_soon(self._prune, name="executor-prune")
            async with anyio.create_task_group() as work:
                work.start_soon(self._work, name="executor-workers")
                async with anyio.create_task_group() as fetchers:
                    for host in self.config.hosts:
                        fetchers.start_soon(self._consume, nc, js, host, stop, name=host)
                running = sum(len(q.processing()) for q in self.queues.values())
                logger.info("executor.stopping", running=running, held=len(self._held))
                async with anyio.create_task_group() as draining:
                    for queue in self.queues.values():
                        draining.start_soon(queue.shutdown_and_drain)
            await self._release_unstarted()
            try:
                with anyio.fail_after(5):
                    await nc.flush()
            except Exception as exc:  # acks not confirmed: redelivery meets the records
                logger.warning("executor.flush_failed", error=repr(exc))
            background.cancel_scope.cancel()

    # ------------------------------------------------------------------ consuming

    async def _consume(
        self, nc: Client, js: JetStreamContext, host: str, stop: anyio.Event
    ) -> None:
        """Fetch ``host``'s commands into the queue until ``stop``; never raises for NATS."""
        config = self.config
        log = logger.bind(host=host, consumer=consumer_name(host))
        reader = PullReader(
            nc,
            stream=self.names.out_stream,
            batch=config.fetch_batch,
            ahead=EXECUTOR_AHEAD,
            expires_s=config.fetch_timeout_s,
            stall_s=STALL_S,
        )
        try:
            while not stop.is_set():
                room = config.max_in_hand - self._held_per_host[host]
                if room <= 0:
                    await self._wait_for_room()
                    continue
                # what came is held (its ack subject stays good across a rebinding)
                for raw in reader.pop_buffered(room):
                    await self._receive(host, raw, log)
                if reader.needs_binding():
                    self._bound.discard(host)
                    if reader.broken == "fetch stalled":
                        log.warning("consumer.fetch_stalled")
                    if not await self._bind(nc, js, host, reader, log):
                        await _pause(stop, config.reconnect_wait_s)
                    continue
                if not reader.buffered:
                    try:
                        await reader.wait()
                    except Exception as exc:  # closed or reconnecting
                        log.warning("consumer.fetch_failed", error=repr(exc))
                        reader.broken = f"fetch failed: {exc!r}"
                        self._bound.discard(host)
                        await _pause(stop, config.reconnect_wait_s)
                    else:
                        if not reader.buffered and reader.broken is None:
                            self.counts.backlog[host] = 0  # a request ended with nothing
        finally:
            self._bound.discard(host)
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await reader.unbind()

    async def _bind(
        self, nc: Client, js: JetStreamContext, host: str, reader: PullReader, log: Any
    ) -> bool:
        """Ensure ``host``'s consumer and bind ``reader`` to it; ``False`` (logged) on
        trouble."""
        config = self.config
        try:
            with anyio.fail_after(config.fetch_timeout_s + 10.0):
                await ensure_executor_consumer(
                    nc,
                    js,
                    stream=self.names.out_stream,
                    prefix=config.prefix,
                    host=host,
                    ack_wait_s=config.ack_wait_s,
                    max_in_hand=config.max_in_hand,
                    catch_up_s=config.catch_up_s,
                    log=log,
                )
                await reader.bind(consumer_name(host))
        except NotFoundError as exc:  # the stream is not there yet (or the consumer went)
            log.warning(
                "consumer.not_found",
                stream=self.names.out_stream,
                error=exc.description or repr(exc),
            )
            return False
        except Exception as exc:
            log.warning("consumer.bind_failed", error=repr(exc))
            return False
        log.info("consumer.bound", stream=self.names.out_stream)
        self._bound.add(host)
        if len(self._bound) == len(self.config.hosts):
            self.ready.set()
        return True

    async def _receive(self, host: str, raw: RawMessage, log: Any) -> None:
        """Hold a fetched message and queue its instance, or refuse it (terminated)."""
        subject, ack_subject, data, _ = raw
        try:
            seq, delivered, _ = parse_ack_subject(ack_subject)
        except ValueError:  # not a JetStream delivery: nothing to ack
            log.warning("command.not_a_delivery", subject=subject, reply=ack_subject)
            return
        self.counts.backlog[host] = pending_of(ack_subject)
        held = self._held.get((host, seq))
        if held is not None:  # redelivered while held: ack with the newest handle
            held.ack_subject, held.delivered = ack_subject, delivered
            log.info("command.redelivered_while_held", stream_seq=seq, delivered=delivered)
            return
        parsed = self._parser.parse(subject, data, prefix=self.config.prefix, host=host)
        if isinstance(parsed, Refusal):
            self.stats["refused"] += 1
            self.counts.refused[(host, parsed.reason)] += 1
            log.warning(
                "command.refused",
                subject=subject,
                stream_seq=seq,
                delivered=delivered,
                **parsed.log_fields(),
            )
            await self._reply(ack_subject, "term", log)
            return
        held = _Held(
            host=host,
            stream_seq=seq,
            command=parsed,
            ack_subject=ack_subject,
            delivered=delivered,
            received=time.monotonic(),
        )
        self._held[(host, seq)] = held
        self._held_per_host[host] += 1
        self._fifos.setdefault(parsed.key, deque()).append(held)
        self.queues[host].add(parsed.key)
        log.debug("command.received", delivered=delivered, **held.log_fields())

    async def _reply(self, ack_subject: str, verdict: Reply, log: Any) -> None:
        """Ack, terminate or nak a delivery; a failure is logged (redelivery is handled)."""
        try:
            if self._nc is None:
                raise RuntimeError("not connected")
            await reply(self._nc, (ack_subject,), _VERDICTS[verdict])
        except Exception as exc:
            log.warning(
                "command.reply_failed", reply=verdict, error=repr(exc), ack_subject=ack_subject
            )

    async def _wait_for_room(self) -> None:
        """Until a held message is released (or a fetch timeout passes: stop is checked)."""
        with anyio.move_on_after(self.config.fetch_timeout_s):
            await self._room.wait()

    # ------------------------------------------------------------------ working

    async def _work(self) -> None:
        async with anyio.create_task_group() as tg:
            for host, queue in self.queues.items():
                handler = functools.partial(self._handle, queue)
                tg.start_soon(
                    functools.partial(run_workers, queue, handler, workers=self.config.workers),
                    name=f"executor-workers-{host}",
                )

    async def _handle(self, queue: WorkQueue[str], key: str) -> None:
        """Work on the head command of instance ``key``; raise TemporaryError to retry."""
        fifo = self._fifos.get(key)
        if not fifo:
            self._fifos.pop(key, None)
            return
        held = fifo[0]
        verdict = await self._decide(held)
        await self._settle(held, verdict)
        fifo.popleft()
        self._unhold(held)
        if fifo:
            queue.add(key)  # the next command of this instance, after this run
        else:
            del self._fifos[key]

    async def _decide(self, held: _Held) -> _Verdict:
        command = held.command
        store = self.store
        earlier = await store.finished(command.command_id)
        if earlier is not None:
            return _Verdict(outcome=earlier.outcome, detail=earlier.detail, earlier=earlier)
        if isinstance(command, CreateCommand):
            deleted = await store.lease_deleted(host=command.host, lease_id=command.lease_id)
            if deleted is not None:
                return _Verdict(
                    outcome="superseded",
                    detail=f"the lease's VM was deleted by {deleted.command_id}",
                )
        held.attempts += 1
        if held.started is None:
            held.started = time.monotonic()
        try:
            outcome, detail = await self._act(command, held)
        except IncusError as exc:
            failure = classify(exc)
            detail = f"{failure.reason}: {failure.error}"
            if failure.retry is Retry.NEVER:
                await self._report(held, failure.error)
                return _Verdict(outcome="rejected", detail=detail, reply="term")
            if failure.retry is Retry.LIMITED and held.attempts >= self.config.max_attempts:
                await self._report(held, f"{failure.error} (after {held.attempts} attempts)")
                return _Verdict(outcome="gave-up", detail=detail, reply="term")
            self.stats["retry"] += 1
            self.counts.retried[(held.host, command.verb, failure.reason)] += 1
            logger.warning(
                "command.retry",
                **held.log_fields(),
                attempt=held.attempts,
                failure=failure.reason,
                retry=failure.retry.value,
                error=failure.error,
            )
            raise TemporaryError(detail) from exc
        return _Verdict(outcome=outcome, detail=detail)

    async def _report(self, held: _Held, error: str) -> None:
        """Publish what failed for good as the host's ``failure`` input (module rules)."""
        command = held.command
        action = held.action or command.verb
        payload = {
            "v": 1,
            "host": command.host,
            "instance": command.instance,
            "project": command.project,
            "lease_id": command.lease_id,
            "action": action,
            "error": clip(error) or "failed",
            "command_id": command.command_id,
        }
        subject = self.names.subjects.host_input(command.host, "failure")
        try:
            if self._js is None:
                raise RuntimeError("not connected")
            await publish(
                self._js,
                subject,
                orjson.dumps(payload),
                msg_id=failure_msg_id(command.lease_id, action),
                retry_for_s=self.config.report_for_s,
            )
        except Exception as exc:  # the lease ends by the timeouts instead
            logger.error("command.failure_unreported", **held.log_fields(), error=repr(exc))
            return
        logger.info("command.failure_reported", **held.log_fields(), action=action)

    async def _act(self, command: Command, held: _Held) -> tuple[str, str]:
        """Carry ``command`` out on its host: ``(outcome, detail)``; Incus errors raise.
        ``held.action`` says which step it is at."""
        host = self.hosts[command.host]
        if isinstance(command, DeleteCommand):
            held.action = "delete"
            try:
                view = await host.get_instance(command.instance, project=command.project)
                if view is None:
                    return "absent", "no such instance"
                await host.destroy_instance(command.instance, project=command.project)
            except NotFound as exc:  # the project (or the instance) is gone: so is the VM
                return "absent", exc.message
            tagged = view.lease_id
            owner = "" if tagged in (None, command.lease_id) else f", tagged lease {tagged}"
            return "deleted", f"was {view.status}{owner}"
        spec = command.spec(storage_pool=self.config.storage_pool)
        held.action = "create"
        view = await host.create_instance(spec)
        held.action = "start"
        await host.start_instance(command.instance, project=command.project)
        return "created", f"started (was {view.status} after create)"

    async def _settle(self, held: _Held, verdict: _Verdict) -> None:
        """Record the verdict (unless a duplicate), then ack or terminate the message."""
        command = held.command
        now = time.monotonic()
        fields = {
            **held.log_fields(),
            "outcome": verdict.outcome,
            "detail": verdict.detail,
            "attempts": held.attempts,
            "delivered": held.delivered,
            "waited_s": round((held.started or now) - held.received, 3),
            "duration_s": round(now - held.started, 3) if held.started is not None else 0.0,
        }
        if verdict.earlier is not None:
            self.stats["duplicate"] += 1
            self.counts.duplicates[(held.host, command.verb)] += 1
            logger.info("command.duplicate", **fields, first_seq=verdict.earlier.stream_seq)
            await self._reply(held.ack_subject, "ack", logger)
            return
        await self.store.record(
            FinishedCommand(
                command_id=command.command_id,
                verb=command.verb,
                host=command.host,
                project=command.project,
                instance=command.instance,
                lease_id=command.lease_id,
                outcome=verdict.outcome,
                detail=verdict.detail,
                stream_seq=held.stream_seq,
                attempts=held.attempts,
            )
        )
        self.stats[verdict.outcome] += 1
        self.counts.finished[(held.host, command.verb, verdict.outcome)] += 1
        if verdict.outcome == "rejected":
            logger.error("command.rejected", **fields)
        elif verdict.outcome == "gave-up":
            logger.error("command.gave_up", **fields)
        else:
            logger.info("command.done", **fields)
        await self._reply(held.ack_subject, verdict.reply, logger)

    def _unhold(self, held: _Held) -> None:
        if self._held.pop((held.host, held.stream_seq), None) is not None:
            self._held_per_host[held.host] -= 1
        self._room.set()
        self._room = anyio.Event()

    async def _release_unstarted(self) -> None:
        """At shutdown: ``nak`` every held command not finished, in stream order."""
        left = sorted(self._held.values(), key=lambda h: (h.host, h.stream_seq))
        for held in left:
            await self._reply(held.ack_subject, "nak", logger)
        if left:
            logger.info("executor.released_unfinished", count=len(left))
        self._held.clear()
        self._held_per_host.clear()
        self._fifos.clear()

    # ------------------------------------------------------------------ background

    async def _heartbeats(self) -> None:
        """``in_progress`` for every held message, every heartbeat interval."""
        while True:
            await anyio.sleep(self.config.heartbeat_interval_s)
            nc = self._nc
            if nc is None:
                continue
            for held in list(self._held.values()):
                try:
                    await reply(nc, (held.ack_subject,), PROGRESS)
                except Exception as exc:  # closed or reconnecting: redelivery is handled
                    logger.debug("command.heartbeat_failed", error=repr(exc))

    async def _prune(self) -> None:
        while True:
            try:
                dropped = await self.store.prune(retention_s=self.config.retention_s)
            except Exception as exc:
                logger.warning("executor.prune_failed", error=repr(exc))
            else:
                if dropped:
                    logger.info("executor.pruned", records=dropped)
            await anyio.sleep(self.config.prune_interval_s)


# ---------------------------------------------------------------------------- helpers

Reply = Literal["ack", "term", "nak"]
_VERDICTS: dict[Reply, bytes] = {"ack": ACK, "term": TERM, "nak": NAK}


async def _pause(stop: anyio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with anyio.move_on_after(seconds):
        await stop.wait()


async def _unless_stopped(stop: anyio.Event, make: Callable[[], Awaitable[T]]) -> T | None:
    """``await make()``, or ``None`` if ``stop`` is set first (``make`` is cancelled)."""
    result: T | None = None
    async with anyio.create_task_group() as tg:

        async def on_stop() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(on_stop)
        result = await make()
        tg.cancel_scope.cancel()
    return result


async def _close(nc: Client) -> None:
    try:
        with anyio.fail_after(5):
            await nc.close()
    except Exception as exc:
        logger.warning("nats.close_failed", error=repr(exc))
