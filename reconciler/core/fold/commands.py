"""Commands folded: admit (and admit-preemptible), claim-warm, authorize-warm-drain,
mark-created, mark-warm-injected, mark-deleting, release, render-runtime.

Rules (docs/architecture.md, "the seed API"): every command gets a decision; no lease,
no mutation; one job is bound to one warm VM forever; an admission reserves before
anything is created, within the pool's maxima and the placement's choice, and a
preemptible one that does not fit marks a minimal victim set and waits at its launch
gate (:mod:`.gates`). A command whose request id was decided already is answered with
its decision again before it reaches this module (:func:`reconciler.core.fold.fold`).
"""

from __future__ import annotations

from reconciler.core import inputs as ev
from reconciler.core.fold.admission import pool_at_max, reserve
from reconciler.core.fold.gates import held_by, release
from reconciler.core.fold.queue import (
    cancel,
    curable,
    enqueue,
    kept_for_queue,
    lane_waits,
    overtakes,
    reclaim,
    starving_hold,
    tenant_refusal,
    wait_of,
)
from reconciler.core.fold.step import Step
from reconciler.core.model import (
    CLAIMED,
    CREATED,
    DELETING,
    INJECTED,
    RELEASED,
    RESERVED,
    VICTIM,
    WARM,
    Host,
    HostName,
    Lease,
    LeaseState,
    Pool,
    ResolvedClaim,
)
from reconciler.core.placement import (
    STAGE_NAMES,
    ClaimError,
    PlacementResult,
    capacity_bound,
    choose_host,
    merge_claims,
    resolve_claims,
)
from reconciler.core.preemption import choose_victims
from reconciler.core.runtime import runtime_basis

__all__ = [
    "on_admit",
    "on_claim_warm",
    "on_drain",
    "on_mark_created",
    "on_mark_deleting",
    "on_mark_injected",
    "on_release",
    "on_render_runtime",
]

#: rejections that preemption may turn around (capacity, possibly on the selected host)
_PREEMPTIBLE_REASONS = ("insufficient-capacity", "selected-host-unsuitable")


def on_admit(step: Step, cmd: ev.Admit) -> None:
    # cmd.verb, without the property's call (most inputs are admissions)
    verb = "admit-preemptible" if cmd.preemptible else "admit"
    pool = step.state.pools.get(cmd.pool)
    if pool is None:
        step.decide(
            cmd.request_id,
            verb,
            "rejected",
            reason="unknown-pool",
            detail=f"no pool named {cmd.pool!r}",
        )
        return
    state = step.state
    # wait_of(), its common case (no wait anywhere) first
    wait_s = wait_of(cmd, pool) if cmd.wait_s or pool.queue_wait_s else 0
    existing = state.lease_of_instance(cmd.instance)
    if existing is not None and existing.state is not RELEASED:
        step.decide(
            cmd.request_id,
            verb,
            "rejected",
            reason="duplicate-instance",
            detail=f"{cmd.instance!r} already holds lease {existing.lease_id}",
        )
        return
    if state.waiting and cmd.instance in state.queue.by_instance:
        step.decide(
            cmd.request_id,
            verb,
            "rejected",
            reason="duplicate-instance",
            detail=f"{cmd.instance!r} waits in the queue as request "
            f"{state.queue.by_instance[cmd.instance]}",
        )
        return
    bound = state.jobs.get(cmd.job) if cmd.job is not None else None
    if bound is not None:
        step.decide(
            cmd.request_id,
            verb,
            "rejected",
            reason="already-claimed",
            detail=f"job {cmd.job!r} is bound to {state.leases[bound].instance!r}",
        )
        return
    if wait_s:
        ahead = lane_waits(state, cmd)
        if ahead is not None and enqueue(
            step, cmd, verb, wait_s, ahead.reason, f"waits behind {ahead.request_id}"
        ):
            return
    at_max = pool_at_max(state, pool, cmd.kind)
    if at_max is not None:
        if wait_s and enqueue(step, cmd, verb, wait_s, "pool-at-max", at_max):
            return
        step.decide(cmd.request_id, verb, "rejected", reason="pool-at-max", detail=at_max)
        return
    claims: list[ResolvedClaim] = []
    if pool.claims or cmd.claims:  # most requests have none to merge and resolve
        try:
            claims = resolve_claims(state, merge_claims(pool, cmd.claims))
        except ClaimError as exc:
            detail = str(exc)
            step.decide(cmd.request_id, verb, "rejected", reason="invalid-claim", detail=detail)
            return
    if state.tenants:
        refusal = tenant_refusal(state, pool, claims)
        if refusal is not None:
            if wait_s and enqueue(step, cmd, verb, wait_s, "tenant-quota", refusal):
                return
            step.decide(cmd.request_id, verb, "rejected", reason="tenant-quota", detail=refusal)
            return
    result = choose_host(state, pool, pool.flavor, claims, selected=cmd.host)
    if not isinstance(result, PlacementResult):
        host, gpus = result
        if state.waiting and _held_for_queue(step, cmd, verb, pool, host, wait_s):
            return
        lease = reserve(step, cmd, verb, pool, host, gpus)
        step.decide(cmd.request_id, verb, "admitted", lease=lease)
        step.fx.admitted_at_once += 1
        if lease.kind is WARM:
            step.exec_create(lease, pool, host)
        return
    assert result.reason is not None
    if cmd.preemptible and result.reason in _PREEMPTIBLE_REASONS:
        capacity_hosts = capacity_bound(
            state,
            pool,
            pool.flavor,
            claims,
            [cmd.host] if cmd.host is not None else _hosts_with_idle_warm(step),
        )
        preemption = choose_victims(state, pool, pool.flavor, claims, capacity_hosts)
        if preemption is not None:
            fit = preemption.fit
            _preempt(step, cmd, verb, pool, fit.host, fit.gpus, preemption.victims)
            return
    detail = _rejection_detail(result, cmd)
    if (
        wait_s
        and curable(result, result.reason)
        and enqueue(step, cmd, verb, wait_s, result.reason, detail)
    ):
        if state.tenants and result.reason == "insufficient-capacity":
            reclaim(step, state.waiting[cmd.request_id], pool, claims)
        return
    step.decide(cmd.request_id, verb, "rejected", reason=result.reason, detail=detail)


def _held_for_queue(
    step: Step, cmd: ev.Admit, verb: str, pool: Pool, host: Host, wait_s: int
) -> bool:
    """While requests wait, whether an admission that fits ``host`` is held back for
    them (queued, or refused without a wait): a warm VM is, where a waiting request of
    its priority or higher could use the host; any request is, where one overtaken
    BACKFILL_LIMIT times could. Otherwise it goes ahead, counted as overtaking those
    that could use the host (:mod:`reconciler.core.waiting`, backfill)."""
    if cmd.kind is WARM:
        kept = kept_for_queue(step, pool, host)
        held = f"room on {host.name} is kept for {kept} queued request(s)" if kept else None
    elif wait_s and starving_hold(step.state, pool, host):
        held = f"room on {host.name} is kept for a queued request overtaken too often"
    else:
        overtakes(step, pool, host, warm=False)
        return False
    if held is None:
        return False
    if wait_s and enqueue(step, cmd, verb, wait_s, "insufficient-capacity", held):
        return True
    step.decide(cmd.request_id, verb, "rejected", reason="insufficient-capacity", detail=held)
    return True


def _hosts_with_idle_warm(step: Step) -> set[HostName]:
    leases = step.state.leases
    return {leases[i].host for ids in step.state.pool_ready.values() for i in ids}


def _preempt(
    step: Step,
    cmd: ev.Admit,
    verb: str,
    pool: Pool,
    host: Host,
    gpus: tuple[int, ...],
    victims: tuple[Lease, ...],
) -> None:
    for victim in victims:
        marked = step.move(victim, VICTIM, "preempted", victim_of=cmd.request_id)
        step.exec_delete(marked, "preempted")
    gate = tuple(v.lease_id for v in victims)
    lease = reserve(step, cmd, verb, pool, host, gpus, gate=gate)
    held, held_gpus = held_by(step, gate)
    lease = step.move(lease, lease.state, "victims-held", held=held, held_gpus=held_gpus)
    step.decide(cmd.request_id, verb, "pending", phase="pending", lease=lease, victims=victims)


def on_claim_warm(step: Step, cmd: ev.ClaimWarm) -> None:
    verb = cmd.verb
    bound = step.state.jobs.get(cmd.job)
    if bound is not None:
        lease = step.state.leases[bound]
        step.decide(
            cmd.request_id,
            verb,
            "claimed",
            lease=lease,
            detail=f"job already bound to {lease.instance}",
        )
        return
    if cmd.pool not in step.state.pools:
        step.decide(
            cmd.request_id,
            verb,
            "no-warm",
            reason="unknown-pool",
            detail=f"no pool named {cmd.pool!r}",
        )
        return
    ready = [step.state.leases[i] for i in step.state.pool_ready.get(cmd.pool, ())]
    if not ready:
        booting = step.state.pool_warm_unclaimed.get(cmd.pool, 0) > 0
        step.decide(
            cmd.request_id,
            verb,
            "no-warm",
            reason="not-ready" if booting else None,
            detail="warm VMs are still booting" if booting else "no ready warm VM",
        )
        return
    chosen = min(ready, key=lambda le: (le.ready_seq, le.lease_id))
    claimed = step.move(chosen, CLAIMED, verb, job=cmd.job)
    step.state.jobs[cmd.job] = claimed.lease_id
    step.decide(cmd.request_id, verb, "claimed", lease=claimed)


def on_drain(step: Step, cmd: ev.AuthorizeWarmDrain) -> None:
    verb = cmd.verb
    lease = step.state.lease_of_instance(cmd.instance)
    if lease is None or lease.state is RELEASED:
        step.decide(cmd.request_id, verb, "refused", reason="unknown-instance")
        return
    reason = _drain_refusal(lease)
    if reason is not None:
        step.decide(
            cmd.request_id,
            verb,
            "refused",
            reason=reason,
            lease=lease,
            detail=f"lease is {lease.kind.value} and {lease.state.value}",
        )
        return
    drained = step.drain(lease, verb)
    step.decide(cmd.request_id, verb, "authorized", lease=drained)


def on_mark_created(step: Step, cmd: ev.MarkCreated) -> None:
    lease = step.state.lease_of_instance(cmd.instance)
    if lease is None or lease.state is RELEASED:
        step.decide(
            cmd.request_id,
            cmd.verb,
            "error",
            reason="no-lease",
            detail="admission must precede every mutation",
        )
        return
    if lease.state is RESERVED and lease.gate_seq is None:
        lease = step.move(lease, CREATED, cmd.verb)
    elif lease.state is not CREATED:
        detail = (
            "launch gate still shut"
            if lease.gate_seq is not None
            else f"lease is {lease.state.value}"
        )
        step.decide(
            cmd.request_id, cmd.verb, "error", reason="wrong-state", lease=lease, detail=detail
        )
        return
    step.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


def on_mark_injected(step: Step, cmd: ev.MarkWarmInjected) -> None:
    lease = step.state.lease_of_instance(cmd.instance)
    if lease is None or lease.state is RELEASED:
        step.decide(cmd.request_id, cmd.verb, "error", reason="no-lease")
        return
    if lease.state not in (CLAIMED, INJECTED):
        step.decide(cmd.request_id, cmd.verb, "error", reason="wrong-state", lease=lease)
        return
    if lease.job != cmd.job:
        step.decide(
            cmd.request_id,
            cmd.verb,
            "error",
            reason="wrong-job",
            lease=lease,
            detail="claimed by another job",
        )
        return
    if lease.state is CLAIMED:
        lease = step.move(lease, INJECTED, cmd.verb)
    step.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


def on_mark_deleting(step: Step, cmd: ev.MarkDeleting) -> None:
    lease = step.state.lease_of_instance(cmd.instance)
    if lease is not None and lease.state is not RELEASED and lease.state is not DELETING:
        lease = step.move(lease, DELETING, cmd.verb)
    step.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


def on_release(step: Step, cmd: ev.Release) -> None:
    cancelled = cancel(step, cmd.instance) if step.state.waiting else None
    if cancelled is not None:
        step.decide(cmd.request_id, cmd.verb, "ok", detail=f"cancelled waiting request {cancelled}")
        return
    lease = step.state.lease_of_instance(cmd.instance)
    if lease is not None:
        release(step, lease, cmd.verb)
        lease = step.state.leases[lease.lease_id]
    step.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


def on_render_runtime(step: Step, cmd: ev.RenderRuntime) -> None:
    lease = step.state.lease_of_instance(cmd.instance)
    host = step.state.hosts.get(lease.host) if lease is not None else None
    if lease is None or lease.state is RELEASED or host is None:
        step.decide(cmd.request_id, cmd.verb, "error", reason="no-lease")
        return
    gpu_rev, profile, profile_rev = runtime_basis(step.state, host)
    lease = step.move(
        lease,
        lease.state,
        cmd.verb,
        runtime_gpu_revision=gpu_rev,
        runtime_profile=profile,
        runtime_profile_revision=profile_rev,
    )
    step.decide(cmd.request_id, cmd.verb, "ok", lease=lease)


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
