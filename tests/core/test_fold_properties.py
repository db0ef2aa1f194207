"""Property tests of the fold: random streams of every input kind, invariants after each.

A :class:`Run` folds one input at a time and, after every input, checks the safety rules
of DESIGN.md ("Principles", "Domain") and the decision shapes of CONTRACT.md against
facts the test computes itself from ``state.leases`` and the inputs it sent:

1. booking (``own_booking``: active non-victim leases, a pending reservation at least at
   what its victims hold, plus foreign VMs) equals ``placement.booking`` and is
   <= allocatable on every host in every dimension in *strict* streams (no foreign or
   tagged VMs). With foreign and adopted VMs, which may over-commit a host: no input but
   an inventory raises a host's booking above allocatable, nothing is reserved on a host
   left over-committed, and a lease admitted at once fits beside the victims that still
   run;
2. no GPU index in two capacity-booking leases of a host nor in ``host.foreign_gpus``
   (strict), or no such conflict made by anything but observed facts; a new lease takes
   free GPUs; GPUs the latest inventory shows in use are booked;
3. ``state.jobs`` is injective and permanent, a lease's job never changes, no second
   lease carries a bound job; claim-warm: same job, same lease; else the oldest idle VM;
4. nothing claims a lease that ever was draining or a victim (``Effects.transitions``),
   and every transition is an edge of the lease diagram;
5. the launch gate: a pending admit-preemptible is answered ``admitted`` only after all
   its victims were released, after an accepted snapshot or inventory of its host newer
   than the pending decision, and while the fit holds; victims are a 1-minimal set of
   idle ready VMs of that host and protected pools keep ``min_ready``;
6. a command whose request id was decided changes nothing and re-sends the same bytes
   under the same msg id; re-folding an applied message or batch is a no-op without
   outputs; stale snapshots/inventories and rejected configs change nothing;
7. folding the same stream into a fresh state, and into a state rebuilt from the
   persisted fields half way (a restart), gives the same state and output bytes;
8. every decision has the contract's shape, outcome and reason codes, its input seq and
   timestamp; executor commands and config rejections are well-formed, and a delete never
   hits another live lease.

Also: derived indexes equal a fresh ``reindex()``; placement (with its incremental
candidate index) picks what a full scan picks; pool maxima; mark-created /
mark-warm-injected / drain outcomes follow the pre-state; Incus events and observations
move only the lease they name.

Streams are drawn interactively (``st.data()``) so that commands and events name the
instances and leases that exist, with a few macros (warm VMs booting, a host filled up and
contended, the executor deleting, the verifier observing) to reach deep states; hypothesis
still shrinks them, and a failure prints the stream as ``seq: kind payload`` notes.

Profiles: ``RC_HYPOTHESIS_PROFILE=rc-dev`` (default, random seeds), ``rc-ci``
(``derandomize=True``, same budget) or ``rc-long`` (ten times the examples). No property
depends on which one runs.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from reconciler.core.configs import CONFIG_KINDS
from reconciler.core.fold import fold
from reconciler.core.inputs import (
    Admit,
    AuthorizeWarmDrain,
    ClaimWarm,
    Command,
    Failure,
    HostInventory,
    HostSnapshot,
    Lifecycle,
    MarkCreated,
    MarkWarmInjected,
    Message,
    Observation,
    RenderRuntime,
)
from reconciler.core.messages import Output
from reconciler.core.model import (
    TAG_JOB,
    TAG_KIND,
    TAG_LEASE_ID,
    TAG_POOL,
    HostName,
    Lease,
    LeaseId,
    LeaseKind,
    LeaseState,
)
from reconciler.core.placement import (
    REASON_FOR_FIT,
    ClaimError,
    Fit,
    booking,
    choose,
    evaluate,
    merge_claims,
    resolve_claims,
)
from reconciler.core.runtime import is_stale
from reconciler.core.state import Effects, State
from tests.support.builders import (
    Fleet,
    admit,
    apply_config,
    cmd,
    failure,
    gpu,
    gpu_class,
    gpu_policy,
    gpu_profile,
    instance,
    inventory,
    lifecycle,
    message,
    observation,
    pool,
    res,
    snapshot,
)

Item = tuple[str, dict[str, Any]]
T = TypeVar("T")

# ============================================================================ profiles

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("rc-dev", **_COMMON)
settings.register_profile("rc-ci", derandomize=True, **_COMMON)
settings.register_profile("rc-long", **_COMMON)
_PROFILE = os.environ.get("RC_HYPOTHESIS_PROFILE", "rc-dev")
_SCALE = 10 if _PROFILE == "rc-long" else 1


def budget(examples: int) -> settings:
    return settings(
        settings.get_profile(_PROFILE), max_examples=examples * _SCALE, report_multiple_bugs=False
    )


# ============================================================================ alphabet

#: capacity, reserve and GPUs are fixed per host name; snapshots vary the rest
HOST_SPECS: dict[str, dict[str, Any]] = {
    "h1": {
        "cpu": 6,
        "memory_mib": 16384,
        "disk_gib": 200,
        "reserve": res(1, 1024, 20),
        "gpus": [gpu(0), gpu(1, numa=1)],
    },
    "h2": {"cpu": 4, "memory_mib": 12288, "disk_gib": 120, "reserve": res(0), "gpus": []},
    "h3": {
        "cpu": 5,
        "memory_mib": 16384,
        "disk_gib": 160,
        "reserve": res(0, 2048, 0),
        "gpus": [
            gpu(0, model="H100", memory_mib=81920),
            gpu(1, model="H100", memory_mib=81920),
            gpu(2),
            gpu(3, numa=1),
        ],
    },
    "h4": {"cpu": 3, "memory_mib": 8192, "disk_gib": 80, "reserve": res(0), "gpus": [gpu(0)]},
}
HOSTS = sorted(HOST_SPECS)
UNKNOWN_HOST = "h9"
POOLS = ["p1", "p2", "p3"]
UNKNOWN_POOL = "p9"
CLASSES = ["gpu", "a100", "pair", "plain"]
INSTANCES = [f"i{n}" for n in range(1, 9)]
FOREIGN = ["f1", "f2"]
JOBS = [f"j{n}" for n in range(1, 6)]
PROFILES = ["prof-a", "prof-b"]
POLICIES = ["pol1", "pol2", "pol3"]
ACTIONS = [
    "instance-created",
    "instance-ready",
    "instance-ready",
    "instance-agent-started",
    "instance-deleted",
    "instance-deleted",
    "instance-started",
    "instance-stopped",
    "instance-updated",
]

# ============================================================================ contract

OUTCOMES = {
    "admit": {"admitted", "rejected"},
    "admit-preemptible": {"admitted", "pending", "rejected"},
    "claim-warm": {"claimed", "no-warm"},
    "authorize-warm-drain": {"authorized", "refused"},
    "mark-created": {"ok", "error"},
    "mark-warm-injected": {"ok", "error"},
    "mark-deleting": {"ok"},
    "release": {"ok"},
    "render-runtime": {"ok", "error"},  # an addition to the contract
    # additions: the operators' config and host commands
    "apply-config": {"applied", "rejected"},
    "cordon": {"ok", "rejected"},
    "uncordon": {"ok", "rejected"},
    "drain": {"ok", "rejected"},
}
REASONS = {
    "insufficient-capacity",
    "no-suitable-host",
    "selected-host-unsuitable",
    "host-unschedulable",
    "unknown-pool",
    "pool-at-max",
    "invalid-claim",
    "duplicate-instance",
    "not-ready",
    "already-claimed",
    "draining",
    "unknown-instance",
    "no-lease",
    "wrong-state",
    "wrong-job",
    # additions
    "invalid-config",
    "unknown-host",
    "preemption-failed",
}
LEASE_KEYS = {"lease_id", "instance", "host", "host_uid", "pool", "kind", "state", "demand", "gpus"}
ACTIVE_STATES = [s.value for s in LeaseState if s is not LeaseState.RELEASED]
#: the lease diagram of DESIGN.md ("Leases"); None is "no lease yet" (admit or adopt)
EDGES = (
    {(None, "reserved"), (None, "created"), (None, "ready"), (None, "claimed")}
    | {("reserved", "created"), ("reserved", "ready"), ("created", "ready")}
    | {("ready", "claimed"), ("claimed", "injected"), ("ready", "draining"), ("ready", "victim")}
    | {(s, "deleting") for s in ACTIVE_STATES if s != "deleting"}
    | {(s, "released") for s in ACTIVE_STATES}
)
ADMIT_EVENTS = ("admit", "admit-preemptible")
#: Incus lifecycle actions that may change state (CONTRACT "Inputs"); others are recorded
STATE_ACTIONS = ("instance-created", "instance-ready", "instance-agent-started", "instance-deleted")

# ============================================================================ digests

PERSISTED = ("hosts", "pools", "classes", "profiles", "policies", "leases", "decisions", "jobs")


def _fallback(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"cannot digest {type(value).__name__}")


def digest(state: State, *, with_seq: bool = True) -> bytes:
    """Everything the store persists, canonically: dataclasses as objects, dict keys
    sorted, sets sorted (applied_seq optional)."""
    parts: dict[str, Any] = {name: getattr(state, name) for name in PERSISTED}
    if with_seq:
        parts["applied_seq"] = state.applied_seq
    return orjson.dumps(parts, option=orjson.OPT_SORT_KEYS, default=_fallback)


def rebuilt(state: State) -> State:
    """The state a restarted replica loads: persisted fields only, indexes rebuilt."""
    fresh = State(
        applied_seq=state.applied_seq,
        hosts=dict(state.hosts),
        pools=dict(state.pools),
        classes=dict(state.classes),
        profiles=dict(state.profiles),
        policies=dict(state.policies),
        leases=dict(state.leases),
        decisions=dict(state.decisions),
        jobs=dict(state.jobs),
    )
    fresh.reindex()
    return fresh


def derived(state: State) -> dict[str, Any]:
    """The derived indexes, with empty entries dropped (they are equivalent to absent)."""
    return {
        "by_instance": dict(state.by_instance),
        "on_host": {k: set(v) for k, v in state.on_host.items() if v},
        "pool_counts": {k: dict(v) for k, v in state.pool_counts.items() if v},
        "booked": {k: list(v) for k, v in state.booked.items() if any(v)},
        "gpus_held": {k: dict(v) for k, v in state.gpus_held.items() if v},
        "pool_booking": {k: v for k, v in state.pool_booking.items() if v},
        "pool_warm_unclaimed": {k: v for k, v in state.pool_warm_unclaimed.items() if v},
        "pool_ready": {k: set(v) for k, v in state.pool_ready.items() if v},
        "pool_booting": {k: set(v) for k, v in state.pool_booting.items() if v},
        "host_order": list(state.host_order),
    }


def scanned_pool_counts(state: State) -> dict[str, dict[str, int]]:
    """A pool status's lease counts by a scan of every lease (the test's own rules:
    CONTRACT.md's pool status, DESIGN "Leases"), no zero counts."""
    counts: dict[str, dict[str, int]] = {}
    for lease in state.leases.values():
        if lease.state is LeaseState.RELEASED:
            continue
        if lease.gate_seq is not None:
            key = "pending_requests"
        elif lease.state in (LeaseState.VICTIM, LeaseState.DRAINING):
            key = "victims" if lease.state is LeaseState.VICTIM else "draining"
        elif lease.state in (LeaseState.CLAIMED, LeaseState.INJECTED):
            key = "claimed"
        elif lease.kind is LeaseKind.WARM and lease.state in (
            LeaseState.RESERVED,
            LeaseState.CREATED,
        ):
            key = "booting"
        else:
            continue
        pool = counts.setdefault(lease.pool, {})
        pool[key] = pool.get(key, 0) + 1
    return counts


def out_tuples(fx: Effects) -> list[tuple[str, str | None, bytes]]:
    return [(o.subject, o.msg_id, o.payload) for o in fx.outputs]


# ============================================================================ test model


def books(lease: Lease) -> bool:
    """The test's own rule (DESIGN "Leases"): active and not a victim."""
    return lease.state is not LeaseState.RELEASED and lease.victim_of is None


def own_booking(
    state: State, host: str, *, promised: str | None = None
) -> tuple[tuple[int, int, int], Counter[int]]:
    """Booked on a host (DESIGN "Leases"): every active lease but victims, whose
    capacity is promised to the pending reservation naming them, which books at least
    what its remaining victims hold (their GPUs too); plus foreign VMs. With
    ``promised``, that pending lease counts only its own demand: what the host will
    book once its victims are gone."""
    cpu = mem = disk = 0
    gpus: Counter[int] = Counter()
    for lease in state.leases.values():
        if lease.host == host and books(lease):
            d = lease.demand
            mine = {*lease.gpus}
            victims = [state.leases[v] for v in lease.awaiting_victims]
            if victims and lease.lease_id != promised:
                held = (
                    sum(v.demand.cpu for v in victims),
                    sum(v.demand.memory_mib for v in victims),
                    sum(v.demand.disk_gib for v in victims),
                )
                cpu += max(d.cpu, held[0])
                mem += max(d.memory_mib, held[1])
                disk += max(d.disk_gib, held[2])
                for v in victims:
                    mine.update(v.gpus)
            else:
                cpu += d.cpu
                mem += d.memory_mib
                disk += d.disk_gib
            gpus.update(mine)
    h = state.hosts[HostName(host)]
    f = h.foreign_demand
    return (cpu + f.cpu, mem + f.memory_mib, disk + f.disk_gib), gpus


def running_on(state: State, host: str) -> tuple[tuple[int, int, int], Counter[int]]:
    """What may run on the host: every active lease but pending ones still at the launch
    gate (their VM is not created before it opens), victims included, plus foreign VMs."""
    cpu = mem = disk = 0
    gpus: Counter[int] = Counter()
    for lease in state.leases.values():
        if lease.host == host and lease.active and lease.gate_seq is None:
            cpu += lease.demand.cpu
            mem += lease.demand.memory_mib
            disk += lease.demand.disk_gib
            gpus.update(lease.gpus)
    h = state.hosts[HostName(host)]
    gpus.update(h.foreign_gpus)
    f = h.foreign_demand
    return (cpu + f.cpu, mem + f.memory_mib, disk + f.disk_gib), gpus


def gpu_conflicts(state: State, host: str) -> set[int]:
    """GPU indexes held twice: by two booking leases, or by a lease and a foreign VM."""
    _, held = own_booking(state, host)
    foreign = state.hosts[HostName(host)].foreign_gpus
    return {ix for ix, n in held.items() if n > 1} | (set(held) & set(foreign))


def over(state: State, host: str, *, promised: str | None = None) -> tuple[bool, bool, bool]:
    (cpu, mem, disk), _ = own_booking(state, host, promised=promised)
    a = state.hosts[HostName(host)].allocatable
    return (cpu > a.cpu, mem > a.memory_mib, disk > a.disk_gib)


def idle_ready(lease: Lease) -> bool:
    return (
        lease.state is LeaseState.READY
        and lease.kind is LeaseKind.WARM
        and lease.job is None
        and lease.victim_of is None
        and lease.suspect_revision is None
    )


@dataclass
class Gate:
    seq: int
    host: str
    lease_id: str
    victims: tuple[str, ...]
    opened: bool = False


@dataclass
class Run:
    """Folds inputs one by one and checks every property after each."""

    strict: bool = False
    checks: bool = True
    state: State = field(default_factory=State)
    seq: int = 0
    log: list[Message] = field(default_factory=list)
    outs: list[list[tuple[str, str | None, bytes]]] = field(default_factory=list)
    commands: list[Item] = field(default_factory=list)
    visited: dict[str, set[str]] = field(default_factory=dict)
    job_of: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, str] = field(default_factory=dict)
    last_decision: dict[str, tuple[str | None, bytes]] = field(default_factory=dict)
    gates: dict[str, Gate] = field(default_factory=dict)
    released_at: dict[str, int] = field(default_factory=dict)
    revision: dict[tuple[str, str], int] = field(default_factory=dict)
    uid: dict[str, str] = field(default_factory=dict)
    #: host -> the latest accepted inventory: (instance, PCI addresses, the lease it was
    #: adopted as, or None for a foreign VM); VMs of leases known before are left out
    listing: dict[str, list[tuple[str, tuple[str, ...], str | None]]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    #: what was exercised, for coverage notes in failures
    seen: Counter[str] = field(default_factory=Counter)

    # ------------------------------------------------------------------ folding

    def send(self, item: Item) -> Effects:
        self.seq += 1
        msg = message(self.seq, item)
        note(f"{self.seq}: {item[0]} {orjson.dumps(item[1]).decode()}")
        if item[0].startswith("cmd."):
            self.commands.append(item)
        pre = self.before(msg) if self.checks else {}
        fx = fold(self.state, msg)
        self.log.append(msg)
        self.outs.append(out_tuples(fx))
        if self.checks:
            self.after(msg, fx, pre)
        return fx

    # -------------------------------------------------------------- pre-state facts

    def before(self, msg: Message) -> dict[str, Any]:
        s = self.state
        item = msg.input
        pre: dict[str, Any] = {
            "digest": digest(s, with_seq=False),
            "booked": {h: own_booking(s, h)[0] for h in s.hosts},
            "conflicts": {h: gpu_conflicts(s, h) for h in s.hosts},
        }
        if isinstance(item, Command):
            pre["decided"] = item.request_id in s.decisions
        if isinstance(item, Admit):
            pre["admit"] = self.expected_placement(item)
            existing = s.lease_of_instance(item.instance)
            pre["duplicate"] = existing is not None and existing.active
            if item.preemptible:
                pre["copy"] = rebuilt(s)
        if isinstance(item, (MarkCreated, MarkWarmInjected)):
            lease = s.lease_of_instance(item.instance)
            if lease is None or not lease.active:
                pre["ok"] = False
            elif isinstance(item, MarkCreated):
                pre["ok"] = lease.state is LeaseState.CREATED or (
                    lease.state is LeaseState.RESERVED and not lease.gated
                )
            else:
                pre["ok"] = (
                    lease.state in (LeaseState.CLAIMED, LeaseState.INJECTED)
                    and lease.job == item.job
                )
        if isinstance(item, ClaimWarm):
            pre["bound"] = s.jobs.get(item.job)
            ready = [
                le
                for le in s.leases.values()
                if le.pool == item.pool and le.active and idle_ready(le)
            ]
            pre["claim"] = min(ready, key=lambda le: (le.ready_seq, le.lease_id)) if ready else None
        if isinstance(item, (Lifecycle, Observation)) and item.instance is not None:
            pre["lease"] = s.lease_of_instance(item.instance)
        if isinstance(item, AuthorizeWarmDrain):
            lease = s.lease_of_instance(item.instance)
            pre["drainable"] = (
                lease is not None
                and lease.active
                and lease.kind is LeaseKind.WARM
                and lease.state is LeaseState.READY
                and lease.job is None
            )
        return pre

    def expected_placement(self, cmd_: Admit) -> tuple[str, Any] | None:
        """A full scan of every host, the way placement is specified (no index)."""
        s = self.state
        p = s.pools.get(cmd_.pool)
        if p is None:
            return None
        try:
            claims = resolve_claims(s, merge_claims(p, cmd_.claims))
        except ClaimError:
            return None
        names = [cmd_.host] if cmd_.host is not None else sorted(s.hosts)
        hosts = [s.hosts[HostName(n)] for n in names if n in s.hosts]
        hfs = [evaluate(s, host, p, p.flavor, claims) for host in hosts]
        fits = [hf for hf in hfs if hf.fit is Fit.FITS]
        if not fits:
            best = max((hf.fit for hf in hfs), default=Fit.SELECTOR)
            return ("none", REASON_FOR_FIT[best])
        chosen = choose(fits, p.placement)
        return ("fits", (chosen.host.name, chosen.gpus))

    # ------------------------------------------------------------------ checks

    def after(self, msg: Message, fx: Effects, pre: dict[str, Any]) -> None:
        s = self.state
        item = msg.input
        assert s.applied_seq == msg.seq
        self.check_transitions(msg, fx)
        self.check_host_inputs(msg, fx, pre)
        self.check_booking(msg, fx, pre)
        self.check_jobs()
        decisions = self.check_outputs(msg, fx, pre)
        self.check_gates(msg, decisions)
        if isinstance(item, Command):
            self.check_command(msg, fx, pre, decisions)
        if isinstance(item, (Lifecycle, Observation)):
            self.check_event(item, fx, pre)
        self.check_metric_effects(msg, fx, pre)
        if fx.outputs and any(o.subject.startswith("out.config.rejected.") for o in fx.outputs):
            assert digest(s, with_seq=False) == pre["digest"], "a rejected config changed state"
            self.seen["config-rejected"] += 1
        assert derived(s) == derived(rebuilt(s)), "derived indexes drifted from a reindex"
        assert derived(s)["pool_counts"] == scanned_pool_counts(s), "pool counts drifted"
        # re-folding an applied message is a no-op with no outputs
        whole = digest(s)
        again = fold(s, msg)
        assert again.outputs == [] and again.transitions == []
        assert digest(s) == whole

    def check_metric_effects(self, msg: Message, fx: Effects, pre: dict[str, Any]) -> None:
        """What the metrics count (``fx.verdicts``, ``fx.warm_claims``) is what the
        decisions say: one verdict per decision written (none for one re-sent), and a
        warm claim per claim-warm decided for a new job on a known pool."""
        item = msg.input
        bodies = [
            orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision.")
        ]
        if pre.get("decided"):
            assert fx.verdicts == [] and fx.warm_claims == [], "a re-sent decision counted"
            return
        assert fx.verdicts == [(d["verb"], d["outcome"], d.get("reason")) for d in bodies]
        counted: list[tuple[str, str]] = []
        if isinstance(item, ClaimWarm) and pre["bound"] is None and item.pool in self.state.pools:
            (d,) = bodies
            counted = [(item.pool, d["outcome"])]
            self.seen[f"warm-claim-{d['outcome']}"] += 1
        assert fx.warm_claims == counted, (fx.warm_claims, counted)

    def check_transitions(self, msg: Message, fx: Effects) -> None:
        for t in fx.transitions:
            assert t.input_seq == msg.seq
            edge = (t.from_state, t.to_state)
            assert edge in EDGES, f"transition {edge} of {t.lease_id} is not in the diagram"
            visited = self.visited.setdefault(t.lease_id, set())
            if t.from_state is None:
                assert not visited, f"{t.lease_id} created twice"
            if t.to_state == "claimed" and t.from_state is not None:
                assert not visited & {"draining", "victim"}, (
                    f"{t.lease_id} claimed after it was {sorted(visited)}"
                )
                self.seen["claimed"] += 1
            if t.to_state == "released":
                self.released_at.setdefault(t.lease_id, msg.seq)
            if t.to_state == "victim":
                self.seen["victim"] += 1
            visited.add(t.to_state)
        for lease in self.state.leases.values():
            if lease.state is LeaseState.CLAIMED:
                assert lease.victim_of is None
                assert not self.visited.get(lease.lease_id, set()) & {"draining", "victim"}

    def check_host_inputs(self, msg: Message, fx: Effects, pre: dict[str, Any]) -> None:
        item = msg.input
        if not isinstance(item, (HostSnapshot, HostInventory)):
            return
        kind = "snapshot" if isinstance(item, HostSnapshot) else "inventory"
        key = (item.host, kind)
        known = self.uid.get(item.host)
        if known is None:
            fresh = True
            self.uid[item.host] = item.uid
        elif known != item.uid:
            # a snapshot of a new identity replaces the host; an inventory of another one
            # is ignored
            fresh = kind == "snapshot"
            if fresh:
                self.uid[item.host] = item.uid
                self.revision.pop((item.host, "snapshot"), None)
                self.revision.pop((item.host, "inventory"), None)
                self.seen["new-uid"] += 1
        else:
            fresh = item.revision > self.revision.get(key, -1)
        host = self.state.hosts[item.host]
        applied = (host.snapshot_seq if kind == "snapshot" else host.inventory_seq) == msg.seq
        assert applied == fresh, f"{kind} r{item.revision} of {item.host}: applied={applied}"
        if fresh:
            self.revision[key] = item.revision
            self.accepted.setdefault(item.host, []).append(msg.seq)
            if isinstance(item, HostInventory):
                listing: list[tuple[str, tuple[str, ...], str | None]] = []
                for inst in item.instances:
                    lease = self.state.lease_of_instance(inst.name)
                    if lease is None or not lease.active or lease.host != item.host:
                        listing.append((inst.name, inst.gpus, None))
                    elif lease.adopted and lease.admitted_seq == msg.seq:
                        listing.append((inst.name, inst.gpus, lease.lease_id))
                self.listing[item.host] = listing
        else:
            self.seen["stale"] += 1
            assert digest(self.state, with_seq=False) == pre["digest"], "stale input changed state"
            assert fx.outputs == []

    def newly_reserved(self, fx: Effects) -> list[Lease]:
        return [
            self.state.leases[t.lease_id]
            for t in fx.transitions
            if t.from_state is None and t.event in ADMIT_EVENTS
        ]

    def check_booking(self, msg: Message, fx: Effects, pre: dict[str, Any]) -> None:
        s = self.state
        inventory_input = isinstance(msg.input, HostInventory)
        # a snapshot may resolve PCI addresses an earlier inventory reported into GPU
        # indexes, and so reveal that two observed VMs use one GPU
        gpu_facts = isinstance(msg.input, (HostInventory, HostSnapshot))
        fresh = self.newly_reserved(fx)
        for name, host in s.hosts.items():
            mine, held = own_booking(s, name)
            theirs = booking(s, host)
            assert (theirs.booked.cpu, theirs.booked.memory_mib, theirs.booked.disk_gib) == mine
            assert theirs.used_gpus == frozenset(held) | host.foreign_gpus
            alloc = host.allocatable
            limits = (alloc.cpu, alloc.memory_mib, alloc.disk_gib)
            conflicts = gpu_conflicts(s, name)
            if self.strict:
                assert all(b <= a for b, a in zip(mine, limits, strict=True)), (
                    f"{name} booked {mine} > allocatable {limits}"
                )
                assert not conflicts, f"{name}: GPU indexes {conflicts} held twice"
            elif not inventory_input:
                before = pre["booked"].get(name, (0, 0, 0))
                raised = zip(mine, limits, before, strict=True)
                assert all(b <= max(a, was) for b, a, was in raised), (
                    f"{name}: {type(msg.input).__name__} raised booking {before} -> {mine} "
                    f"over allocatable {limits}"
                )
                assert gpu_facts or conflicts <= pre["conflicts"].get(name, set()), (
                    f"{name}: {type(msg.input).__name__} made GPU conflicts {conflicts}"
                )
        self.check_observed_gpus()
        for lease in fresh:
            host = s.hosts[lease.host]
            # a pending reservation books what its victims still hold: where foreign VMs
            # over-commit the host that stays over until they are gone; what it promises
            # (its own demand, once the victims are gone) must fit
            promised = lease.lease_id if lease.gate_seq is not None else None
            assert not any(over(s, lease.host, promised=promised)), (
                f"{lease.lease_id} reserved on over-committed {lease.host}"
            )
            others: Counter[int] = Counter()
            for other in s.leases.values():
                if other.host == lease.host and books(other) and other.lease_id != lease.lease_id:
                    others.update(other.gpus)
            assert not set(lease.gpus) & (set(others) | host.foreign_gpus), (
                f"{lease.lease_id} took GPUs {lease.gpus} already in use"
            )
            assert set(lease.gpus) <= {g.index for g in host.gpus}
            if lease.gate_seq is None:  # admitted at once: beside victims that still run
                running, running_gpus = running_on(s, lease.host)
                alloc = host.allocatable
                limit = (alloc.cpu, alloc.memory_mib, alloc.disk_gib)
                assert all(r <= a for r, a in zip(running, limit, strict=True)), (
                    f"{lease.lease_id} admitted at once beside victims still running: {running}"
                )
                running_gpus.subtract(lease.gpus)
                assert not set(lease.gpus) & {ix for ix, n in running_gpus.items() if n > 0}, (
                    f"{lease.lease_id} admitted at once onto a GPU a victim still runs on"
                )
            assert len(set(lease.gpus)) == len(lease.gpus)
            # pool maxima
            p = s.pools[lease.pool]
            count = sum(1 for le in s.leases.values() if le.pool == p.name and books(le))
            assert count <= p.max_instances, f"{p.name}: {count} > max_instances"
            if lease.kind is LeaseKind.WARM:
                warm = sum(
                    1
                    for le in s.leases.values()
                    if le.pool == p.name
                    and books(le)
                    and le.kind is LeaseKind.WARM
                    and le.state in (LeaseState.RESERVED, LeaseState.CREATED, LeaseState.READY)
                )
                assert warm <= p.warm.max_ready, f"{p.name}: {warm} unclaimed warm > max_ready"
            self.seen["reserved"] += 1

    def check_observed_gpus(self) -> None:
        """A GPU the latest inventory shows in use, by a VM that books capacity (ours) or
        a foreign one, is in use for placement too."""
        s = self.state
        for name, listing in self.listing.items():
            host = s.hosts[HostName(name)]
            by_pci = host.gpu_by_pci()
            used = booking(s, host).used_gpus
            for vm, pcis, lease_id in listing:
                if lease_id is not None:
                    if not books(s.leases[LeaseId(lease_id)]):
                        continue
                elif vm not in host.foreign_instances:
                    continue
                seen = {by_pci[a].index for a in pcis if a in by_pci}
                assert seen <= used, f"{vm} uses GPUs {sorted(seen)} of {name}, booked {used}"

    def check_jobs(self) -> None:
        s = self.state
        assert len(set(s.jobs.values())) == len(s.jobs), f"a lease bound to two jobs: {s.jobs}"
        for job, lease_id in s.jobs.items():
            assert self.bindings.setdefault(job, lease_id) == lease_id, f"job {job} rebound"
            assert s.leases[lease_id].job == job
        for lease in s.leases.values():
            if lease.job is not None:
                assert self.job_of.setdefault(lease.lease_id, lease.job) == lease.job
            else:
                assert lease.lease_id not in self.job_of, f"{lease.lease_id} lost its job"
        for bound in self.bindings:
            assert bound in s.jobs, f"binding of {bound} forgotten"
        for lease in s.leases.values():  # one job, one lease: no second lease carries it
            if lease.job is not None:
                assert s.jobs.get(lease.job) == lease.lease_id, (
                    f"{lease.lease_id} carries job {lease.job}, bound to {s.jobs.get(lease.job)}"
                )

    def check_outputs(self, msg: Message, fx: Effects, pre: dict[str, Any]) -> list[dict[str, Any]]:
        decided: list[dict[str, Any]] = []
        republish = isinstance(msg.input, Command) and pre.get("decided")
        for out in fx.outputs:
            body = orjson.loads(out.payload)
            assert body["v"] == 1
            if out.subject.startswith("out.decision."):
                rid = out.subject.removeprefix("out.decision.")
                check_decision(body, rid, out)
                if not republish:
                    assert body["input_seq"] == msg.seq and body["decided_at"] == msg.timestamp
                self.last_decision[rid] = (out.msg_id, out.payload)
                decided.append(body)
            elif out.subject.startswith("out.exec."):
                assert out.msg_id == body["command_id"]
                host, verb = out.subject.removeprefix("out.exec.").split(".")
                assert body["host"] == host and verb in ("create", "delete")
                lease = self.state.leases[body["lease_id"]]
                assert lease.instance == body["instance"]
                if verb == "delete":
                    assert body["reason"] in ("preempted", "drained", "orphan")
                    live = self.state.lease_of_instance(body["instance"])
                    assert not (
                        live is not None
                        and live.active
                        and live.host == host
                        and live.lease_id != body["lease_id"]
                    ), f"delete of {body['instance']} on {host} hits live lease {live}"
                    if body["reason"] == "orphan":
                        assert isinstance(msg.input, HostInventory)
                        assert host == msg.input.host, "orphan deleted on another host"
                    # a drained warm VM still booting is deleting (a drain of its host or
                    # pool), a ready one draining
                    expected = {
                        "preempted": {"victim"},
                        "drained": {"draining", "deleting"},
                        "orphan": {"released"},
                    }
                    if body["reason"] != "orphan":
                        assert body["lease_id"] in {t.lease_id for t in fx.transitions}
                    assert lease.state.value in expected[body["reason"]] or not lease.active
                else:
                    assert lease.kind is LeaseKind.WARM
                    assert lease.lease_id in {le.lease_id for le in self.newly_reserved(fx)}
            elif out.subject.startswith("out.config.rejected."):
                assert body["input_seq"] == msg.seq and body["error"]
            else:
                raise AssertionError(f"unexpected output subject {out.subject}")
        return decided

    def check_gates(self, msg: Message, decisions: list[dict[str, Any]]) -> None:
        for d in decisions:
            rid = d["request_id"]
            if d["phase"] == "pending" and rid not in self.gates:
                victims = tuple(v["lease_id"] for v in d["victims"])
                assert victims, "a pending decision names no victims"
                for v in d["victims"]:
                    lease = self.state.leases[v["lease_id"]]
                    assert lease.victim_of == rid and v["host"] == d["lease"]["host"]
                    assert lease.instance == v["instance"]
                self.gates[rid] = Gate(msg.seq, d["lease"]["host"], d["lease"]["lease_id"], victims)
                self.seen["pending"] += 1
            gate = self.gates.get(rid)
            if (
                gate is not None
                and not gate.opened
                and d["phase"] == "final"
                and d["verb"] == "admit-preemptible"
            ):
                if d["outcome"] == "rejected":
                    # a victim's VM could not be deleted (a failure input): the preemption
                    # ends, its lease released with the victim's fault, no gate opened
                    assert d["reason"] == "preemption-failed", d
                    item = msg.input
                    assert isinstance(item, Failure), f"{rid} failed without a failure input"
                    assert item.lease_id in gate.victims, f"{rid} failed for a non-victim"
                    ended = self.state.leases.get(LeaseId(gate.lease_id))
                    assert ended is None or (ended.state is LeaseState.RELEASED and ended.fault), (
                        ended
                    )
                    gate.opened = True
                    self.seen["preemption-failed"] += 1
                    continue
                assert d["outcome"] == "admitted", d
                assert d["lease"]["lease_id"] == gate.lease_id
                for v in gate.victims:
                    assert v in self.released_at, f"gate of {rid} opened while victim {v} runs"
                assert any(seq > gate.seq for seq in self.accepted.get(gate.host, ())), (
                    f"gate of {rid} opened without a snapshot or inventory after seq {gate.seq}"
                )
                # ... and the fit still holds on that host (proven on fresh state)
                s = self.state
                host = s.hosts[HostName(gate.host)]
                lease = s.leases[LeaseId(gate.lease_id)]
                assert not any(over(s, gate.host)), f"gate of {rid} opened on a full host"
                others: Counter[int] = Counter()
                for other in s.leases.values():
                    if other.host == gate.host and books(other) and other is not lease:
                        others.update(other.gpus)
                taken = set(lease.gpus) & (set(others) | host.foreign_gpus)
                assert not taken, f"gate of {rid} opened onto GPUs {taken} in use"
                gate.opened = True
                self.seen["gate-opened"] += 1

    def check_command(
        self, msg: Message, fx: Effects, pre: dict[str, Any], decisions: list[dict[str, Any]]
    ) -> None:
        item = msg.input
        assert isinstance(item, Command)
        rid = item.request_id
        mine = [d for d in decisions if d["request_id"] == rid]
        assert len(mine) == 1, f"{rid}: {len(mine)} decisions"
        if pre["decided"]:
            self.seen["republished"] += 1
            msg_id, payload = self.last_decision[rid]
            assert out_tuples(fx) == [(f"out.decision.{rid}", msg_id, payload)]
            assert fx.transitions == []
            assert digest(self.state, with_seq=False) == pre["digest"], "re-sent command changed"
            return
        (d,) = mine
        assert d["verb"] == item.verb
        if isinstance(item, Admit):
            self.check_admit(item, d, pre)
        if isinstance(item, ClaimWarm):
            if pre["bound"] is not None:  # same job, same instance, forever
                assert d["outcome"] == "claimed" and d["lease"]["lease_id"] == pre["bound"]
            elif d["outcome"] == "claimed":
                assert pre["claim"] is not None, "claimed with no idle ready warm VM"
                assert d["lease"]["lease_id"] == pre["claim"].lease_id, "not the oldest ready VM"
                assert d["lease"]["state"] == "claimed" and d["lease"]["job"] == item.job
            else:
                assert pre["claim"] is None or item.pool not in self.state.pools, (
                    f"no-warm while {pre['claim']} was ready"
                )
        if isinstance(item, AuthorizeWarmDrain):
            assert (d["outcome"] == "authorized") == pre["drainable"]
        if isinstance(item, (MarkCreated, MarkWarmInjected)):
            assert (d["outcome"] == "ok") == pre["ok"], (d, pre["ok"])
        if isinstance(item, RenderRuntime) and d["outcome"] == "ok":
            lease = self.state.leases[d["lease"]["lease_id"]]
            assert not is_stale(self.state, lease)

    def check_admit(self, item: Admit, d: dict[str, Any], pre: dict[str, Any]) -> None:
        s = self.state
        if pre["duplicate"] and item.pool in s.pools:
            assert (d["outcome"], d.get("reason")) == ("rejected", "duplicate-instance")
            return
        expected = pre["admit"]
        if d["outcome"] == "admitted":
            assert d["phase"] == "final"
            lease = d["lease"]
            assert expected is not None and expected[0] == "fits", (expected, d)
            host, gpus = expected[1]
            assert (lease["host"], tuple(lease["gpus"])) == (host, gpus), (
                f"placed on {lease['host']} {lease['gpus']}, a full scan picks {host} {gpus}"
            )
            if item.host is not None:
                assert lease["host"] == item.host
            assert lease["kind"] == item.kind.value and lease["state"] == "reserved"
        elif d["outcome"] == "pending":
            assert expected is not None and expected[0] == "none", (expected, d)
            if item.host is not None:
                assert d["lease"]["host"] == item.host
            self.check_victims(item, d, pre["copy"])
        elif d.get("reason") in ("insufficient-capacity", "no-suitable-host", "host-unschedulable"):
            assert expected is not None and expected[0] == "none", (expected, d)
            if item.host is None:
                assert d["reason"] == expected[1], (expected, d)
        elif d.get("reason") == "selected-host-unsuitable":
            assert expected is None or expected[0] == "none", (expected, d)

    def check_event(self, item: Lifecycle | Observation, fx: Effects, pre: dict[str, Any]) -> None:
        """Incus events move only the lease of that instance on that host (and project);
        an observation releases only a suspect lease, and only if it is not older than
        the inventory that missed it."""
        lease: Lease | None = pre.get("lease")
        here = lease is not None and lease.active and lease.host == item.host
        unchanged = digest(self.state, with_seq=False) == pre["digest"]
        if isinstance(item, Lifecycle):
            moves = item.action in STATE_ACTIONS and here and lease is not None
            if not moves or (lease is not None and lease.project != item.project):
                assert unchanged and not fx.transitions, f"{item.action} moved {fx.transitions}"
            return
        if not here or lease is None or lease.suspect_revision is None:
            assert unchanged and not fx.transitions, "an observation of no suspect lease acted"
            return
        released = any(
            t.lease_id == lease.lease_id and t.to_state == "released" for t in fx.transitions
        )
        if released:
            assert not item.present and item.checked_revision >= lease.suspect_revision
        after = self.state.leases[lease.lease_id]
        if item.present:
            assert after.suspect_revision is None and after.state is lease.state

    def check_victims(self, item: Admit, d: dict[str, Any], was: State) -> None:
        """Victims were idle ready warm VMs of that host; together they make the request
        fit, and none of them can be spared (the walk-back); protected pools keep
        ``min_ready``."""
        host = was.hosts[HostName(d["lease"]["host"])]
        victims = [was.leases[v["lease_id"]] for v in d["victims"]]
        assert all(idle_ready(v) and v.host == host.name for v in victims), victims
        p = was.pools[item.pool]
        claims = resolve_claims(was, merge_claims(p, item.claims))
        fit = evaluate(was, host, p, p.flavor, claims, without=victims)
        assert fit.fit is Fit.FITS and fit.gpus == tuple(d["lease"]["gpus"])
        if len(victims) > 1:
            for v in victims:
                fewer = [o for o in victims if o is not v]
                trial = evaluate(was, host, p, p.flavor, claims, without=fewer)
                assert trial.fit is not Fit.FITS, f"victim {v.lease_id} was not needed"
        for name, owner in was.pools.items():
            if not owner.warm.protect_min_ready:
                continue
            before = sum(1 for le in was.leases.values() if le.pool == name and idle_ready(le))
            now = sum(1 for le in self.state.leases.values() if le.pool == name and idle_ready(le))
            assert now >= min(before, owner.warm.min_ready), f"{name} taken below min_ready"

    # ------------------------------------------------------------------ endings

    def check_end(self) -> None:
        """Replay into a fresh state, and restart from persisted fields half way."""
        if not self.log:
            return
        replay = State()
        for msg, outs in zip(self.log, self.outs, strict=True):
            assert out_tuples(fold(replay, msg)) == outs, f"replay diverged at seq {msg.seq}"
        assert digest(replay) == digest(self.state)
        half = len(self.log) // 2
        restarted = State()
        for i, (msg, outs) in enumerate(zip(self.log, self.outs, strict=True)):
            if i == half:
                restarted = rebuilt(restarted)
            assert out_tuples(fold(restarted, msg)) == outs, f"restart diverged at seq {msg.seq}"
        assert digest(restarted) == digest(self.state)
        # a redelivered batch (everything up to applied_seq) is skipped whole
        whole = digest(self.state)
        fx = Effects()
        for msg in self.log:
            fold(self.state, msg, fx)
        assert fx.outputs == [] and digest(self.state) == whole


def check_decision(body: dict[str, Any], rid: str, out: Output) -> None:
    assert body["request_id"] == rid
    assert out.msg_id == f"decision:{rid}:{body['phase']}"
    assert body["verb"] in OUTCOMES, body
    assert body["phase"] in ("pending", "final")
    assert body["outcome"] in OUTCOMES[body["verb"]], body
    assert (body["phase"] == "pending") == (body["outcome"] == "pending"), body
    if "reason" in body:
        assert body["reason"] in REASONS, body
    if body["outcome"] in ("rejected", "refused", "error"):
        assert "reason" in body, body
    assert isinstance(body["input_seq"], int) and body["input_seq"] > 0
    assert isinstance(body["decided_at"], str) and body["decided_at"].endswith("Z")
    if "lease" in body:
        lease = body["lease"]
        assert set(lease) >= LEASE_KEYS, lease
        assert lease["kind"] in ("cold", "warm")
        assert lease["state"] in {s.value for s in LeaseState}
        assert set(lease["demand"]) == {"cpu", "memory_mib", "disk_gib"}
    if body["outcome"] == "pending":
        assert body["victims"] and "lease" in body
        for v in body["victims"]:
            assert set(v) == {"lease_id", "instance", "host"}
    if body["outcome"] in ("admitted", "claimed", "authorized") or body["outcome"] == "pending":
        assert "lease" in body, body


# ============================================================================ strategies

Draw = Any  # hypothesis's data.draw


_SAMPLERS: dict[tuple[Any, ...], st.SearchStrategy[Any]] = {}


def some(draw: Draw, options: Sequence[T]) -> T:
    """One of ``options`` (shrinking towards the first)."""
    try:
        key = tuple((type(o), o) for o in options)
        strategy = _SAMPLERS.get(key)
    except TypeError:  # unhashable options (dicts)
        strategy = st.sampled_from(options)
    else:
        if strategy is None:
            strategy = _SAMPLERS[key] = st.sampled_from(options)
    value: T = draw(strategy)
    return value


def next_revision(draw: Draw, run: Run, host: str, kind: str) -> int:
    last = run.revision.get((host, kind), 0)
    return some(draw, [last + 1, last + 1, last + 2, last, max(last - 1, 0)])


def host_uid(draw: Draw, run: Run, host: str) -> str:
    """Mostly the host's current identity; rarely the other one (a reinstalled host)."""
    mine = run.uid.get(host, f"uid-{host}")
    other = f"uid-{host}" if mine.endswith("-b") else f"uid-{host}-b"
    return some(draw, [mine] * 11 + [other])


def host_snapshot(draw: Draw, run: Run, *, host: str | None = None) -> Item:
    host = host or some(draw, HOSTS)
    spec = HOST_SPECS[host]
    return snapshot(
        host,
        uid=host_uid(draw, run, host),
        revision=next_revision(draw, run, host, "snapshot"),
        cpu=spec["cpu"],
        memory_mib=spec["memory_mib"],
        disk_gib=spec["disk_gib"],
        reserve=spec["reserve"],
        gpus=spec["gpus"],
        schedulable=some(draw, [True, True, True, False]),
        labels=some(draw, [{}, {"zone": "a"}, {"zone": "a"}, {"zone": "b"}]),
        gpu_profile=some(draw, [None, *PROFILES]),
    )


def pci_of(host: str, index: int) -> str:
    return str(next(g["pci_address"] for g in HOST_SPECS[host]["gpus"] if g["index"] == index))


def host_inventory(
    draw: Draw,
    run: Run,
    *,
    host: str | None = None,
    crowded: bool = False,
    missing: str | None = None,
) -> Item:
    """The complete list of a host's instances: most of our leases' VMs (a missing one
    becomes suspect), and unless strict, small foreign VMs and VMs with our tags
    (adopted, or leftovers of released leases); ``crowded``: at least one foreign VM;
    ``missing``: that instance is left out."""
    busy = sorted({le.host for le in run.state.leases.values() if le.active})
    if host is None:
        host = some(draw, busy) if busy and draw(st.booleans()) else some(draw, HOSTS)
    s = run.state
    names: set[str] = {le.instance for le in s.active_on_host(HostName(host))}  # not foreign
    listed = []
    for lease in s.active_on_host(HostName(host)):
        if lease.instance != missing and draw(st.sampled_from([True, True, True, False])):
            config = {}
            if draw(st.booleans()):
                config = {
                    TAG_LEASE_ID: lease.lease_id,
                    TAG_POOL: lease.pool,
                    TAG_KIND: lease.kind.value,
                }
            listed.append(
                instance(
                    lease.instance,
                    project=lease.project,
                    cpu=lease.demand.cpu,
                    memory_mib=lease.demand.memory_mib,
                    disk_gib=lease.demand.disk_gib,
                    status_code=some(draw, [103, 103, 102, 113]),  # 113: the guest said ready
                    config=config,
                    gpus=[
                        pci_of(host, ix)
                        for ix in lease.gpus
                        if any(g["index"] == ix for g in HOST_SPECS[host]["gpus"])
                    ],
                )
            )
            names.add(lease.instance)
    gpus = HOST_SPECS[host]["gpus"]
    if not run.strict:
        for _ in range(draw(st.integers(1 if crowded else 0, 2))):  # foreign VMs, kept small
            name = some(draw, FOREIGN + INSTANCES)
            if name in names:
                continue
            names.add(name)
            used = [some(draw, gpus)["pci_address"]] if gpus and draw(st.booleans()) else []
            listed.append(
                instance(
                    name,
                    cpu=draw(st.integers(0, 1)),
                    memory_mib=some(draw, [0, 256, 512]),
                    disk_gib=draw(st.integers(0, 5)),
                    gpus=used,
                )
            )
        for _ in range(draw(st.integers(0, 1))):  # VMs carrying our lease tags
            released = sorted(le.lease_id for le in s.leases.values() if not le.active)
            tag: str
            if released and draw(st.booleans()):  # a leftover (or copy) of a released VM
                tag = some(draw, released)
                name = s.leases[LeaseId(tag)].instance
            else:
                tag, name = some(draw, [*sorted(s.leases), "T1", "T2", "T3"]), some(draw, INSTANCES)
            if name in names:
                continue
            names.add(name)
            config = {
                TAG_LEASE_ID: tag,
                TAG_POOL: some(draw, POOLS),
                TAG_KIND: some(draw, ["warm", "cold"]),
            }
            if draw(st.booleans()):
                config[TAG_JOB] = some(draw, JOBS)
            used = [some(draw, gpus)["pci_address"]] if gpus and draw(st.booleans()) else []
            listed.append(
                instance(
                    name,
                    cpu=1,
                    memory_mib=1024,
                    disk_gib=10,
                    config=config,
                    gpus=used,
                    status_code=some(draw, [103, 102]),
                )
            )
    return inventory(
        host,
        listed,
        revision=next_revision(draw, run, host, "inventory"),
        uid=host_uid(draw, run, host),
    )


def some_instance(draw: Draw, run: Run) -> str:
    active = sorted({le.instance for le in run.state.leases.values() if le.active})
    if active and draw(st.booleans()):
        return some(draw, active)
    return some(draw, INSTANCES)


def host_lifecycle(draw: Draw, run: Run) -> Item:
    booting = sorted(
        le.instance
        for le in run.state.leases.values()
        if le.kind is LeaseKind.WARM and le.state in (LeaseState.RESERVED, LeaseState.CREATED)
    )
    going = sorted(
        le.instance
        for le in run.state.leases.values()
        if le.state in (LeaseState.VICTIM, LeaseState.DRAINING, LeaseState.DELETING)
    )
    pick = draw(st.sampled_from(["any", "any", "booting", "going"]))
    name: str
    if pick == "booting" and booting:
        name, action = some(draw, booting), some(draw, ["instance-ready", "instance-agent-started"])
    elif pick == "going" and going:
        name, action = some(draw, going), "instance-deleted"
    else:
        name, action = some_instance(draw, run), some(draw, ACTIONS)
    lease = run.state.lease_of_instance(name)
    host = (
        lease.host
        if lease is not None and draw(st.sampled_from([True, True, False]))
        else some(draw, HOSTS)
    )
    project = lease.project if lease is not None else "default"
    return lifecycle(host, action, name, project=some(draw, [project, project, project, "other"]))


def host_observation(draw: Draw, run: Run) -> Item:
    suspects = sorted(
        le.instance
        for le in run.state.leases.values()
        if le.active and le.suspect_revision is not None
    )
    name = some(draw, suspects) if suspects and draw(st.booleans()) else some_instance(draw, run)
    lease = run.state.lease_of_instance(name)
    host = lease.host if lease is not None and draw(st.booleans()) else some(draw, HOSTS)
    rev = lease.suspect_revision if lease is not None and lease.suspect_revision else 1
    return observation(
        host,
        name,
        present=draw(st.booleans()),
        checked_revision=some(draw, [rev, rev + 1, max(rev - 1, 0)]),
    )


def claim_spec(draw: Draw) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "name": some(draw, ["gpu", "gpu", "extra"]),
        "class": some(draw, ["gpu", "gpu", *CLASSES, "ghost"]),
    }
    if draw(st.booleans()):
        params: dict[str, Any] = {"count": some(draw, [1, 1, 2, 0])}
        if draw(st.booleans()):
            params["model"] = some(draw, ["A100", "H100"])
        claim["parameters"] = {"gpu": params}
    return claim


def pool_config(draw: Draw, run: Run) -> Item:
    name = some(draw, POOLS)
    max_ready = draw(st.integers(0, 3))
    claims = [] if draw(st.sampled_from([True, True, False])) else [claim_spec(draw)]
    item = pool(
        name,
        cpu=draw(st.integers(1, 4)),
        memory_mib=some(draw, [1024, 2048, 4096]),
        disk_gib=some(draw, [10, 20, 40]),
        min_ready=draw(st.integers(0, max_ready)),
        max_ready=max_ready,
        protect_min_ready=draw(st.booleans()),
        max_instances=draw(st.integers(max_ready, 6)),
        priority=draw(st.integers(0, 2)),
        placement=some(draw, ["pack", "spread"]),
        host_selector=some(draw, [None, None, {"zone": "a"}]),
        claims=claims,
        project=some(draw, ["default"] * 4 + ["ci"]),
    )
    payload = item[1]
    broken = some(draw, [None] * 6 + ["min>max", "max>instances", "dup-claims", "no-image"])
    if broken == "min>max":
        payload["warm"] = {**payload["warm"], "min_ready": max_ready + 1}
    elif broken == "max>instances":
        payload["max_instances"] = max(max_ready - 1, 0)
        payload["warm"] = {**payload["warm"], "max_ready": max(max_ready, 1), "min_ready": 0}
    elif broken == "dup-claims":
        payload["claims"] = [claim_spec(draw) | {"name": "x"}, claim_spec(draw) | {"name": "x"}]
    elif broken == "no-image":
        payload["image"] = ""
        payload["warm"] = {**payload["warm"], "max_ready": max(max_ready, 1)}
        payload["max_instances"] = max(payload["max_instances"], 1)
    return item


def class_config(draw: Draw, run: Run) -> Item:
    name = some(draw, CLASSES)
    if draw(st.sampled_from([False, False, False, True])):
        return "config.class", {"v": 1, "class": name, "parameters": {}}
    item = gpu_class(
        name,
        count=some(draw, [1, 1, 2, 0]),
        model=some(draw, [None, None, "A100", "H100"]),
        vendor=some(draw, [None, None, "nvidia", ""]),
        min_memory_mib=some(draw, [None, None, 40960, 81920]),
        host_selector=some(draw, [None, None, {"zone": "a"}]),
    )
    return item


def profile_config(draw: Draw, run: Run) -> Item:
    return gpu_profile(
        some(draw, PROFILES),
        revision=draw(st.integers(1, 4)),
        mig_mode=some(draw, ["disabled", "enabled"]),
        compute_mode=some(draw, ["default", "exclusive-process", "prohibited"]),
        persistence=draw(st.booleans()),
        power_limit_w=some(draw, [None, 250, 400, 0]),
        ecc=draw(st.booleans()),
    )


def policy_config(draw: Draw, run: Run) -> Item:
    values: dict[str, list[Any]] = {
        "mig_mode": ["enabled", "disabled", "sometimes"],
        "compute_mode": ["exclusive-process", "default", "shared"],
        "persistence": [True, False, "yes"],
        "power_limit_w": [300, None, -5],
        "ecc": [True, False],
    }
    overrides: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from([*values, "fan_speed"]), max_size=3, unique=True)):
        overrides[key] = some(draw, values.get(key, [50]))
    return gpu_policy(
        some(draw, POLICIES),
        priority=draw(st.integers(0, 3)),
        overrides=overrides,
        host_labels=some(draw, [None, {"zone": "a"}]),
        models=some(draw, [None, ["A100"], ["H100"]]),
        indexes=some(draw, [None, [0], [1, 2], [-1]]),
    )


def admit_command(draw: Draw, run: Run, *, preemptible: bool) -> Item:
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["job"] = some(draw, JOBS)
    warm_hosts = sorted({le.host for le in run.state.leases.values() if idle_ready(le)})
    if preemptible and warm_hosts and draw(st.booleans()):
        fields["host"] = some(draw, warm_hosts)
    elif draw(st.sampled_from([False, False, True])):
        fields["host"] = some(draw, [*HOSTS, UNKNOWN_HOST])
    if draw(st.sampled_from([False, False, False, True])):
        fields["claims"] = [claim_spec(draw)]
    kind = "cold" if preemptible else some(draw, ["cold", "warm", "warm"])
    known = sorted(run.state.pools)
    name = (
        some(draw, known)
        if known and draw(st.sampled_from([True, True, False]))
        else some(draw, [*POOLS, UNKNOWN_POOL])
    )
    active = {le.instance for le in run.state.leases.values() if le.active}
    free = [n for n in INSTANCES if n not in active]
    vm = (
        some(draw, free)
        if free and draw(st.sampled_from([True, True, True, False]))
        else some(draw, INSTANCES)
    )
    return admit(request_id(draw, run), name, vm, kind=kind, preemptible=preemptible, **fields)


def request_id(draw: Draw, run: Run, *, fresh: bool = False) -> str:
    """Mostly a fresh id; sometimes one already used (by any verb)."""
    used: list[str] = sorted({payload["request_id"] for _, payload in run.commands})
    if used and not fresh and draw(st.sampled_from([False] * 5 + [True])):
        return some(draw, used)
    return f"r{len(used) + 1}"


def command(draw: Draw, run: Run, verb: str) -> Item:
    rid = request_id(draw, run)
    if verb == "claim-warm":
        known = sorted(run.state.pools)
        name = (
            some(draw, known)
            if known and draw(st.booleans())
            else some(draw, [*POOLS, UNKNOWN_POOL])
        )
        return cmd(verb, rid, pool=name, job=some(draw, JOBS))
    if verb == "mark-warm-injected":
        name = some_instance(draw, run)
        lease = run.state.lease_of_instance(name)
        own = lease is not None and lease.job and draw(st.booleans())
        job = lease.job if own and lease is not None else some(draw, JOBS)
        return cmd(verb, rid, instance=name, job=job)
    if verb == "authorize-warm-drain":
        ready, draining = (
            sorted(le.instance for le in run.state.leases.values() if le.state is state)
            for state in (LeaseState.READY, LeaseState.DRAINING)
        )
        pick = draw(st.sampled_from(["ready", "ready", "draining", "any"]))
        if pick == "ready" and ready:
            return cmd(verb, rid, instance=some(draw, ready))
        if pick == "draining" and draining:
            return cmd(verb, rid, instance=some(draw, draining))
    return cmd(verb, rid, instance=some_instance(draw, run))


def free_instances(run: Run) -> list[str]:
    active = {le.instance for le in run.state.leases.values() if le.active}
    return [n for n in INSTANCES if n not in active]


def warm_vm(draw: Draw, run: Run, *, host: str | None = None) -> None:
    """A macro: admit one to three warm VMs, and (usually) report each ready."""
    pools = sorted(n for n, p in run.state.pools.items() if p.warm.max_ready > 0)
    if not pools or not run.state.hosts:
        return None
    name = some(draw, pools)
    for _ in range(draw(st.integers(1, 3))):
        free = free_instances(run)
        if not free:
            return None
        fields: dict[str, Any] = {}
        if host is not None:
            fields["host"] = host
        elif draw(st.sampled_from([False, False, False, True])):
            fields["host"] = some(draw, sorted(run.state.hosts))
        if draw(st.sampled_from([False] * 5 + [True])):
            fields["job"] = some(draw, JOBS)  # a warm VM booked for one job up front
        rid = request_id(draw, run, fresh=True)
        fx = run.send(admit(rid, name, some(draw, free), kind="warm", **fields))
        made = [o for o in fx.outputs if o.subject.endswith(".create")]
        if made and draw(st.sampled_from([True, True, True, False])):
            body = orjson.loads(made[0].payload)
            action = some(draw, ["instance-ready", "instance-agent-started"])
            run.send(lifecycle(body["host"], action, body["instance"], project=body["project"]))
    return None


def fill_host(draw: Draw, run: Run, *, host: str | None = None) -> None:
    """A macro: cold admits onto one host (preferably one with idle warm VMs) until it
    refuses one (at most five), then often a preemptible admit for that host."""
    pools, hosts = sorted(run.state.pools), sorted(run.state.hosts)
    if not pools or not hosts:
        return None
    warm = sorted({le.host for le in run.state.leases.values() if idle_ready(le)})
    if host is None:
        host = some(draw, warm) if warm and draw(st.booleans()) else some(draw, hosts)
    by_size = sorted(pools, key=lambda n: (run.state.pools[n].flavor.cpu, n))
    # fill with the smallest flavor (no slack left), preempt for the largest
    name = by_size[0] if draw(st.booleans()) else some(draw, pools)
    for _ in range(6):
        free = free_instances(run)
        if not free:
            return None
        fx = run.send(admit(request_id(draw, run, fresh=True), name, some(draw, free), host=host))
        if b'"admitted"' not in fx.outputs[-1].payload:
            break
    free = free_instances(run)
    if free and draw(st.sampled_from([True, True, False])):
        fields = {"host": host} if draw(st.sampled_from([True, True, False])) else {}
        rid = request_id(draw, run, fresh=True)
        big = by_size[-1] if draw(st.booleans()) else some(draw, pools)
        run.send(admit(rid, big, some(draw, free), preemptible=True, **fields))
    return None


def contend(draw: Draw, run: Run) -> None:
    """A macro: warm VMs on a host, the host filled up, a preemptible admit for it."""
    if not run.state.hosts:
        return None
    host = some(draw, sorted(run.state.hosts))
    for _ in range(draw(st.integers(1, 2))):  # maybe from two pools: victims of two sizes
        warm_vm(draw, run, host=host)
    fill_host(draw, run, host=host)
    return None


def executor(draw: Draw, run: Run) -> None:
    """A macro: the executor deletes VMs it was told to delete, and the bridge then
    reports the host afresh (a snapshot or an inventory, or neither)."""
    going = sorted(
        (le.instance, le.host, le.project)
        for le in run.state.leases.values()
        if le.state in (LeaseState.VICTIM, LeaseState.DRAINING, LeaseState.DELETING)
    )
    if not going:
        return None
    hosts = set()
    if draw(st.booleans()):  # all of them, as an executor that keeps up would
        chosen = going
    else:
        chosen = draw(st.lists(st.sampled_from(going), min_size=1, unique=True))
    for name, host, project in chosen:
        run.send(lifecycle(host, "instance-deleted", name, project=project))
        hosts.add(host)
    for host in sorted(hosts):
        then = draw(st.sampled_from(["snapshot", "inventory", "crowded", "nothing"]))
        if then == "snapshot":
            run.send(host_snapshot(draw, run, host=host))
        elif then != "nothing":
            run.send(host_inventory(draw, run, host=host, crowded=then == "crowded"))
            if draw(st.booleans()):
                verifier(draw, run)
    return None


def verifier(draw: Draw, run: Run) -> None:
    """A macro: the leader's live GET of suspect leases, published as observations
    (sometimes about an older inventory revision than the one that missed the VM)."""
    suspects = sorted(
        (le.instance, le.host, le.suspect_revision)
        for le in run.state.leases.values()
        if le.active and le.suspect_revision is not None
    )
    if not suspects:
        return None
    for name, host, rev in draw(st.lists(st.sampled_from(suspects), min_size=1, unique=True)):
        checked = some(draw, [rev, rev, rev + 1, max(rev - 1, 0)])
        run.send(observation(host, name, present=draw(st.booleans()), checked_revision=checked))
    return None


def vanish(draw: Draw, run: Run) -> None:
    """A macro: a VM goes missing from its host's inventory, and the verifier looks."""
    running = sorted(
        (le.instance, le.host)
        for le in run.state.leases.values()
        if le.active and le.state is not LeaseState.RESERVED
    )
    if not running:
        return None
    name, host = some(draw, running)
    run.send(host_inventory(draw, run, host=host, missing=name))
    verifier(draw, run)
    return None


def failure_report(draw: Draw, run: Run) -> Item | None:
    """The executor (or GARM's provider) reports what it could not do to a lease's VM:
    a create or start refused, a delete that cannot be done; now and then about a lease
    that is gone, or in a state the failure no longer fits."""
    leases = sorted(run.state.leases.values(), key=lambda le: le.lease_id)
    if not leases:
        return None
    lease = some(draw, leases)
    action = some(draw, ["create", "start", "delete", "delete"])
    return failure(lease.host, lease.instance, lease.lease_id, action, "Incus said no")


def host_command(draw: Draw, run: Run) -> Item:
    """An operator cordons, drains or uncordons a host (now and then one never seen)."""
    host = some(draw, [*HOSTS, "nowhere"])
    verb = some(draw, ["cordon", "drain", "uncordon", "uncordon"])
    return cmd(verb, request_id(draw, run, fresh=True), host=host)


def config_change(draw: Draw, run: Run) -> Item:
    """An ``apply-config`` change: pools and classes put (some refused, some unchanged)
    and deleted (some in use, some unknown); applied whole or not at all."""
    items = [
        some(draw, [pool_config, pool_config, class_config])(draw, run)
        for _ in range(draw(st.integers(0, 2)))
    ]
    if run.state.pools and draw(st.booleans()):  # the same again: unchanged
        name = some(draw, sorted(run.state.pools))
        items.append(("config.pool", CONFIG_KINDS["pool"].payload(run.state.pools[name])))
    deletions = tuple(
        some(draw, [("pool", p) for p in POOLS] + [("class", c) for c in CLASSES])
        for _ in range(draw(st.integers(0, 2)))
    )
    return apply_config(request_id(draw, run, fresh=True), *items, delete=deletions)


GENERATORS: dict[str, Any] = {
    "vanish": vanish,
    "failure": failure_report,
    "host-command": host_command,
    "apply-config": config_change,
    "verifier": verifier,
    "executor": executor,
    "fill": fill_host,
    "contend": contend,
    "warm-vm": warm_vm,
    "snapshot": host_snapshot,
    "inventory": host_inventory,
    "lifecycle": host_lifecycle,
    "observation": host_observation,
    "pool": pool_config,
    "class": class_config,
    "gpu-profile": profile_config,
    "gpu-policy": policy_config,
    "admit": lambda draw, run: admit_command(draw, run, preemptible=False),
    "admit-preemptible": lambda draw, run: admit_command(draw, run, preemptible=True),
    **{
        verb: (lambda v: lambda draw, run: command(draw, run, v))(verb)
        for verb in (
            "claim-warm",
            "authorize-warm-drain",
            "mark-created",
            "mark-warm-injected",
            "mark-deleting",
            "release",
            "render-runtime",
        )
    },
    "resend": lambda draw, run: some(
        draw, run.commands[-3:] if draw(st.booleans()) else run.commands
    ),
}
WEIGHTS = {
    "snapshot": 3,
    "inventory": 3,
    "lifecycle": 6,
    "observation": 3,
    "pool": 2,
    "class": 1,
    "gpu-profile": 1,
    "gpu-policy": 1,
    "admit": 6,
    "admit-preemptible": 4,
    "claim-warm": 3,
    "authorize-warm-drain": 2,
    "mark-created": 2,
    "mark-warm-injected": 2,
    "mark-deleting": 1,
    "release": 3,
    "render-runtime": 1,
    "resend": 2,
    "warm-vm": 4,
    "fill": 2,
    "contend": 2,
    "executor": 3,
    "verifier": 1,
    "vanish": 2,
    "failure": 2,
    "host-command": 1,
    "apply-config": 1,
}
KIND_CHOICES = [k for k, w in WEIGHTS.items() for _ in range(w)]


def prelude(draw: Draw, run: Run) -> list[Item]:
    """An optional, shrinkable start: hosts, warm pools and a GPU class, so that deep
    states (ready warm VMs, preemption) are reached within a short stream."""
    items: list[Item] = []
    if True:
        for host in draw(st.lists(st.sampled_from(HOSTS), min_size=1, max_size=4, unique=True)):
            spec = HOST_SPECS[host]
            items.append(
                snapshot(
                    host,
                    revision=1,
                    cpu=spec["cpu"],
                    memory_mib=spec["memory_mib"],
                    disk_gib=spec["disk_gib"],
                    reserve=spec["reserve"],
                    gpus=spec["gpus"],
                    labels={"zone": some(draw, ["a", "b"])},
                )
            )
        items.append(gpu_class("gpu"))
        gpu_claim = [{"name": "gpu", "class": "gpu"}]
        # p1 is a larger cold flavor than p2's warm VMs, so preempting takes several
        # (and, at a higher priority, comes after them: the walk-back drops spare ones)
        for name, priorities, claims, cpus in (
            ("p1", [1, 0], [], [2, 3]),
            ("p2", [0, 1], [], [1, 1, 2]),
            ("p3", [0, 1], gpu_claim, [1, 2]),
        ):
            items.append(
                pool(
                    name,
                    cpu=some(draw, cpus),
                    memory_mib=2048,
                    disk_gib=20,
                    max_ready=3,
                    min_ready=draw(st.integers(0, 1)),
                    max_instances=6,
                    priority=some(draw, priorities),
                    protect_min_ready=draw(st.booleans()),
                    claims=claims,
                )
            )
    return items


RunT = TypeVar("RunT", bound=Run)


def play(data: Any, run: RunT, *, steps: int) -> RunT:
    draw = data.draw
    for item in prelude(draw, run):
        run.send(item)
    n = draw(st.integers(1, steps))
    for _ in range(n):
        kind = draw(st.sampled_from(KIND_CHOICES))
        if kind == "resend" and not run.commands:
            kind = "release"
        item = GENERATORS[kind](draw, run)
        if item is not None:
            run.send(item)
    return run


# ============================================================================ properties


# A failing property shrinks for minutes (each example is a stream of checked inputs), so
# these tests get more than the project's default timeout.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "foreign"])
@budget(200)
@given(data=st.data())
def test_every_invariant_holds_after_every_input(strict: bool, data: Any) -> None:
    """Properties 1-6 and 8 after every input; 7 at the end of the stream."""
    run = play(data, Run(strict=strict), steps=45)
    run.check_end()


@pytest.mark.timeout(900)
@budget(100)
@given(data=st.data())
def test_folding_is_deterministic_and_restart_safe(data: Any) -> None:
    """Property 7 on longer streams, without the per-step checks."""
    run = play(data, Run(checks=False), steps=80)
    run.check_end()


# ============================================================================ found bugs
#
# Minimal repros of bugs the properties above found in reconciler/core (fixed since in
# the tree); kept as regression tests, each naming the check that caught it.


def only_decision(fx: Effects) -> dict[str, Any]:
    (out,) = [o for o in fx.outputs if o.subject.startswith("out.decision.")]
    body: dict[str, Any] = orjson.loads(out.payload)
    return body


def test_found_preemptible_admit_naming_an_unknown_host_is_rejected_not_a_crash() -> None:
    """Caught as a crash of the fold (DESIGN principle 7). ``place`` answered an unknown
    selected host ``selected-host-unsuitable``, a reason preemption may turn around, so
    ``capacity_bound`` looked the host up in ``state.hosts``: KeyError."""
    fleet = Fleet()
    fleet.send(snapshot("h1"), pool("p1"))

    d = only_decision(fleet.send(admit("r1", "p1", "i1", preemptible=True, host="h9")))

    assert (d["outcome"], d["reason"]) == ("rejected", "selected-host-unsuitable")


def test_found_gpus_of_a_vm_adopted_before_the_hosts_first_snapshot_stay_in_use() -> None:
    """Caught by ``check_observed_gpus``. Adoption resolved the VM's PCI addresses
    against the GPUs known then (none before the first snapshot) and no snapshot
    resolved them again, so the adopted VM's GPU went to the next claim."""
    tags = {TAG_LEASE_ID: "X1", TAG_POOL: "p1", TAG_KIND: "cold"}
    pci0 = gpu(0)["pci_address"]
    fleet = Fleet()
    fleet.send(inventory("h1", [instance("old", cpu=1, config=tags, gpus=[pci0])]))
    fleet.send(
        snapshot("h1", gpus=[gpu(0)]),
        gpu_class("g"),
        pool("p1", cpu=1, claims=[{"name": "gpu", "class": "g"}]),
    )

    adopted = fleet.state.lease_of_instance("old")
    assert adopted is not None and adopted.adopted
    assert 0 in booking(fleet.state, fleet.state.hosts[HostName("h1")]).used_gpus
    d = only_decision(fleet.send(admit("r1", "p1", "new")))
    assert (d["outcome"], d.get("reason")) == ("rejected", "insufficient-capacity")


def test_found_a_job_already_bound_is_not_carried_by_a_second_lease() -> None:
    """Caught by ``check_jobs`` (property 3). ``_reserve`` put ``cmd.job`` on the new
    lease although ``state.jobs`` bound the job to another one, so two leases carried
    ``j1`` while ``resolve j1`` named only ``a``."""
    fleet = Fleet()
    fleet.send(snapshot("h1"), pool("p1", cpu=1))
    fleet.send(admit("r1", "p1", "a", job="j1"))

    fleet.send(admit("r2", "p1", "b", job="j1"))

    carriers = sorted(le.instance for le in fleet.state.leases.values() if le.job == "j1")
    assert carriers == ["a"], f"job j1 is carried by {carriers}"


def test_found_an_orphan_is_deleted_on_the_host_that_reported_it() -> None:
    """Caught by the exec-delete checks of ``check_outputs``. A VM tagged with a
    released lease was deleted as an orphan on the released lease's host, not on the
    host whose inventory showed it: with the name leased again there (the VM was moved
    or copied with its ``user.*`` keys), the executor deleted the live VM."""
    fleet = Fleet()
    fleet.send(snapshot("h1"), snapshot("h2"), pool("p1", cpu=1))
    old = only_decision(fleet.send(admit("r1", "p1", "x", host="h2")))["lease"]["lease_id"]
    fleet.send(cmd("release", "r2", instance="x"))
    live = only_decision(fleet.send(admit("r3", "p1", "x", host="h2")))["lease"]["lease_id"]
    tags = {TAG_LEASE_ID: old, TAG_POOL: "p1", TAG_KIND: "cold"}

    fx = fleet.send(inventory("h1", [instance("x", cpu=1, config=tags)]))

    deletes = [(o.subject, orjson.loads(o.payload)) for o in fx.outputs if ".delete" in o.subject]
    assert [(s, d["host"], d["instance"]) for s, d in deletes] == [
        ("out.exec.h1.delete", "h1", "x")
    ], f"deletes {deletes} while {live} holds x on h2"


def test_found_a_victims_spare_capacity_is_not_handed_out_while_it_still_runs() -> None:
    """Caught by the "admitted at once" check of ``check_booking``. Booking dropped a
    victim's whole demand and GPUs and booked only the pending request's demand, so
    what the victim held beyond that (here 1 vCPU and GPU 0) went to a plain admit
    that skips the launch gate while the victim VM still ran."""
    fleet = Fleet()
    gpu_claim = [{"name": "gpu", "class": "g"}]
    fleet.send(
        snapshot("h1", cpu=4, gpus=[gpu(0)]),
        gpu_class("g"),
        pool("warm", cpu=2, max_ready=2, claims=gpu_claim),
        pool("cold", cpu=1),
        pool("gpu", cpu=1, claims=gpu_claim),
    )
    fleet.send(admit("w", "warm", "w1", kind="warm"), lifecycle("h1", "instance-ready", "w1"))
    fleet.send(admit("c1", "cold", "c1"), admit("c2", "cold", "c2"))  # h1 is full
    pending = only_decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    assert pending["outcome"] == "pending"

    d = only_decision(fleet.send(admit("r2", "gpu", "g1")))  # w1 still runs on GPU 0

    assert d["outcome"] == "rejected", f"admitted {d.get('lease')} beside victim w1 on GPU 0"
