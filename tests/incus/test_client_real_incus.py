"""The Incus adapter (reconciler.incus.client) against the real Incus 6.0 daemon.

Real pylxd, real incusd (tests/support/realincus.py), containers of the busybox test
image. What the simulator cannot prove: Incus 6.0 accepts a create it cannot do with 202
and fails only its operation (whose ``wait`` answers HTTP 200 with an error envelope),
which the executor must treat as permanent (``test_executor_real_incus.py`` in
``tests/executor/``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from reconciler.core.model import TAG_KIND, TAG_POOL, Resources
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import (
    ImageNotFound,
    ImageTypeMismatch,
    InstanceExists,
    InstanceRunning,
)
from reconciler.incus.views import InstanceSpec
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


def container(name: str, *, lease: str = "L1", image: str = "busybox", **kw: Any) -> InstanceSpec:
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
