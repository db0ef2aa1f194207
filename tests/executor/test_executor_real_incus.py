"""``reconciler executor`` against the real Incus 6.0 daemon: containers of the busybox
test image created and deleted, and a create Incus refused inside its operation never
retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from reconciler.bus.streams import ensure_streams
from reconciler.core.model import TAG_LEASE_ID
from reconciler.executor.executor import ExecutorConfig
from reconciler.incus.client import IncusEndpoint
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
