"""The demo: a simulated Incus fleet run by the whole system, end to end, in one process.

On a fresh machine it starts a local nats-server (JetStream in a temporary directory) and
a simulated Incus fleet (``reconciler.incus.simulator``: three hosts, one with four GPUs,
on unix sockets), then runs, each as in production and talking only over NATS and pylxd:
one replica of ``reconciler run`` (SQLite file ``--db``), ``reconciler bridge`` and
``reconciler executor``. A small driver plays the operators and GARM: it publishes the
pool and GPU configuration, asks for warm VMs and cold jobs, and creates or deletes the
cold jobs' VMs through pylxd after their admission, as GARM's provider would.

The story: the bridge brings the hosts in; the leader tops the warm pool up and the
executor boots the VMs; a job claims one; GPU jobs are placed on the GPU host with DRA
semantics; cold jobs fill the CPU hosts; a preemptible job evicts an idle warm VM and is
admitted only after the executor deleted it and a fresh inventory proved the room; bad
inputs are dead-lettered; a job ends. Every decision and executor command is printed as
it comes back on the OUT stream; at the end a summary, and a replay of the input stream
that must reproduce every decision and the store's state digest.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

from reconciler.bridge.bridge import Bridge, HostBridge, settings_from_json
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.embedded import embedded_nats
from reconciler.client import NoDecision, ReconcilerClient
from reconciler.core.messages import (
    DEFAULT_PREFIX,
    MSG_ID,
    DeadLetterSubject,
    DecidedLease,
    Decision,
    DecisionSubject,
    ExecSubject,
    Origin,
    StatusSubject,
    Subjects,
)
from reconciler.core.model import PoolName
from reconciler.core.state import State
from reconciler.executor.executor import Executor, ExecutorConfig
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.simulator import Fleet, FleetOptions, GpuShape, HostShape, Listen
from reconciler.incus.views import InstanceSpec
from reconciler.replay.replay import replay_into
from reconciler.replica.replica import Replica, RunConfig
from reconciler.store.digest import state_digest

__all__ = ["Summary", "run_demo"]

PROJECT = "ci"
IMAGE = "images:ubuntu/24.04/cloud"

#: the simulated hosts: two CPU hosts and one with four L40S GPUs on two NUMA nodes
SHAPES = (
    HostShape(name="cpu-a", cpu=16, memory_mib=65536, storage_gib=1000, projects=(PROJECT,)),
    HostShape(name="cpu-b", cpu=10, memory_mib=40960, storage_gib=500, projects=(PROJECT,)),
    HostShape(
        name="gpu-a",
        cpu=32,
        memory_mib=262144,
        storage_gib=2000,
        numa_nodes=2,
        gpus=tuple(
            GpuShape(pci_address=f"0000:{0x41 + 0x20 * i:02x}:00.0", numa_node=i // 2)
            for i in range(4)
        ),
        projects=(PROJECT,),
    ),
)

#: what Incus does not say: the system reserve, labels, the GPU profile
HOST_SETTINGS = {
    "defaults": {
        "reserve": {"cpu": 2, "memory_mib": 4096, "disk_gib": 50},
        "labels": {"gpu": "no"},
    },
    "hosts": {"gpu-a": {"labels": {"gpu": "yes"}, "gpu_profile": "compute"}},
}


def _res(cpu: int, memory_mib: int, disk_gib: int) -> dict[str, int]:
    return {"cpu": cpu, "memory_mib": memory_mib, "disk_gib": disk_gib}


#: the operators' configuration: (what it is, its kind, its name, its payload)
CONFIG: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    (
        "GPU profile 'compute': exclusive-process, persistence on, 300 W",
        "gpu-profile",
        "compute",
        {
            "v": 1,
            "name": "compute",
            "revision": 1,
            "defaults": {
                "mig_mode": "disabled",
                "compute_mode": "exclusive-process",
                "persistence": True,
                "power_limit_w": 300,
                "ecc": True,
            },
        },
    ),
    (
        "resource class 'l40s': one NVIDIA L40S",
        "class",
        "l40s",
        {
            "v": 1,
            "class": "l40s",
            "parameters": {"gpu": {"count": 1, "vendor": "nvidia"}},
            "host_selector": {"gpu": "yes"},
        },
    ),
    (
        "pool 'linux': 4 vCPUs, keep 2 warm VMs ready (at most 3)",
        "pool",
        "linux",
        {
            "v": 1,
            "pool": "linux",
            "flavor": _res(4, 8192, 40),
            "claims": [],
            "warm": {"min_ready": 2, "max_ready": 3, "protect_min_ready": False},
            "max_instances": 20,
            "priority": 0,
            "host_selector": {"gpu": "no"},
            "placement": "pack",
            "image": IMAGE,
            "profiles": ["default"],
            "project": PROJECT,
        },
    ),
    (
        "pool 'ml': 8 vCPUs and a claim of 2 GPUs, spread",
        "pool",
        "ml",
        {
            "v": 1,
            "pool": "ml",
            "flavor": _res(8, 32768, 200),
            "claims": [{"name": "gpus", "class": "l40s", "parameters": {"gpu": {"count": 2}}}],
            "warm": {"min_ready": 0, "max_ready": 0, "protect_min_ready": False},
            "max_instances": 4,
            "priority": 10,
            "host_selector": {},
            "placement": "spread",
            "image": IMAGE,
            "profiles": ["default"],
            "project": PROJECT,
        },
    ),
)


@dataclass
class Summary:
    decisions: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    commands: Counter[str] = field(default_factory=Counter)
    digest: str = ""
    replay_divergences: int = -1
    vms: list[str] = field(default_factory=list)


class _Say:
    """The demo's voice: story lines, and what comes back on the OUT stream."""

    def __init__(self, *, echo: bool) -> None:
        self.echo = echo

    def step(self, text: str) -> None:
        if self.echo:
            click.secho(f"\n▸ {text}", bold=True)

    def note(self, text: str) -> None:
        if self.echo:
            click.secho(f"    {text}", dim=True)

    def decision(self, body: dict[str, Any]) -> None:
        if not self.echo:
            return
        lease = body.get("lease") or {}
        where = f" {lease.get('instance')}@{lease.get('host')}" if lease else ""
        gpus = f" gpus={lease['gpus']}" if lease.get("gpus") else ""
        victims = body.get("victims")
        preempts = f" evicting {[v['instance'] for v in victims]}" if victims else ""
        why = f" ({body['reason']})" if "reason" in body else ""
        color = {"admitted": "green", "claimed": "green", "ok": "green", "pending": "cyan"}.get(
            body["outcome"], "red"
        )
        phase = "" if body["phase"] in ("final", body["outcome"]) else f"{body['phase']} "
        click.echo(f"    decision {body['verb']} {body['request_id']} → ", nl=False)
        click.secho(f"{phase}{body['outcome']}{why}{where}{gpus}{preempts}", fg=color)

    def command(self, verb: str, body: dict[str, Any]) -> None:
        if self.echo:
            what = body.get("reason", "create")
            click.secho(
                f"    executor command: {verb} {body['instance']} on {body['host']} ({what})",
                fg="magenta",
            )

    def dead_letter(self, body: dict[str, Any]) -> None:
        if self.echo:
            click.secho(f"    dead letter (seq {body['stream_seq']}): {body['error']}", fg="yellow")


class _Watch:
    """Everything published on the OUT stream, kept and printed as it arrives."""

    def __init__(self, say: _Say, summary: Summary, prefix: str) -> None:
        self.say = say
        self.summary = summary
        self.subjects = Subjects(prefix)
        self.decisions: dict[str, dict[str, Any]] = {}
        self.pools: dict[str, dict[str, Any]] = {}
        self.seen: set[str] = set()
        self.changed = anyio.Event()

    async def on_output(self, msg: Msg) -> None:
        msg_id = (msg.headers or {}).get(MSG_ID)
        if msg_id is not None:
            if msg_id in self.seen:
                return  # published again (the stream stored it once; core subscribers see both)
            self.seen.add(msg_id)
        route = self.subjects.parse_output(msg.subject)
        body = orjson.loads(msg.data)
        if isinstance(route, DecisionSubject):
            self.decisions[body["request_id"]] = body
            self.summary.decisions.append(body)
            self.say.decision(body)
        elif isinstance(route, ExecSubject):
            self.summary.commands[route.verb] += 1
            self.say.command(route.verb, body)
        elif isinstance(route, DeadLetterSubject):
            self.summary.dead_letters.append(body)
            self.say.dead_letter(body)
        elif isinstance(route, StatusSubject) and route.kind == "pool":
            self.pools[body["pool"]] = body
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, what: str, check: Callable[[], bool], within_s: float = 30) -> None:
        try:
            with anyio.fail_after(within_s):
                while not check():
                    with anyio.move_on_after(0.25):
                        await self.changed.wait()
        except TimeoutError:
            raise click.ClickException(f"the demo waited {within_s} s for {what}") from None


class Driver:
    """Plays the operators and GARM through the producer's client: configuration,
    commands (each awaited to its decision) and bad input."""

    def __init__(self, nc: Client, prefix: str) -> None:
        self.client = ReconcilerClient(nc, prefix=prefix, origin=Origin.DEMO)

    async def configure(self, kind: str, name: str, payload: dict[str, Any]) -> None:
        subject = self.client.subjects.config_input(kind, name)
        await self.client.publish_input(subject, orjson.dumps(payload))

    async def command(
        self, verb: str, request_id: str, *, first: bool = False, **fields: Any
    ) -> Decision:
        """The command's final decision (with ``first``: its first one)."""
        payload = {"v": 1, "request_id": request_id, **fields}
        try:
            return await self.client.command(verb, payload, within_s=30, first=first)
        except NoDecision as exc:
            raise click.ClickException(
                f"the demo waited {exc.within_s:g} s for the decision of {request_id}"
            ) from None

    async def bad_input(self, verb: str, payload: dict[str, Any] | bytes) -> None:
        """A command the reconciler will dead-letter, published as it is."""
        if isinstance(payload, dict):
            await self.client.send(verb, payload)
        else:
            await self.client.publish_input(self.client.subjects.command(verb), payload)


class _Driver(Driver):
    """The story's driver: also creates and deletes cold VMs, as GARM would."""

    def __init__(self, nc: Client, garm: dict[str, IncusHost], prefix: str) -> None:
        super().__init__(nc, prefix)
        self.garm = garm

    async def admit(self, request_id: str, pool: str, instance: str, **fields: Any) -> Decision:
        fields.setdefault("kind", "cold")
        decision = await self.command("admit", request_id, pool=pool, instance=instance, **fields)
        if decision.outcome == "admitted" and decision.lease is not None:
            await self.garm_creates(decision.lease)
        return decision

    async def garm_creates(self, lease: DecidedLease) -> None:
        """What GARM's provider does after an admission: create and start the VM."""
        host = self.garm[lease.host]
        spec = InstanceSpec.for_lease(
            name=lease.instance,
            image=IMAGE,
            lease_id=lease.lease_id,
            pool=lease.pool,
            kind=lease.kind,
            job=lease.job,
            project=PROJECT,
            demand=lease.demand,
        )
        await host.create_instance(spec)
        await host.start_instance(spec.name, project=PROJECT)

    async def garm_deletes(self, instance: str, host: str) -> None:
        await self.garm[host].destroy_instance(instance, project=PROJECT)


async def run_demo(
    db: Path,
    *,
    nats_url: str | None = None,
    echo: bool = True,
    prefix: str = DEFAULT_PREFIX,
    boot_delay_s: float = 0.5,
) -> Summary:
    """Run the story; see the module's docstring."""
    for suffix in ("", "-wal", "-shm"):
        await anyio.Path(f"{db}{suffix}").unlink(missing_ok=True)
    say = _Say(echo=echo)
    summary = Summary()
    async with contextlib.AsyncExitStack() as stack:
        if nats_url is None:
            server = stack.enter_context(embedded_nats())
            nats_url = server.url
            say.note(f"nats-server with JetStream at {nats_url}")
        fleet = await stack.enter_async_context(_fleet(boot_delay_s))
        say.note(f"simulated Incus fleet: {', '.join(s.name for s in SHAPES)} (unix sockets)")
        endpoints = tuple(
            IncusEndpoint(host=name, url=url) for name, url in sorted(fleet.endpoints.items())
        )
        await _story(
            db, nats_url=nats_url, endpoints=endpoints, prefix=prefix, say=say, summary=summary
        )
        summary.vms = sorted(
            f"{name}@{host.shape.name}"
            for host in (fleet.host(s.name) for s in SHAPES)
            for (_, name) in host.instances
        )
    return summary


@contextlib.asynccontextmanager
async def _fleet(boot_delay_s: float) -> AsyncIterator[Fleet]:
    directory = Path(tempfile.mkdtemp(prefix="rc-demo-"))
    try:
        options = FleetOptions(boot_delay_s=boot_delay_s, operation_retention_s=5.0)
        async with Fleet(
            SHAPES, listen=Listen(kind="unix", directory=directory), options=options
        ) as fleet:
            yield fleet
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _story(
    db: Path,
    *,
    nats_url: str,
    endpoints: tuple[IncusEndpoint, ...],
    prefix: str,
    say: _Say,
    summary: Summary,
) -> None:
    nats = ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.2, initial_timeout_s=10)
    replica, executor = await _replica_and_executor(nats, db, prefix, endpoints)
    settings = settings_from_json(HOST_SETTINGS)
    bridge_hosts = [IncusHost(ep) for ep in endpoints]
    garm = {ep.host: IncusHost(ep) for ep in endpoints}
    nc = await connect(replace(nats, name="demo-driver"))
    try:
        js = nc.jetstream()
        bridge = Bridge(
            [
                HostBridge(
                    incus=host,
                    js=js,
                    prefix=prefix,
                    settings=settings.get(host.name, settings["*"]),
                    inventory_delay_s=0.2,
                )
                for host in bridge_hosts
            ]
        )
        watch = _Watch(say, summary, prefix)
        await nc.subscribe(watch.subjects.outputs, cb=watch.on_output)
        driver = _Driver(nc, garm, prefix)
        await _tell(
            functools.partial(_chapters, driver, watch, replica, say),
            nc=nc,
            prefix=prefix,
            parts=(replica, executor, bridge),
            watch=watch,
            summary=summary,
            say=say,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()
            for host in [*bridge_hosts, *garm.values()]:
                await host.aclose()


async def _replica_and_executor(
    nats: ConnectOptions, db: Path, prefix: str, endpoints: tuple[IncusEndpoint, ...]
) -> tuple[Replica, Executor]:
    """The demo's replica (short TTL and status intervals, to keep the story brisk) and
    its executor, on a fresh executor database next to ``db``."""
    replica = Replica(
        RunConfig(
            nats=nats,
            db=db,
            prefix=prefix,
            replica="demo",
            leader_ttl_s=3.0,
            status_debounce_s=0.1,
            status_progress_interval_s=2.0,
            incus=endpoints,
        )
    )
    executor_db = db.with_name(f"{db.stem}-executor.db")
    for suffix in ("", "-wal", "-shm"):
        await anyio.Path(f"{executor_db}{suffix}").unlink(missing_ok=True)
    executor = Executor(
        ExecutorConfig(endpoints=endpoints, nats=nats, prefix=prefix, db=executor_db)
    )
    return replica, executor


async def _tell(
    chapters: Callable[[], Awaitable[None]],
    *,
    nc: Client,
    prefix: str,
    parts: tuple[Replica, Executor, Bridge],
    watch: _Watch,
    summary: Summary,
    say: _Say,
) -> None:
    """Run the replica, the executor and the bridge while ``chapters`` tell the story;
    stop them all, then replay the input stream into a fresh database for audit."""
    replica, executor, bridge = parts
    stop = anyio.Event()
    failure: click.ClickException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(replica.run, stop=stop))
        tg.start_soon(functools.partial(executor.run, stop=stop))
        with anyio.fail_after(30):
            await replica.started.wait()
            await executor.ready.wait()
        bridging = anyio.CancelScope()

        async def run_bridge() -> None:
            with bridging:
                await bridge.run()

        tg.start_soon(run_bridge)
        try:
            await chapters()
            await watch.until("the leader to publish everything", lambda: _caught_up(replica))
            summary.digest = state_digest(_state(replica))
        except click.ClickException as exc:
            failure = exc
        bridging.cancel()
        stop.set()  # the replica commits, publishes and resigns; the executor finishes
    if failure is not None:
        raise failure
    say.step("Replaying the input stream into a fresh database, for audit")
    report = await replay_into(nc, prefix=prefix)
    summary.replay_divergences = len(report.divergences)
    for divergence in report.divergences[:5]:
        say.note(f"divergence: {divergence}")
    say.note(f"{report.inputs} inputs folded again, {report.compared} outputs compared")


def _caught_up(replica: Replica) -> bool:
    facts = replica.facts()
    return bool(replica.leader_ready and facts["applied"] >= facts["head"])


def _state(replica: Replica) -> State:
    if replica.pipeline is None:
        raise RuntimeError("the replica has not started")
    return replica.pipeline.state


def _ready(replica: Replica, pool: str) -> int:
    return len(_state(replica).pool_ready.get(PoolName(pool), ()))


async def _chapters(driver: _Driver, watch: _Watch, replica: Replica, say: _Say) -> None:
    say.step("The bridge brings the Incus hosts in (snapshots and inventories)")
    await watch.until("three hosts", lambda: len(_state(replica).hosts) == 3)
    for name, host in sorted(_state(replica).hosts.items()):
        a = host.allocatable
        say.note(
            f"{name}: {a.cpu} vCPU, {a.memory_mib} MiB, {a.disk_gib} GiB allocatable, "
            f"{len(host.gpus)} GPUs, labels {host.labels}"
        )

    say.step("Operators configure a GPU profile, a resource class and two pools")
    for title, kind, config_name, payload in CONFIG:
        await driver.configure(kind, config_name, payload)
        say.note(title)

    say.step("The leader tops the warm pool up; the executor boots the VMs")
    await watch.until("two warm VMs ready", lambda: _ready(replica, "linux") >= 2)
    say.note("2 warm VMs of pool 'linux' are booted, unregistered and ready")

    say.step("Job 1001 claims a warm VM (again: the same VM), and GARM injects its runner")
    claim = await driver.command("claim-warm", "claim-1001", pool="linux", job="job-1001")
    await driver.command("claim-warm", "claim-1001-retry", pool="linux", job="job-1001")
    assert claim.lease is not None
    instance = claim.lease.instance
    await driver.command("mark-warm-injected", "inject-1001", job="job-1001", instance=instance)
    await watch.until("the pool refilled", lambda: _ready(replica, "linux") >= 2)
    say.note("the pool is short of one: the leader tops it up again")

    say.step("Two GPU jobs are placed with DRA semantics; a third finds no GPUs")
    await driver.admit("ml-1", "ml", "ml-1")
    await driver.admit("ml-2", "ml", "ml-2")
    await driver.admit("ml-3", "ml", "ml-3")

    say.step("Cold jobs fill the CPU hosts (GARM creates each VM after its admission)")
    n = 0
    while True:
        n += 1
        body = await driver.admit(f"cold-{n}", "linux", f"cold-{n}", job=f"job-{2000 + n}")
        if body.outcome != "admitted" or n >= 8:
            break

    say.step("A cold job that fits nowhere evicts an idle warm VM (admit-preemptible)")
    urgent: dict[str, Any] = {"pool": "linux", "instance": "urgent-1", "kind": "cold"}
    first = await driver.command("admit-preemptible", "urgent-1", first=True, **urgent)
    if not first.final:
        say.note("the executor deletes the victim; the bridge reports it gone and re-inventories")
    final = await driver.command("admit-preemptible", "urgent-1", **urgent)
    if final.outcome == "admitted" and final.lease is not None:
        say.note("the launch gate opened only on a fresh inventory proving the room")
        await driver.garm_creates(final.lease)

    say.step("Bad inputs are dead-lettered; the line goes on")
    await driver.bad_input("admit", b"{not json")
    await driver.bad_input(
        "admit",
        {"v": 1, "request_id": "evil", "pool": "linux", "instance": "../etc", "kind": "cold"},
    )
    await watch.until("two dead letters", lambda: len(watch.summary.dead_letters) >= 2)

    say.step("Job 2001 ends: GARM deletes its VM and releases it; room for warm VMs again")
    first = watch.decisions["cold-1"]["lease"]
    await driver.garm_deletes(first["instance"], first["host"])
    await driver.command("release", "release-cold-1", instance=first["instance"])
    await watch.until("the warm pool refilled", lambda: _ready(replica, "linux") >= 2)
    say.note("the leader refilled the warm pool into the room the job left")
