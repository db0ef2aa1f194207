"""The whole loop on the real Incus 6.0 daemon: ``reconciler run``, ``bridge`` and
``executor`` over a real nats-server and real pylxd, with busybox containers standing in
for VMs (``instance_type: container``).

A warm pool of 2 reaches ``ready`` (the guest's ``PATCH /1.0 {"state":"Ready"}`` makes
Incus emit ``instance-ready``) and refills after a claimed runner is deleted; a
preemption hands off only after the executor deleted a victim container and a fresh
inventory proved the room; warm containers that said ready while the bridge was down
become ready from its next inventory; the live verifier answers present and absent.

The host's real CPU count bounds the pool: the bridge's reserve leaves exactly two
CPUs allocatable, so two warm containers of one CPU fill it.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bridge.bridge import Bridge, HostBridge, settings_from_json
from reconciler.bus.connection import ConnectOptions
from reconciler.core.model import PoolName
from reconciler.executor.executor import Executor, ExecutorConfig
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.replica.replica import Replica
from reconciler.replica.verify import IncusPresence
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.realincus import RealIncus

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(120)]

HOST = "real-01"
POOL = "ci-ct"


def report(line: str) -> None:
    """Print a line of the run's story (shown with ``pytest -s``, and in the log)."""
    print(f"[real-incus] {line}")


def container_pool(**fields: Any) -> tuple[str, dict[str, Any]]:
    kind, payload = b.pool(POOL, cpu=1, memory_mib=128, disk_gib=1, **fields)
    return kind, {
        **payload,
        "image": "busybox",
        "profiles": ["default"],
        "instance_type": "container",
    }


class BridgeSwitch:
    """The system's bridge, which a test may stop (Incus's events go unheard) and start
    again (a new bridge catches up with a snapshot and an inventory)."""

    def __init__(self) -> None:
        self._tg: anyio.abc.TaskGroup | None = None
        self._make: Any = None
        self._scope: anyio.CancelScope | None = None

    def attach(self, tg: anyio.abc.TaskGroup, make: Any) -> None:
        self._tg, self._make = tg, make
        self.start()

    def start(self) -> None:
        assert self._tg is not None and self._scope is None
        self._scope = anyio.CancelScope()
        self._tg.start_soon(self._run, self._scope, self._make())

    def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()
        self._scope = None

    @staticmethod
    async def _run(scope: anyio.CancelScope, bridge: HostBridge) -> None:
        with scope:
            await Bridge([bridge]).run()


@contextlib.asynccontextmanager
async def whole_system(
    nats_url: str,
    tmp_path: Path,
    daemon: RealIncus,
    bus: BusClient,
    bridge: BridgeSwitch | None = None,
) -> AsyncIterator[Replica]:
    """A replica (verifying suspects on the daemon), a bridge and an executor."""
    eps = (IncusEndpoint(host=HOST, url=daemon.url),)
    resources = daemon.query("/1.0/resources")
    assert isinstance(resources, dict)
    cpus = int(resources["cpu"]["total"])
    assert cpus >= 2, "the host needs two CPUs for a warm pool of two"
    settings = settings_from_json(
        {"defaults": {"reserve": {"cpu": cpus - 2, "memory_mib": 0, "disk_gib": 0}}}
    )
    host = IncusHost(eps[0], request_timeout_s=5, operation_timeout_s=30)
    executor = Executor(
        ExecutorConfig(
            endpoints=eps,
            nats=ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.1),
            db=tmp_path / "executor.db",
            retry_base_s=0.1,
            retry_cap_s=1.0,
            operation_timeout_s=30.0,
        )
    )
    stop = anyio.Event()
    try:
        async with (
            running_replica(fast_config(nats_url, tmp_path / "rc.db", incus=eps)) as replica,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(executor.run, stop=stop))
            (bridge or BridgeSwitch()).attach(
                tg,
                functools.partial(
                    HostBridge,
                    incus=host,
                    js=bus.js,
                    prefix="rc",
                    settings=settings["*"],
                    inventory_delay_s=0.1,
                    backoff_s=0.1,
                ),
            )
            with anyio.fail_after(15):
                await executor.ready.wait()
            await until("the bridge brought the host in", lambda: _has_host(replica))
            yield replica
            stop.set()
            tg.cancel_scope.cancel()
    finally:
        await host.aclose()


def _has_host(replica: Replica) -> bool:
    return replica.pipeline is not None and HOST in replica.pipeline.state.hosts


def ready_warm(replica: Replica) -> int:
    assert replica.pipeline is not None
    return len(replica.pipeline.state.pool_ready.get(PoolName(POOL), ()))


async def until(what: str, check: Any, within_s: float = 40) -> None:
    with anyio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - polling state the test does not own
            await anyio.sleep(0.05)


def ready_journal(db: Path) -> list[str]:
    """The journal events that made leases ready, from the replica's store."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT event FROM journal WHERE to_state = 'ready'").fetchall()
    return [str(event) for (event,) in rows]


def containers(daemon: RealIncus) -> dict[str, dict[str, Any]]:
    return {str(i["name"]): i for i in daemon.instances()}


def describe(out_seq: int, d: dict[str, Any]) -> str:
    where = f"out seq {out_seq}, " if out_seq else ""
    return (
        f"decision {d['request_id']} {d['phase']} {d['outcome']} "
        f"({where}input_seq {d['input_seq']})"
    )


async def decisions_with_seqs(bus: BusClient) -> list[tuple[int, dict[str, Any]]]:
    return [(m.seq, m.json()) for m in await bus.outputs("rc.out.decision.>")]


async def test_a_warm_pool_of_two_reaches_ready_and_refills_after_a_claim(
    real_incus: RealIncus, nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with whole_system(nats_url, tmp_path, real_incus, bus) as replica:
        await bus.send(container_pool(min_ready=2, max_ready=2))
        await until("two warm containers ready", lambda: ready_warm(replica) == 2)
        booted = containers(real_incus)
        assert len(booted) == 2
        for inst in booted.values():
            assert inst["type"] == "container"
            assert inst["status"] == "Ready"
            assert inst["config"]["user.rc.pool"] == POOL
            assert inst["config"]["user.rc.kind"] == "warm"
        ready_events = [
            (m.seq, m.json()["event"]["metadata"]["name"])
            for m in await bus.inputs(f"rc.in.host.{HOST}.lifecycle")
            if m.json()["event"]["metadata"]["action"] == "instance-ready"
        ]
        assert sorted(n for _, n in ready_events) == sorted(booted)
        for seq, name in ready_events:
            report(f"warm: instance-ready of {name} at input seq {seq}")
        for seq, d in await decisions_with_seqs(bus):
            report(f"warm: {describe(seq, d)}")

        await bus.send(b.cmd("claim-warm", "k1", pool=POOL, job="job-1"))
        claimed = await bus.decision("k1")
        report(f"claim: {describe(0, claimed)} -> {claimed['lease']['instance']}")
        assert claimed["outcome"] == "claimed"
        name = claimed["lease"]["instance"]
        assert name in booted
        # the runner did its job: GARM deletes it; the room frees and the pool refills
        await anyio.to_thread.run_sync(lambda: real_incus.incus("delete", "--force", name))
        await until(
            "the pool refilled",
            lambda: ready_warm(replica) == 2 and name not in containers(real_incus),
        )
        after = containers(real_incus)
        assert len(after) == 2 and name not in after
        assert all(i["status"] == "Ready" for i in after.values())
        report(f"refilled: {sorted(after)} ready after {name} was claimed and deleted")


async def test_warm_containers_that_said_ready_while_the_bridge_was_down_become_ready(
    real_incus: RealIncus, nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """Incus sends no lifecycle event twice: the instance-ready events emitted while no
    bridge listened are lost, and the new bridge's first inventory, which lists the
    containers as Ready (113), makes their warm leases ready instead."""
    bus = BusClient(nc)
    bridge = BridgeSwitch()
    async with whole_system(nats_url, tmp_path, real_incus, bus, bridge) as replica:
        bridge.stop()
        await bus.send(container_pool(min_ready=2, max_ready=2))
        await until(
            "two containers the guest said ready",
            lambda: [i["status"] for i in containers(real_incus).values()] == ["Ready"] * 2,
        )
        assert ready_warm(replica) == 0  # nobody told the reconciler
        bridge.start()
        await until("two warm leases ready", lambda: ready_warm(replica) == 2)
        await until("the journal has both", lambda: len(ready_journal(tmp_path / "rc.db")) == 2)
        assert ready_journal(tmp_path / "rc.db") == ["inventory-ready"] * 2
        lifecycle = [m.json() for m in await bus.inputs(f"rc.in.host.{HOST}.lifecycle")]
        assert not any(e["event"]["metadata"]["action"] == "instance-ready" for e in lifecycle)
        report(f"ready through the inventory: {sorted(containers(real_incus))}")


async def test_a_preemption_hands_off_only_after_the_victim_container_is_gone(
    real_incus: RealIncus, nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with whole_system(nats_url, tmp_path, real_incus, bus) as replica:
        await bus.send(container_pool(min_ready=2, max_ready=2))
        await until("two warm containers ready", lambda: ready_warm(replica) == 2)
        await bus.send(b.admit("urgent", POOL, "urgent-1", preemptible=True))
        pending = await bus.decision("urgent", phase="pending")
        (victim,) = [v["instance"] for v in pending["victims"]]
        final = await bus.decision("urgent", within_s=40)
        assert final["outcome"] == "admitted" and final["lease"]["host"] == HOST
        assert victim not in containers(real_incus)  # the executor really deleted it
        # in stream order: the victim's deletion, then an inventory without it, then the gate
        events = [(m.seq, m.json()) for m in await bus.inputs(f"rc.in.host.{HOST}.>")]
        deleted = next(
            seq for seq, body in events
            if body.get("event", {}).get("metadata", {}).get("action") == "instance-deleted"
            and body["event"]["metadata"]["name"] == victim
        )  # fmt: skip
        proof = next(
            seq for seq, body in events
            if seq > deleted and "instances" in body
            and victim not in {i["name"] for i in body["instances"]}
        )  # fmt: skip
        report(
            f"preemption: pending at input seq {pending['input_seq']} (victim {victim}), "
            f"instance-deleted at {deleted}, inventory without it at {proof}, "
            f"admitted at input seq {final['input_seq']}"
        )
        for seq, d in await decisions_with_seqs(bus):
            report(f"preemption: {describe(seq, d)}")
        assert pending["input_seq"] < deleted < proof <= final["input_seq"]


async def test_the_live_verifier_sees_present_and_absent(real_incus: RealIncus) -> None:
    real_incus.launch("live-1")
    host = IncusHost(IncusEndpoint(host=HOST, url=real_incus.url), request_timeout_s=5)
    probe = IncusPresence(host)
    try:
        present = await probe.presence(name="live-1", project="default", timeout_s=5)
        absent = await probe.presence(name="live-never", project="default", timeout_s=5)
    finally:
        await host.aclose()
    assert present.present and present.status in ("Running", "Ready")
    assert not absent.present


async def test_a_suspect_lease_whose_container_is_gone_is_released_by_the_verifier(
    real_incus: RealIncus, nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with whole_system(nats_url, tmp_path, real_incus, bus) as replica:
        await bus.send(container_pool(max_ready=0))
        await bus.send(b.admit("c1", POOL, "ghost-1"))
        assert (await bus.decision("c1"))["outcome"] == "admitted"
        await bus.send(b.cmd("mark-created", "m1", instance="ghost-1"))
        assert (await bus.decision("m1"))["outcome"] == "ok"
        # any change makes the bridge publish an inventory, which lacks ghost-1
        await anyio.to_thread.run_sync(real_incus.launch, "bystander")
        observations = await bus.wait_inputs(f"rc.in.host.{HOST}.observation", within_s=30)
        body = observations[0].json()
        assert (body["instance"], body["present"]) == ("ghost-1", False)
        assert replica.pipeline is not None
        await until(
            "released",
            lambda: (
                replica.pipeline is not None
                and not any(
                    lease.instance == "ghost-1" and lease.active
                    for lease in replica.pipeline.state.leases.values()
                )
            ),
        )
