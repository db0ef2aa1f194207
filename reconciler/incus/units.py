"""Incus's size and CPU notations, read into the domain's units.

Rules (after Incus's ``units.ParseByteSizeString`` and ``limits.cpu``):

- A byte size is a number with an optional suffix: decimal ``kB MB GB TB PB EB`` (powers
  of 1000) or binary ``KiB MiB GiB TiB PiB EiB`` (powers of 1024); a bare number or ``B``
  is bytes. Anything else is a :class:`ValueError`.
- ``limits.memory`` may also be a percentage of the host's memory.
- ``limits.cpu`` is a count (``"4"``) or a pinning set (``"0-3,8"``: five CPUs).
- Conversions round up: a VM with 1.5 GiB of disk books 2 GiB, never 1.
- Defaults are Incus's for a VM with no limit: 1 vCPU, 1 GiB of memory, a 10 GiB root disk.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "DEFAULT_VM_CPU",
    "DEFAULT_VM_DISK_GIB",
    "DEFAULT_VM_MEMORY_MIB",
    "GIB",
    "MIB",
    "bytes_to_gib",
    "bytes_to_mib",
    "cpu_count",
    "memory_mib",
    "parse_bytes",
]

MIB = 1024**2
GIB = 1024**3
DEFAULT_VM_CPU = 1
DEFAULT_VM_MEMORY_MIB = 1024
DEFAULT_VM_DISK_GIB = 10

_MULTIPLIERS = {
    "": 1,
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "PB": 1000**5,
    "EB": 1000**6,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "PiB": 1024**5,
    "EiB": 1024**6,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_bytes(value: str) -> int:
    """Bytes in an Incus size string (``"40GiB"``, ``"512MB"``, ``"1073741824"``)."""
    match = _SIZE.match(value)
    if match is None or match.group(2) not in _MULTIPLIERS:
        raise ValueError(f"invalid size {value!r}")
    return math.ceil(float(match.group(1)) * _MULTIPLIERS[match.group(2)])


def bytes_to_mib(n: int) -> int:
    return math.ceil(n / MIB)


def bytes_to_gib(n: int) -> int:
    return math.ceil(n / GIB)


def memory_mib(value: str | None, *, host_memory_mib: int = 0) -> int:
    """MiB of a ``limits.memory`` value; ``None`` or empty is Incus's VM default (1 GiB)."""
    if not value:
        return DEFAULT_VM_MEMORY_MIB
    text = value.strip()
    if text.endswith("%"):
        return math.ceil(host_memory_mib * float(text[:-1]) / 100)
    return bytes_to_mib(parse_bytes(text))


def cpu_count(value: str | None) -> int:
    """vCPUs of a ``limits.cpu`` value: a count or a pinning set; empty is 1."""
    if not value or not value.strip():
        return DEFAULT_VM_CPU
    text = value.strip()
    if text.isdigit():
        return int(text)
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"invalid limits.cpu {value!r}")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low:
            raise ValueError(f"invalid limits.cpu {value!r}")
        cpus.update(range(low, high + 1))
    return len(cpus)
