"""``reconciler bridge`` against the Incus simulator through real pylxd, onto a real
nats-server. :func:`bridged` also serves the verifier's test (tests/replica/test_verify.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bridge.bridge import Bridge, HostBridge, settings_from_json
from reconciler.bus.schemas import load
from reconciler.incus.client import IncusHost
from reconciler.incus.simulator import Fleet
from reconciler.incus.views import InstanceSpec
from tests.support.bus import BusClient
from tests.support.simfleet import GPU_HOST, endpoints, sim_fleet

pytestmark = pytest.mark.timeout(60)

SCHEMAS = load()


def valid(relpath: str, body: Any) -> None:
    SCHEMAS.validator(relpath).validate(body)


@contextlib.asynccontextmanager
async def bridged(
    fleet: Fleet, bus: BusClient, settings: dict[str, Any] | None = None
) -> AsyncIterator[list[HostBridge]]:
    """A bridge over every host of ``fleet`` for the block."""
    config = settings_from_json(settings or {})
    hosts = [IncusHost(ep, request_timeout_s=5, operation_timeout_s=10) for ep in endpoints(fleet)]
    bridges = [
        HostBridge(
            incus=host,
            js=bus.js,
            prefix="rc",
            settings=config.get(host.name, config["*"]),
            resync_s=60,
            inventory_delay_s=0.1,
            backoff_s=0.1,
            idle_timeout_s=3,
        )
        for host in hosts
    ]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(Bridge(bridges).run)
            yield bridges
            tg.cancel_scope.cancel()
    finally:
        for host in hosts:
            await host.aclose()


def spec(name: str, lease_id: str, **fields: Any) -> InstanceSpec:
    return InstanceSpec.for_lease(
        name=name, image="ubuntu/24.04", lease_id=lease_id, pool="web", kind="warm", **fields
    )


async def test_snapshots_inventories_and_lifecycle_events_reach_the_bus(nc: Client) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    settings = {
        "defaults": {
            "labels": {"zone": "a"},
            "reserve": {"cpu": 2, "memory_mib": 4096, "disk_gib": 50},
        },
        "hosts": {GPU_HOST: {"labels": {"gpu": "yes"}, "gpu_profile": "compute"}},
    }
    async with sim_fleet(4) as fleet, bridged(fleet, bus, settings) as bridges:
        snapshot = (await bus.wait_inputs(f"rc.in.host.{GPU_HOST}.snapshot"))[0].json()
        valid("in/host.snapshot.json", snapshot)
        shape = fleet.host(GPU_HOST).shape
        assert snapshot["capacity"] == {
            "cpu": shape.cpu,
            "memory_mib": shape.memory_mib,
            "disk_gib": shape.storage_gib,
        }
        assert snapshot["reserve"] == {"cpu": 2, "memory_mib": 4096, "disk_gib": 50}
        assert (snapshot["labels"], snapshot["gpu_profile"]) == ({"gpu": "yes"}, "compute")
        assert [g["index"] for g in snapshot["gpus"]] == [0, 1, 2, 3]
        assert {g["numa_node"] for g in snapshot["gpus"]} == {0, 1}
        plain = (await bus.wait_inputs("rc.in.host.host-01.snapshot"))[0].json()
        assert plain["labels"] == {"zone": "a"} and plain["gpus"] == []
        assert plain["uid"] != snapshot["uid"]
        assert (await bus.wait_inputs("rc.in.host.host-01.inventory"))[0].json()["instances"] == []

        incus = bridges[0].incus
        await incus.create_instance(spec("vm-1", "L9", project="ci"))
        await incus.start_instance("vm-1", project="ci")
        events = await bus.wait_inputs("rc.in.host.host-01.lifecycle", 3)
        actions = [e.json()["event"]["metadata"]["action"] for e in events]
        # the simulator plays Incus 6.0 LTS: no instance-agent-started
        assert actions[:3] == ["instance-created", "instance-started", "instance-ready"]
        for e in events:
            valid("in/host.lifecycle.json", e.json())
            assert e.msg_id is not None and e.msg_id.startswith("lifecycle:")
        inventories = await bus.wait_inputs("rc.in.host.host-01.inventory", 2)
        last = inventories[-1].json()
        valid("in/host.inventory.json", last)
        (vm,) = last["instances"]
        assert (vm["name"], vm["project"], vm["config"]["user.rc.lease-id"]) == ("vm-1", "ci", "L9")
        revisions = [i.json()["revision"] for i in inventories]
        assert revisions == sorted(set(revisions))


async def test_a_lost_event_stream_reconnects_and_publishes_a_fresh_inventory(
    nc: Client,
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with sim_fleet(1) as fleet, bridged(fleet, bus) as (bridge,):
        await bus.wait_inputs("rc.in.host.host-01.inventory")
        await bridge.incus.create_instance(spec("vm-1", "L1"))
        await bus.wait_inputs("rc.in.host.host-01.inventory", 2)
        # the stream breaks, and while it is down the VM disappears without an event
        dropped = await fleet.host("host-01").drop_event_streams()
        assert dropped == 1
        fleet.host("host-01").remove_instance("vm-1", silent=True)
        with anyio.fail_after(10):
            while bridge.connections < 2:  # noqa: ASYNC110 - a counter
                await anyio.sleep(0.02)
        inventories = await bus.wait_inputs("rc.in.host.host-01.inventory", 3)
        assert inventories[-1].json()["instances"] == []  # what was missed is not missed


async def test_revisions_keep_growing_across_a_bridge_restart(nc: Client) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with sim_fleet(1) as fleet:
        async with bridged(fleet, bus):
            first = (await bus.wait_inputs("rc.in.host.host-01.inventory"))[0].json()["revision"]
        # a second bridge whose clock went backwards still continues from the stream
        host = IncusHost(endpoints(fleet)[0])
        try:
            again = HostBridge(
                incus=host, js=bus.js, prefix="rc", settings=settings_from_json({})["*"],
                clock=lambda: 0.0,
            )  # fmt: skip
            async with anyio.create_task_group() as tg:
                tg.start_soon(again.run)
                found = await bus.wait_inputs("rc.in.host.host-01.inventory", 2)
                tg.cancel_scope.cancel()
        finally:
            await host.aclose()
    assert found[-1].json()["revision"] == first + 1
