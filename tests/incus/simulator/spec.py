"""Incus's ``rest-api.yaml`` and ``FACTS.md`` as test data, and a shape checker.

The files are read from ``RC_INCUS_SPEC_DIR``, else from ``tests/incus/simulator/data`` (copies of
the project's shared ``../shared/incus`` documents, so the comparison runs on every
machine; a test checks the copies still equal the shared ones where those exist).
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.repo import ROOT

VENDORED_DIR = Path(__file__).resolve().parent / "data"
SHARED_DIR = ROOT.parent / "shared" / "incus"
SPEC_DIR = Path(os.environ.get("RC_INCUS_SPEC_DIR", VENDORED_DIR))
DATE_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)$")

#: Spec fields Incus leaves out when empty (Go ``omitempty``), and so does the simulator.
OMITTED_WHEN_EMPTY: dict[str, frozenset[str]] = {
    # write-only request fields that InstancePut shares with Instance
    "Instance": frozenset({"restore", "disk_only"}),
    "InstanceFull": frozenset({"restore", "disk_only"}),
    # present only while the guest agent runs
    "InstanceState": frozenset({"os_info"}),
    # present only for cards that have them (nvidia only on NVIDIA cards)
    "ResourcesGPUCard": frozenset({"mdev", "sriov", "usb_address", "nvidia", "drm"}),
    "ResourcesCPUSocket": frozenset({"address_sizes"}),
    "ResourcesCPUCore": frozenset({"flags"}),
    "ResourcesCPUCache": frozenset(),
    "ResourcesMemoryNode": frozenset(),
    "ServerEnvironment": frozenset(),
}


def spec_file(name: str) -> Path:
    path = SPEC_DIR / name
    if not path.exists():
        pytest.skip(f"{path} not found (set RC_INCUS_SPEC_DIR to the folder of rest-api.yaml)")
    return path


@cache
def rest_api() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml is 10x faster
    loaded: dict[str, Any] = yaml.load(spec_file("rest-api.yaml").read_text(), Loader=loader)
    return loaded


@cache
def facts() -> str:
    return spec_file("FACTS.md").read_text()


def normalize(path: str) -> str:
    """``/1.0/instances/{name}?recursion=1`` → ``/1.0/instances/{}``."""
    return re.sub(r"\{[^}]*\}", "{}", path.split("?", 1)[0])


def spec_operations() -> dict[tuple[str, str], set[str]]:
    """(METHOD, normalized path) → the response status codes the spec declares."""
    found: dict[tuple[str, str], set[str]] = {}
    for path, methods in rest_api()["paths"].items():
        for method, operation in methods.items():
            codes = found.setdefault((method.upper(), normalize(path)), set())
            codes.update(str(code) for code in operation.get("responses", {}))
    return found


def shape_problems(value: Any, definition: str) -> list[str]:
    """How ``value`` differs from spec definition ``definition`` (empty: it conforms)."""
    problems: list[str] = []
    _check(value, {"$ref": f"#/definitions/{definition}"}, definition, problems)
    return problems


def _check(value: Any, schema: dict[str, Any], where: str, problems: list[str]) -> None:
    name = None
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = rest_api()["definitions"][name]
    if value is None:
        return  # Go renders nil pointers, slices and maps as null
    kind = schema.get("type")
    if "properties" in schema:
        _check_object(value, schema, name, where, problems)
    elif kind == "object":
        if not isinstance(value, dict):
            problems.append(f"{where}: {type(value).__name__}, spec says object")
            return
        items = schema.get("additionalProperties")
        if isinstance(items, dict) and items:
            for key, item in value.items():
                _check(item, items, f"{where}[{key}]", problems)
    elif kind == "array":
        if not isinstance(value, list):
            problems.append(f"{where}: {type(value).__name__}, spec says array")
            return
        for index, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{where}[{index}]", problems)
    else:
        _check_scalar(value, schema, where, problems)


def _check_object(
    value: Any, schema: dict[str, Any], name: str | None, where: str, problems: list[str]
) -> None:
    if not isinstance(value, dict):
        problems.append(f"{where}: {type(value).__name__}, spec says object {name}")
        return
    declared = schema["properties"]
    for key in sorted(set(value) - set(declared)):
        problems.append(f"{where}.{key}: not in the spec's {name}")
    omitted = OMITTED_WHEN_EMPTY.get(name or "", frozenset())
    for key in sorted(set(declared) - set(value) - omitted):
        problems.append(f"{where}.{key}: missing (the spec's {name} declares it)")
    for key in sorted(set(value) & set(declared)):
        _check(value[key], declared[key], f"{where}.{key}", problems)


def _check_scalar(value: Any, schema: dict[str, Any], where: str, problems: list[str]) -> None:
    kind = schema.get("type")
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        None: True,
    }.get(kind, True)
    if not ok:
        problems.append(f"{where}: {value!r} is not {kind}")
    elif schema.get("format") == "date-time" and not DATE_TIME.match(value):
        problems.append(f"{where}: {value!r} is not RFC 3339")
