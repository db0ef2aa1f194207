"""Config kinds: pools, resource classes, GPU profiles, GPU policies and tenants, one entry
each.

Everything that handles config by its kind goes through :data:`CONFIG_KINDS`:

- the checks the fold makes on an input of the kind before it accepts it (``check``:
  the sentence it is rejected with, ``None`` when it may be used); a single
  ``in.config.<kind>.<name>`` input and an item of an ``apply-config`` change are
  checked alike;
- the entity an accepted input becomes in the state (``build``), and the state's table
  of the kind (``table``);
- what uses an item, so that deleting it is refused while anything does (``users``):
  a class while a pool's claims name it, a GPU profile while a host names it or a lease
  was rendered against it; pools and GPU policies can always be deleted;
- what an item to put contradicts in the config it would join (``conflicts``): a tenant
  naming a pool another tenant names (a pool belongs to one tenant at most: its quota,
  its share and its idle warm VMs are that tenant's);
- the payload an entity is shown as (``payload``): what ``reconciler get`` prints and
  ``apply`` accepts back, and what ``diff`` compares, field by field.

A new kind (tenants) is one more :class:`ConfigKind` here, with its typed input, its
builder and name field in :mod:`reconciler.core.inputs`, its fold handler, and its
schema (``in/config.<kind>.json``, and the ``config-kind`` enum of ``defs.json``; a test
keeps them the same as this table). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from reconciler.core import inputs as ev
from reconciler.core.model import (
    ClaimSpec,
    ClassName,
    GpuPolicy,
    GpuProfile,
    GpuRequest,
    Pool,
    PoolName,
    ResourceClass,
    Tenant,
)
from reconciler.core.runtime import RuntimeConfigError, validate_overrides, validate_profile
from reconciler.core.state import Effects, State

__all__ = [
    "CONFIG_KINDS",
    "KIND_OF_PLURAL",
    "ConfigKind",
    "ConfigView",
    "diff_payloads",
]


class ConfigView:
    """The config a change would leave: the state's, with the change's items put
    (``put``: kind -> name -> entity) and deleted (``deleted``: kind -> names)."""

    def __init__(
        self,
        state: State,
        *,
        put: Mapping[str, Mapping[str, object]] | None = None,
        deleted: Mapping[str, set[str]] | None = None,
    ) -> None:
        self.state = state
        self.put = put or {}
        self.deleted = deleted or {}

    def entities(self, kind: str) -> dict[str, Any]:
        table: dict[str, Any] = dict(CONFIG_KINDS[kind].table(self.state))
        table.update(self.put.get(kind, {}))
        for name in self.deleted.get(kind, ()):
            table.pop(name, None)
        return table


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigKind:
    """One kind of config; see the module's rules."""

    #: the kind as subjects and ``apply`` files name it (``pool``)
    kind: str
    #: as ``reconciler get`` names it (``pools``)
    plural: str
    #: the typed input of the kind
    input_type: type
    #: the state's table of the kind
    table: Callable[[State], dict[Any, Any]]
    #: records in a step's effects that the named item changed (the rows to write)
    touch: Callable[[Effects, str], None]
    #: why the fold refuses an input of the kind (``None``: it does not)
    check: Callable[[Any], str | None]
    #: the entity an accepted input becomes, folded at input ``seq``
    build: Callable[[Any, int], Any]
    #: the payload an entity is shown as (``apply`` accepts it back)
    payload: Callable[[Any], dict[str, Any]]
    #: what uses the named item in a config view (deleting it is refused while any does)
    users: Callable[[ConfigView, str], list[str]]
    #: why the named item, as a config view holds it, contradicts the rest of the view
    #: (``None``: it does not); putting it is refused. ``None``: a kind without conflicts
    conflicts: Callable[[ConfigView, str], str | None] | None = None

    @property
    def name_field(self) -> str:
        """The payload field holding the item's name (the typed inputs' own table)."""
        return ev.CONFIG_NAME_FIELDS[self.kind]


# -------------------------------------------------------------------------- checks


def _check_pool(cfg: ev.PoolConfig) -> str | None:
    warm = cfg.warm
    if warm.min_ready > warm.max_ready:
        return f"pool {cfg.pool!r}: warm.min_ready {warm.min_ready} > max_ready {warm.max_ready}"
    if warm.max_ready > cfg.max_instances:
        return (
            f"pool {cfg.pool!r}: warm.max_ready {warm.max_ready} > "
            f"max_instances {cfg.max_instances}"
        )
    if len({c.name for c in cfg.claims}) != len(cfg.claims):
        return f"pool {cfg.pool!r}: claim names repeat"
    if warm.max_ready > 0 and not cfg.image:
        return f"pool {cfg.pool!r}: a warm pool needs an image"
    return None


def _check_class(cfg: ev.ClassConfig) -> str | None:
    gpu = cfg.gpu
    if gpu is not None and gpu.count < 1:
        return f"class {cfg.name!r}: parameters.gpu.count must be at least 1, not {gpu.count}"
    if gpu is not None and (gpu.vendor == "" or gpu.model == ""):
        return f"class {cfg.name!r}: parameters.gpu vendor and model may not be empty"
    return None


def _check_profile(cfg: ev.GpuProfileConfig) -> str | None:
    try:
        validate_profile(cfg.name, cfg.defaults)
    except RuntimeConfigError as exc:
        return str(exc)
    return None


def _check_policy(cfg: ev.GpuPolicyConfig) -> str | None:
    try:
        validate_overrides(cfg.name, cfg.overrides)
    except RuntimeConfigError as exc:
        return str(exc)
    if cfg.selector.indexes is not None and any(i < 0 for i in cfg.selector.indexes):
        return f"gpu-policy {cfg.name!r}: negative GPU index"
    return None


def _check_tenant(cfg: ev.TenantConfig) -> str | None:
    if cfg.cohort is None and (cfg.borrowing_limit is not None or cfg.lending_limit is not None):
        return f"tenant {cfg.tenant!r}: borrowing and lending limits need a cohort"
    if len(set(cfg.pools)) != len(cfg.pools):
        return f"tenant {cfg.tenant!r}: pools repeat"
    return None


# --------------------------------------------------------------------------- build


def _build_pool(cfg: ev.PoolConfig, seq: int) -> Pool:
    return Pool(
        name=cfg.pool,
        flavor=cfg.flavor,
        claims=cfg.claims,
        warm=cfg.warm,
        max_instances=cfg.max_instances,
        priority=cfg.priority,
        host_selector=dict(cfg.host_selector),
        placement=cfg.placement,
        image=cfg.image,
        profiles=cfg.profiles,
        project=cfg.project,
        seq=seq,
        instance_type=cfg.instance_type,
        queue_wait_s=cfg.queue_wait_s,
    )


def _build_class(cfg: ev.ClassConfig, seq: int) -> ResourceClass:
    return ResourceClass(name=cfg.name, gpu=cfg.gpu, host_selector=dict(cfg.host_selector), seq=seq)


def _build_profile(cfg: ev.GpuProfileConfig, seq: int) -> GpuProfile:
    return GpuProfile(cfg.name, cfg.revision, cfg.defaults, seq)


def _build_policy(cfg: ev.GpuPolicyConfig, seq: int) -> GpuPolicy:
    overrides = validate_overrides(cfg.name, cfg.overrides)  # checked: cannot raise here
    return GpuPolicy(cfg.name, cfg.priority, cfg.selector, overrides, seq)


def _build_tenant(cfg: ev.TenantConfig, seq: int) -> Tenant:
    return Tenant(
        name=cfg.tenant,
        pools=cfg.pools,
        quota=cfg.quota,
        weight=cfg.weight,
        cohort=cfg.cohort,
        borrowing_limit=cfg.borrowing_limit,
        lending_limit=cfg.lending_limit,
        seq=seq,
    )


# ------------------------------------------------------------------------ payloads


def _gpu_request(gpu: GpuRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"count": gpu.count}
    if gpu.vendor is not None:
        out["vendor"] = gpu.vendor
    if gpu.model is not None:
        out["model"] = gpu.model
    if gpu.min_memory_mib is not None:
        out["min_memory_mib"] = gpu.min_memory_mib
    return out


def _claim(claim: ClaimSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": claim.name, "class": claim.class_name}
    if claim.gpu is not None:
        out["parameters"] = {"gpu": _gpu_request(claim.gpu)}
    return out


def _pool_payload(pool: Pool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "v": 1,
        "pool": pool.name,
        "flavor": pool.flavor.as_dict(),
        "claims": [_claim(c) for c in pool.claims],
        "warm": {
            "min_ready": pool.warm.min_ready,
            "max_ready": pool.warm.max_ready,
            "protect_min_ready": pool.warm.protect_min_ready,
        },
        "max_instances": pool.max_instances,
        "priority": pool.priority,
        "host_selector": dict(sorted(pool.host_selector.items())),
        "placement": pool.placement.value,
        "image": pool.image,
        "profiles": list(pool.profiles),
        "project": pool.project,
    }
    if pool.instance_type is not None:
        out["instance_type"] = pool.instance_type.value
    if pool.queue_wait_s is not None:
        out["queue"] = {"wait_s": pool.queue_wait_s}
    return out


def _class_payload(resource_class: ResourceClass) -> dict[str, Any]:
    parameters = {"gpu": _gpu_request(resource_class.gpu)} if resource_class.gpu else {}
    return {
        "v": 1,
        "class": resource_class.name,
        "parameters": parameters,
        "host_selector": dict(sorted(resource_class.host_selector.items())),
    }


def _profile_payload(profile: GpuProfile) -> dict[str, Any]:
    return {
        "v": 1,
        "name": profile.name,
        "revision": profile.revision,
        "defaults": profile.defaults.as_dict(),
    }


def _policy_payload(policy: GpuPolicy) -> dict[str, Any]:
    selector: dict[str, Any] = {}
    s = policy.selector
    if s.host_labels is not None:
        selector["host_labels"] = dict(sorted(s.host_labels.items()))
    if s.models is not None:
        selector["models"] = list(s.models)
    if s.indexes is not None:
        selector["indexes"] = list(s.indexes)
    overrides = {key: str(v) if isinstance(v, str) else v for key, v in policy.overrides}
    return {
        "v": 1,
        "name": policy.name,
        "priority": policy.priority,
        "selector": selector,
        "overrides": overrides,
    }


def _tenant_payload(tenant: Tenant) -> dict[str, Any]:
    return {
        "v": 1,
        "tenant": tenant.name,
        "pools": list(tenant.pools),
        "quota": tenant.quota.as_dict(),
        "weight": tenant.weight,
        "cohort": tenant.cohort,
        "borrowing_limit": (
            tenant.borrowing_limit.as_dict() if tenant.borrowing_limit is not None else None
        ),
        "lending_limit": (
            tenant.lending_limit.as_dict() if tenant.lending_limit is not None else None
        ),
    }


# ----------------------------------------------------------------------- conflicts


def _tenant_conflicts(view: ConfigView, name: str) -> str | None:
    tenants: dict[str, Tenant] = view.entities("tenant")
    mine = tenants.get(name)
    if mine is None:
        return None
    for other in sorted(tenants):
        shared = [p for p in mine.pools if other != name and p in tenants[other].pools]
        if shared:
            return (
                f"tenant {name!r}: pool {shared[0]!r} belongs to tenant {other!r} already "
                "(a pool belongs to one tenant at most)"
            )
    return None


# --------------------------------------------------------------------------- users


def _no_users(view: ConfigView, name: str) -> list[str]:
    return []


def _class_users(view: ConfigView, name: str) -> list[str]:
    pools: dict[str, Pool] = view.entities("pool")
    return [
        f"pool {pool!r}"
        for pool in sorted(pools)
        if any(c.class_name == name for c in pools[pool].claims)
    ]


def _profile_users(view: ConfigView, name: str) -> list[str]:
    state = view.state
    hosts = [f"host {h!r}" for h in sorted(state.hosts) if state.hosts[h].gpu_profile == name]
    leases = sorted(
        le.lease_id for le in state.leases.values() if le.active and le.runtime_profile == name
    )
    if leases:
        hosts.append(f"{len(leases)} active lease(s) ({', '.join(leases[:3])}…)")
    return hosts


def _touch_tenant(fx: Effects, name: str) -> None:
    fx.tenants.add(name)


def _touch_pool(fx: Effects, name: str) -> None:
    fx.pools.add(PoolName(name))
    fx.pool_rows.add(PoolName(name))


#: every config kind, by the word its subjects and files name it by
CONFIG_KINDS: Final[dict[str, ConfigKind]] = {
    k.kind: k
    for k in (
        ConfigKind(
            kind="pool",
            plural="pools",
            input_type=ev.PoolConfig,
            table=lambda state: state.pools,
            touch=_touch_pool,
            check=_check_pool,
            build=_build_pool,
            payload=_pool_payload,
            users=_no_users,
        ),
        ConfigKind(
            kind="class",
            plural="classes",
            input_type=ev.ClassConfig,
            table=lambda state: state.classes,
            touch=lambda fx, name: fx.classes.add(ClassName(name)),
            check=_check_class,
            build=_build_class,
            payload=_class_payload,
            users=_class_users,
        ),
        ConfigKind(
            kind="gpu-profile",
            plural="gpu-profiles",
            input_type=ev.GpuProfileConfig,
            table=lambda state: state.profiles,
            touch=lambda fx, name: fx.profiles.add(name),
            check=_check_profile,
            build=_build_profile,
            payload=_profile_payload,
            users=_profile_users,
        ),
        ConfigKind(
            kind="gpu-policy",
            plural="gpu-policies",
            input_type=ev.GpuPolicyConfig,
            table=lambda state: state.policies,
            touch=lambda fx, name: fx.policies.add(name),
            check=_check_policy,
            build=_build_policy,
            payload=_policy_payload,
            users=_no_users,
        ),
        ConfigKind(
            kind="tenant",
            plural="tenants",
            input_type=ev.TenantConfig,
            table=lambda state: state.tenants,
            touch=_touch_tenant,
            check=_check_tenant,
            build=_build_tenant,
            payload=_tenant_payload,
            users=_no_users,
            conflicts=_tenant_conflicts,
        ),
    )
}

#: ``pools`` -> ``pool``: the kinds as ``reconciler get`` and ``delete`` name them
KIND_OF_PLURAL: Final[dict[str, str]] = {k.plural: k.kind for k in CONFIG_KINDS.values()}


def diff_payloads(before: Any, after: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every field that differs between two payloads: ``(dotted path, before, after)``,
    in the order of ``after``'s fields (then ``before``'s fields it lacks); lists are
    compared whole."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in [*after, *(k for k in before if k not in after)]:
            where = f"{path}.{key}" if path else str(key)
            out += diff_payloads(before.get(key, _ABSENT), after.get(key, _ABSENT), where)
        return out
    return [] if before == after else [(path, before, after)]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT: Final = _Absent()
