"""Host inputs folded: snapshots, inventories, Incus lifecycle events, live observations.

Rules: a snapshot not newer (by revision) than the last of the same host identity
(``uid``) is ignored, and one of a new identity starts the host afresh. An inventory of
another identity, or not newer than the last, is ignored; otherwise it is the complete
truth of the host: it adopts VMs that carry our lease tags, counts foreign ones, moves
leases the guest says are ready, marks leases missing from it as suspect (the leader
checks them with a live GET, whose observation releases or clears them), and asks the
executor to delete a VM that carries a released lease's tag. A lifecycle event moves
the active lease of its instance on that host and project only. Snapshots and
inventories may open the launch gates of their host, as the release of a victim may
(:mod:`.gates`).

A failure (``in.host.<host>.failure``, from the executor or a producer that creates
instances itself) names a lease: a create or start that failed releases it if it is
still reserved or created (its room is free again; anything half-made that carries its
tag is deleted as an orphan by the next inventory); a delete that cannot be done leaves
it ``deleting``, booking its room, until Incus says it is gone or an operator releases
it, and a victim's ends the preemption that waits for it (:func:`.gates.victim_failed`).
The lease keeps the failure as its ``fault``. A failure for a lease that is gone, or in
another state, is recorded and changes nothing.

Operators' host commands: ``cordon`` (nothing new is admitted on the host, whatever its
snapshot says), ``drain`` (cordoned, and its idle warm VMs, booting or ready and
unclaimed, are drained at once; claimed VMs and cold leases run to their end) and
``uncordon`` (both lifted; a snapshot that says unschedulable still keeps new work off).
The cordon belongs to the host's name: a reinstalled host (a new ``uid``) keeps it. A
host no snapshot has named is refused (``unknown-host``).
"""

from __future__ import annotations

from typing import Any

from reconciler.core import inputs as ev
from reconciler.core.fold.gates import check_gates, release, victim_failed
from reconciler.core.fold.step import Step
from reconciler.core.messages import clip
from reconciler.core.model import (
    CLAIMED,
    COLD,
    CORDONED,
    CREATED,
    DELETING,
    DRAINING_HOST,
    READY,
    RELEASED,
    RESERVED,
    TAG_JOB,
    TAG_KIND,
    TAG_LEASE_ID,
    TAG_POOL,
    VICTIM,
    WARM,
    Host,
    HostName,
    JobId,
    Lease,
    LeaseId,
    PoolName,
    RequestId,
    Resources,
    evolve_host,
)
from reconciler.core.runtime import runtime_basis
from reconciler.core.state import is_idle_warm

__all__ = [
    "on_cordon",
    "on_drain_host",
    "on_failure",
    "on_inventory",
    "on_lifecycle",
    "on_observation",
    "on_snapshot",
    "on_uncordon",
]

_NO_GPUS: frozenset[int] = frozenset()

#: Incus status codes in an inventory: Running, and Ready (running, and its guest said
#: ready: ``volatile.last_state.ready``)
_STATUS_RUNNING = 103
_STATUS_READY = 113


def on_snapshot(step: Step, snap: ev.HostSnapshot) -> None:
    old = step.state.hosts.get(snap.host)
    same_identity = old is not None and old.uid == snap.uid
    if old is not None and same_identity and snap.revision <= old.snapshot_revision:
        step.note(f"snapshot r{snap.revision} of {snap.host} is stale; ignored")
        return
    base = old if (old is not None and same_identity) else Host(name=snap.host, uid=snap.uid)
    if old is not None and not same_identity and old.cordon is not None:
        base = evolve_host(base, cordon=old.cordon)  # an operator's cordon names the host
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
        snapshot_seq=step.seq,
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
    step.state.put_host(host)
    step.fx.hosts.add(snap.host)
    step.fx.host_rows.add(snap.host)
    if base.gpus != host.gpus:
        _resolve_adopted_gpus(step, host)
    check_gates(step, snap.host)


def _resolve_adopted_gpus(step: Step, host: Host) -> None:
    """Adopted VMs name their GPUs by PCI address: map them to this snapshot's."""
    by_pci = host.gpu_by_pci()
    for lease in step.state.active_on_host(host.name):
        if lease.gpu_pci:
            gpus = tuple(sorted(by_pci[a].index for a in lease.gpu_pci if a in by_pci))
            if gpus != lease.gpus:
                step.move(lease, lease.state, "gpus-resolved", gpus=gpus)


def on_inventory(step: Step, inv: ev.HostInventory) -> None:
    old = step.state.hosts.get(inv.host)
    if old is None:
        old = Host(name=inv.host, uid=inv.uid)
    elif old.uid != inv.uid:
        step.note(f"inventory of {inv.host} for uid {inv.uid} but host is {old.uid}; ignored")
        return
    if inv.revision <= old.inventory_revision:
        step.note(f"inventory r{inv.revision} of {inv.host} is stale; ignored")
        return
    seen: set[LeaseId] = set()
    foreign = Resources()
    foreign_pci: set[str] = set()
    foreign_names: list[str] = []
    pci = old.gpu_by_pci()
    for inst in inv.instances:
        lease = step.state.lease_of_instance(inst.name)
        if lease is not None and lease.state is not RELEASED and lease.host == inv.host:
            seen.add(lease.lease_id)
            _observed(step, lease, inst)
            continue
        tagged = inst.config.get(TAG_LEASE_ID)
        if tagged:
            known = step.state.leases.get(LeaseId(tagged))
            if known is None and lease is None:
                adopted_id = LeaseId(f"A{step.seq}-{len(seen)}")
                seen.add(_adopt(step, inv, inst, adopted_id, pci))
                continue
            if known is not None and known.state is RELEASED and known.instance == inst.name:
                step.exec_delete(known, "orphan", host=inv.host, project=inst.project)
                step.note(f"{inst.name} on {inv.host} carries released lease {tagged}")
        foreign = foreign + inst.resources
        foreign_pci.update(inst.gpus)
        foreign_names.append(inst.name)
    host = evolve_host(
        old,
        inventory_revision=inv.revision,
        inventory_seq=step.seq,
        foreign_demand=foreign,
        foreign_pci=frozenset(foreign_pci),
        foreign_gpus=frozenset(pci[a].index for a in foreign_pci if a in pci),
        foreign_instances=tuple(sorted(foreign_names)),
    )
    step.state.put_host(host)
    step.fx.hosts.add(inv.host)
    step.fx.host_rows.add(inv.host)
    for lease in step.state.active_on_host(inv.host):
        if (
            lease.lease_id not in seen
            and lease.state is not RESERVED
            and lease.suspect_revision is None
        ):
            step.move(lease, lease.state, "missing", suspect_revision=inv.revision)
            step.note(f"{lease.instance} missing from inventory r{inv.revision}; suspect")
    check_gates(step, inv.host)


def _observed(step: Step, lease: Lease, inst: ev.ObservedInstance) -> None:
    if (lease.state is RESERVED or lease.state is CREATED) and lease.gate_seq is None:
        if lease.kind is WARM and inst.status_code == _STATUS_READY:
            # The guest said ready and Incus remembers it: the same as instance-ready,
            # whose event the bridge may have missed (it is not sent again)
            lease = step.move(lease, READY, "inventory-ready", ready_seq=step.seq)
        elif lease.state is RESERVED:
            lease = step.move(lease, CREATED, "inventory")
    if lease.suspect_revision is not None:
        step.move(lease, lease.state, "reappeared", suspect_revision=None)


def _adopt(
    step: Step,
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
    host = step.state.hosts.get(inv.host)
    basis = runtime_basis(step.state, host) if host else (-1, None, -1)
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
        job=JobId(job) if job and JobId(job) not in step.state.jobs else None,
        admitted_seq=step.seq,
        ready_seq=step.seq if state is READY else 0,
        adopted=True,
        runtime_gpu_revision=basis[0],
        runtime_profile=basis[1],
        runtime_profile_revision=basis[2],
    )
    step.create(lease, "adopted")
    if lease.job is not None:
        step.state.jobs[lease.job] = lease_id
    step.note(f"adopted {inst.name} on {inv.host} as {lease_id} ({state.value})")
    return lease_id


def _lease_here(step: Step, host: HostName, instance: str | None, project: str) -> Lease | None:
    if instance is None:
        return None
    lease = step.state.lease_of_instance(instance)
    if lease is None or lease.state is RELEASED or lease.host != host or lease.project != project:
        return None
    return lease


def on_lifecycle(step: Step, event: ev.Lifecycle) -> None:
    lease = _lease_here(step, event.host, event.instance, event.project)
    if lease is None:
        step.note(f"lifecycle {event.action} for {event.instance}: no lease here")
        return
    action = event.action
    if action == "instance-created":
        if lease.state is RESERVED and lease.gate_seq is None:
            step.move(lease, CREATED, action)
    elif action in ("instance-ready", "instance-agent-started"):
        if (
            lease.kind is WARM
            and lease.state
            in (
                RESERVED,
                CREATED,
            )
            and lease.gate_seq is None
        ):
            step.move(lease, READY, action, ready_seq=step.seq)
    elif action == "instance-deleted":
        release(step, lease, action)
    else:
        step.note(f"lifecycle {action} for {lease.instance} recorded")


def on_observation(step: Step, obs: ev.Observation) -> None:
    lease = step.state.lease_of_instance(obs.instance)
    if lease is None or lease.state is RELEASED or lease.host != obs.host:
        step.note(f"observation of {obs.instance}: no active lease on {obs.host}")
        return
    if lease.suspect_revision is None:
        step.note(f"observation of {obs.instance}: not suspect")
    elif obs.present:
        step.move(lease, lease.state, "verified-present", suspect_revision=None)
    elif obs.checked_revision >= lease.suspect_revision:
        release(step, lease, "verified-absent")
    else:
        step.note(f"observation of {obs.instance} older than its suspicion; ignored")


# ------------------------------------------------------------------------ failures


def on_failure(step: Step, failure: ev.Failure) -> None:
    lease = step.state.leases.get(failure.lease_id)
    what = f"{failure.action} of {failure.instance} on {failure.host} failed"
    if lease is None or lease.instance != failure.instance or lease.host != failure.host:
        step.note(f"{what}: no such lease {failure.lease_id} there; recorded")
        return
    if lease.state is RELEASED:
        step.note(f"{what}: {lease.lease_id} is released already; recorded")
        return
    fault = clip(f"{failure.action} failed: {failure.error}")
    event = f"{failure.action}-failed"
    if failure.action == "delete":
        if lease.state is VICTIM:
            victim_failed(step, lease, fault)
        else:
            step.move(lease, DELETING, event, fault=fault)
        return
    if lease.state not in (RESERVED, CREATED) or lease.gate_seq is not None:
        step.note(f"{what}: {lease.lease_id} is {lease.state.value}; recorded")
        return
    faulted = step.move(lease, lease.state, event, fault=fault)
    release(step, faulted, event)
    if lease.kind is WARM:
        step.fx.failed_pools.add(lease.pool)


# -------------------------------------------------------------- operators' commands


def on_cordon(step: Step, cmd: ev.Cordon) -> None:
    host = _known_host(step, cmd.request_id, cmd.verb, cmd.host)
    if host is None:
        return
    if host.cordon is not None:
        step.decide(cmd.request_id, cmd.verb, "ok", detail=f"{host.name} is {host.cordon} already")
        return
    _set_cordon(step, host, CORDONED)
    step.decide(
        cmd.request_id,
        cmd.verb,
        "ok",
        detail=f"{host.name} cordoned: nothing new is admitted there{_snapshot_says(host)}",
    )


def on_uncordon(step: Step, cmd: ev.Uncordon) -> None:
    host = _known_host(step, cmd.request_id, cmd.verb, cmd.host)
    if host is None:
        return
    if host.cordon is None:
        detail = f"{host.name} was not cordoned{_snapshot_says(host)}"
    else:
        _set_cordon(step, host, None)
        detail = f"{host.name} uncordoned{_snapshot_says(host)}"
        check_gates(step, host.name)
    step.decide(cmd.request_id, cmd.verb, "ok", detail=detail)


def on_drain_host(step: Step, cmd: ev.Drain) -> None:
    host = _known_host(step, cmd.request_id, cmd.verb, cmd.host)
    if host is None:
        return
    if host.cordon != DRAINING_HOST:
        _set_cordon(step, host, DRAINING_HOST)
    idle = [le for le in step.state.active_on_host(host.name) if is_idle_warm(le)]
    for lease in idle:
        step.drain(lease, "host-drained")
    staying = len(step.state.on_host.get(host.name, ())) - len(idle)
    names = ", ".join(le.instance for le in idle[:8]) + (", …" if len(idle) > 8 else "")
    step.decide(
        cmd.request_id,
        cmd.verb,
        "ok",
        detail=f"{host.name} draining: {len(idle)} idle warm VM(s) deleted"
        + (f" ({names})" if idle else "")
        + f"; {staying} other lease(s) run to their end",
    )


def _known_host(step: Step, request_id: RequestId, verb: str, name: HostName) -> Host | None:
    host = step.state.hosts.get(name)
    if host is None:
        step.decide(
            request_id,
            verb,
            "rejected",
            reason="unknown-host",
            detail=f"no host named {name!r} has sent a snapshot",
        )
    return host


def _set_cordon(step: Step, host: Host, cordon: str | None) -> None:
    step.state.put_host(evolve_host(host, cordon=cordon))
    step.fx.hosts.add(host.name)
    step.fx.host_rows.add(host.name)


def _snapshot_says(host: Host) -> str:
    if host.schedulable:
        return ""
    return "; its snapshot says unschedulable (the bridge's host settings), which still holds"
