"""Effective GPU runtime: a host's GPU profile, overridden by runtime policies.

A host names a profile whose ``defaults`` apply to all its GPUs. Accepted policies that
select a GPU (every given selector field must match: host labels, model, index) override
fields, applied in ``(priority, name)`` order so that the later one wins. A lease's
runtime is *stale* while the host's GPU inputs or its profile revision differ from those
the lease was last rendered against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from reconciler.core.model import (
    RUNTIME_FIELDS,
    ComputeMode,
    Gpu,
    GpuPolicy,
    GpuProfile,
    GpuRuntime,
    Host,
    Lease,
    MigMode,
)
from reconciler.core.state import State


class RuntimeConfigError(ValueError):
    """A profile or policy whose content is not valid; the message names it."""


def _check_field(owner: str, key: str, value: Any) -> object:
    if key == "mig_mode":
        if value not in {m.value for m in MigMode}:
            raise RuntimeConfigError(f"{owner}: mig_mode {value!r} is not disabled|enabled")
        return MigMode(value)
    if key == "compute_mode":
        if value not in {m.value for m in ComputeMode}:
            raise RuntimeConfigError(f"{owner}: compute_mode {value!r} is not valid")
        return ComputeMode(value)
    if key in ("persistence", "ecc"):
        if not isinstance(value, bool):
            raise RuntimeConfigError(f"{owner}: {key} must be a boolean, not {value!r}")
        return value
    if key == "power_limit_w":
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise RuntimeConfigError(
                f"{owner}: power_limit_w must be a positive integer or null, not {value!r}"
            )
        return value
    raise RuntimeConfigError(f"{owner}: unknown runtime field {key!r}")


def validate_profile(name: str, defaults: GpuRuntime) -> None:
    _check_field(f"gpu-profile {name!r}", "power_limit_w", defaults.power_limit_w)


def validate_overrides(name: str, overrides: Mapping[str, Any]) -> tuple[tuple[str, object], ...]:
    """Check a policy's overrides; return them in field order, typed."""
    owner = f"gpu-policy {name!r}"
    checked = {key: _check_field(owner, key, value) for key, value in overrides.items()}
    return tuple((key, checked[key]) for key in RUNTIME_FIELDS if key in checked)


def _selects(policy: GpuPolicy, host: Host, gpu: Gpu) -> bool:
    s = policy.selector
    if s.host_labels is not None and any(host.labels.get(k) != v for k, v in s.host_labels.items()):
        return False
    if s.models is not None and gpu.model not in s.models:
        return False
    return s.indexes is None or gpu.index in s.indexes


def profile_of(state: State, host: Host) -> GpuProfile | None:
    return state.profiles.get(host.gpu_profile) if host.gpu_profile else None


def runtime_for(state: State, host: Host, gpu: Gpu) -> GpuRuntime:
    profile = profile_of(state, host)
    runtime = profile.defaults if profile is not None else GpuRuntime()
    for policy in sorted(state.policies.values(), key=lambda p: (p.priority, p.name)):
        if _selects(policy, host, gpu):
            runtime = replace(runtime, **dict(policy.overrides))  # type: ignore[arg-type]
    return runtime


def runtime_basis(state: State, host: Host) -> tuple[int, str | None, int]:
    """What a rendering depends on: GPU inputs revision, profile name and revision."""
    profile = profile_of(state, host)
    return (host.gpu_revision, host.gpu_profile, profile.revision if profile else -1)


def is_stale(state: State, lease: Lease) -> bool:
    host = state.hosts.get(lease.host)
    if host is None:
        return True
    basis = (lease.runtime_gpu_revision, lease.runtime_profile, lease.runtime_profile_revision)
    return basis != runtime_basis(state, host)


def effective_runtime(state: State, lease: Lease) -> list[dict[str, object]]:
    """``[{index, runtime}]`` for the lease's GPUs (the caller checks staleness first)."""
    host = state.hosts[lease.host]
    by_index = {g.index: g for g in host.gpus}
    return [
        {"index": ix, "runtime": runtime_for(state, host, by_index[ix]).as_dict()}
        for ix in lease.gpus
        if ix in by_index
    ]
