"""Incus notations read into the domain's units (reconciler.incus.units)."""

from __future__ import annotations

import pytest

from reconciler.incus import units


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
