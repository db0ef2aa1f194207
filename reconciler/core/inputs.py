"""Typed input messages, as the fold consumes them.

A payload reaches this module only after it passed its JSON Schema (see ``reconciler/schemas/``
and ``reconciler.bus.decoder``); ``from_payload`` turns the validated dict into one of
the dataclasses below. Anything the schema cannot express (a subject token that
disagrees with the payload, say) raises :class:`DomainError`, which the caller
dead-letters as ``domain``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from reconciler.core.frozen import fast_init
from reconciler.core.model import (
    ClaimSpec,
    ClassName,
    ComputeMode,
    Gpu,
    GpuRequest,
    GpuRuntime,
    HostName,
    InstanceName,
    InstanceType,
    JobId,
    LeaseId,
    LeaseKind,
    MigMode,
    Placement,
    PolicySelector,
    PoolName,
    Quota,
    RequestId,
    Resources,
    WarmPolicy,
)


class DomainError(ValueError):
    """A well-formed payload that cannot be an input (dead-lettered as ``domain``)."""


# --------------------------------------------------------------------------- hosts


@fast_init
@dataclass(frozen=True, slots=True)
class HostSnapshot:
    host: HostName
    uid: str
    revision: int
    schedulable: bool
    labels: dict[str, str]
    capacity: Resources
    reserve: Resources
    gpus: tuple[Gpu, ...]
    gpu_profile: str | None


@fast_init
@dataclass(frozen=True, slots=True)
class ObservedInstance:
    name: InstanceName
    project: str
    status: str
    status_code: int
    type: str
    config: dict[str, str]
    resources: Resources
    gpus: tuple[str, ...]  # PCI addresses


@fast_init
@dataclass(frozen=True, slots=True)
class HostInventory:
    host: HostName
    uid: str
    revision: int
    instances: tuple[ObservedInstance, ...]


@fast_init
@dataclass(frozen=True, slots=True)
class Lifecycle:
    host: HostName
    action: str
    instance: InstanceName | None
    project: str
    timestamp: str


@fast_init
@dataclass(frozen=True, slots=True)
class Observation:
    host: HostName
    instance: InstanceName
    present: bool
    status: str | None
    checked_revision: int


#: what an instance's creator could not do (:attr:`Failure.action`)
FAILED_ACTIONS = ("create", "start", "delete")


@fast_init
@dataclass(frozen=True, slots=True)
class Failure:
    """What the executor (or a producer that creates instances itself, GARM's provider)
    could not do to a lease's instance, for good: a create Incus refused, a start that
    failed after its retries, a delete that cannot be done (an addition)."""

    host: HostName
    instance: InstanceName
    project: str
    lease_id: LeaseId
    action: str  # one of FAILED_ACTIONS
    error: str


# -------------------------------------------------------------------------- config


@fast_init
@dataclass(frozen=True, slots=True)
class PoolConfig:
    pool: PoolName
    flavor: Resources
    claims: tuple[ClaimSpec, ...]
    warm: WarmPolicy
    max_instances: int
    priority: int
    host_selector: dict[str, str]
    placement: Placement
    image: str
    profiles: tuple[str, ...]
    project: str
    instance_type: InstanceType | None = None
    queue_wait_s: int | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ClassConfig:
    name: ClassName
    gpu: GpuRequest | None
    host_selector: dict[str, str]


@fast_init
@dataclass(frozen=True, slots=True)
class GpuProfileConfig:
    name: str
    revision: int
    defaults: GpuRuntime


@fast_init
@dataclass(frozen=True, slots=True)
class GpuPolicyConfig:
    name: str
    priority: int
    selector: PolicySelector
    overrides: dict[str, Any]  # validated by the fold, so a bad one is rejected by name


@fast_init
@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant (an addition): its pools, nominal quota, weight and cohort."""

    tenant: str
    pools: tuple[PoolName, ...]
    quota: Quota
    weight: int
    cohort: str | None
    borrowing_limit: Quota | None
    lending_limit: Quota | None


ConfigInput = PoolConfig | ClassConfig | GpuProfileConfig | GpuPolicyConfig | TenantConfig


@fast_init
@dataclass(frozen=True, slots=True)
class RefusedConfig:
    """A config input refused before the fold could read it, for a field its schema
    does not name: the fold rejects it by name (``config.rejected``), as it does a
    config it cannot use, and the last good version stays in force."""

    kind: str
    name: str
    error: str


@fast_init
@dataclass(frozen=True, slots=True)
class ConfigItem:
    """One item of a config change: its kind (``pool``, ``class``, ``gpu-profile``,
    ``gpu-policy``) and name, and the typed config, or why it is not one."""

    kind: str
    name: str
    config: ConfigInput | None
    error: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ConfigRef:
    """A config item named for deletion."""

    kind: str
    name: str


# ------------------------------------------------------------------------ commands


@fast_init
@dataclass(frozen=True, slots=True)
class Admit:
    request_id: RequestId
    pool: PoolName
    instance: InstanceName
    kind: LeaseKind
    job: JobId | None
    host: HostName | None
    claims: tuple[ClaimSpec, ...]
    preemptible: bool = False
    #: seconds it may wait for room (an addition): ``None`` takes the pool's default
    wait_s: int | None = None

    @property
    def verb(self) -> str:
        return "admit-preemptible" if self.preemptible else "admit"


@fast_init
@dataclass(frozen=True, slots=True)
class ClaimWarm:
    request_id: RequestId
    pool: PoolName
    job: JobId
    verb = "claim-warm"


@fast_init
@dataclass(frozen=True, slots=True)
class AuthorizeWarmDrain:
    request_id: RequestId
    instance: InstanceName
    verb = "authorize-warm-drain"


@fast_init
@dataclass(frozen=True, slots=True)
class MarkCreated:
    request_id: RequestId
    instance: InstanceName
    verb = "mark-created"


@fast_init
@dataclass(frozen=True, slots=True)
class MarkWarmInjected:
    request_id: RequestId
    instance: InstanceName
    job: JobId
    verb = "mark-warm-injected"


@fast_init
@dataclass(frozen=True, slots=True)
class MarkDeleting:
    request_id: RequestId
    instance: InstanceName
    verb = "mark-deleting"


@fast_init
@dataclass(frozen=True, slots=True)
class Release:
    request_id: RequestId
    instance: InstanceName
    verb = "release"


@fast_init
@dataclass(frozen=True, slots=True)
class RenderRuntime:
    """Re-render a lease's GPU runtime against the host's current inputs (an addition)."""

    request_id: RequestId
    instance: InstanceName
    verb = "render-runtime"


@fast_init
@dataclass(frozen=True, slots=True)
class QueueTimeout:
    """The leader's word that a waiting request's deadline has passed (an addition):
    the fold ends every wait whose deadline is at or before the command's timestamp."""

    request_id: RequestId
    #: the waiting request it is published for
    waiting: RequestId
    verb = "queue-timeout"


@fast_init
@dataclass(frozen=True, slots=True)
class ApplyConfig:
    """Config items to put and to delete, applied whole or not at all (an addition)."""

    request_id: RequestId
    items: tuple[ConfigItem, ...]
    deletions: tuple[ConfigRef, ...]
    verb = "apply-config"


@fast_init
@dataclass(frozen=True, slots=True)
class Cordon:
    """Admit nothing new on a host (an addition)."""

    request_id: RequestId
    host: HostName
    verb = "cordon"


@fast_init
@dataclass(frozen=True, slots=True)
class Uncordon:
    """Lift a host's cordon or drain (an addition)."""

    request_id: RequestId
    host: HostName
    verb = "uncordon"


@fast_init
@dataclass(frozen=True, slots=True)
class Drain:
    """Cordon a host and delete its idle warm VMs (an addition)."""

    request_id: RequestId
    host: HostName
    verb = "drain"


Command = (
    Admit
    | ClaimWarm
    | AuthorizeWarmDrain
    | MarkCreated
    | MarkWarmInjected
    | MarkDeleting
    | Release
    | RenderRuntime
    | ApplyConfig
    | Cordon
    | Uncordon
    | Drain
    | QueueTimeout
)
Input = (
    HostSnapshot
    | HostInventory
    | Lifecycle
    | Observation
    | Failure
    | PoolConfig
    | ClassConfig
    | GpuProfileConfig
    | GpuPolicyConfig
    | TenantConfig
    | RefusedConfig
    | Command
)


@fast_init
@dataclass(frozen=True, slots=True)
class Message:
    """One input as the fold sees it: its stream position, its time, its content."""

    seq: int
    timestamp: str  # the JetStream timestamp, RFC 3339 UTC
    input: Input
    subject: str = ""


# ------------------------------------------------------------------ from payloads

Payload = Mapping[str, Any]

# Speed notes (``from_payload`` runs once per input, on the decoder's hot path):
# - ids are passed as they come, without calling their ``NewType``: on Python 3.11 a
#   ``NewType`` call is a Python-level function that returns its argument unchanged,
#   and a payload's values are ``Any``, which mypy accepts where an id is expected;
# - enum values are looked up in a dict of the members by value, falling back to the
#   enum's own call (``LeaseKind("cold")`` is a Python-level call of ~300 ns), so an
#   invalid value fails exactly as before;
# - empty lists skip the comprehensions and duplicate checks built for the general case.

_LEASE_KINDS: dict[str, LeaseKind] = {k.value: k for k in LeaseKind}


def _resources(d: Payload) -> Resources:
    return Resources(int(d["cpu"]), int(d["memory_mib"]), int(d["disk_gib"]))


def _gpu_request(d: Payload | None) -> GpuRequest | None:
    if d is None:
        return None
    return GpuRequest(
        count=int(d.get("count", 1)),
        vendor=d.get("vendor"),
        model=d.get("model"),
        min_memory_mib=d.get("min_memory_mib"),
    )


def _claim(d: Payload) -> ClaimSpec:
    params = d.get("parameters") or {}
    return ClaimSpec(
        name=d["name"], class_name=ClassName(d["class"]), gpu=_gpu_request(params.get("gpu"))
    )


def _snapshot(p: Payload) -> HostSnapshot:
    gpus = p.get("gpus")
    return HostSnapshot(
        host=p["host"],
        uid=p["uid"],
        revision=p["revision"],
        schedulable=p["schedulable"],
        labels=dict(p.get("labels") or {}),
        capacity=_resources(p["capacity"]),
        reserve=_resources(p["reserve"]),
        gpus=tuple(
            Gpu(
                index=g["index"],
                vendor=g["vendor"],
                model=g["model"],
                memory_mib=g["memory_mib"],
                pci_address=g["pci_address"],
                numa_node=g["numa_node"],
            )
            for g in gpus
        )
        if gpus
        else (),
        gpu_profile=p.get("gpu_profile"),
    )


def _inventory(p: Payload) -> HostInventory:
    return HostInventory(
        host=HostName(p["host"]),
        uid=p["uid"],
        revision=p["revision"],
        instances=tuple(
            ObservedInstance(
                name=InstanceName(i["name"]),
                project=i.get("project", "default"),
                status=i.get("status", ""),
                status_code=i.get("status_code", 0),
                type=i.get("type", "virtual-machine"),
                config=dict(i.get("config") or {}),
                resources=_resources(
                    i.get("resources") or {"cpu": 0, "memory_mib": 0, "disk_gib": 0}
                ),
                gpus=tuple(i.get("gpus") or ()),
            )
            for i in p["instances"]
        ),
    )


def _lifecycle(p: Payload) -> Lifecycle:
    event = p["event"]
    meta = event["metadata"]
    name = meta.get("name")
    source = meta.get("source", "")
    if not name and source.startswith("/1.0/instances/"):
        name = source.removeprefix("/1.0/instances/").split("?", 1)[0]
    return Lifecycle(
        host=p["host"],
        action=meta["action"],
        instance=name or None,
        project=meta.get("project") or event.get("project") or "default",
        timestamp=event.get("timestamp", ""),
    )


def _observation(p: Payload) -> Observation:
    return Observation(
        host=HostName(p["host"]),
        instance=InstanceName(p["instance"]),
        present=p["present"],
        status=p.get("status"),
        checked_revision=p["checked_revision"],
    )


def _failure(p: Payload) -> Failure:
    return Failure(
        host=p["host"],
        instance=p["instance"],
        project=p.get("project", "default"),
        lease_id=p["lease_id"],
        action=p["action"],
        error=p["error"],
    )


def _pool(p: Payload) -> PoolConfig:
    warm = p.get("warm") or {}
    return PoolConfig(
        pool=PoolName(p["pool"]),
        flavor=_resources(p["flavor"]),
        claims=tuple(_claim(c) for c in p.get("claims") or ()),
        warm=WarmPolicy(
            min_ready=warm.get("min_ready", 0),
            max_ready=warm.get("max_ready", 0),
            protect_min_ready=warm.get("protect_min_ready", False),
        ),
        max_instances=p["max_instances"],
        priority=p.get("priority", 0),
        host_selector=dict(p.get("host_selector") or {}),
        placement=Placement(p.get("placement", "pack")),
        image=p.get("image", ""),
        profiles=tuple(p.get("profiles") or ()),
        project=p.get("project", "default"),
        instance_type=InstanceType(p["instance_type"]) if "instance_type" in p else None,
        queue_wait_s=p["queue"]["wait_s"] if "queue" in p else None,
    )


def _class(p: Payload) -> ClassConfig:
    params = p.get("parameters") or {}
    return ClassConfig(
        name=ClassName(p["class"]),
        gpu=_gpu_request(params.get("gpu")),
        host_selector=dict(p.get("host_selector") or {}),
    )


def _gpu_profile(p: Payload) -> GpuProfileConfig:
    d = p["defaults"]
    return GpuProfileConfig(
        name=p["name"],
        revision=p["revision"],
        defaults=GpuRuntime(
            mig_mode=MigMode(d["mig_mode"]),
            compute_mode=ComputeMode(d["compute_mode"]),
            persistence=d["persistence"],
            power_limit_w=d.get("power_limit_w"),
            ecc=d["ecc"],
        ),
    )


def _gpu_policy(p: Payload) -> GpuPolicyConfig:
    s = p.get("selector") or {}
    return GpuPolicyConfig(
        name=p["name"],
        priority=p["priority"],
        selector=PolicySelector(
            host_labels=dict(s["host_labels"]) if s.get("host_labels") is not None else None,
            models=tuple(s["models"]) if s.get("models") is not None else None,
            indexes=tuple(s["indexes"]) if s.get("indexes") is not None else None,
        ),
        overrides=dict(p.get("overrides") or {}),
    )


def _quota(q: Payload | None) -> Quota | None:
    if q is None:
        return None
    return Quota(
        q.get("cpu"), q.get("memory_mib"), q.get("disk_gib"), q.get("gpus"), q.get("instances")
    )


def _tenant(p: Payload) -> TenantConfig:
    return TenantConfig(
        tenant=p["tenant"],
        pools=tuple(PoolName(name) for name in p.get("pools") or ()),
        quota=_quota(p.get("quota")) or Quota(),
        weight=p.get("weight", 1),
        cohort=p.get("cohort"),
        borrowing_limit=_quota(p.get("borrowing_limit")),
        lending_limit=_quota(p.get("lending_limit")),
    )


def _admit(p: Payload, preemptible: bool = False) -> Admit:
    claims = p.get("claims")
    value = p.get("kind", "cold")
    kind = _LEASE_KINDS.get(value) if type(value) is str else None
    return Admit(
        p["request_id"],
        p["pool"],
        p["instance"],
        kind if kind is not None else LeaseKind(value),
        p.get("job"),
        p.get("host"),
        tuple(_claim(c) for c in claims) if claims else (),
        preemptible,
        p.get("wait_s"),
    )


def apply_config(p: Payload, item_errors: Mapping[int, str] | None = None) -> ApplyConfig:
    """The typed ``apply-config`` command of a payload whose envelope passed its schema.

    Each item is built as its config input would be (:func:`from_payload`); an item that
    cannot be is kept with its error, so that the fold refuses the change naming it.
    ``item_errors`` are the items (by index) that failed their own config schema, with
    the sentence to report (the decoder checks each against ``config.<kind>``)."""
    items: list[ConfigItem] = []
    for index, raw in enumerate(p.get("items") or ()):
        kind, payload = raw["kind"], raw["payload"]
        named = payload.get(CONFIG_NAME_FIELDS[kind])
        name = named if isinstance(named, str) else ""
        error = item_errors.get(index) if item_errors else None
        config: Any = None
        if error is None:
            try:
                config = from_payload(f"config.{kind}", payload)
            except DomainError as exc:
                error = str(exc)
        items.append(ConfigItem(kind, name, config, error))
    return ApplyConfig(
        request_id=p["request_id"],
        items=tuple(items),
        deletions=tuple(ConfigRef(d["kind"], d["name"]) for d in p.get("delete") or ()),
    )


_BUILDERS: dict[str, Callable[[Payload], Input]] = {
    "host.snapshot": _snapshot,
    "host.inventory": _inventory,
    "host.lifecycle": _lifecycle,
    "host.observation": _observation,
    "host.failure": _failure,
    "config.pool": _pool,
    "config.class": _class,
    "config.gpu-profile": _gpu_profile,
    "config.gpu-policy": _gpu_policy,
    "config.tenant": _tenant,
    "cmd.admit": _admit,
    "cmd.admit-preemptible": partial(_admit, preemptible=True),
    "cmd.claim-warm": lambda p: ClaimWarm(p["request_id"], p["pool"], p["job"]),
    "cmd.authorize-warm-drain": lambda p: AuthorizeWarmDrain(p["request_id"], p["instance"]),
    "cmd.mark-created": lambda p: MarkCreated(p["request_id"], p["instance"]),
    "cmd.mark-warm-injected": lambda p: MarkWarmInjected(p["request_id"], p["instance"], p["job"]),
    "cmd.mark-deleting": lambda p: MarkDeleting(p["request_id"], p["instance"]),
    "cmd.release": lambda p: Release(p["request_id"], p["instance"]),
    "cmd.render-runtime": lambda p: RenderRuntime(p["request_id"], p["instance"]),
    "cmd.apply-config": apply_config,
    "cmd.cordon": lambda p: Cordon(p["request_id"], p["host"]),
    "cmd.uncordon": lambda p: Uncordon(p["request_id"], p["host"]),
    "cmd.drain": lambda p: Drain(p["request_id"], p["host"]),
    "cmd.queue-timeout": lambda p: QueueTimeout(p["request_id"], p["waiting"]),
}

#: input kinds, as named by the subject after ``<prefix>.in.`` (host token removed)
KINDS = tuple(_BUILDERS)

#: the payload field that names a config input, per config kind (``pool``, ``class``…)
CONFIG_NAME_FIELDS: dict[str, str] = {
    "pool": "pool",
    "class": "class",
    "gpu-profile": "name",
    "gpu-policy": "name",
    "tenant": "tenant",
}

# Which payload field must equal the subject's name token, per kind family.
_SUBJECT_FIELD = {
    "host": "host",
    **{f"config.{kind}": field for kind, field in CONFIG_NAME_FIELDS.items()},
}
#: the same, per kind (commands have no name token)
_SUBJECT_FIELD_OF_KIND: dict[str, str | None] = {
    kind: _SUBJECT_FIELD.get(kind.split(".", 1)[0] if kind.startswith("host.") else kind)
    for kind in KINDS
}


def from_payload(kind: str, payload: Payload, *, subject_token: str | None = None) -> Input:
    """Build the typed input of ``kind`` from a schema-valid payload.

    ``subject_token`` is the ``<host>``/``<pool>``/``<class>``/``<name>`` token of the
    subject; it must equal the corresponding payload field.
    """
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise DomainError(f"unknown input kind {kind!r}")
    if subject_token is not None:
        key = _SUBJECT_FIELD_OF_KIND[kind]
        if key is not None and payload.get(key) != subject_token:
            raise DomainError(
                f"subject names {subject_token!r} but payload field {key!r} is {payload.get(key)!r}"
            )
    try:
        built = builder(payload)
    except (KeyError, TypeError, ValueError) as exc:
        raise DomainError(f"{kind}: {type(exc).__name__}: {exc}") from exc
    # the domain checks a JSON Schema cannot state (_check(), inlined)
    check = _CHECKS.get(type(built))
    if check is not None:
        check(built)
    return built


def _duplicates(values: list[Any]) -> list[Any]:
    if len(values) < 2:
        return []
    seen: set[Any] = set()
    return sorted({v for v in values if v in seen or seen.add(v)})  # type: ignore[func-returns-value]


def _check_snapshot(built: HostSnapshot) -> None:
    if len(built.gpus) < 2:
        return
    if dup := _duplicates([g.index for g in built.gpus]):
        raise DomainError(f"snapshot of host {built.host!r} repeats GPU index {dup}")
    if dup := _duplicates([g.pci_address for g in built.gpus]):
        raise DomainError(f"snapshot of host {built.host!r} repeats PCI address {dup}")


def _check_inventory(built: HostInventory) -> None:
    if dup := _duplicates([(i.project, i.name) for i in built.instances]):
        raise DomainError(f"inventory of host {built.host!r} repeats instance {dup}")


def _check_admit(built: Admit) -> None:
    if len(built.claims) > 1 and (dup := _duplicates([c.name for c in built.claims])):
        raise DomainError(f"request {built.request_id!r} repeats claim name {dup}")
    if built.preemptible and built.kind is not LeaseKind.COLD:
        raise DomainError(f"request {built.request_id!r}: admit-preemptible is for cold VMs")


#: the domain checks by input type (found by the exact type: every input class is final)
_CHECKS: dict[type, Callable[[Any], None]] = {
    HostSnapshot: _check_snapshot,
    HostInventory: _check_inventory,
    Admit: _check_admit,
}
