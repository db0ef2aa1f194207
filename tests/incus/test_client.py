"""The pylxd adapter against the simulator: every call, its idempotency and its errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from reconciler.core.model import TAG_JOB, TAG_KIND, TAG_LEASE_ID, TAG_POOL, Resources
from reconciler.incus.client import IncusEndpoint, IncusHost, endpoints_from_fleet_file
from reconciler.incus.errors import (
    EventStreamLost,
    IncusUnavailable,
    InstanceExists,
    InstanceRunning,
    NotFound,
    OperationFailed,
    OperationTimedOut,
)
from reconciler.incus.events import LifecycleStream
from reconciler.incus.simulator import Fleet, FleetOptions, GpuShape
from reconciler.incus.views import InstanceSpec
from tests.incus.conftest import CPU_HOST, GPU_HOST, make_fleet


@pytest.fixture(params=["6.0", "7"])
def incus_version(request: pytest.FixtureRequest) -> str:
    """Every adapter test against the simulator playing Incus 6.0 LTS and 7.x."""
    return str(request.param)


GPUS = ("0000:41:00.0", "0000:61:00.0", "0000:81:00.0", "0000:a1:00.0")


def lease_spec(name: str = "vm-1", *, lease: str = "L1", **fields: Any) -> InstanceSpec:
    fields.setdefault("project", "ci")
    fields.setdefault("demand", Resources(cpu=4, memory_mib=8192, disk_gib=40))
    return InstanceSpec.for_lease(
        name=name, image="debian/13", lease_id=lease, pool="gpu", kind="warm", **fields
    )


async def next_action(events: LifecycleStream, *, timeout_s: float = 2.0) -> str:
    with anyio.fail_after(timeout_s):
        event = await events.__anext__()
    return str(event["metadata"]["action"])


async def test_server_info_is_the_hosts_stable_identity(fleet: Fleet, gpu_host: IncusHost) -> None:
    info = await gpu_host.server_info()
    assert info.server_name == GPU_HOST
    assert info.uid == fleet.host(GPU_HOST).tls.fingerprint
    assert len(info.uid) == 64
    assert {"resources", "projects", "instances"} <= info.api_extensions


async def test_resources_index_gpus_by_pci_address(fleet: Fleet, gpu_host: IncusHost) -> None:
    found = await gpu_host.resources()
    assert (found.cpu, found.memory_mib) == (64, 524288)
    assert [g.pci_address for g in found.gpus] == list(GPUS)
    assert [g.index for g in found.gpus] == [0, 1, 2, 3]
    assert [g.numa_node for g in found.gpus] == [0, 0, 1, 1]
    assert {(g.vendor, g.model, g.memory_mib) for g in found.gpus} == {
        ("nvidia", "NVIDIA L40S", 46068)
    }


async def test_gpu_order_and_memory_table_do_not_depend_on_incus_order(fleet: Fleet) -> None:
    fleet.host(CPU_HOST).set_resources(
        gpus=[
            GpuShape(
                pci_address="0000:c1:00.0",
                vendor="amd",
                model="MI210",
                product="MI210",
                product_id="740f",
                numa_node=1,
            ),
            GpuShape(pci_address="0000:01:00.0", model="Tesla T4", product="TU104GL [Tesla T4]"),
        ]
    )
    host = IncusHost(
        IncusEndpoint(host=CPU_HOST, url=fleet.endpoints[CPU_HOST]),
        gpu_memory_mib={"Tesla T4": 15360},
    )
    try:
        gpus = (await host.resources()).gpus
    finally:
        await host.aclose()
    assert [(g.index, g.pci_address, g.vendor, g.model, g.memory_mib) for g in gpus] == [
        (0, "0000:01:00.0", "nvidia", "Tesla T4", 15360),
        (1, "0000:c1:00.0", "amd", "MI210", 0),  # Incus reports no GPU memory
    ]


async def test_storage_total_is_the_pools_space(gpu_host: IncusHost) -> None:
    assert await gpu_host.storage_total_gib("default") == 4096
    with pytest.raises(NotFound, match="Storage pool not found"):
        await gpu_host.storage_total_gib("nope")


async def test_create_is_idempotent_for_the_same_lease(fleet: Fleet, gpu_host: IncusHost) -> None:
    spec = lease_spec(gpu_pci=GPUS[:2], job="job-7")
    first = await gpu_host.create_instance(spec)
    again = await gpu_host.create_instance(spec)
    assert first == again
    assert first.status == "Stopped" and first.status_code == 102
    assert first.project == "ci" and first.type == "virtual-machine"
    assert first.resources == Resources(cpu=4, memory_mib=8192, disk_gib=40)
    assert first.gpus == GPUS[:2]
    assert first.config == {TAG_LEASE_ID: "L1", TAG_POOL: "gpu", TAG_KIND: "warm", TAG_JOB: "job-7"}
    assert len(fleet.host(GPU_HOST).instances) == 1


async def test_create_refuses_a_name_held_by_another_lease(gpu_host: IncusHost) -> None:
    await gpu_host.create_instance(lease_spec(lease="L1"))
    with pytest.raises(InstanceExists, match="exists with lease 'L1', not 'L2'"):
        await gpu_host.create_instance(lease_spec(lease="L2"))


async def test_create_failure_is_an_operation_failure(fleet: Fleet, gpu_host: IncusHost) -> None:
    fleet.host(GPU_HOST).fail_next("create", message="no space left on device")
    with pytest.raises(OperationFailed) as failure:
        await gpu_host.create_instance(lease_spec())
    assert failure.value.err == "Failed creating instance from image: no space left on device"
    assert await gpu_host.get_instance("vm-1", project="ci") is None


async def test_start_and_stop_are_idempotent(gpu_host: IncusHost) -> None:
    await gpu_host.create_instance(lease_spec())
    await gpu_host.start_instance("vm-1", project="ci")
    await gpu_host.start_instance("vm-1", project="ci")  # already running: fine
    view = await gpu_host.get_instance("vm-1", project="ci")
    assert view is not None and view.status_code in (103, 113)
    await gpu_host.stop_instance("vm-1", project="ci")
    await gpu_host.stop_instance("vm-1", project="ci")  # already stopped: fine
    await gpu_host.stop_instance("ghost", project="ci")  # missing: fine
    view = await gpu_host.get_instance("vm-1", project="ci")
    assert view is not None and view.status == "Stopped"


async def test_start_failure_leaves_the_vm_stopped(fleet: Fleet, gpu_host: IncusHost) -> None:
    await gpu_host.create_instance(lease_spec())
    fleet.host(GPU_HOST).fail_next("start", name="vm-1")
    with pytest.raises(OperationFailed, match="Failed to start instance: simulated failure"):
        await gpu_host.start_instance("vm-1", project="ci")
    view = await gpu_host.get_instance("vm-1", project="ci")
    assert view is not None and view.status == "Stopped"
    await gpu_host.start_instance("vm-1", project="ci")  # one-shot: the next start works


async def test_a_gpu_in_use_cannot_be_started_twice(gpu_host: IncusHost) -> None:
    await gpu_host.create_instance(lease_spec("vm-1", gpu_pci=GPUS[:1]))
    await gpu_host.create_instance(lease_spec("vm-2", lease="L2", gpu_pci=GPUS[:1]))
    await gpu_host.start_instance("vm-1", project="ci")
    with pytest.raises(OperationFailed, match=re.escape('GPU "0000:41:00.0" is in use by "vm-1"')):
        await gpu_host.start_instance("vm-2", project="ci")


async def test_delete_refuses_a_running_vm_and_tolerates_a_missing_one(gpu_host: IncusHost) -> None:
    await gpu_host.create_instance(lease_spec())
    await gpu_host.start_instance("vm-1", project="ci")
    with pytest.raises(InstanceRunning, match="Instance is running") as refused:
        await gpu_host.delete_instance("vm-1", project="ci")
    assert refused.value.status == 400
    await gpu_host.destroy_instance("vm-1", project="ci")
    assert await gpu_host.get_instance("vm-1", project="ci") is None
    await gpu_host.delete_instance("vm-1", project="ci")
    await gpu_host.destroy_instance("vm-1", project="ci")


async def test_list_instances_covers_every_project(fleet: Fleet, gpu_host: IncusHost) -> None:
    sim = fleet.host(GPU_HOST)
    sim.add_instance(
        "foreign",
        status="Running",
        config={"limits.cpu": "0-3,8", "limits.memory": "25%"},
        devices={
            "root": {"type": "disk", "path": "/", "pool": "default", "size": "1500MiB"},
            "gpu": {"type": "gpu", "pci": GPUS[3]},
        },
    )
    sim.add_instance("plain", project="ci", status="Stopped")
    await gpu_host.resources()  # learns the host's memory for percentages
    views = await gpu_host.list_instances()
    assert [(v.project, v.name, v.status, v.status_code) for v in views] == [
        ("ci", "plain", "Stopped", 102),
        ("default", "foreign", "Running", 103),
    ]
    plain, foreign = views
    assert plain.resources == Resources(cpu=1, memory_mib=1024, disk_gib=10)  # VM defaults
    assert foreign.resources == Resources(cpu=5, memory_mib=131072, disk_gib=2)
    assert foreign.gpus == (GPUS[3],) and foreign.config == {}
    assert foreign.as_inventory()["resources"] == {"cpu": 5, "memory_mib": 131072, "disk_gib": 2}


async def test_get_instance_raises_for_other_errors(gpu_host: IncusHost) -> None:
    assert await gpu_host.get_instance("nope", project="ci") is None
    with pytest.raises(NotFound, match="Project not found"):
        await gpu_host.get_instance("nope", project="no-such-project")


async def test_an_unreachable_host_is_unavailable(socket_dir: Path) -> None:
    host = IncusHost(IncusEndpoint(host="gone", url="http://127.0.0.1:9"), request_timeout_s=1)
    with pytest.raises(IncusUnavailable, match="gone: "):
        await host.server_info()
    await host.aclose()


async def test_a_slow_operation_times_out(socket_dir: Path) -> None:
    async with make_fleet(socket_dir, options=FleetOptions(action_delay_s=3.0)) as slow:
        host = IncusHost(
            IncusEndpoint(host=CPU_HOST, url=slow.endpoints[CPU_HOST]), operation_timeout_s=0.5
        )
        with pytest.raises(OperationTimedOut, match=r"still running after 0\.5 s"):
            await host.create_instance(lease_spec())
        await host.aclose()


async def test_endpoints_from_the_fleet_file(fleet: Fleet, socket_dir: Path) -> None:
    endpoints = endpoints_from_fleet_file(socket_dir / "fleet.json")
    assert {e.host: e.url for e in endpoints} == fleet.endpoints


async def test_lifecycle_events_of_every_project_verbatim(
    fleet: Fleet, gpu_host: IncusHost
) -> None:
    async with gpu_host.lifecycle_events() as events:
        await gpu_host.create_instance(lease_spec("vm-1"))
        fleet.host(GPU_HOST).add_instance("other", status="Stopped", silent=False)
        assert await next_action(events) == "instance-created"
        with anyio.fail_after(2):
            event = await events.__anext__()
    assert event["metadata"] == {
        "action": "instance-created",
        "source": "/1.0/instances/other",
        "name": "other",
        "project": "default",
    }
    assert event["project"] == "default" and event["location"] == "none"


async def test_boot_events_follow_start_after_the_boot_delay(
    gpu_host: IncusHost, incus_version: str
) -> None:
    async with gpu_host.lifecycle_events() as events:
        await gpu_host.create_instance(lease_spec())
        await gpu_host.start_instance("vm-1", project="ci")
        actions = [await next_action(events) for _ in range(4 if incus_version == "7" else 3)]
        await gpu_host.stop_instance("vm-1", project="ci")
        assert await next_action(events) == "instance-stopped"
    agent = ["instance-agent-started"] if incus_version == "7" else []  # none on 6.0
    assert actions == ["instance-created", "instance-started", *agent, "instance-ready"]


async def test_a_dropped_stream_raises_and_a_new_one_works(
    fleet: Fleet, gpu_host: IncusHost
) -> None:
    sim = fleet.host(GPU_HOST)
    async with gpu_host.lifecycle_events() as events:
        await sim.drop_event_streams()
        with pytest.raises(EventStreamLost, match="closed by the server"), anyio.fail_after(2):
            await events.__anext__()
    async with gpu_host.lifecycle_events() as events:
        sim.add_instance("after", status="Stopped", silent=False)
        assert await next_action(events) == "instance-created"


async def test_a_silent_stream_is_lost_after_the_idle_timeout(socket_dir: Path) -> None:
    async with make_fleet(socket_dir, options=FleetOptions(ping_interval_s=30)) as quiet:
        host = IncusHost(IncusEndpoint(host=CPU_HOST, url=quiet.endpoints[CPU_HOST]))
        async with host.lifecycle_events(idle_timeout_s=0.3) as events:
            with pytest.raises(EventStreamLost, match="no frame for"), anyio.fail_after(3):
                await events.__anext__()
        await host.aclose()


async def test_pings_keep_an_idle_stream_alive(gpu_host: IncusHost) -> None:
    async with gpu_host.lifecycle_events(idle_timeout_s=0.5) as events:
        with anyio.move_on_after(1.2) as waited:
            await events.__anext__()
        assert waited.cancelled_caught  # pings every 0.2 s kept it open, no event came


async def test_events_of_an_unreachable_host_are_unavailable() -> None:
    host = IncusHost(IncusEndpoint(host="gone", url="http://127.0.0.1:9"), request_timeout_s=1)
    with pytest.raises(IncusUnavailable):
        async with host.lifecycle_events():
            pass
    await host.aclose()
