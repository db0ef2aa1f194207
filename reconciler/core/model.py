"""The domain model: resources, hosts, GPUs, pools, classes, leases.

Every entity is a frozen, slotted dataclass; changing one means building a new one
(``dataclasses.replace``). Identifiers are ``NewType`` strings so that mypy keeps a
host name from being passed where a lease id is expected.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NewType

from reconciler.core.frozen import evolver, fast_init

#: the metadata key of a field :data:`ADDED_LATER`
OMITTED_AT_DEFAULT = "omitted_at_default"
#: metadata of a field added to a stored entity after such entities were first stored
#: (``field(default=None, metadata=ADDED_LATER)``): the store writes it only when it holds
#: another value than its default, so an entity that never sets it keeps its encoding,
#: and a state its digest (reconciler.store.codec)
ADDED_LATER: Mapping[str, object] = MappingProxyType({OMITTED_AT_DEFAULT: True})

HostName = NewType("HostName", str)
PoolName = NewType("PoolName", str)
ClassName = NewType("ClassName", str)
LeaseId = NewType("LeaseId", str)
InstanceName = NewType("InstanceName", str)
JobId = NewType("JobId", str)
RequestId = NewType("RequestId", str)


@fast_init
@dataclass(frozen=True, slots=True)
class Resources:
    """A quantity of the three scalar resources; never negative when it is a demand."""

    cpu: int = 0
    memory_mib: int = 0
    disk_gib: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu + other.cpu,
            self.memory_mib + other.memory_mib,
            self.disk_gib + other.disk_gib,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu - other.cpu,
            self.memory_mib - other.memory_mib,
            self.disk_gib - other.disk_gib,
        )

    def fits_in(self, room: Resources) -> bool:
        """True when this demand fits in ``room`` in every dimension."""
        return (
            self.cpu <= room.cpu
            and self.memory_mib <= room.memory_mib
            and self.disk_gib <= room.disk_gib
        )

    def is_negative(self) -> bool:
        return self.cpu < 0 or self.memory_mib < 0 or self.disk_gib < 0

    def as_dict(self) -> dict[str, int]:
        return {"cpu": self.cpu, "memory_mib": self.memory_mib, "disk_gib": self.disk_gib}


ZERO = Resources()


@fast_init
@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    vendor: str
    model: str
    memory_mib: int
    pci_address: str
    numa_node: int


@fast_init
@dataclass(frozen=True, slots=True)
class Host:
    """What the latest accepted snapshot and inventory said about one Incus host."""

    name: HostName
    uid: str = ""
    snapshot_revision: int = -1
    inventory_revision: int = -1
    #: input sequence of the latest accepted snapshot / inventory (launch gate)
    snapshot_seq: int = 0
    inventory_seq: int = 0
    #: snapshot revision at which GPUs, labels or the GPU profile last changed
    gpu_revision: int = -1
    schedulable: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    capacity: Resources = ZERO
    reserve: Resources = ZERO
    gpus: tuple[Gpu, ...] = ()
    gpu_profile: str | None = None
    #: instances in the latest inventory that carry none of our lease tags
    foreign_demand: Resources = ZERO
    foreign_pci: frozenset[str] = frozenset()
    #: ``foreign_pci`` resolved against the latest snapshot's GPUs
    foreign_gpus: frozenset[int] = frozenset()
    foreign_instances: tuple[str, ...] = ()
    #: an operator's cordon on the bus (:data:`CORDONED` or :data:`DRAINING_HOST`):
    #: nothing new is admitted here, whatever the snapshot says; ``None``: none
    cordon: str | None = field(default=None, metadata=ADDED_LATER)

    @property
    def allocatable(self) -> Resources:
        return self.capacity - self.reserve

    def gpu_by_pci(self) -> dict[str, Gpu]:
        return {g.pci_address: g for g in self.gpus}

    @property
    def admits(self) -> bool:
        """Whether new leases may be placed here: its snapshot says schedulable and no
        operator cordoned it (placement spells this out on its hot path)."""
        return self.schedulable and self.cordon is None


#: :attr:`Host.cordon` values: no new admissions; and also its idle warm VMs deleted
CORDONED = "cordoned"
DRAINING_HOST = "draining"


class Placement(enum.StrEnum):
    PACK = "pack"
    SPREAD = "spread"


class InstanceType(enum.StrEnum):
    """What a pool's instances are in Incus (a pool that says nothing gets VMs)."""

    VIRTUAL_MACHINE = "virtual-machine"
    CONTAINER = "container"


@fast_init
@dataclass(frozen=True, slots=True)
class GpuRequest:
    """The GPU part of a class's (or a merged claim's) parameters."""

    count: int
    vendor: str | None = None
    model: str | None = None
    min_memory_mib: int | None = None

    def matches(self, gpu: Gpu) -> bool:
        if self.vendor is not None and gpu.vendor != self.vendor:
            return False
        if self.model is not None and gpu.model != self.model:
            return False
        return self.min_memory_mib is None or gpu.memory_mib >= self.min_memory_mib


@fast_init
@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """A claim as written in a pool or a request: a class name and optional parameters."""

    name: str
    class_name: ClassName
    gpu: GpuRequest | None = None  # the claim's own parameters, not yet merged


@fast_init
@dataclass(frozen=True, slots=True)
class ResourceClass:
    name: ClassName
    gpu: GpuRequest | None = None
    host_selector: dict[str, str] = field(default_factory=dict)
    seq: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class ResolvedClaim:
    """A claim merged with its class: what placement actually has to satisfy."""

    name: str
    class_name: ClassName
    gpu: GpuRequest | None
    host_selector: dict[str, str]


@fast_init
@dataclass(frozen=True, slots=True)
class WarmPolicy:
    min_ready: int = 0
    max_ready: int = 0
    protect_min_ready: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class Pool:
    name: PoolName
    flavor: Resources
    claims: tuple[ClaimSpec, ...] = ()
    warm: WarmPolicy = WarmPolicy()
    max_instances: int = 0
    priority: int = 0
    host_selector: dict[str, str] = field(default_factory=dict)
    placement: Placement = Placement.PACK
    image: str = ""
    profiles: tuple[str, ...] = ()
    project: str = "default"
    seq: int = 0
    #: ``None``: the pool did not say (Incus's default, a VM); carried on creates only when set
    instance_type: InstanceType | None = None
    #: how long its admissions wait for room when they do not say (``queue.wait_s``;
    #: docs/queue.md); ``None``: they do not wait
    queue_wait_s: int | None = field(default=None, metadata=ADDED_LATER)


#: the resources a tenant's quota counts, in this order (``instances``: active leases)
QUOTA_RESOURCES = ("cpu", "memory_mib", "disk_gib", "gpus", "instances")


@fast_init
@dataclass(frozen=True, slots=True)
class Quota:
    """An amount of each quota resource; ``None``: unlimited (or, for a limit, none)."""

    cpu: int | None = None
    memory_mib: int | None = None
    disk_gib: int | None = None
    gpus: int | None = None
    instances: int | None = None

    def values(self) -> tuple[int | None, ...]:
        """In :data:`QUOTA_RESOURCES` order."""
        return (self.cpu, self.memory_mib, self.disk_gib, self.gpus, self.instances)

    def as_dict(self) -> dict[str, int]:
        return {
            name: value
            for name, value in zip(QUOTA_RESOURCES, self.values(), strict=True)
            if value is not None
        }


@fast_init
@dataclass(frozen=True, slots=True)
class Tenant:
    """Who owns pools: their nominal quota, fair-sharing weight, and cohort (Kueue's
    ClusterQueue, docs/interface.md "Tenants")."""

    name: str
    pools: tuple[PoolName, ...]
    quota: Quota = Quota()
    weight: int = 1
    cohort: str | None = None
    #: how far above its nominal quota it may borrow from its cohort (``None``: as far
    #: as the cohort lends)
    borrowing_limit: Quota | None = None
    #: how much of its nominal quota its cohort may borrow (``None``: all of it)
    lending_limit: Quota | None = None
    seq: int = 0


class MigMode(enum.StrEnum):
    DISABLED = "disabled"
    ENABLED = "enabled"


class ComputeMode(enum.StrEnum):
    DEFAULT = "default"
    EXCLUSIVE_PROCESS = "exclusive-process"
    PROHIBITED = "prohibited"


RUNTIME_FIELDS = ("mig_mode", "compute_mode", "persistence", "power_limit_w", "ecc")


@fast_init
@dataclass(frozen=True, slots=True)
class GpuRuntime:
    mig_mode: MigMode = MigMode.DISABLED
    compute_mode: ComputeMode = ComputeMode.DEFAULT
    persistence: bool = False
    power_limit_w: int | None = None
    ecc: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "mig_mode": self.mig_mode.value,
            "compute_mode": self.compute_mode.value,
            "persistence": self.persistence,
            "power_limit_w": self.power_limit_w,
            "ecc": self.ecc,
        }


@fast_init
@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    revision: int
    defaults: GpuRuntime
    seq: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class PolicySelector:
    host_labels: dict[str, str] | None = None
    models: tuple[str, ...] | None = None
    indexes: tuple[int, ...] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class GpuPolicy:
    name: str
    priority: int
    selector: PolicySelector
    #: the fields it sets, in RUNTIME_FIELDS order, already validated
    overrides: tuple[tuple[str, object], ...]
    seq: int = 0


class LeaseKind(enum.StrEnum):
    COLD = "cold"
    WARM = "warm"


class LeaseState(enum.StrEnum):
    RESERVED = "reserved"
    CREATED = "created"
    READY = "ready"
    CLAIMED = "claimed"
    INJECTED = "injected"
    DRAINING = "draining"
    VICTIM = "victim"
    DELETING = "deleting"
    RELEASED = "released"


# The lease states and kinds as module constants, for the fold's hot paths: on Python
# 3.11 ``LeaseState.READY`` goes through the enum metaclass's ``__getattr__`` hook (about
# 100 ns, where a global is about 10 ns), and the fold tests lease states and kinds
# several times per input. Imported by name, each is a global of the importing module.
RESERVED = LeaseState.RESERVED
CREATED = LeaseState.CREATED
READY = LeaseState.READY
CLAIMED = LeaseState.CLAIMED
INJECTED = LeaseState.INJECTED
DRAINING = LeaseState.DRAINING
VICTIM = LeaseState.VICTIM
DELETING = LeaseState.DELETING
RELEASED = LeaseState.RELEASED
COLD = LeaseKind.COLD
WARM = LeaseKind.WARM


@fast_init
@dataclass(frozen=True, slots=True)
class Lease:
    """One VM the journal admitted or adopted, and where it is in its life."""

    lease_id: LeaseId
    instance: InstanceName
    host: HostName
    host_uid: str
    pool: PoolName
    kind: LeaseKind
    state: LeaseState
    demand: Resources
    gpus: tuple[int, ...] = ()
    #: PCI addresses an adopted VM was seen with (re-resolved on every snapshot)
    gpu_pci: tuple[str, ...] = ()
    project: str = "default"
    job: JobId | None = None
    request_id: RequestId | None = None
    admitted_seq: int = 0
    #: input sequence at which it became ready (claim order: oldest first)
    ready_seq: int = 0
    adopted: bool = False
    #: missing from an inventory; awaiting a live verification (revision that missed it)
    suspect_revision: int | None = None
    #: the pending cold request this lease was preempted for
    victim_of: RequestId | None = None
    #: set while a preemptible admission waits at the launch gate: the pending decision's seq
    gate_seq: int | None = None
    #: victims (lease ids) still to be released before the launch gate can open
    awaiting_victims: tuple[LeaseId, ...] = ()
    #: what those victims still hold: promised to this lease, booked by it meanwhile
    held: Resources = ZERO
    held_gpus: tuple[int, ...] = ()
    #: runtime inputs this lease's GPUs were rendered against
    runtime_gpu_revision: int = -1
    runtime_profile: str | None = None
    runtime_profile_revision: int = -1
    #: what could not be done to its VM (a create Incus refused, a start that failed, a
    #: delete that cannot be done), as its creator or the executor reported it
    fault: str | None = field(default=None, metadata=ADDED_LATER)

    @property
    def active(self) -> bool:
        return self.state is not RELEASED

    @property
    def books_capacity(self) -> bool:
        """Active and not promised away to a pending cold reservation."""
        return self.state is not RELEASED and self.victim_of is None

    @property
    def booked_demand(self) -> Resources:
        """What this lease books: its demand, or while it waits on victims, at least
        what they hold (the victims themselves book nothing)."""
        held = self.held
        # ``is`` first: most leases hold the shared ZERO, and a dataclass ``==`` is a
        # Python-level call (this runs for every lease the fold stores)
        if not self.held_gpus and (held is ZERO or held == ZERO):
            return self.demand
        d, h = self.demand, held
        return Resources(
            max(d.cpu, h.cpu), max(d.memory_mib, h.memory_mib), max(d.disk_gib, h.disk_gib)
        )

    @property
    def booked_gpus(self) -> tuple[int, ...]:
        if not self.held_gpus:
            return self.gpus
        return tuple(sorted(set(self.gpus) | set(self.held_gpus)))

    @property
    def gated(self) -> bool:
        return self.gate_seq is not None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "lease_id": self.lease_id,
            "instance": self.instance,
            "host": self.host,
            "host_uid": self.host_uid,
            "pool": self.pool,
            "kind": self.kind.value,
            "state": self.state.value,
            "demand": self.demand.as_dict(),
            "gpus": list(self.gpus),
        }
        if self.job is not None:
            out["job"] = self.job
        if self.gate_seq is not None:
            out["awaiting_victims"] = list(self.awaiting_victims)
        if self.suspect_revision is not None:
            out["suspect"] = True
        if self.adopted:
            out["adopted"] = True
        if self.fault is not None:
            out["fault"] = self.fault
        return out


# Lease tags the executor writes on every instance it creates; inventory adopts on them.
TAG_LEASE_ID = "user.rc.lease-id"
TAG_POOL = "user.rc.pool"
TAG_KIND = "user.rc.kind"
TAG_JOB = "user.rc.job"


#: a copy of a lease with changes: :func:`dataclasses.replace` for the fold's most
#: frequent copy, at about a third of its cost (see :func:`reconciler.core.frozen.evolver`)
evolve_lease = evolver(Lease)
#: a copy of a host with changes (every snapshot and inventory copies its host)
evolve_host = evolver(Host)
