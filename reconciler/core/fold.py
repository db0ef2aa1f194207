"""The fold: every input, in stream order, applied to the state, returning its effects.

This is where every safety rule lives (docs/architecture.md, rule 1). It is deterministic:
time is the input message's timestamp, ids derive from the input sequence and the
request ids, and every choice ends in a total order on names. A message at or below
``state.applied_seq`` is skipped, so a redelivered batch changes nothing.

Outputs are the messages of :mod:`reconciler.core.messages`, sorted-key JSON, so that
folding the same stream twice gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args

from reconciler.core import inputs as ev
from reconciler.core.expiry import SECONDS_SEEN, epoch_second
from reconciler.core.messages import (
    UNPREFIXED,
    ConfigRejected,
    CreateCommand,
    DeleteCommand,
    DeleteReason,
    GpuAssignment,
    Output,
    decision_output,
    lease_payload,
    victim_payload,
)
from reconciler.core.model import (
    CLAIMED,
    COLD,
    CREATED,
    DELETING,
    DRAINING,
    INJECTED,
    READY,
    RELEASED,
    RESERVED,
    TAG_JOB,
    TAG_KIND,
    TAG_LEASE_ID,
    TAG_POOL,
    VICTIM,
    WARM,
    ZERO,
    ClassName,
    GpuPolicy,
    GpuProfile,
    Host,
    HostName,
    InstanceType,
    JobId,
    Lease,
    LeaseId,
    LeaseKind,
    LeaseState,
    Pool,
    PoolName,
    RequestId,
    ResolvedClaim,
    ResourceClass,
    Resources,
    evolve_host,
    evolve_lease,
)
from reconciler.core.placement import (
    STAGE_NAMES,
    ClaimError,
    PlacementResult,
    booking,
    capacity_bound,
    choose_host,
    merge_claims,
    resolve_claims,
)
from reconciler.core.preemption import choose_victims
from reconciler.core.retention import evict_expired
from reconciler.core.runtime import (
    RuntimeConfigError,
    runtime_basis,
    validate_overrides,
    validate_profile,
)
from reconciler.core.state import DecisionRecord, Effects, State, Transition

# Speed notes (the fold is the hot path of the live line and of replay):
# - enum members as module constants (imported from model as ``READY`` and so on): on
#   Python 3.11 ``LeaseState.READY`` goes through the enum metaclass's ``__getattr__``
#   hook (about 100 ns, where a global is about 10 ns), and the fold tests lease states
#   and kinds several times per input;
# - enum values as ``str(member)``: the lease enums are ``StrEnum``s, whose ``str()`` is
#   their value (Python's documented ``StrEnum.__str__``), a C call where ``.value`` is
#   a Python-level descriptor (about 6 times slower).

_NO_GPUS: frozenset[int] = frozenset()

#: Incus status codes in an inventory: Running, and Ready (running, and its guest said
#: ready: ``volatile.last_state.ready``)
_STATUS_RUNNING = 103
_STATUS_READY = 113

#: rejections that preemption may turn around (capacity, possibly on the selected host)
_PREEMPTIBLE_REASONS = ("insufficient-capacity", "selected-host-unsuitable")


# ============================================================================ entry


def fold(state: State, message: ev.Message, fx: Effects | None = None) -> Effects:
    """Apply one message. Skipped (no effects) when at or below the applied position."""
    return fold_input(
        state, message.seq, message.timestamp, message.input, Effects() if fx is None else fx
    )


def fold_input(state: State, seq: int, timestamp: str, item: ev.Input, fx: Effects) -> Effects:
    """:func:`fold` of a message given by its parts (sequence, stream time, input), for
    a caller that has them apart: the caches fold each input they decode this way,
    without a :class:`~reconciler.core.inputs.Message` built for it."""
    if seq <= state.applied_seq:
        return fx
    handler = _HANDLERS.get(type(item))
    step = _Step(state, seq, timestamp, fx)
    now = step.now
    retention = state.decision_retention_s
    if now is not None and retention is not None:
        # evict_expired() when something is due (the expiry index's own test, inlined):
        # most steps have nothing to evict
        due = state.expiry.seconds
        if due and due[0] <= now - retention:
            evict_expired(state, now, fx)
    if handler is None:  # pragma: no cover - every input type is registered
        raise TypeError(f"no handler for {type(item).__name__}")
    # a set lookup on the exact type rather than isinstance() against the Command union
    if type(item) in _COMMANDS and item.request_id in state.decisions:  # type: ignore[union-attr]
        step.republish(item.request_id)  # type: ignore[union-attr]
    else:
        handler(step, item)
    state.applied_seq = seq
    return fx


# ============================================================================= step


class _Step:
    """One message being folded; a small object so helpers share seq, time and effects."""

    __slots__ = ("at", "fx", "now", "seq", "state", "ts")

    def __init__(self, state: State, seq: int, timestamp: str, fx: Effects) -> None:
        self.state = state
        self.seq = seq
        self.ts = timestamp
        #: the stream time in whole seconds (retention), None for a timestamp without one;
        #: epoch_second()'s cache read first, as most inputs share their second with others
        now = SECONDS_SEEN.get(timestamp[:19])
        self.now = now if now is not None else epoch_second(timestamp)
        #: the journal's time of this step: its stream second, 0 when it has none
        self.at = self.now if self.now is not None else 0
        self.fx = fx

    # ------------------------------------------------------------------ helpers

    def note(self, text: str) -> None:
        self.fx.notes.append((self.seq, text))

    def republish(self, request_id: RequestId) -> None:
        """Answer a request id decided already: its latest decision, the same bytes."""
        record = self.state.decisions[request_id]
        self.fx.outputs.append(
            Output(UNPREFIXED.decision(request_id), record.msg_id, record.payload)
        )
        self.note(f"request {request_id} already decided; decision re-sent")

    def decide(
        self,
        request_id: RequestId,
        verb: str,
        outcome: str,
        *,
        phase: str = "final",
        reason: str | None = None,
        detail: str | None = None,
        lease: Lease | None = None,
        victims: Iterable[Lease] | None = None,
    ) -> None:
        out = decision_output(
            request_id,
            verb,
            outcome,
            phase,
            self.seq,
            self.ts,
            reason,
            detail,
            lease_payload(lease) if lease is not None else None,
            [victim_payload(v) for v in victims] if victims is not None else None,
        )
        final_at = self.now if phase == "final" else None
        state = self.state
        # positional: the fields' order is request_id, verb, phase, payload, lease_id, final_at
        record = DecisionRecord(
            request_id,
            verb,
            phase,
            out.payload,
            lease.lease_id if lease is not None else None,
            final_at,
        )
        state.decisions[request_id] = record
        if final_at is not None:
            # expiry.add_decision(), its common case inlined: the second's bucket exists
            bucket = state.expiry.decisions.get(final_at)
            if bucket is not None:
                bucket.append(request_id)
            else:
                state.expiry.add_decision(final_at, request_id)
        fx = self.fx
        fx.decisions.add(request_id)
        fx.outputs.append(out)

    def move(self, lease: Lease, to: LeaseState, event: str, **changes: Any) -> Lease:
        """Change a lease's state (or only its fields, when ``to`` is its state)."""
        new = evolve_lease(lease, state=to, **changes)
        self.state.put_lease(new)
        fx = self.fx
        fx.leases.add(new.lease_id)
        fx.hosts.add(new.host)
        fx.pools.add(new.pool)
        if to is not lease.state:
            fx.transitions.append(
                Transition(self.seq, new.lease_id, event, str(lease.state), str(to), self.at)
            )
            if to is RELEASED:
                self._released(new.lease_id)
        return new

    def _released(self, lease_id: LeaseId) -> None:
        """File a lease just released for eviction after the retention."""
        if self.now is not None:
            self.state.released_at[lease_id] = self.now
            self.state.expiry.add_lease(self.now, lease_id)

    def create(self, lease: Lease, event: str) -> None:
        self.state.put_lease(lease)
        self.fx.leases.add(lease.lease_id)
        self.fx.hosts.add(lease.host)
        self.fx.pools.add(lease.pool)
        self.fx.transitions.append(
            Transition(self.seq, lease.lease_id, event, None, str(lease.state), self.at)
        )
        if lease.state is RELEASED:
            self._released(lease.lease_id)

    def exec_delete(
        self,
        lease: Lease,
        reason: DeleteReason,
        *,
        host: HostName | None = None,
        project: str | None = None,
    ) -> None:
        """Ask the executor to delete the lease's VM (an orphan: where it was seen)."""
        command = DeleteCommand.for_lease(
            lease_id=lease.lease_id,
            host=host or lease.host,
            instance=lease.instance,
            project=project or lease.project,
            reason=reason,
        )
        self.fx.outputs.append(command.output())

    def exec_create(self, lease: Lease, pool: Pool, host: Host) -> None:
        by_index = {g.index: g for g in host.gpus}
        command = CreateCommand.for_lease(
            lease_id=lease.lease_id,
            host=lease.host,
            instance=lease.instance,
            project=lease.project,
            pool=lease.pool,
            image=pool.image,
            profiles=pool.profiles,
            demand=lease.demand,
            gpus=tuple(
                GpuAssignment(index=i, pci_address=by_index[i].pci_address) for i in lease.gpus
            ),
            # always the pool's type, its default spelled out: the executor need not know it
            instance_type=(pool.instance_type or InstanceType.VIRTUAL_MACHINE).value,
        )
        self.fx.outputs.append(command.output())

    def reject_config(self, kind: str, name: str, error: str) -> None:
        rejected = ConfigRejected(kind=kind, name=name, error=error, input_seq=self.seq)
        self.fx.outputs.append(rejected.output())
        self.note(f"config {kind} {name} rejected: {error}")

    def release(self, lease: Lease, event: str) -> None:
        """Release a lease (idempotent) and let any launch gate waiting on it move."""
        if not lease.active:
            return
        if lease.gated and lease.awaiting_victims:
            # Its victims still run: keep booking their room until they are gone, so
            # nothing else can be admitted onto capacity that is not free yet.
            if lease.state is not DELETING:
                self.move(lease, DELETING, event)
            self.note(f"{lease.lease_id} waits for its victims before it is released")
            return
        released = self.move(
            lease,
            RELEASED,
            event,
            suspect_revision=None,
            gate_seq=None,
            awaiting_victims=(),
            held=ZERO,
            held_gpus=(),
        )
        if released.victim_of is not None:
            self._victim_gone(released)

    def _victim_gone(self, victim: Lease) -> None:
        record = self.state.decisions.get(victim.victim_of) if victim.victim_of else None
        pending = self.state.leases.get(record.lease_id) if record and record.lease_id else None
        if pending is None or not pending.gated:
            return
        remaining = tuple(v for v in pending.awaiting_victims if v != victim.lease_id)
        held, held_gpus = self._held_by(remaining)
        pending = self.move(
            pending,
            pending.state,
            "victim-released",
            awaiting_victims=remaining,
            held=held,
            held_gpus=held_gpus,
        )
        if pending.state is DELETING:
            if not remaining:
                self.release(pending, "victims-released")
            return
        self.check_gates(pending.host)

    def _held_by(self, victims: Iterable[LeaseId]) -> tuple[Resources, tuple[int, ...]]:
        total = Resources()
        gpus: set[int] = set()
        for lease_id in victims:
            victim = self.state.leases[lease_id]
            total = total + victim.demand
            gpus.update(victim.gpus)
        return total, tuple(sorted(gpus))

    def check_gates(self, host_name: HostName) -> None:
        """Open every launch gate on the host whose victims are gone and whose fit a
        snapshot or inventory newer than the pending decision proves again."""
        host = self.state.hosts.get(host_name)
        if host is None:
            return
        for lease in self.state.gated_on(host_name):
            if lease.awaiting_victims or lease.state is not RESERVED:
                continue
            if not host.schedulable:
                self.note(f"gate of {lease.lease_id} stays shut: {host_name} is unschedulable")
                continue
            gate = lease.gate_seq or 0
            if host.snapshot_seq <= gate and host.inventory_seq <= gate:
                continue
            book = booking(self.state, host, without=[lease])
            room = host.allocatable - book.booked
            if not lease.demand.fits_in(room) or book.used_gpus & set(lease.gpus):
                self.note(f"gate of {lease.lease_id} stays shut: fit not proven on {host_name}")
                continue
            opened = self.move(lease, lease.state, "gate-opened", gate_seq=None)
            assert opened.request_id is not None
            self.decide(opened.request_id, "admit-preemptible", "admitted", lease=opened)

    # ----------------------------------------------------------- host inputs

    def on_snapshot(self, snap: ev.HostSnapshot) -> None:
        old = self.state.hosts.get(snap.host)
        same_identity = old is not None and old.uid == snap.uid
        if old is not None and same_identity and snap.revision <= old.snapshot_revision:
            self.note(f"snapshot r{snap.revision} of {snap.host} is stale; ignored")
            return
        base = old if (old is not None and same_identity) else Host(name=snap.host, uid=snap.uid)
        gpus = snap.gpus  # most hosts have none: skip the sort and the set then
        gpu_inputs_changed = (
            base.gpus != snap.gpus
            or base.labels != snap.labels
            or base.gpu_profile != snap.gpu_profile
            or base.gpu_revision < 0
        )
        host = evolve_host(
            base,
            uid=snap.uid,
            snapshot_revision=snap.revision,
            snapshot_seq=self.seq,
            schedulable=snap.schedulable,
            labels=dict(snap.labels),
            capacity=snap.capacity,
            reserve=snap.reserve,
            gpus=tuple(sorted(gpus, key=lambda g: g.index)) if gpus else (),
            gpu_profile=snap.gpu_profile,
            gpu_revision=snap.revision if gpu_inputs_changed else base.gpu_revision,
            foreign_gpus=(
                frozenset(g.index for g in gpus if g.pci_address in base.foreign_pci)
                if gpus and base.foreign_pci
                else _NO_GPUS
            ),
        )
        self.state.put_host(host)
        self.fx.hosts.add(snap.host)
        self.fx.host_rows.add(snap.host)
        if base.gpus != host.gpus:
            self._resolve_adopted_gpus(host)
        self.check_gates(snap.host)

    def _resolve_adopted_gpus(self, host: Host) -> None:
        """Adopted VMs name their GPUs by PCI address: map them to this snapshot's."""
        by_pci = host.gpu_by_pci()
        for lease in self.state.active_on_host(host.name):
            if lease.gpu_pci:
                gpus = tuple(sorted(by_pci[a].index for a in lease.gpu_pci if a in by_pci))
                if gpus != lease.gpus:
                    self.move(lease, lease.state, "gpus-resolved", gpus=gpus)

    def on_inventory(self, inv: ev.HostInventory) -> None:
        old = self.state.hosts.get(inv.host)
        if old is None:
            old = Host(name=inv.host, uid=inv.uid)
        elif old.uid != inv.uid:
            self.note(f"inventory of {inv.host} for uid {inv.uid} but host is {old.uid}; ignored")
            return
        if inv.revision <= old.inventory_revision:
            self.note(f"inventory r{inv.revision} of {inv.host} is stale; ignored")
            return
        seen: set[LeaseId] = set()
        foreign = Resources()
        foreign_pci: set[str] = set()
        foreign_names: list[str] = []
        pci = old.gpu_by_pci()
        for inst in inv.instances:
            lease = self.state.lease_of_instance(inst.name)
            if lease is not None and lease.active and lease.host == inv.host:
                seen.add(lease.lease_id)
                self._observed(lease, inst)
                continue
            tagged = inst.config.get(TAG_LEASE_ID)
            if tagged:
                known = self.state.leases.get(LeaseId(tagged))
                if known is None and lease is None:
                    adopted_id = LeaseId(f"A{self.seq}-{len(seen)}")
                    seen.add(self._adopt(inv, inst, adopted_id, pci))
                    continue
                if known is not None and not known.active and known.instance == inst.name:
                    self.exec_delete(known, "orphan", host=inv.host, project=inst.project)
                    self.note(f"{inst.name} on {inv.host} carries released lease {tagged}")
            foreign = foreign + inst.resources
            foreign_pci.update(inst.gpus)
            foreign_names.append(inst.name)
        host = evolve_host(
            old,
            inventory_revision=inv.revision,
            inventory_seq=self.seq,
            foreign_demand=foreign,
            foreign_pci=frozenset(foreign_pci),
            foreign_gpus=frozenset(pci[a].index for a in foreign_pci if a in pci),
            foreign_instances=tuple(sorted(foreign_names)),
        )
        self.state.put_host(host)
        self.fx.hosts.add(inv.host)
        self.fx.host_rows.add(inv.host)
        for lease in self.state.active_on_host(inv.host):
            if (
                lease.lease_id not in seen
                and lease.state is not RESERVED
                and lease.suspect_revision is None
            ):
                self.move(lease, lease.state, "missing", suspect_revision=inv.revision)
                self.note(f"{lease.instance} missing from inventory r{inv.revision}; suspect")
        self.check_gates(inv.host)

    def _observed(self, lease: Lease, inst: ev.ObservedInstance) -> None:
        if (lease.state is RESERVED or lease.state is CREATED) and not lease.gated:
            if lease.kind is WARM and inst.status_code == _STATUS_READY:
                # The guest said ready and Incus remembers it: the same as instance-ready,
                # whose event the bridge may have missed (it is not sent again)
                lease = self.move(lease, READY, "inventory-ready", ready_seq=self.seq)
            elif lease.state is RESERVED:
                lease = self.move(lease, CREATED, "inventory")
        if lease.suspect_revision is not None:
            self.move(lease, lease.state, "reappeared", suspect_revision=None)

    def _adopt(
        self,
        inv: ev.HostInventory,
        inst: ev.ObservedInstance,
        lease_id: LeaseId,
        pci: dict[str, Any],
    ) -> LeaseId:
        kind = WARM if inst.config.get(TAG_KIND) == "warm" else COLD
        job = inst.config.get(TAG_JOB) or None
        if kind is COLD:
            state = CREATED
        elif job is not None:
            state = CLAIMED
        elif inst.status_code in (_STATUS_RUNNING, _STATUS_READY):
            state = READY
        else:
            state = CREATED
        host = self.state.hosts.get(inv.host)
        basis = runtime_basis(self.state, host) if host else (-1, None, -1)
        lease = Lease(
            lease_id=lease_id,
            instance=inst.name,
            host=inv.host,
            host_uid=inv.uid,
            pool=PoolName(inst.config.get(TAG_POOL, "")),
            kind=kind,
            state=state,
            demand=inst.resources,
            gpus=tuple(sorted(pci[a].index for a in inst.gpus if a in pci)),
            gpu_pci=tuple(sorted(inst.gpus)),
            project=inst.project,
            job=JobId(job) if job and JobId(job) not in self.state.jobs else None,
            admitted_seq=self.seq,
            ready_seq=self.seq if state is READY else 0,
            adopted=True,
            runtime_gpu_revision=basis[0],
            runtime_profile=basis[1],
            runtime_profile_revision=basis[2],
        )
        self.create(lease, "adopted")
        if lease.job is not None:
            self.state.jobs[lease.job] = lease_id
        self.note(f"adopted {inst.name} on {inv.host} as {lease_id} ({state.value})")
        return lease_id

    def _lease_here(self, host: HostName, instance: str | None, project: str) -> Lease | None:
        if instance is None:
            return None
        lease = self.state.lease_of_instance(instance)
        if lease is None or not lease.active or lease.host != host or lease.project != project:
            return None
        return lease

    def on_lifecycle(self, event: ev.Lifecycle) -> None:
        lease = self._lease_here(event.host, event.instance, event.project)
        if lease is None:
            self.note(f"lifecycle {event.action} for {event.instance}: no lease here")
            return
        action = event.action
        if action == "instance-created":
            if lease.state is RESERVED and not lease.gated:
                self.move(lease, CREATED, action)
        elif action in ("instance-ready", "instance-agent-started"):
            if (
                lease.kind is WARM
                and lease.state
                in (
                    RESERVED,
                    CREATED,
                )
                and not lease.gated
            ):
                self.move(lease, READY, action, ready_seq=self.seq)
        elif action == "instance-deleted":
            self.release(lease, action)
        else:
            self.note(f"lifecycle {action} for {lease.instance} recorded")

    def on_observation(self, obs: ev.Observation) -> None:
        lease = self.state.lease_of_instance(obs.instance)
        if lease is None or not lease.active or lease.host != obs.host:
            self.note(f"observation of {obs.instance}: no active lease on {obs.host}")
            return
        if lease.suspect_revision is None:
            self.note(f"observation of {obs.instance}: not suspect")
        elif obs.present:
            self.move(lease, lease.state, "verified-present", suspect_revision=None)
        elif obs.checked_revision >= lease.suspect_revision:
            self.release(lease, "verified-absent")
        else:
            self.note(f"observation of {obs.instance} older than its suspicion; ignored")

    # ---------------------------------------------------------------- config

    def on_pool(self, cfg: ev.PoolConfig) -> None:
        warm = cfg.warm
        error = None
        if warm.min_ready > warm.max_ready:
            error = (
                f"pool {cfg.pool!r}: warm.min_ready {warm.min_ready} > max_ready {warm.max_ready}"
            )
        elif warm.max_ready > cfg.max_instances:
            error = (
                f"pool {cfg.pool!r}: warm.max_ready {warm.max_ready} > "
                f"max_instances {cfg.max_instances}"
            )
        elif len({c.name for c in cfg.claims}) != len(cfg.claims):
            error = f"pool {cfg.pool!r}: claim names repeat"
        elif warm.max_ready > 0 and not cfg.image:
            error = f"pool {cfg.pool!r}: a warm pool needs an image"
        if error is not None:
            self.reject_config("pool", cfg.pool, error)
            return
        self.state.pools[cfg.pool] = Pool(
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
            seq=self.seq,
            instance_type=cfg.instance_type,
        )
        self.fx.pools.add(cfg.pool)
        self.fx.pool_rows.add(cfg.pool)

    def on_class(self, cfg: ev.ClassConfig) -> None:
        gpu = cfg.gpu
        error = None
        if gpu is not None and gpu.count < 1:
            error = f"class {cfg.name!r}: parameters.gpu.count must be at least 1, not {gpu.count}"
        elif gpu is not None and (gpu.vendor == "" or gpu.model == ""):
            error = f"class {cfg.name!r}: parameters.gpu vendor and model may not be empty"
        if error is not None:
            self.reject_config("class", cfg.name, error)
            return
        self.state.classes[ClassName(cfg.name)] = ResourceClass(
            name=cfg.name, gpu=gpu, host_selector=dict(cfg.host_selector), seq=self.seq
        )
        self.fx.classes.add(cfg.name)

    def on_gpu_profile(self, cfg: ev.GpuProfileConfig) -> None:
        old = self.state.profiles.get(cfg.name)
        if old is not None and cfg.revision <= old.revision:
            self.note(f"gpu-profile {cfg.name} r{cfg.revision} is stale; ignored")
            return
        try:
            validate_profile(cfg.name, cfg.defaults)
        except RuntimeConfigError as exc:
            self.reject_config("gpu-profile", cfg.name, str(exc))
            return
        self.state.profiles[cfg.name] = GpuProfile(cfg.name, cfg.revision, cfg.defaults, self.seq)
        self.fx.profiles.add(cfg.name)

    def on_gpu_policy(self, cfg: ev.GpuPolicyConfig) -> None:
        try:
            overrides = validate_overrides(cfg.name, cfg.overrides)
            if cfg.selector.indexes is not None and any(i < 0 for i in cfg.selector.indexes):
                raise RuntimeConfigError(f"gpu-policy {cfg.name!r}: negative GPU index")
        except RuntimeConfigError as exc:
            self.reject_config("gpu-policy", cfg.name, str(exc))
            return
        self.state.policies[cfg.name] = GpuPolicy(
            cfg.name, cfg.priority, cfg.selector, overrides, self.seq
        )
        self.fx.policies.add(cfg.name)

    # -------------------------------------------------------------- commands

    def on_admit(self, cmd: ev.Admit) -> None:
        verb = cmd.verb
        pool = self.state.pools.get(cmd.pool)
        if pool is None:
            self.decide(
                cmd.request_id,
                verb,
                "rejected",
                reason="unknown-pool",
                detail=f"no pool named {cmd.pool!r}",
            )
            return
        existing = self.state.lease_of_instance(cmd.instance)
        if existing is not None and existing.active:
            self.decide(
                cmd.request_id,
                verb,
                "rejected",
                reason="duplicate-instance",
                detail=f"{cmd.instance!r} already holds lease {existing.lease_id}",
            )
            return
        bound = self.state.jobs.get(cmd.job) if cmd.job is not None else None
        if bound is not None:
            self.decide(
                cmd.request_id,
                verb,
                "rejected",
                reason="already-claimed",
                detail=f"job {cmd.job!r} is bound to {self.state.leases[bound].instance!r}",
            )
            return
        at_max = self._pool_at_max(pool, cmd.kind)
        if at_max is not None:
            self.decide(cmd.request_id, verb, "rejected", reason="pool-at-max", detail=at_max)
            return
        claims: list[ResolvedClaim] = []
        if pool.claims or cmd.claims:  # most requests have none to merge and resolve
            try:
                claims = resolve_claims(self.state, merge_claims(pool, cmd.claims))
            except ClaimError as exc:
                detail = str(exc)
                self.decide(cmd.request_id, verb, "rejected", reason="invalid-claim", detail=detail)
                return
        result = choose_host(self.state, pool, pool.flavor, claims, selected=cmd.host)
        if not isinstance(result, PlacementResult):
            host, gpus = result
            lease = self._reserve(cmd, pool, host, gpus)
            self.decide(cmd.request_id, verb, "admitted", lease=lease)
            if lease.kind is WARM:
                self.exec_create(lease, pool, host)
            return
        assert result.reason is not None
        if cmd.preemptible and result.reason in (
            "insufficient-capacity",
            "selected-host-unsuitable",
        ):
            capacity_hosts = capacity_bound(
                self.state,
                pool,
                pool.flavor,
                claims,
                [cmd.host] if cmd.host is not None else self._hosts_with_idle_warm(),
            )
            preemption = choose_victims(self.state, pool, pool.flavor, claims, capacity_hosts)
            if preemption is not None:
                self._preempt(
                    cmd, pool, preemption.fit.host, preemption.fit.gpus, preemption.victims
                )
                return
        self.decide(
            cmd.request_id,
            verb,
            "rejected",
            reason=result.reason,
            detail=_rejection_detail(result, cmd),
        )

    def _hosts_with_idle_warm(self) -> set[HostName]:
        leases = self.state.leases
        return {leases[i].host for ids in self.state.pool_ready.values() for i in ids}

    def _pool_at_max(self, pool: Pool, kind: LeaseKind) -> str | None:
        booking_count = self.state.pool_booking.get(pool.name, 0)
        if booking_count >= pool.max_instances:
            return f"pool {pool.name!r} has {booking_count} of max_instances {pool.max_instances}"
        warm = self.state.pool_warm_unclaimed.get(pool.name, 0)
        if kind is WARM and warm >= pool.warm.max_ready:
            return (
                f"pool {pool.name!r} has {warm} unclaimed warm VMs of "
                f"max_ready {pool.warm.max_ready}"
            )
        return None

    def _reserve(
        self,
        cmd: ev.Admit,
        pool: Pool,
        host: Host,
        gpus: tuple[int, ...],
        *,
        gate: tuple[LeaseId, ...] | None = None,
    ) -> Lease:
        basis = runtime_basis(self.state, host)
        lease = Lease(
            lease_id=LeaseId(f"L{self.seq}"),
            instance=cmd.instance,
            host=host.name,
            host_uid=host.uid,
            pool=pool.name,
            kind=cmd.kind,
            state=RESERVED,
            demand=pool.flavor,
            gpus=gpus,
            project=pool.project,
            job=cmd.job,
            request_id=cmd.request_id,
            admitted_seq=self.seq,
            gate_seq=self.seq if gate is not None else None,
            awaiting_victims=gate or (),
            runtime_gpu_revision=basis[0],
            runtime_profile=basis[1],
            runtime_profile_revision=basis[2],
        )
        self.create(lease, cmd.verb)
        if cmd.job is not None:
            self.state.jobs[cmd.job] = lease.lease_id
        return lease

    def _preempt(
        self,
        cmd: ev.Admit,
        pool: Pool,
        host: Host,
        gpus: tuple[int, ...],
        victims: tuple[Lease, ...],
    ) -> None:
        for victim in victims:
            marked = self.move(victim, VICTIM, "preempted", victim_of=cmd.request_id)
            self.exec_delete(marked, "preempted")
        gate = tuple(v.lease_id for v in victims)
        lease = self._reserve(cmd, pool, host, gpus, gate=gate)
        held, held_gpus = self._held_by(gate)
        lease = self.move(lease, lease.state, "victims-held", held=held, held_gpus=held_gpus)
        self.decide(
            cmd.request_id, cmd.verb, "pending", phase="pending", lease=lease, victims=victims
        )

    def on_claim_warm(self, cmd: ev.ClaimWarm) -> None:
        verb = cmd.verb
        bound = self.state.jobs.get(cmd.job)
        if bound is not None:
            lease = self.state.leases[bound]
            self.decide(
                cmd.request_id,
                verb,
                "claimed",
                lease=lease,
                detail=f"job already bound to {lease.instance}",
            )
            return
        if cmd.pool not in self.state.pools:
            self.decide(
                cmd.request_id,
                verb,
                "no-warm",
                reason="unknown-pool",
                detail=f"no pool named {cmd.pool!r}",
            )
            return
        ready = [self.state.leases[i] for i in self.state.pool_ready.get(cmd.pool, ())]
        if not ready:
            booting = self.state.pool_warm_unclaimed.get(cmd.pool, 0) > 0
            self.decide(
                cmd.request_id,
                verb,
                "no-warm",
                reason="not-ready" if booting else None,
                detail="warm VMs are still booting" if booting else "no ready warm VM",
            )
            return
        chosen = min(ready, key=lambda le: (le.ready_seq, le.lease_id))
        claimed = self.move(chosen, CLAIMED, verb, job=cmd.job)
        self.state.jobs[cmd.job] = claimed.lease_id
        self.decide(cmd.request_id, verb, "claimed", lease=claimed)

    def on_drain(self, cmd: ev.AuthorizeWarmDrain) -> None:
        verb = cmd.verb
        lease = self.state.lease_of_instance(cmd.instance)
        if lease is None or not lease.active:
            self.decide(cmd.request_id, verb, "refused", reason="unknown-instance")
            return
        reason = _drain_refusal(lease)
        if reason is not None:
            self.decide(
                cmd.request_id,
                verb,
                "refused",
                reason=reason,
                lease=lease,
                detail=f"lease is {lease.kind.value} and {lease.state.value}",
            )
            return
        drained = self.move(lease, DRAINING, verb)
        self.exec_delete(drained, "drained")
        self.decide(cmd.request_id, verb, "authorized", lease=drained)

    def on_mark_created(self, cmd: ev.MarkCreated) -> None:
        lease = self.state.lease_of_instance(cmd.instance)
        if lease is None or not lease.active:
            self.decide(
                cmd.request_id,
                cmd.verb,
                "error",
                reason="no-lease",
                detail="admission must precede every mutation",
            )
            return
        if lease.state is RESERVED and not lease.gated:
            lease = self.move(lease, CREATED, cmd.verb)
        elif lease.state is not CREATED:
            detail = "launch gate still shut" if lease.gated else f"lease is {lease.state.value}"
            self.decide(
                cmd.request_id, cmd.verb, "error", reason="wrong-state", lease=lease, detail=detail
            )
            return
        self.decide(cmd.request_id, cmd.verb, "ok", lease=lease)

    def on_mark_injected(self, cmd: ev.MarkWarmInjected) -> None:
        lease = self.state.lease_of_instance(cmd.instance)
        if lease is None or not lease.active:
            self.decide(cmd.request_id, cmd.verb, "error", reason="no-lease")
            return
        if lease.state not in (CLAIMED, INJECTED):
            self.decide(cmd.request_id, cmd.verb, "error", reason="wrong-state", lease=lease)
            return
        if lease.job != cmd.job:
            self.decide(
                cmd.request_id,
                cmd.verb,
                "error",
                reason="wrong-job",
                lease=lease,
                detail="claimed by another job",
            )
            return
        if lease.state is CLAIMED:
            lease = self.move(lease, INJECTED, cmd.verb)
        self.decide(cmd.request_id, cmd.verb, "ok", lease=lease)

    def on_mark_deleting(self, cmd: ev.MarkDeleting) -> None:
        lease = self.state.lease_of_instance(cmd.instance)
        if lease is not None and lease.active and lease.state is not DELETING:
            lease = self.move(lease, DELETING, cmd.verb)
        self.decide(cmd.request_id, cmd.verb, "ok", lease=lease)

    def on_release(self, cmd: ev.Release) -> None:
        lease = self.state.lease_of_instance(cmd.instance)
        if lease is not None:
            self.release(lease, cmd.verb)
            lease = self.state.leases[lease.lease_id]
        self.decide(cmd.request_id, cmd.verb, "ok", lease=lease)

    def on_render_runtime(self, cmd: ev.RenderRuntime) -> None:
        lease = self.state.lease_of_instance(cmd.instance)
        host = self.state.hosts.get(lease.host) if lease is not None else None
        if lease is None or not lease.active or host is None:
            self.decide(cmd.request_id, cmd.verb, "error", reason="no-lease")
            return
        gpu_rev, profile, profile_rev = runtime_basis(self.state, host)
        lease = self.move(
            lease,
            lease.state,
            cmd.verb,
            runtime_gpu_revision=gpu_rev,
            runtime_profile=profile,
            runtime_profile_revision=profile_rev,
        )
        self.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


def _drain_refusal(lease: Lease) -> str | None:
    if lease.kind is not WARM:
        return "wrong-state"
    match lease.state:
        case LeaseState.READY:
            return None if lease.job is None else "already-claimed"
        case LeaseState.RESERVED | LeaseState.CREATED:
            return "not-ready"
        case LeaseState.CLAIMED | LeaseState.INJECTED:
            return "already-claimed"
        case LeaseState.DRAINING:
            return "draining"
        case _:
            return "wrong-state"


def _rejection_detail(result: PlacementResult, cmd: ev.Admit) -> str:
    if cmd.host is not None:
        stage = result.fits[0].fit.name.lower() if result.fits else "unknown host"
        return f"selected host {cmd.host!r}: {stage}"
    if not result.stages:
        return "no hosts are known"
    summary = ", ".join(
        f"{n} {STAGE_NAMES[stage]}" for stage, n in sorted(result.stages.items(), reverse=True)
    )
    return f"hosts by furthest filter stage reached: {summary}"


#: the command input types: a command whose request id was decided is answered again
_COMMANDS: frozenset[type] = frozenset(get_args(ev.Command))

_HANDLERS: dict[type, Any] = {
    ev.HostSnapshot: _Step.on_snapshot,
    ev.HostInventory: _Step.on_inventory,
    ev.Lifecycle: _Step.on_lifecycle,
    ev.Observation: _Step.on_observation,
    ev.PoolConfig: _Step.on_pool,
    ev.ClassConfig: _Step.on_class,
    ev.GpuProfileConfig: _Step.on_gpu_profile,
    ev.GpuPolicyConfig: _Step.on_gpu_policy,
    ev.Admit: _Step.on_admit,
    ev.ClaimWarm: _Step.on_claim_warm,
    ev.AuthorizeWarmDrain: _Step.on_drain,
    ev.MarkCreated: _Step.on_mark_created,
    ev.MarkWarmInjected: _Step.on_mark_injected,
    ev.MarkDeleting: _Step.on_mark_deleting,
    ev.Release: _Step.on_release,
    ev.RenderRuntime: _Step.on_render_runtime,
}

__all__ = ["fold", "fold_input"]
