"""The whole loop on a simulated Incus fleet: ``reconciler run``, ``bridge`` and ``executor``
over a real nats-server and real pylxd. Warm pools fill and refill; a preemption hands
off only after the executor deleted the victim and a fresh inventory proved the room."""

from __future__ import annotations

import contextlib
import functools
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
from reconciler.incus.simulator import Fleet
from reconciler.incus.simulator.wire import StatusCode
from reconciler.replica.replica import Replica
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.simfleet import endpoints, sim_fleet

pytestmark = pytest.mark.timeout(90)

POOL = "web"


def whole_system(
    nats_url: str, tmp_path: Path, fleet: Fleet, bus: BusClient
) -> contextlib.AbstractAsyncContextManager[Replica]:
    """A replica (verifying suspects on the fleet), a bridge and an executor."""
    return system_on(nats_url, tmp_path, endpoints(fleet), bus)


@contextlib.asynccontextmanager
async def system_on(
    nats_url: str,
    tmp_path: Path,
    eps: tuple[IncusEndpoint, ...],
    bus: BusClient,
    **replica_config: Any,
) -> AsyncIterator[Replica]:
    """A replica, a bridge and an executor on the Incus hosts ``eps``; ``replica_config``
    overrides :func:`~tests.support.bus.fast_config`'s settings."""
    settings = settings_from_json(
        {"defaults": {"reserve": {"cpu": 0, "memory_mib": 0, "disk_gib": 0}}}
    )
    hosts = [IncusHost(ep, request_timeout_s=5, operation_timeout_s=10) for ep in eps]
    executor = Executor(
        ExecutorConfig(
            endpoints=eps,
            nats=ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.1),
            db=tmp_path / "executor.db",
            retry_base_s=0.1,
            retry_cap_s=1.0,
        )
    )
    stop = anyio.Event()
    try:
        async with (
            running_replica(
                fast_config(nats_url, tmp_path / "rc.db", incus=eps, **replica_config)
            ) as replica,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(executor.run, stop=stop))
            bridge = Bridge(
                [
                    HostBridge(
                        incus=host, js=bus.js, prefix="rc", settings=settings["*"],
                        inventory_delay_s=0.1, backoff_s=0.1,
                    )
                    for host in hosts
                ]
            )  # fmt: skip
            tg.start_soon(bridge.run)
            with anyio.fail_after(10):
                await executor.ready.wait()
            yield replica
            stop.set()
            tg.cancel_scope.cancel()
    finally:
        for host in hosts:
            await host.aclose()


def ready_warm(replica: Replica) -> int:
    assert replica.pipeline is not None
    return len(replica.pipeline.state.pool_ready.get(PoolName(POOL), ()))


async def until(what: str, check: Any, within_s: float = 20) -> None:
    with anyio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - polling state the test does not own
            await anyio.sleep(0.05)


def vms(fleet: Fleet, host: str = "host-01") -> dict[str, Any]:
    return {name: inst for (_, name), inst in fleet.host(host).instances.items()}


async def test_a_warm_pool_fills_to_min_ready_and_refills_after_claims(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with sim_fleet(1) as fleet, whole_system(nats_url, tmp_path, fleet, bus) as replica:
        await bus.send(b.pool(POOL, cpu=2, memory_mib=4096, disk_gib=20, min_ready=2, max_ready=3))
        await until("two warm VMs ready", lambda: ready_warm(replica) == 2)
        booted = vms(fleet)
        assert len(booted) == 2
        for inst in booted.values():
            assert inst.config["user.rc.pool"] == POOL and inst.config["user.rc.kind"] == "warm"
            assert inst.agent_running and inst.status in (StatusCode.RUNNING, StatusCode.READY)
        await bus.send(b.cmd("claim-warm", "k1", pool=POOL, job="job-1"))
        claimed = (await bus.decision("k1"))["lease"]["instance"]
        assert claimed in booted
        await until("the pool refilled", lambda: ready_warm(replica) == 2 and len(vms(fleet)) == 3)
        await bus.send(b.cmd("claim-warm", "k2", pool=POOL, job="job-2"))
        await bus.decision("k2")
        await until("refilled again", lambda: ready_warm(replica) == 2 and len(vms(fleet)) == 4)


async def test_a_preemption_hands_off_only_after_the_victim_is_gone(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with sim_fleet(1) as fleet, whole_system(nats_url, tmp_path, fleet, bus) as replica:
        # host-01 has 32 vCPUs: two warm VMs of 10 and one cold job of 10 leave 2 free
        await bus.send(b.pool(POOL, cpu=10, memory_mib=8192, disk_gib=20, min_ready=2, max_ready=2))
        await until("two warm VMs ready", lambda: ready_warm(replica) == 2)
        await bus.send(b.admit("c1", POOL, "cold-1"))
        assert (await bus.decision("c1"))["outcome"] == "admitted"
        await bus.send(b.admit("urgent", POOL, "urgent-1", preemptible=True))
        pending = await bus.decision("urgent", phase="pending")
        (victim,) = [v["instance"] for v in pending["victims"]]
        final = await bus.decision("urgent", within_s=30)
        assert final["outcome"] == "admitted" and final["lease"]["host"] == "host-01"
        assert victim not in vms(fleet)  # the executor really deleted it
        # in stream order: the victim's deletion, then an inventory without it, then the gate
        events = [(m.seq, m.json()) for m in await bus.inputs("rc.in.host.host-01.>")]
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
        assert deleted < proof <= final["input_seq"]
        assert pending["input_seq"] < deleted
