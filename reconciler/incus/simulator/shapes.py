"""Host shapes: what each simulated Incus host has, and the fleet file that finds them.

Rules:

- A shape is data only (frozen dataclasses); a running host reads it and never changes
  it. Changing a host's resources at run time replaces its shape.
- A host's identity is stable: ``server_name`` is the host name, and its TLS certificate
  (Ed25519, derived from the name, fixed validity) and so ``certificate_fingerprint``
  (SHA-256 of the DER) are the same on every run and in every process.
- :func:`default_fleet` is deterministic: ``host-01`` … ``host-NN``, most CPU-only, every
  4th with four NVIDIA GPUs split over two NUMA nodes.
- The fleet description (``--fleet`` JSON) and the fleet file (written by a running fleet)
  use the same host shape encoding, so a fleet file can describe the next fleet.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import orjson
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

__all__ = [
    "DEFAULT_PROJECTS",
    "GpuShape",
    "HostShape",
    "HostTls",
    "default_fleet",
    "fleet_from_json",
    "host_tls",
    "read_fleet_file",
    "shape_from_json",
    "shape_to_json",
]

DEFAULT_PROJECTS: tuple[str, ...] = ("default",)

#: PCI vendor ids of the GPU vendors the simulator knows.
VENDOR_IDS = {"nvidia": "10de", "amd": "1002", "intel": "8086"}
VENDOR_NAMES = {
    "nvidia": "NVIDIA Corporation",
    "amd": "Advanced Micro Devices, Inc. [AMD/ATI]",
    "intel": "Intel Corporation",
}
DRIVERS = {
    "nvidia": ("nvidia", "550.54.14"),
    "amd": ("amdgpu", "6.8.0"),
    "intel": ("i915", "6.8.0"),
}


@dataclass(frozen=True, kw_only=True)
class GpuShape:
    """One GPU card of a host, as ``/1.0/resources`` reports it."""

    pci_address: str
    vendor: str = "nvidia"
    model: str = "NVIDIA L40S"
    product: str = "AD102GL [L40S]"
    product_id: str = "26b9"
    memory_mib: int = 46068
    numa_node: int = 0

    def __post_init__(self) -> None:
        if self.vendor not in VENDOR_IDS:
            raise ValueError(f"unknown GPU vendor {self.vendor!r} (one of {sorted(VENDOR_IDS)})")


@dataclass(frozen=True, kw_only=True)
class HostShape:
    """One simulated Incus host: its name and what it has."""

    name: str
    cpu: int = 32
    memory_mib: int = 131072
    storage_pool: str = "default"
    storage_gib: int = 1024
    numa_nodes: int = 1
    gpus: tuple[GpuShape, ...] = ()
    #: projects besides ``default``; each gets a ``default`` profile with a root disk
    projects: tuple[str, ...] = ()
    architecture: str = "x86_64"

    def __post_init__(self) -> None:
        if self.cpu < 1 or self.memory_mib < 1 or self.storage_gib < 1 or self.numa_nodes < 1:
            raise ValueError(
                f"host {self.name!r}: cpu, memory, storage and NUMA nodes must be >= 1"
            )
        if len({g.pci_address for g in self.gpus}) != len(self.gpus):
            raise ValueError(f"host {self.name!r}: duplicate GPU PCI address")

    @property
    def all_projects(self) -> tuple[str, ...]:
        return ("default", *sorted(set(self.projects) - {"default"}))


@dataclass(frozen=True)
class HostTls:
    """A host's stable certificate (PEM), key (PEM) and fingerprint (hex SHA-256 of DER)."""

    certificate_pem: str
    key_pem: str
    fingerprint: str = field(repr=True)


@cache
def host_tls(name: str) -> HostTls:
    """The stable self-signed certificate of host ``name`` (same bytes on every run)."""
    seed = hashlib.sha256(f"sim-incus host {name}".encode()).digest()
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Linux Containers"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"root@{name}"),
        ]
    )
    serial = int.from_bytes(seed[:16], "big") >> 1
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        .not_valid_after(dt.datetime(2036, 1, 1, tzinfo=dt.UTC))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, None)  # Ed25519 signatures are deterministic
    )
    der = certificate.public_bytes(serialization.Encoding.DER)
    return HostTls(
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM).decode(),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode(),
        fingerprint=hashlib.sha256(der).hexdigest(),
    )


def _nvidia_gpus(count: int, *, numa_nodes: int) -> tuple[GpuShape, ...]:
    per_node = max(count // numa_nodes, 1)
    return tuple(
        GpuShape(
            pci_address=f"0000:{0x41 + 0x20 * i:02x}:00.0",
            numa_node=min(i // per_node, numa_nodes - 1),
        )
        for i in range(count)
    )


def default_fleet(
    hosts: int, *, prefix: str = "host", projects: Sequence[str] = ()
) -> tuple[HostShape, ...]:
    """``hosts`` shapes: CPU-only hosts, and every 4th one with 4 NVIDIA GPUs on 2 NUMA nodes."""
    if hosts < 1:
        raise ValueError(f"a fleet needs at least one host, got {hosts}")
    width = max(2, len(str(hosts)))
    shapes = []
    for index in range(1, hosts + 1):
        name = f"{prefix}-{index:0{width}d}"
        if index % 4 == 0:
            shape = HostShape(
                name=name,
                cpu=64,
                memory_mib=524288,
                storage_gib=4096,
                numa_nodes=2,
                gpus=_nvidia_gpus(4, numa_nodes=2),
                projects=tuple(projects),
            )
        else:
            shape = HostShape(name=name, projects=tuple(projects))
        shapes.append(shape)
    return tuple(shapes)


def shape_to_json(shape: HostShape) -> dict[str, Any]:
    """A shape as plain JSON data (the fleet file's ``shape``)."""
    data = asdict(shape)
    data["gpus"] = [asdict(g) for g in shape.gpus]
    data["projects"] = list(shape.projects)
    return data


def shape_from_json(data: Mapping[str, Any]) -> HostShape:
    """The inverse of :func:`shape_to_json`; unknown keys are an error (typos show)."""
    known = set(HostShape.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown host shape keys: {sorted(unknown)}")
    values = dict(data)
    values["gpus"] = tuple(GpuShape(**g) for g in values.get("gpus", ()))
    values["projects"] = tuple(values.get("projects", ()))
    return HostShape(**values)


def fleet_from_json(data: Any) -> tuple[HostShape, ...]:
    """Shapes from a fleet description: ``{"hosts": [shape, …]}`` or a list of shapes."""
    entries = data.get("hosts") if isinstance(data, Mapping) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError('a fleet description is {"hosts": [shape, ...]} with at least one host')
    shapes = tuple(shape_from_json(e) for e in entries)
    if len({s.name for s in shapes}) != len(shapes):
        raise ValueError("duplicate host name in fleet description")
    return shapes


def read_fleet_file(path: Path) -> dict[str, dict[str, Any]]:
    """A fleet file: host name → ``{"url", "socket"?, "shape", "fingerprint"}``."""
    data = orjson.loads(path.read_bytes())
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, dict):
        raise ValueError(f"{path} is not a fleet file (no 'hosts' object)")
    return hosts
