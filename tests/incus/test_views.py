"""Incus notations and JSON read into the domain's units, without a server."""

from __future__ import annotations

import pytest

from reconciler.core.model import TAG_JOB, TAG_KIND, TAG_LEASE_ID, TAG_POOL, Resources
from reconciler.incus import units
from reconciler.incus.views import InstanceSpec, host_resources, instance_view, server_info


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1024**3),
        ("40GiB", 40 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5GiB", 3 * 512 * 1024**2),
        ("2kB", 2000),
        ("7B", 7),
        (" 3 TiB ", 3 * 1024**4),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert units.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "1.2.3MB"])
def test_parse_bytes_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        units.parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, 1), ("", 1), ("4", 4), ("0-3", 4), ("0-3,8,10-11", 7), ("1,1", 1)],
)
def test_cpu_count(text: str | None, expected: int) -> None:
    assert units.cpu_count(text) == expected


@pytest.mark.parametrize("text", ["3-1", "a", "1,,2"])
def test_cpu_count_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid limits\.cpu"):
        units.cpu_count(text)


def test_memory_and_rounding() -> None:
    assert units.memory_mib(None) == 1024
    assert units.memory_mib("8GiB") == 8192
    assert units.memory_mib("1500kB") == 2  # rounds up: a demand never under-books
    assert units.memory_mib("25%", host_memory_mib=4000) == 1000
    assert units.bytes_to_gib(units.GIB + 1) == 2


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
