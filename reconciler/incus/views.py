"""What the adapter returns and takes: small frozen dataclasses in the domain's units.

Rules:

- Views are built from Incus's JSON by pure functions here (no I/O), so they are tested
  without a server and the adapter stays a thin shell.
- Quantities are the contract's: ``cpu`` in vCPUs, ``memory_mib``, ``disk_gib``. Host
  capacity rounds *down* (never promise what is not there); instance demand rounds *up*.
- An instance's demand comes from its *expanded* config and devices (profiles applied):
  ``limits.cpu``, ``limits.memory`` and the root disk's ``size``, with Incus's VM
  defaults when unset (1 vCPU, 1 GiB, 10 GiB). Its GPUs are the ``pci`` addresses of its
  ``gpu`` devices; a GPU device without ``pci`` cannot be told apart and is not listed.
- Only ``user.*`` config keys travel in a view (the contract's inventory ``config``).
- GPU index = position in the host's GPUs ordered by PCI address (stable across reboots
  and runs). Incus reports no GPU memory, so ``memory_mib`` comes from the caller's
  model table (:data:`KNOWN_GPU_MEMORY_MIB` by default), 0 when unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reconciler.core.model import TAG_JOB, TAG_KIND, TAG_LEASE_ID, TAG_POOL, ZERO, Gpu, Resources
from reconciler.incus import units

__all__ = [
    "DEFAULT_VM_DEMAND",
    "KNOWN_GPU_MEMORY_MIB",
    "HostResources",
    "InstanceSpec",
    "InstanceView",
    "ServerInfo",
    "host_resources",
    "instance_view",
    "server_info",
]

#: GPU memory by model name, for hosts whose Incus cannot tell (it never reports it)
KNOWN_GPU_MEMORY_MIB: Mapping[str, int] = {
    "NVIDIA L40S": 46068,
    "NVIDIA L4": 23034,
    "NVIDIA A100-SXM4-80GB": 81920,
    "NVIDIA A100-PCIE-40GB": 40960,
    "NVIDIA H100 PCIe": 81559,
    "NVIDIA H100 80GB HBM3": 81559,
    "Tesla T4": 15360,
}
#: Incus's defaults for a VM without limits
DEFAULT_VM_DEMAND = Resources(
    cpu=units.DEFAULT_VM_CPU,
    memory_mib=units.DEFAULT_VM_MEMORY_MIB,
    disk_gib=units.DEFAULT_VM_DISK_GIB,
)
_VENDORS_BY_ID = {"10de": "nvidia", "1002": "amd", "8086": "intel"}


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """``GET /1.0``: who the host is. ``uid`` is its certificate fingerprint."""

    uid: str
    server_name: str
    server_version: str
    api_extensions: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class HostResources:
    """``GET /1.0/resources``: CPU threads, memory and GPUs (the core's :class:`Gpu`).

    Disk is a storage pool's (:meth:`~reconciler.incus.client.IncusHost.storage_total_gib`).
    """

    cpu: int
    memory_mib: int
    gpus: tuple[Gpu, ...] = ()


@dataclass(frozen=True, kw_only=True)
class InstanceView:
    """One instance as the contract's inventory lists it."""

    name: str
    project: str
    status: str
    status_code: int
    type: str
    config: Mapping[str, str] = field(default_factory=dict)
    resources: Resources = ZERO
    gpus: tuple[str, ...] = ()
    #: the image's ``image.os`` and ``image.release`` (Incus copies them at create)
    os_name: str = ""
    os_version: str = ""
    #: Incus's architecture name (``x86_64``, ``aarch64``…)
    architecture: str = ""
    #: global-scope addresses, by interface name; only in full views (with ``state``)
    addresses: tuple[str, ...] = ()

    @property
    def lease_id(self) -> str | None:
        return self.config.get(TAG_LEASE_ID)

    def as_inventory(self) -> dict[str, Any]:
        """The contract's ``rc.in.host.<host>.inventory`` entry."""
        return {
            "name": self.name,
            "project": self.project,
            "status": self.status,
            "status_code": self.status_code,
            "type": self.type,
            "config": dict(self.config),
            "resources": self.resources.as_dict(),
            "gpus": list(self.gpus),
        }


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """What to create: a VM from an image, with limits, a root size, GPUs and tags."""

    name: str
    image: str
    project: str = "default"
    profiles: tuple[str, ...] = ("default",)
    demand: Resources = DEFAULT_VM_DEMAND
    gpu_pci: tuple[str, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    storage_pool: str = "default"
    image_server: str | None = None
    image_protocol: str = "simplestreams"
    instance_type: str = "virtual-machine"
    #: cloud-init user data (``cloud-init.user-data``); a secret: never logged
    user_data: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        bad = [k for k in self.tags if not k.startswith("user.")]
        if bad:
            raise ValueError(f"instance tags must be user.* config keys, got {bad}")

    @classmethod
    def for_lease(
        cls,
        *,
        name: str,
        image: str,
        lease_id: str,
        pool: str,
        kind: str,
        job: str | None = None,
        **fields: Any,
    ) -> InstanceSpec:
        """A spec tagged with the lease tags the fold adopts by (``user.rc.*``)."""
        tags = {TAG_LEASE_ID: lease_id, TAG_POOL: pool, TAG_KIND: kind}
        if job is not None:
            tags[TAG_JOB] = job
        tags.update(fields.pop("tags", {}))
        return cls(name=name, image=image, tags=tags, **fields)

    @property
    def lease_id(self) -> str | None:
        return self.tags.get(TAG_LEASE_ID)

    def request_body(self) -> dict[str, Any]:
        """The ``POST /1.0/instances`` body (``InstancesPost``)."""
        source: dict[str, Any] = {"type": "image"}
        is_fingerprint = len(self.image) >= 12 and all(c in "0123456789abcdef" for c in self.image)
        source["fingerprint" if is_fingerprint else "alias"] = self.image
        if self.image_server is not None:
            source.update(server=self.image_server, protocol=self.image_protocol, mode="pull")
        devices: dict[str, dict[str, str]] = {
            "root": {
                "type": "disk",
                "path": "/",
                "pool": self.storage_pool,
                "size": f"{self.demand.disk_gib}GiB",
            }
        }
        for index, pci in enumerate(self.gpu_pci):
            devices[f"gpu{index}"] = {"type": "gpu", "gputype": "physical", "pci": pci}
        config = {
            "limits.cpu": str(self.demand.cpu),
            "limits.memory": f"{self.demand.memory_mib}MiB",
            **self.tags,
        }
        if self.user_data is not None:
            config["cloud-init.user-data"] = self.user_data
        return {
            "name": self.name,
            "type": self.instance_type,
            "source": source,
            "profiles": list(self.profiles),
            "config": config,
            "devices": devices,
            "start": False,
        }


def server_info(metadata: Mapping[str, Any]) -> ServerInfo:
    environment = metadata.get("environment") or {}
    return ServerInfo(
        uid=str(environment.get("certificate_fingerprint", "")),
        server_name=str(environment.get("server_name", "")),
        server_version=str(environment.get("server_version", "")),
        api_extensions=frozenset(metadata.get("api_extensions") or ()),
    )


def _gpu(card: Mapping[str, Any], index: int, memory_table: Mapping[str, int]) -> Gpu:
    vendor_id = str(card.get("vendor_id", "")).lower()
    vendor = _VENDORS_BY_ID.get(vendor_id, str(card.get("vendor", "")).lower())
    nvidia = card.get("nvidia") or {}
    model = str(nvidia.get("model") or card.get("product") or "")
    numa = card.get("numa_node")
    return Gpu(
        index=index,
        vendor=vendor,
        model=model,
        memory_mib=int(memory_table.get(model, 0)),
        pci_address=str(card.get("pci_address", "")),
        numa_node=int(numa) if isinstance(numa, int) and numa >= 0 else 0,
    )


def host_resources(
    metadata: Mapping[str, Any], *, gpu_memory_mib: Mapping[str, int] = KNOWN_GPU_MEMORY_MIB
) -> HostResources:
    cards = sorted(
        (c for c in (metadata.get("gpu") or {}).get("cards") or () if c.get("pci_address")),
        key=lambda c: str(c["pci_address"]),
    )
    return HostResources(
        cpu=int((metadata.get("cpu") or {}).get("total", 0)),
        memory_mib=int((metadata.get("memory") or {}).get("total", 0)) // units.MIB,
        gpus=tuple(_gpu(card, i, gpu_memory_mib) for i, card in enumerate(cards)),
    )


def _global_addresses(state: Any) -> tuple[str, ...]:
    """The ``global`` addresses of a full view's ``state.network``, by interface name."""
    network = (state or {}).get("network") or {}
    return tuple(
        str(address["address"])
        for _, nic in sorted(network.items())
        for address in (nic or {}).get("addresses") or ()
        if address.get("scope") == "global" and address.get("address")
    )


def _root_disk_gib(devices: Mapping[str, Mapping[str, str]]) -> int:
    for device in devices.values():
        if device.get("type") == "disk" and device.get("path") == "/":
            size = device.get("size")
            if size:
                return units.bytes_to_gib(units.parse_bytes(size))
    return units.DEFAULT_VM_DISK_GIB


def instance_view(metadata: Mapping[str, Any], *, host_memory_mib: int = 0) -> InstanceView:
    """An ``Instance`` object (recursion 1, or 2 with its ``state``) as a view."""
    config: Mapping[str, str] = metadata.get("expanded_config") or metadata.get("config") or {}
    devices: Mapping[str, Mapping[str, str]] = (
        metadata.get("expanded_devices") or metadata.get("devices") or {}
    )
    demand = Resources(
        cpu=units.cpu_count(config.get("limits.cpu")),
        memory_mib=units.memory_mib(config.get("limits.memory"), host_memory_mib=host_memory_mib),
        disk_gib=_root_disk_gib(devices),
    )
    gpus = sorted(
        str(d["pci"]) for d in devices.values() if d.get("type") == "gpu" and d.get("pci")
    )
    own: Mapping[str, str] = metadata.get("config") or {}
    return InstanceView(
        os_name=str(config.get("image.os", "")),
        os_version=str(config.get("image.release", "")),
        architecture=str(metadata.get("architecture", "")),
        addresses=_global_addresses(metadata.get("state")),
        name=str(metadata["name"]),
        project=str(metadata.get("project") or "default"),
        status=str(metadata.get("status", "")),
        status_code=int(metadata.get("status_code", 0)),
        type=str(metadata.get("type", "")),
        config={k: str(v) for k, v in sorted(own.items()) if k.startswith("user.")},
        resources=demand,
        gpus=tuple(gpus),
    )
