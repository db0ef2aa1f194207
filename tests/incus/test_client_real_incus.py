"""The Incus adapter and ``reconciler executor`` against the real Incus 6.0 daemon.

Real pylxd, real incusd (tests/support/realincus.py), containers of the busybox test image, a
real nats-server. What the simulator cannot prove: Incus 6.0 accepts a create it cannot
do with 202 and fails only its operation (whose ``wait`` answers HTTP 200 with an error
envelope), and such a refusal must be permanent, never retried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from reconciler.bus.streams import ensure_streams
from reconciler.core.model import TAG_KIND, TAG_LEASE_ID, TAG_POOL, Resources
from reconciler.executor.executor import ExecutorConfig
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import (
    ImageNotFound,
    ImageTypeMismatch,
    InstanceExists,
    InstanceRunning,
)
from reconciler.incus.views import InstanceSpec
from tests.support.executor import (
    NAMES,
    create_cmd,
    delete_cmd,
    fast_config,
    publish,
    running_executor,
    settled,
)
from tests.support.realincus import RealIncus

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(60)]

HOST = "real-01"
SMALL = Resources(cpu=1, memory_mib=128, disk_gib=1)


@pytest.fixture
async def host(real_incus: RealIncus) -> AsyncIterator[IncusHost]:
    adapter = IncusHost(IncusEndpoint(host=HOST, url=real_incus.url), request_timeout_s=10)
    try:
        yield adapter
    finally:
        await adapter.aclose()


def container(
    name: str, *, lease: str = "L1", image: str = "busybox", **kw: object
) -> InstanceSpec:
    return InstanceSpec.for_lease(
        name=name,
        image=image,
        lease_id=lease,
        pool="small",
        kind="warm",
        demand=SMALL,
        instance_type=kw.pop("instance_type", "container"),
        **kw,
    )


# --------------------------------------------------------------------------- adapter


async def test_create_makes_a_tagged_limited_container(host: IncusHost) -> None:
    view = await host.create_instance(container("ad-create", lease="L7"))

    assert view.type == "container"
    assert view.lease_id == "L7"
    assert view.config[TAG_POOL] == "small"
    assert view.config[TAG_KIND] == "warm"
    assert (view.resources.cpu, view.resources.memory_mib) == (1, 128)
    await host.start_instance("ad-create")
    await host.start_instance("ad-create")  # already running: success
    again = await host.get_instance("ad-create")
    assert again is not None and again.status in ("Running", "Ready")


async def test_creating_the_same_lease_twice_is_idempotent(host: IncusHost) -> None:
    first = await host.create_instance(container("ad-twice", lease="L8"))

    second = await host.create_instance(container("ad-twice", lease="L8"))

    assert (second.name, second.lease_id) == (first.name, "L8")


async def test_a_duplicate_name_of_another_lease_is_refused(host: IncusHost) -> None:
    await host.create_instance(container("ad-dup", lease="L9"))

    with pytest.raises(InstanceExists, match="L9"):
        await host.create_instance(container("ad-dup", lease="L10"))


async def test_a_container_image_as_a_vm_is_refused_inside_the_operation(host: IncusHost) -> None:
    with pytest.raises(ImageTypeMismatch, match="doesn't match instance type"):
        await host.create_instance(container("ad-vm", instance_type="virtual-machine"))
    assert await host.get_instance("ad-vm") is None


async def test_a_missing_image_is_refused_inside_the_operation(host: IncusHost) -> None:
    with pytest.raises(ImageNotFound):
        await host.create_instance(container("ad-noimage", image="no-such-image"))
    assert await host.get_instance("ad-noimage") is None


async def test_delete_of_running_stopped_and_absent(host: IncusHost) -> None:
    await host.create_instance(container("ad-del-run"))
    await host.start_instance("ad-del-run")
    with pytest.raises(InstanceRunning):
        await host.delete_instance("ad-del-run")

    await host.destroy_instance("ad-del-run")  # forced stop, then delete
    await host.create_instance(container("ad-del-stopped"))
    await host.destroy_instance("ad-del-stopped")
    await host.destroy_instance("ad-never-was")

    assert [v.name for v in await host.list_instances()] == []


async def test_live_get_sees_present_and_absent(host: IncusHost) -> None:
    await host.create_instance(container("ad-live"))

    present = await host.get_instance("ad-live", timeout_s=5)
    absent = await host.get_instance("ad-not-there", timeout_s=5)

    assert present is not None and present.status == "Stopped"
    assert absent is None


async def test_resources_and_identity_of_the_real_host(host: IncusHost) -> None:
    info = await host.server_info()
    found = await host.resources()

    assert info.server_version.startswith("6.")
    assert len(info.uid) == 64
    assert found.cpu >= 1
    assert found.memory_mib > 0


# -------------------------------------------------------------------------- executor


@pytest.fixture
async def bus(nc: Client) -> Client:
    await ensure_streams(nc.jetstream(), NAMES)
    return nc


def _config(nats_url: str, tmp_path: Path, real_incus: RealIncus) -> ExecutorConfig:
    endpoints = (IncusEndpoint(host=HOST, url=real_incus.url),)
    return fast_config(nats_url, tmp_path / "executor.db", endpoints, operation_timeout_s=30.0)


async def test_the_executor_creates_and_deletes_containers(
    real_incus: RealIncus, bus: Client, nats_url: str, tmp_path: Path
) -> None:
    create = create_cmd(
        HOST,
        "ex-warm-1",
        "L20",
        project="default",
        image="busybox",
        cpu=1,
        memory_mib=128,
        disk_gib=1,
        instance_type="container",
    )
    config = _config(nats_url, tmp_path, real_incus)
    async with running_executor(config) as running:
        await publish(bus, create)
        record = await running.record("create:L20", within_s=30)
        assert (record.outcome, record.attempts) == ("created", 1)
        made = real_incus.query("/1.0/instances/ex-warm-1")
        assert isinstance(made, dict)
        assert made["type"] == "container"
        assert made["status"] in ("Running", "Ready")
        assert made["config"][TAG_LEASE_ID] == "L20"
        assert made["config"]["limits.cpu"] == "1"
        assert made["config"]["limits.memory"] == "128MiB"

        real_incus.incus("init", "busybox", "ex-stopped")
        await publish(bus, delete_cmd(HOST, "ex-warm-1", "L20", project="default"))
        await publish(bus, delete_cmd(HOST, "ex-stopped", "L21", project="default"))
        await publish(bus, delete_cmd(HOST, "ex-absent", "L22", project="default"))
        running_deleted = await running.record("delete:L20:drained", within_s=30)
        stopped_deleted = await running.record("delete:L21:drained", within_s=30)
        absent = await running.record("delete:L22:drained", within_s=30)
        await settled(bus, HOST)
    assert running_deleted.outcome == "deleted"
    assert stopped_deleted.outcome == "deleted"
    assert absent.outcome == "absent"
    assert real_incus.instances() == []


async def test_the_executor_never_retries_a_create_incus_refused(
    real_incus: RealIncus, bus: Client, nats_url: str, tmp_path: Path
) -> None:
    as_vm = create_cmd(HOST, "ex-vm", "L30", project="default", image="busybox")
    no_image = create_cmd(
        HOST, "ex-noimg", "L31", project="default", image="nope", instance_type="container"
    )
    config = _config(nats_url, tmp_path, real_incus)
    async with running_executor(config) as running:
        await publish(bus, as_vm)
        await publish(bus, no_image)
        vm = await running.record("create:L30", within_s=30)
        missing = await running.record("create:L31", within_s=30)
        await settled(bus, HOST)
        assert running.executor.stats["retry"] == 0
    assert (vm.outcome, vm.attempts) == ("rejected", 1)
    assert "doesn't match instance type" in vm.detail
    assert (missing.outcome, missing.attempts) == ("rejected", 1)
    assert "Image not provided" in missing.detail
    assert real_incus.instances() == []
