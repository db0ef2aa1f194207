"""The bridge: Incus hosts → the IN stream (``reconciler bridge``).

For every Incus host it watches, the bridge publishes what the fold needs to know about
it, through pylxd (:mod:`reconciler.incus`):

- **lifecycle**: every ``instance-*`` lifecycle event of every project, verbatim, on
  ``<prefix>.in.host.<host>.lifecycle`` (other actions change nothing in the fold and
  are not forwarded);
- **snapshot**: capacity (CPU threads, memory, the storage pool's size), the configured
  system reserve, labels, schedulability and GPU profile, and the GPUs, on
  ``…snapshot``, whenever it differs from the last one published, and on every
  (re)connection;
- **inventory**: the complete list of instances of every project, on ``…inventory``,
  after every (re)connection of the event stream (so nothing missed while it was down
  stays missed), shortly after an instance is created or deleted (a launch gate waits
  for proof that a victim is gone), and every ``resync_s``.

Rules:

- Revisions only grow, across restarts too: a host's next revision is one more than the
  last one of its kind on the stream (read at start), and at least the wall clock in
  milliseconds.
- **Lossless while connected.** An event that reached the bridge is published until the
  stream stored it: a failed publish (NATS down, slow, restarting) is retried with
  backoff, never dropped, and never ends the event session (Incus keeps no history, so
  a reconnect would lose whatever it emitted meanwhile). While a publish waits, later
  events wait behind it in the stream's bounded buffer (backpressure, in order).
- A failed snapshot or inventory (Incus busy, NATS trouble) is logged and tried again
  later; it does not end the event session either. The event session ends only when
  the event stream itself is lost.
- A lost event stream (Incus restarted, the network, a silent socket) is reconnected
  with a backoff that doubles from ``backoff_s`` to ``max_backoff_s`` while connecting
  keeps failing, and starts again from ``backoff_s`` once a connection was made; every
  failure is logged with its cause, none stops the bridge or its other hosts. After a
  reconnection a fresh snapshot and inventory cover what was missed.
- Lifecycle events carry a ``Nats-Msg-Id`` derived from their content, so a publish
  retried after a NATS hiccup is stored once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import orjson
import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from reconciler.bus.sending import PayloadTooLarge, publish
from reconciler.bus.streams import StreamNames
from reconciler.bus.violations import PermissionViolation
from reconciler.core.messages import Subjects, lifecycle_msg_id
from reconciler.core.model import Resources
from reconciler.incus.client import IncusHost
from reconciler.incus.errors import EventStreamLost, IncusError

__all__ = [
    "DEFAULT_RESERVE",
    "DEFAULT_RESYNC_S",
    "Bridge",
    "HostBridge",
    "HostSettings",
    "settings_from_json",
]

logger = structlog.get_logger(__name__)

#: actions after which an inventory is published soon (the launch gate's proof)
_INVENTORY_SOON = frozenset({"instance-created", "instance-deleted"})


#: the system reserve a host keeps for itself unless configured otherwise
DEFAULT_RESERVE = Resources(cpu=1, memory_mib=2048, disk_gib=20)


@dataclass(frozen=True, kw_only=True)
class HostSettings:
    """What the bridge says of a host beyond what Incus reports."""

    reserve: Resources = DEFAULT_RESERVE
    labels: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    gpu_profile: str | None = None
    storage_pool: str = "default"


def settings_from_json(data: Mapping[str, Any]) -> dict[str, HostSettings]:
    """``{"defaults": {...}, "hosts": {name: {...}}}`` → settings per named host, and
    the defaults under the key ``"*"``. Unknown keys are an error, so typos show."""
    known = {"reserve", "labels", "schedulable", "gpu_profile", "storage_pool"}

    def build(raw: Mapping[str, Any], base: HostSettings) -> HostSettings:
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown host settings {sorted(unknown)}; known: {sorted(known)}")
        reserve = raw.get("reserve")
        return HostSettings(
            reserve=Resources(**reserve) if reserve is not None else base.reserve,
            labels=dict(raw.get("labels", base.labels)),
            schedulable=bool(raw.get("schedulable", base.schedulable)),
            gpu_profile=raw.get("gpu_profile", base.gpu_profile),
            storage_pool=str(raw.get("storage_pool", base.storage_pool)),
        )

    extra = set(data) - {"defaults", "hosts"}
    if extra:
        raise ValueError(f"unknown top-level keys {sorted(extra)}: use defaults and hosts")
    defaults = build(data.get("defaults", {}), HostSettings())
    out = {"*": defaults}
    for name, raw in dict(data.get("hosts", {})).items():
        out[name] = build(raw, defaults)
    return out


class _Revisions:
    """Per kind, a revision that only grows (see the module's rules)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: dict[str, int] = {}

    def seed(self, kind: str, last: int) -> None:
        self._last[kind] = max(self._last.get(kind, 0), last)

    def next(self, kind: str) -> int:
        revision = max(self._last.get(kind, 0) + 1, int(self._clock() * 1000))
        self._last[kind] = revision
        return revision


#: seconds between full inventories (and snapshot checks) of a host, unless configured
DEFAULT_RESYNC_S = 30.0


class HostBridge:
    """One Incus host onto the bus."""

    def __init__(
        self,
        *,
        incus: IncusHost,
        js: JetStreamContext,
        prefix: str,
        settings: HostSettings,
        resync_s: float = DEFAULT_RESYNC_S,
        inventory_delay_s: float = 0.5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        idle_timeout_s: float = 35.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.incus = incus
        self.host = incus.name
        self.js = js
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.settings = settings
        self.resync_s = resync_s
        self.inventory_delay_s = inventory_delay_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.idle_timeout_s = idle_timeout_s
        self._in_stream = StreamNames.for_prefix(prefix).in_stream
        self._uid: str | None = None
        self._revisions = _Revisions(clock)
        self._seeded = False
        self._last_snapshot: dict[str, Any] | None = None
        self._inventory_due = anyio.Event()
        #: event stream sessions made, the first one included
        self.connections = 0
        #: whether the event stream is connected now, and whether the snapshot and
        #: inventory owed since it (re)connected are published (:mod:`.metrics`)
        self.connected = False
        self.caught_up = False
        self.published = {"lifecycle": 0, "snapshot": 0, "inventory": 0}
        #: snapshots and inventories that could not be published (tried again later)
        self.failed = {"snapshot": 0, "inventory": 0}
        self.publish_retries = 0
        self._log = logger.bind(host=self.host)

    def subject(self, kind: str) -> str:
        return self.subjects.host_input(self.host, kind)

    async def run(self) -> None:
        """Watch the host until cancelled, reconnecting with backoff."""
        delay = self.backoff_s
        while True:
            connections = self.connections
            try:
                await self._connected_session()
            except (EventStreamLost, IncusError) as exc:
                self._log.warning("bridge.incus_lost", error=str(exc), retry_in_s=delay)
            except Exception as exc:  # NATS trouble, a bug: log it, keep the host watched
                self._log.exception("bridge.failed", error=repr(exc), retry_in_s=delay)
            if self.connections > connections:  # it was connected: this loss is a new one
                delay = self.backoff_s
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def _connected_session(self) -> None:
        if not self._seeded:
            await self._seed_revisions()
        async with self.incus.lifecycle_events(idle_timeout_s=self.idle_timeout_s) as events:
            self._uid = (await self.incus.server_info()).uid  # a reinstalled host is another
            self.connections += 1
            self.connected = True
            self._log.info("bridge.connected", connections=self.connections)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._catch_up)
                    tg.start_soon(self._resync)
                    tg.start_soon(self._inventory_soon)
                    async for event in events:
                        await self.publish_lifecycle(event)
                    tg.cancel_scope.cancel()
            finally:
                self.connected = self.caught_up = False

    async def _catch_up(self) -> None:
        """After (re)connecting: a snapshot, then an inventory, each until published."""
        delay = self.backoff_s
        while not await self._attempt("snapshot", self._publish_fresh_snapshot):
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        while not await self._attempt("inventory", self.publish_inventory):
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        self.caught_up = True

    async def _publish_fresh_snapshot(self) -> None:
        await self.publish_snapshot(force=True)

    async def _attempt(
        self, what: Literal["snapshot", "inventory"], publish: Callable[[], Awaitable[None]]
    ) -> bool:
        """Run ``publish``; a failure is logged and counted (the caller tries again later)."""
        try:
            await publish()
        except IncusError as exc:
            self._log.warning("bridge.publish_failed", what=what, error=str(exc))
        except Exception as exc:  # NATS trouble: the event stream is unaffected
            self._log.warning("bridge.publish_failed", what=what, error=repr(exc))
        else:
            return True
        self.failed[what] += 1
        return False

    async def _seed_revisions(self) -> None:
        for kind in ("snapshot", "inventory"):
            try:
                last = await self.js.get_last_msg(self._in_stream, self.subject(kind))
                revision = orjson.loads(last.data or b"{}").get("revision", 0)
                if isinstance(revision, int):
                    self._revisions.seed(kind, revision)
            except NotFoundError:
                pass
            except orjson.JSONDecodeError:
                pass
        self._seeded = True

    async def _resync(self) -> None:
        while True:
            await anyio.sleep(self.resync_s)
            await self._attempt("snapshot", self.publish_snapshot)
            await self._attempt("inventory", self.publish_inventory)

    async def _inventory_soon(self) -> None:
        while True:
            await self._inventory_due.wait()
            await anyio.sleep(self.inventory_delay_s)  # let a burst of events settle
            self._inventory_due = anyio.Event()
            if not await self._attempt("inventory", self.publish_inventory):
                self._inventory_due.set()  # still owed: again after the delay

    # -------------------------------------------------------------- publishing

    async def publish_lifecycle(self, event: Mapping[str, Any]) -> None:
        metadata = event.get("metadata") or {}
        action = str(metadata.get("action", ""))
        if not action.startswith("instance-"):
            return
        body = orjson.dumps({"v": 1, "host": self.host, "event": event})
        msg_id = lifecycle_msg_id(body)
        delay = self.backoff_s
        while True:  # until stored: the same id makes a retry after a lost ack harmless
            try:
                # one attempt each: this loop retries (and counts) for as long as it takes
                await publish(
                    self.js, self.subject("lifecycle"), body, msg_id=msg_id, retry_for_s=0
                )
                break
            except (PermissionViolation, PayloadTooLarge):
                raise  # a deployment or input fault: retrying cannot fix it
            except Exception as exc:  # NATS down, slow or restarting
                self.publish_retries += 1
                self._log.warning(
                    "bridge.lifecycle_retry", action=action, error=repr(exc), retry_in_s=delay
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        self.published["lifecycle"] += 1
        self._log.debug("bridge.lifecycle", action=action, instance=metadata.get("name"))
        if action in _INVENTORY_SOON:
            self._inventory_due.set()

    async def _host_uid(self) -> str:
        if self._uid is None:
            self._uid = (await self.incus.server_info()).uid
        return self._uid

    async def publish_snapshot(self, *, force: bool = False) -> None:
        uid = await self._host_uid()
        resources = await self.incus.resources()
        disk = await self.incus.storage_total_gib(self.settings.storage_pool)
        s = self.settings
        content: dict[str, Any] = {
            "v": 1,
            "host": self.host,
            "uid": uid,
            "schedulable": s.schedulable,
            "labels": dict(s.labels),
            "capacity": Resources(resources.cpu, resources.memory_mib, disk).as_dict(),
            "reserve": s.reserve.as_dict(),
            "gpus": [
                {
                    "index": g.index,
                    "vendor": g.vendor,
                    "model": g.model,
                    "memory_mib": g.memory_mib,
                    "pci_address": g.pci_address,
                    "numa_node": g.numa_node,
                }
                for g in resources.gpus
            ],
        }
        if s.gpu_profile is not None:
            content["gpu_profile"] = s.gpu_profile
        if not force and content == self._last_snapshot:
            return
        payload = {**content, "revision": self._revisions.next("snapshot")}
        await publish(self.js, self.subject("snapshot"), orjson.dumps(payload))
        self._last_snapshot = content
        self.published["snapshot"] += 1
        self._log.info("bridge.snapshot", revision=payload["revision"], uid=uid)

    async def publish_inventory(self) -> None:
        uid = await self._host_uid()
        await self.incus.resources()  # the host's memory, for "limits.memory: N%"
        instances = await self.incus.list_instances()
        payload = {
            "v": 1,
            "host": self.host,
            "uid": uid,
            "revision": self._revisions.next("inventory"),
            "instances": [view.as_inventory() for view in instances],
        }
        await publish(self.js, self.subject("inventory"), orjson.dumps(payload))
        self.published["inventory"] += 1
        self._log.info("bridge.inventory", revision=payload["revision"], instances=len(instances))


class Bridge:
    """Every configured host, each watched on its own."""

    def __init__(self, hosts: list[HostBridge]) -> None:
        self.hosts = hosts

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for host in self.hosts:
                tg.start_soon(host.run, name=f"bridge-{host.host}")
