"""Incus JSON read into the domain's views, and a lease's create request written, without
a server (reconciler.incus.views)."""

from __future__ import annotations

import pytest

from reconciler.core.model import TAG_JOB, TAG_KIND, TAG_LEASE_ID, TAG_POOL, Resources
from reconciler.incus.views import InstanceSpec, host_resources, instance_view, server_info


def test_spec_request_body() -> None:
    spec = InstanceSpec.for_lease(
        name="w-1",
        image="debian/13",
        lease_id="L7",
        pool="gpu",
        kind="warm",
        job="j",
        project="ci",
        profiles=("default", "runner"),
        demand=Resources(cpu=8, memory_mib=16384, disk_gib=80),
        gpu_pci=("0000:41:00.0",),
        tags={"user.extra": "x"},
    )
    body = spec.request_body()
    assert body["source"] == {"type": "image", "alias": "debian/13"}
    assert body["type"] == "virtual-machine" and body["start"] is False
    assert body["profiles"] == ["default", "runner"]
    assert body["config"] == {
        "limits.cpu": "8",
        "limits.memory": "16384MiB",
        TAG_LEASE_ID: "L7",
        TAG_POOL: "gpu",
        TAG_KIND: "warm",
        TAG_JOB: "j",
        "user.extra": "x",
    }
    assert body["devices"] == {
        "root": {"type": "disk", "path": "/", "pool": "default", "size": "80GiB"},
        "gpu0": {"type": "gpu", "gputype": "physical", "pci": "0000:41:00.0"},
    }
    remote = InstanceSpec(name="r", image="0a1b2c3d4e5f6071", image_server="https://images")
    assert remote.request_body()["source"] == {
        "type": "image",
        "fingerprint": "0a1b2c3d4e5f6071",
        "server": "https://images",
        "protocol": "simplestreams",
        "mode": "pull",
    }
    with pytest.raises(ValueError, match=r"user\.\* config keys"):
        InstanceSpec(name="x", image="y", tags={"limits.cpu": "2"})


def test_views_tolerate_missing_fields() -> None:
    assert server_info({}).uid == ""
    empty = host_resources({})
    assert (empty.cpu, empty.memory_mib, empty.gpus) == (0, 0, ())
    gpu = host_resources(
        {
            "gpu": {
                "cards": [
                    {
                        "pci_address": "0000:01:00.0",
                        "vendor_id": "8086",
                        "product": "Arc A770",
                        "numa_node": -1,
                    }
                ]
            }
        }
    ).gpus[0]
    assert (gpu.vendor, gpu.model, gpu.numa_node, gpu.memory_mib) == ("intel", "Arc A770", 0, 0)
    view = instance_view({"name": "n", "config": {"user.a": "1", "volatile.uuid": "u"}})
    assert view.project == "default" and view.config == {"user.a": "1"}
    assert view.resources == Resources(cpu=1, memory_mib=1024, disk_gib=10)
    assert view.lease_id is None
