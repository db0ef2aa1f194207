"""Payload and message builders shared by the core, store and bus tests.

Payloads are built as the contract writes them (plain dicts) and turned into typed
inputs with the same ``from_payload`` the decoder uses, so the tests exercise the real
path from JSON to the fold.
"""

from __future__ import annotations

from typing import Any

from reconciler.core.fold import fold
from reconciler.core.inputs import CONFIG_NAME_FIELDS, Message, from_payload
from reconciler.core.state import Effects, State

TS0 = "2026-12-02T10:00:00Z"


def res(cpu: int, memory_mib: int = 0, disk_gib: int = 0) -> dict[str, int]:
    return {"cpu": cpu, "memory_mib": memory_mib, "disk_gib": disk_gib}


def gpu(
    index: int,
    *,
    model: str = "A100",
    vendor: str = "nvidia",
    numa: int = 0,
    memory_mib: int = 40960,
) -> dict[str, Any]:
    return {
        "index": index,
        "vendor": vendor,
        "model": model,
        "memory_mib": memory_mib,
        "pci_address": f"0000:{index + 1:02x}:00.0",
        "numa_node": numa,
    }


def snapshot(
    host: str,
    *,
    revision: int = 1,
    cpu: int = 16,
    memory_mib: int = 65536,
    disk_gib: int = 500,
    reserve: dict[str, int] | None = None,
    gpus: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    schedulable: bool = True,
    uid: str | None = None,
    gpu_profile: str | None = None,
) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {
        "v": 1,
        "host": host,
        "uid": uid or f"uid-{host}",
        "revision": revision,
        "schedulable": schedulable,
        "labels": labels or {},
        "capacity": res(cpu, memory_mib, disk_gib),
        "reserve": reserve or res(0),
        "gpus": gpus or [],
    }
    if gpu_profile is not None:
        payload["gpu_profile"] = gpu_profile
    return "host.snapshot", payload


def instance(
    name: str,
    *,
    cpu: int = 2,
    memory_mib: int = 4096,
    disk_gib: int = 20,
    status: str = "Running",
    status_code: int = 103,
    project: str = "default",
    config: dict[str, str] | None = None,
    gpus: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "project": project,
        "status": status,
        "status_code": status_code,
        "type": "virtual-machine",
        "config": config or {},
        "resources": res(cpu, memory_mib, disk_gib),
        "gpus": gpus or [],
    }


def inventory(
    host: str, instances: list[dict[str, Any]], *, revision: int = 1, uid: str | None = None
) -> tuple[str, dict[str, Any]]:
    return "host.inventory", {
        "v": 1,
        "host": host,
        "uid": uid or f"uid-{host}",
        "revision": revision,
        "instances": instances,
    }


def lifecycle(
    host: str, action: str, name: str, *, project: str = "default"
) -> tuple[str, dict[str, Any]]:
    return "host.lifecycle", {
        "v": 1,
        "host": host,
        "event": {
            "type": "lifecycle",
            "timestamp": "2026-12-02T10:00:00.123456789Z",
            "metadata": {
                "action": action,
                "source": f"/1.0/instances/{name}",
                "name": name,
                "project": project,
            },
            "location": "none",
            "project": project,
        },
    }


def observation(
    host: str, name: str, *, present: bool, checked_revision: int = 1
) -> tuple[str, dict[str, Any]]:
    return "host.observation", {
        "v": 1,
        "host": host,
        "instance": name,
        "present": present,
        "checked_revision": checked_revision,
    }


def pool(
    name: str,
    *,
    cpu: int = 2,
    memory_mib: int = 4096,
    disk_gib: int = 20,
    min_ready: int = 0,
    max_ready: int = 0,
    protect_min_ready: bool = False,
    max_instances: int = 100,
    priority: int = 0,
    placement: str = "pack",
    host_selector: dict[str, str] | None = None,
    claims: list[dict[str, Any]] | None = None,
    project: str = "default",
    instance_type: str | None = None,
    wait_s: int | None = None,
) -> tuple[str, dict[str, Any]]:
    extra: dict[str, Any] = {} if instance_type is None else {"instance_type": instance_type}
    if wait_s is not None:
        extra["queue"] = {"wait_s": wait_s}
    return "config.pool", {
        "v": 1,
        "pool": name,
        "flavor": res(cpu, memory_mib, disk_gib),
        "claims": claims or [],
        "warm": {
            "min_ready": min_ready,
            "max_ready": max_ready,
            "protect_min_ready": protect_min_ready,
        },
        "max_instances": max_instances,
        "priority": priority,
        "host_selector": host_selector or {},
        "placement": placement,
        "image": "ubuntu/24.04",
        "profiles": ["default"],
        "project": project,
        **extra,
    }


def gpu_class(
    name: str,
    *,
    count: int = 1,
    model: str | None = None,
    vendor: str | None = None,
    min_memory_mib: int | None = None,
    host_selector: dict[str, str] | None = None,
) -> tuple[str, dict[str, Any]]:
    params: dict[str, Any] = {"count": count}
    if model is not None:
        params["model"] = model
    if vendor is not None:
        params["vendor"] = vendor
    if min_memory_mib is not None:
        params["min_memory_mib"] = min_memory_mib
    payload: dict[str, Any] = {"v": 1, "class": name, "parameters": {"gpu": params}}
    if host_selector is not None:
        payload["host_selector"] = host_selector
    return "config.class", payload


def gpu_profile(
    name: str,
    *,
    revision: int = 1,
    mig_mode: str = "disabled",
    compute_mode: str = "default",
    persistence: bool = False,
    power_limit_w: int | None = None,
    ecc: bool = False,
) -> tuple[str, dict[str, Any]]:
    return "config.gpu-profile", {
        "v": 1,
        "name": name,
        "revision": revision,
        "defaults": {
            "mig_mode": mig_mode,
            "compute_mode": compute_mode,
            "persistence": persistence,
            "power_limit_w": power_limit_w,
            "ecc": ecc,
        },
    }


def gpu_policy(
    name: str,
    *,
    priority: int = 0,
    overrides: dict[str, Any],
    host_labels: dict[str, str] | None = None,
    models: list[str] | None = None,
    indexes: list[int] | None = None,
) -> tuple[str, dict[str, Any]]:
    selector: dict[str, Any] = {}
    if host_labels is not None:
        selector["host_labels"] = host_labels
    if models is not None:
        selector["models"] = models
    if indexes is not None:
        selector["indexes"] = indexes
    return "config.gpu-policy", {
        "v": 1,
        "name": name,
        "priority": priority,
        "selector": selector,
        "overrides": overrides,
    }


def cmd(verb: str, request_id: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return f"cmd.{verb}", {"v": 1, "request_id": request_id, **fields}


def admit(
    request_id: str,
    pool_name: str,
    name: str,
    *,
    kind: str = "cold",
    preemptible: bool = False,
    **fields: Any,
) -> tuple[str, dict[str, Any]]:
    verb = "admit-preemptible" if preemptible else "admit"
    return cmd(verb, request_id, pool=pool_name, instance=name, kind=kind, **fields)


def apply_config(
    request_id: str,
    *items: tuple[str, dict[str, Any]],
    delete: tuple[tuple[str, str], ...] = (),
) -> tuple[str, dict[str, Any]]:
    """An ``apply-config`` change of config items (as the builders above make them) and
    deletions (``(kind, name)``)."""
    payload: dict[str, Any] = {"v": 1, "request_id": request_id}
    if items:
        payload["items"] = [
            {"kind": kind.removeprefix("config."), "payload": body} for kind, body in items
        ]
    if delete:
        payload["delete"] = [{"kind": kind, "name": name} for kind, name in delete]
    return "cmd.apply-config", payload


def failure(
    host: str, name: str, lease_id: str, action: str, error: str = "refused"
) -> tuple[str, dict[str, Any]]:
    return "host.failure", {
        "v": 1,
        "host": host,
        "instance": name,
        "project": "default",
        "lease_id": lease_id,
        "action": action,
        "error": error,
    }


def message(seq: int, item: tuple[str, dict[str, Any]]) -> Message:
    kind, payload = item
    return Message(
        seq=seq,
        timestamp=f"2026-12-02T10:{seq // 60 % 60:02d}:{seq % 60:02d}Z",
        input=from_payload(kind, payload),
    )


class Fleet:
    """A state plus a sequence counter: ``fleet.send(item)`` folds it as the next input."""

    def __init__(self) -> None:
        self.state = State()
        self.seq = 0
        self.log: list[Message] = []

    def send(self, *items: tuple[str, dict[str, Any]]) -> Effects:
        fx = Effects()
        for item in items:
            self.seq += 1
            msg = message(self.seq, item)
            self.log.append(msg)
            fold(self.state, msg, fx)
        return fx


def subject_of(item: tuple[str, dict[str, Any]], *, prefix: str = "rc") -> str:
    """The contract subject an input item travels on."""
    kind, payload = item
    family, what = kind.split(".", 1)
    if family == "host":
        return f"{prefix}.in.host.{payload['host']}.{what}"
    if family == "config":
        name = payload[CONFIG_NAME_FIELDS[what]]
        return f"{prefix}.in.config.{what}.{name}"
    return f"{prefix}.in.cmd.{what}"
