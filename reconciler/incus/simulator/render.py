"""Rendering a simulated host as Incus's API objects (the ``metadata`` of sync answers).

Rules:

- Field names and nesting are those of Incus's API structs (``shared/api``), checked
  against ``rest-api.yaml`` by the comparison tests. Fields that Go marks ``omitempty``
  are left out when empty, as Incus leaves them out (``restore``, ``disk_only``,
  ``nvidia``, ``drm``, ``os_info``…); every other field is present, even if empty.
- Numbers are what a real host of that shape would plausibly report; they are derived
  only from the shape and the instances, so two renderings of one state are equal.
- Nothing here changes state.
"""

from __future__ import annotations

from typing import Any

from reconciler.incus import units
from reconciler.incus.simulator.host import Profile, SimHost, SimInstance
from reconciler.incus.simulator.shapes import DRIVERS, VENDOR_IDS, VENDOR_NAMES, GpuShape
from reconciler.incus.simulator.versions import LATEST

__all__ = [
    "API_EXTENSIONS",
    "SERVER_VERSION",
    "instance",
    "instance_full",
    "instance_state",
    "profile",
    "project",
    "resources",
    "server",
    "storage_pool",
    "storage_pool_resources",
]

SERVER_VERSION = LATEST  # the newest version played; a host reports its own
#: a subset of Incus's API extensions: everything pylxd and GARM's provider test for
API_EXTENSIONS = (
    "storage",
    "resources",
    "resources_cpu_socket",
    "resources_gpu",
    "resources_numa",
    "resources_v2",
    "resources_system",
    "projects",
    "projects_limits",
    "instances",
    "instance_all_projects",
    "event_lifecycle",
    "event_lifecycle_requestor",
    "event_location",
    "event_project",
    "operation_description",
    "gpu_devices",
    "instance_ready_state",
)


def server(host: SimHost, *, project: str, requestor: dict[str, str]) -> dict[str, Any]:
    """``GET /1.0`` for a trusted client."""
    tls = host.tls
    return {
        "api_extensions": list(API_EXTENSIONS),
        "api_status": "stable",
        "api_version": "1.0",
        "auth": "trusted",
        "auth_methods": ["tls"],
        "auth_user_method": requestor["protocol"],
        "auth_user_name": requestor["username"],
        "config": {},
        "environment": {
            "addresses": [],
            "architectures": [host.shape.architecture],
            "certificate": tls.certificate_pem,
            "certificate_fingerprint": tls.fingerprint,
            "driver": "qemu",
            "driver_version": "9.0.2",
            "firewall": "nftables",
            "kernel": "Linux",
            "kernel_architecture": host.shape.architecture,
            "kernel_features": {"seccomp_listener": "true", "uevent_injection": "true"},
            "kernel_version": "6.12.0",
            "lxc_features": {},
            "os_name": "Debian GNU/Linux",
            "os_version": "13",
            "project": project,
            "server": "incus",
            "server_clustered": False,
            "server_event_mode": "full-mesh",
            "server_name": host.name,
            "server_pid": 1,
            "server_version": host.version.server_version,
            "storage": "zfs",
            # ServerStorageDriverInfo has no JSON tags in Incus: Go's field names are the keys
            "storage_supported_drivers": [
                {"Name": "zfs", "Version": "2.2.7", "Remote": False},
                {"Name": "dir", "Version": "1", "Remote": False},
            ],
            "storage_version": "2.2.7",
        },
        "public": False,
    }


def _gpu_card(gpu: GpuShape, index: int) -> dict[str, Any]:
    driver, driver_version = DRIVERS[gpu.vendor]
    card: dict[str, Any] = {
        "driver": driver,
        "driver_version": driver_version,
        "drm": {
            "id": index,
            "card_name": f"card{index}",
            "card_device": f"226:{index}",
            "control_name": f"controlD{64 + index}",
            "control_device": f"226:{64 + index}",
            "render_name": f"renderD{128 + index}",
            "render_device": f"226:{128 + index}",
        },
        "numa_node": gpu.numa_node,
        "pci_address": gpu.pci_address,
        "vendor": VENDOR_NAMES[gpu.vendor],
        "vendor_id": VENDOR_IDS[gpu.vendor],
        "product": gpu.product,
        "product_id": gpu.product_id,
    }
    if gpu.vendor == "nvidia":
        card["nvidia"] = {
            "cuda_version": "12.4",
            "nvrm_version": driver_version,
            "brand": "Nvidia",
            "model": gpu.model,
            "uuid": f"GPU-{gpu.pci_address.replace(':', '').replace('.', '')}-sim",
            "architecture": "8.9",
            "card_name": f"nvidia{index}",
            "card_device": f"195:{index}",
        }
    return card


def _cpu(host: SimHost) -> dict[str, Any]:
    shape = host.shape
    sockets = []
    per_socket = -(-shape.cpu // shape.numa_nodes)
    thread_id = 0
    for socket in range(shape.numa_nodes):
        count = min(per_socket, shape.cpu - thread_id)
        cores = []
        for core in range(count):
            cores.append(
                {
                    "core": core,
                    "cluster": 0,
                    "die": 0,
                    "threads": [
                        {
                            "id": thread_id,
                            "numa_node": socket,
                            "thread": 0,
                            "online": True,
                            "isolated": False,
                        }
                    ],
                    "frequency": 3000,
                }
            )
            thread_id += 1
        sockets.append(
            {
                "name": "Simulated CPU",
                "vendor": "GenuineIntel",
                "socket": socket,
                "cache": [{"level": 1, "type": "Data", "size": 49152}],
                "cores": cores,
                "frequency": 3000,
                "frequency_minimum": 800,
                "frequency_turbo": 4000,
            }
        )
    return {"architecture": shape.architecture, "sockets": sockets, "total": shape.cpu}


def running_memory_mib(host: SimHost) -> int:
    total = 0
    for inst in host.instances.values():
        if inst.is_running:
            config, _ = host.expanded(inst)
            total += units.memory_mib(
                config.get("limits.memory"), host_memory_mib=host.shape.memory_mib
            )
    return total


def resources(host: SimHost) -> dict[str, Any]:
    """``GET /1.0/resources``."""
    shape = host.shape
    total = shape.memory_mib * units.MIB
    used = min(total, (2048 + running_memory_mib(host)) * units.MIB)
    per_node = total // shape.numa_nodes
    found: dict[str, Any] = {
        "cpu": _cpu(host),
        "memory": {
            "nodes": [
                {
                    "numa_node": n,
                    "hugepages_used": 0,
                    "hugepages_total": 0,
                    "used": used // shape.numa_nodes,
                    "total": per_node,
                }
                for n in range(shape.numa_nodes)
            ],
            "hugepages_total": 0,
            "hugepages_used": 0,
            "hugepages_size": 2097152,
            "used": used,
            "total": total,
        },
        "gpu": {
            "cards": [_gpu_card(g, i) for i, g in enumerate(shape.gpus)],
            "total": len(shape.gpus),
        },
        "network": {"cards": [], "total": 0},
        "storage": {"disks": [], "total": 0},
        "usb": {"devices": [], "total": 0},
        "pci": {"devices": [], "total": 0},
        "system": {
            "uuid": host.tls.fingerprint[:32],
            "vendor": "Simulated",
            "product": "sim-incus",
            "family": "",
            "version": "",
            "sku": "",
            "serial": host.name,
            "type": "physical",
            "firmware": {"vendor": "Simulated", "date": "01/01/2026", "version": "1.0"},
            "chassis": {
                "vendor": "Simulated",
                "type": "Rack Mount Chassis",
                "serial": host.name,
                "version": "",
            },
            "motherboard": {
                "vendor": "Simulated",
                "product": "sim-incus",
                "serial": host.name,
                "version": "",
            },
        },
        # ResourcesLoad has no JSON tags in Incus: Go's field names are the keys
        "load": {
            "Average1Min": 0.0,
            "Average5Min": 0.0,
            "Average10Min": 0.0,
            "Processes": 100 + len(host.instances),
        },
    }
    if host.version.resources_have_serial:  # 7.x only
        found["serial"] = {"devices": [], "total": 0}
    return found


def root_disk_bytes(host: SimHost, inst: SimInstance) -> int:
    _, devices = host.expanded(inst)
    for device in devices.values():
        if device.get("type") == "disk" and device.get("path") == "/":
            size = device.get("size")
            return units.parse_bytes(size) if size else units.DEFAULT_VM_DISK_GIB * units.GIB
    return units.DEFAULT_VM_DISK_GIB * units.GIB


def storage_pool(host: SimHost, name: str) -> dict[str, Any]:
    used_by = [
        f"/1.0/storage-pools/{name}/volumes/virtual-machine/{i.name}"
        + ("" if i.project == "default" else f"?project={i.project}")
        for i in host.instances_in(None)
    ]
    return {
        "name": name,
        "description": "",
        "driver": "zfs",
        "status": "Created",
        "config": {
            "size": f"{host.shape.storage_gib}GiB",
            "source": f"{name}-zpool",
            "zfs.pool_name": name,
        },
        "used_by": used_by,
        "locations": ["none"],
    }


def storage_pool_resources(host: SimHost) -> dict[str, Any]:
    total = host.shape.storage_gib * units.GIB
    used = sum(root_disk_bytes(host, i) for i in host.instances.values())
    return {
        "space": {"used": min(used, total), "total": total},
        "inodes": {"used": 0, "total": 0},
    }


def project(host: SimHost, name: str) -> dict[str, Any]:
    used_by = [
        f"/1.0/profiles/{p}" + ("" if name == "default" else f"?project={name}")
        for p in sorted(host.projects[name])
    ]
    used_by += [_instance_url(i) for i in host.instances_in(name)]
    return {
        "name": name,
        "description": "Default Incus project" if name == "default" else "",
        "config": {
            "features.images": "true",
            "features.networks": "false",
            "features.profiles": "true",
            "features.storage.buckets": "true",
            "features.storage.volumes": "true",
        },
        "used_by": used_by,
    }


def profile(host: SimHost, project_name: str, item: Profile) -> dict[str, Any]:
    return {
        "name": item.name,
        "description": item.description,
        "config": dict(item.config),
        "devices": {k: dict(v) for k, v in item.devices.items()},
        "project": project_name,
        "used_by": [
            _instance_url(i) for i in host.instances_in(project_name) if item.name in i.profiles
        ],
    }


def _instance_url(inst: SimInstance) -> str:
    path = f"/1.0/instances/{inst.name}"
    return path if inst.project == "default" else f"{path}?project={inst.project}"


def instance_url(inst: SimInstance) -> str:
    """The recursion-0 rendering: a path, with ``?project=P`` outside the default project."""
    return _instance_url(inst)


def instance(host: SimHost, inst: SimInstance) -> dict[str, Any]:
    """An ``Instance`` (recursion 1)."""
    config, devices = host.expanded(inst)
    return {
        "architecture": inst.architecture,
        "config": dict(inst.config),
        "created_at": inst.created_at,
        "description": inst.description,
        "devices": {k: dict(v) for k, v in inst.devices.items()},
        "ephemeral": inst.ephemeral,
        "expanded_config": config,
        "expanded_devices": devices,
        "last_used_at": inst.last_used_at,
        "location": "none",
        "name": inst.name,
        "profiles": list(inst.profiles),
        "project": inst.project,
        "stateful": False,
        "status": inst.status.label,
        "status_code": int(inst.status),
        "type": inst.type,
    }


def instance_state(host: SimHost, inst: SimInstance) -> dict[str, Any]:
    """An ``InstanceState`` (``GET …/state``, and ``state`` at recursion 2)."""
    running = inst.is_running
    config, _ = host.expanded(inst)
    memory_limit = (
        units.memory_mib(config.get("limits.memory"), host_memory_mib=host.shape.memory_mib)
        * units.MIB
    )
    disk_total = root_disk_bytes(host, inst)
    state: dict[str, Any] = {
        "status": inst.status.label,
        "status_code": int(inst.status),
        "disk": {"root": {"usage": disk_total // 10, "total": disk_total}},
        "memory": {
            "usage": memory_limit // 4 if running else 0,
            "usage_peak": 0,
            "total": memory_limit if running else 0,
            "swap_usage": 0,
            "swap_usage_peak": 0,
        },
        "network": _network(inst) if running and inst.agent_running else None,
        "pid": 4242 if running else 0,
        "processes": 42 if running and inst.agent_running else (-1 if running else 0),
        "cpu": {"usage": 0, "allocated_time": 0},
        "started_at": inst.started_at,
    }
    if running and inst.agent_running:
        state["os_info"] = {
            "os": "Debian GNU/Linux",
            "os_version": "13",
            "kernel_version": "6.12.0",
            "hostname": inst.name,
            "fqdn": inst.name,
        }
    return state


def _network(inst: SimInstance) -> dict[str, Any]:
    octet = sum(inst.name.encode()) % 250 + 2
    return {
        "eth0": {
            "addresses": [
                {
                    "family": "inet",
                    "address": f"10.42.0.{octet}",
                    "netmask": "24",
                    "scope": "global",
                }
            ],
            "counters": {
                "bytes_received": 0,
                "bytes_sent": 0,
                "packets_received": 0,
                "packets_sent": 0,
                "errors_received": 0,
                "errors_sent": 0,
                "packets_dropped_outbound": 0,
                "packets_dropped_inbound": 0,
            },
            "hwaddr": "10:66:6a:00:00:01",
            "host_name": f"tap{octet}",
            "mtu": 1500,
            "state": "up",
            "type": "broadcast",
        }
    }


def instance_full(host: SimHost, inst: SimInstance) -> dict[str, Any]:
    """An ``InstanceFull`` (recursion 2): the instance with its state."""
    full = instance(host, inst)
    full["state"] = instance_state(host, inst)
    full["snapshots"] = None
    full["backups"] = None
    return full
