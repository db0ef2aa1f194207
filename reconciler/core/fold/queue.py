"""The admission queue folded: requests that wait for room, and how each wait ends.

Rules (docs/architecture.md, "The admission queue"; the order and the backfill rule
are :mod:`reconciler.core.waiting`'s):

- An ``admit`` with a wait (its ``wait_s``, else its pool's ``queue.wait_s``; 0 or
  neither: no wait, decided as before) that cannot be placed for a reason room can cure
  (:func:`curable`) is queued (:func:`enqueue`): a ``pending`` decision, outcome
  ``queued``, with its reason and its 1-based position in its pool's queue. One that
  arrives while requests of its lane wait queues behind them without being placed, so
  it never overtakes a request of its own shape.
- Every input but those that cannot free room (:data:`NO_ROOM_FREED`) ends with
  :func:`pump`: the heads of the lanes, best first, are tried again; each is admitted
  (``final``, ``admitted``, as an immediate admission), or keeps waiting, or is refused
  for good (its pool deleted, its claim no longer resolvable, its job bound meanwhile).
- Time is the input's JetStream timestamp: before anything else, a step ends every wait
  whose deadline is at or before it (:func:`expire_due`), ``rejected`` with reason
  ``queue-timeout``. The leader publishes ``queue-timeout`` when a deadline passes, so
  that an idle bus has an input to notice it with.
- A ``release`` naming a waiting request's instance cancels it (:func:`cancel`):
  ``rejected`` with reason ``cancelled``.
- A warm VM is not admitted onto a host that a waiting request of the same or higher
  priority could use (:func:`kept_for_queue`): warm top-ups never take room a queued
  request waits for.
"""

from __future__ import annotations

import dataclasses

from reconciler.core import inputs as ev
from reconciler.core.fold.admission import pool_at_max, reserve
from reconciler.core.fold.step import Step
from reconciler.core.model import (
    RELEASED,
    WARM,
    Host,
    HostName,
    LeaseId,
    Pool,
    PoolName,
    RequestId,
    ResolvedClaim,
)
from reconciler.core.placement import (
    ClaimError,
    Fit,
    PlacementResult,
    capacity_bound,
    choose_host,
    evaluate,
    merge_claims,
    resolve_claims,
)
from reconciler.core.preemption import choose_victims
from reconciler.core.state import State
from reconciler.core.tenants import (
    borrower_pools,
    demand_of,
    fleet_room,
    owner,
    quota_refusal,
    shares,
    under_nominal,
)
from reconciler.core.waiting import BACKFILL_LIMIT, QUEUE_REASONS, Lane, Waiting, epoch_ms

__all__ = [
    "NO_ROOM_FREED",
    "cancel",
    "curable",
    "current_shares",
    "enqueue",
    "expire_due",
    "idle_fit",
    "kept_for_queue",
    "lane_waits",
    "on_queue_timeout",
    "order_key",
    "ordered",
    "overtakes",
    "pump",
    "reclaim",
    "starving_hold",
    "tenant_of",
    "tenant_refusal",
    "wait_of",
]

#: the input types after which the queue is not tried again: they take room or change
#: nothing placement reads
NO_ROOM_FREED: frozenset[type] = frozenset(
    {ev.Admit, ev.ClaimWarm, ev.MarkCreated, ev.MarkWarmInjected, ev.RenderRuntime}
)

_CAPACITY = Fit.CAPACITY


def wait_of(cmd: ev.Admit, pool: Pool) -> int:
    """How many seconds ``cmd`` may wait: its own ``wait_s`` (an explicit 0 included),
    else its pool's default, else 0."""
    if cmd.wait_s is not None:
        return cmd.wait_s
    return pool.queue_wait_s or 0


def curable(result: PlacementResult | None, reason: str) -> bool:
    """Whether room can cure a refusal: capacity, a pool at its maximum, and no suitable
    host while no host is known at all. A request larger than every host, or whose
    selectors match none, is refused at once (``result`` is the placement's answer)."""
    if reason in ("insufficient-capacity", "pool-at-max", "tenant-quota"):
        return True
    return reason == "no-suitable-host" and result is not None and not result.stages


def lane_waits(state: State, cmd: ev.Admit) -> Waiting | None:
    """The first request waiting in ``cmd``'s lane, if any."""
    if not state.waiting:
        return None
    lane: Lane = (cmd.pool, cmd.kind, cmd.host, cmd.claims)
    return state.queue.head(lane, state.waiting)


def enqueue(
    step: Step, cmd: ev.Admit, verb: str, wait_s: int, reason: str, detail: str | None
) -> bool:
    """Queue ``cmd`` (see the module's rules); ``False`` when its input has no time to
    count the wait from (then it is decided as without a wait)."""
    now_ms = epoch_ms(step.ts)
    if now_ms is None:
        return False
    entry = Waiting(
        cmd.request_id,
        cmd.pool,
        cmd.instance,
        cmd.kind,
        cmd.job,
        cmd.host,
        cmd.claims,
        cmd.preemptible,
        step.seq,
        step.ts,
        now_ms + wait_s * 1000,
        reason,
    )
    state = step.state
    state.waiting[entry.request_id] = entry
    state.queue.add(entry)
    step.fx.waiting.add(entry.request_id)
    step.fx.pools.add(entry.pool)
    step.decide(
        cmd.request_id,
        verb,
        "queued",
        phase="pending",
        reason=reason,
        detail=detail,
        position=state.queue.per_pool.get(entry.pool, 1),
    )
    return True


def _finish(
    step: Step,
    entry: Waiting,
    outcome: str,
    *,
    reason: str | None = None,
    detail: str | None = None,
) -> None:
    _dequeue(step, entry, _ENDED.get(reason or "", "refused"))
    step.decide(entry.request_id, entry.verb, outcome, reason=reason, detail=detail)


#: how a wait ended, by the reason of its final decision (admitted: none)
_ENDED = {"queue-timeout": "timed-out", "cancelled": "cancelled"}


def _dequeue(step: Step, entry: Waiting, how: str) -> None:
    """Take a request off the queue, noting how its wait ended (metrics)."""
    state = step.state
    del state.waiting[entry.request_id]
    state.queue.remove(entry)
    fx = step.fx
    fx.waiting.add(entry.request_id)
    fx.pools.add(entry.pool)
    now_ms = epoch_ms(step.ts)
    waited = max(0, now_ms - _queued_ms(entry)) if now_ms is not None else 0
    fx.waits_ended.append((how, entry.pool, waited))


def expire_due(step: Step) -> None:
    """End every wait whose deadline is at or before this input's timestamp."""
    state = step.state
    now_ms = epoch_ms(step.ts)
    if now_ms is None:
        return
    for entry in list(state.queue.due(now_ms, state.waiting)):
        waited = (now_ms - _queued_ms(entry)) / 1000
        _finish(
            step,
            entry,
            "rejected",
            reason="queue-timeout",
            detail=f"waited {waited:.3f} s for room ({entry.reason}) and its wait ran out",
        )


def _queued_ms(entry: Waiting) -> int:
    return epoch_ms(entry.queued_at) or 0


def cancel(step: Step, instance: str) -> RequestId | None:
    """Cancel the request waiting for ``instance``, if one does: its id."""
    state = step.state
    if not state.waiting:
        return None
    request_id = state.queue.by_instance.get(instance)  # type: ignore[call-overload]
    entry = state.waiting.get(request_id) if request_id is not None else None
    if entry is None:
        return None
    _finish(
        step,
        entry,
        "rejected",
        reason="cancelled",
        detail=f"released while it waited for room ({entry.reason})",
    )
    return entry.request_id


def on_queue_timeout(step: Step, cmd: ev.QueueTimeout) -> None:
    """The leader's word that a deadline passed: the step's expiry has ended every wait
    due by now; this says what became of the one it names."""
    entry = step.state.waiting.get(cmd.waiting)
    if entry is None:
        detail = f"request {cmd.waiting} does not wait"
    else:
        detail = f"request {cmd.waiting} is not due before its deadline"
    step.decide(cmd.request_id, cmd.verb, "ok", detail=detail)


# ------------------------------------------------------------------------- order


def tenant_of(state: State, pool: PoolName) -> str | None:
    """The tenant whose pools name ``pool`` (``None``: a pool of no tenant)."""
    found = owner(state, pool) if state.tenants else None
    return found.name if found is not None else None


def current_shares(state: State) -> dict[PoolName, float]:
    """The tenants' weighted dominant-resource shares by pool (empty without tenants)."""
    return shares(state, fleet_room(state)) if state.tenants else {}


def order_key(
    state: State, entry: Waiting, by_pool: dict[PoolName, float]
) -> tuple[int, float, int]:
    """Where a waiting request stands: priority (higher first), its tenant's share
    (lower first; ``by_pool``, from :func:`current_shares`), input order."""
    pool = state.pools.get(entry.pool)
    priority = pool.priority if pool is not None else 0
    return (-priority, by_pool.get(entry.pool, 0.0), entry.seq)


def ordered(state: State) -> list[Waiting]:
    """Every waiting request in the order the queue would admit them (shares as they
    stand now)."""
    by_pool = current_shares(state)
    return sorted(state.waiting.values(), key=lambda w: order_key(state, w, by_pool))


def tenant_refusal(state: State, pool: Pool, claims: list[ResolvedClaim]) -> str | None:
    """Why one more instance of ``pool`` would take its tenant past what it may use."""
    tenant = owner(state, pool.name) if state.tenants else None
    if tenant is None:
        return None
    return quota_refusal(state, tenant, demand_of(pool.flavor, claims))


# -------------------------------------------------------------------------- pump


class _Blocked:
    """A lane head that could not be placed in this pump, and what it needs."""

    __slots__ = ("claims", "entry", "pool")

    def __init__(self, entry: Waiting, pool: Pool, claims: list[ResolvedClaim]) -> None:
        self.entry = entry
        self.pool = pool
        self.claims = claims

    def could_use(self, state: State, host: Host) -> bool:
        """Whether the request fits ``host`` once room is freed there."""
        if self.entry.host is not None and self.entry.host != host.name:
            return False
        fit = evaluate(state, host, self.pool, self.pool.flavor, self.claims)
        return fit.fit >= _CAPACITY


def pump(step: Step) -> None:
    """Try the lanes' heads again, best first, until every lane is empty or blocked."""
    state = step.state
    queue = state.queue
    blocked: list[_Blocked] = []
    done: set[Lane] = set()
    room = fleet_room(state) if state.tenants else []
    while state.waiting:
        by_pool = shares(state, room) if state.tenants else {}
        best: tuple[tuple[int, float, int], Lane, Waiting] | None = None
        for lane in list(queue.lanes):
            if lane in done:
                continue
            head = queue.head(lane, state.waiting)
            if head is None:
                continue
            key = order_key(state, head, by_pool)
            if best is None or key < best[0]:
                best = (key, lane, head)
        if best is None:
            return
        _, lane, head = best
        if not _retry(step, head, blocked):
            done.add(lane)


def _blocker(state: State, entry: Waiting) -> _Blocked | None:
    """A waiting request as a blocker (``None`` when it cannot be placed anywhere)."""
    pool = state.pools.get(entry.pool)
    if pool is None:
        return None
    try:
        claims = (
            resolve_claims(state, merge_claims(pool, entry.claims))
            if pool.claims or entry.claims
            else []
        )
    except ClaimError:
        return None
    return _Blocked(entry, pool, claims)


def _keep_waiting(step: Step, entry: Waiting, reason: str, blocked: list[_Blocked]) -> bool:
    """It waits on: its reason as found now (a waiting reason), and it blocks the rest
    of its lane; ``False``, for :func:`_retry`."""
    if reason != entry.reason and reason in QUEUE_REASONS:
        entry = _replace(step, entry, reason=reason)
    found = _blocker(step.state, entry)
    if found is not None:
        blocked.append(found)
    return False


def _replace(
    step: Step, entry: Waiting, *, reason: str | None = None, passed: int | None = None
) -> Waiting:
    new = dataclasses.replace(
        entry,
        reason=reason if reason is not None else entry.reason,
        passed=passed if passed is not None else entry.passed,
    )
    step.state.waiting[entry.request_id] = new
    step.fx.waiting.add(entry.request_id)
    return new


def _retry(step: Step, entry: Waiting, blocked: list[_Blocked]) -> bool:
    """Try one waiting request again: ``True`` when it stopped waiting (admitted or
    refused for good), ``False`` when it waits on (and is then one of ``blocked``)."""
    state = step.state
    verb = entry.verb
    pool = state.pools.get(entry.pool)
    if pool is None:
        _finish(
            step,
            entry,
            "rejected",
            reason="unknown-pool",
            detail=f"pool {entry.pool!r} was deleted while it waited",
        )
        return True
    existing = state.lease_of_instance(entry.instance)
    if existing is not None and existing.state is not RELEASED:
        _finish(
            step,
            entry,
            "rejected",
            reason="duplicate-instance",
            detail=f"{entry.instance!r} already holds lease {existing.lease_id}",
        )
        return True
    if entry.job is not None and entry.job in state.jobs:
        bound = state.leases[state.jobs[entry.job]]
        _finish(
            step,
            entry,
            "rejected",
            reason="already-claimed",
            detail=f"job {entry.job!r} is bound to {bound.instance!r}",
        )
        return True
    if pool_at_max(state, pool, entry.kind) is not None:
        return _keep_waiting(step, entry, "pool-at-max", blocked)
    claims: list[ResolvedClaim] = []
    if pool.claims or entry.claims:
        try:
            claims = resolve_claims(state, merge_claims(pool, entry.claims))
        except ClaimError as exc:
            _finish(step, entry, "rejected", reason="invalid-claim", detail=str(exc))
            return True
    refusal = tenant_refusal(state, pool, claims)
    if refusal is not None:
        return _keep_waiting(step, entry, "tenant-quota", blocked)
    result = choose_host(state, pool, pool.flavor, claims, selected=entry.host)
    if isinstance(result, PlacementResult):
        assert result.reason is not None
        if result.reason == "insufficient-capacity" and state.tenants:
            entry = reclaim(step, entry, pool, claims)
        return _keep_waiting(step, entry, result.reason, blocked)
    host, gpus = result
    users = [b for b in blocked if b.pool.priority >= pool.priority and b.could_use(state, host)]
    if any(b.entry.passed >= BACKFILL_LIMIT for b in users):
        return _keep_waiting(step, entry, entry.reason, blocked)
    for b in users:
        b.entry = _replace(step, state.waiting[b.entry.request_id], passed=b.entry.passed + 1)
    cmd = entry.command()
    _dequeue(step, entry, "admitted")
    lease = reserve(step, cmd, verb, pool, host, gpus, lease_id=LeaseId(f"L{entry.seq}"))
    now_ms = epoch_ms(step.ts)
    waited = "" if now_ms is None else f"{(now_ms - _queued_ms(entry)) / 1000:.3f} s "
    detail = f"waited {waited}in the queue ({entry.reason}) since input {entry.seq}"
    step.decide(entry.request_id, verb, "admitted", lease=lease, detail=detail)
    if lease.kind is WARM:
        step.exec_create(lease, pool, host)
    return True


def reclaim(step: Step, entry: Waiting, pool: Pool, claims: list[ResolvedClaim]) -> Waiting:
    """A request of a tenant under its nominal quota that waits for room: drain idle
    warm VMs of borrowers in its cohort (ready and unclaimed only: a running job is
    never preempted), the fewest that make it fit (:mod:`reconciler.core.preemption`),
    once at a time (not while the VMs drained for it last are still there)."""
    state = step.state
    if any(
        (lease := state.leases.get(lease_id)) is not None and lease.state is not RELEASED
        for lease_id in entry.reclaim
    ):
        return entry
    tenant = owner(state, pool.name)
    if tenant is None or not under_nominal(state, tenant, demand_of(pool.flavor, claims)):
        return entry
    borrowers = borrower_pools(state, tenant)
    if not borrowers:
        return entry
    leases = state.leases
    hosts = {leases[i].host for p in borrowers for i in state.pool_ready.get(p, ())}
    if entry.host is not None:
        hosts &= {entry.host}
    field = capacity_bound(state, pool, pool.flavor, claims, hosts)
    found = choose_victims(
        state, pool, pool.flavor, claims, field, eligible=lambda le: le.pool in borrowers
    )
    if found is None:
        return entry
    for victim in found.victims:
        step.drain(victim, "reclaimed")
    step.note(
        f"{entry.request_id} reclaims {len(found.victims)} idle warm VM(s) of borrowers "
        f"on {found.fit.host.name}"
    )
    new = dataclasses.replace(entry, reclaim=tuple(v.lease_id for v in found.victims))
    state.waiting[entry.request_id] = new
    step.fx.waiting.add(entry.request_id)
    return new


def overtakes(step: Step, pool: Pool, host: Host, *, warm: bool) -> int:
    """An admission onto ``host`` outside the queue, while requests wait: the number of
    waiting lane heads of ``pool``'s priority or higher that could use ``host``. Each is
    counted as passed (the backfill rule) unless ``warm`` (a warm VM is refused then,
    :func:`kept_for_queue`)."""
    state = step.state
    count = 0
    for lane in list(state.queue.lanes):
        head = state.queue.head(lane, state.waiting)
        if head is None:
            continue
        head_pool = state.pools.get(head.pool)
        if head_pool is None or head_pool.priority < pool.priority:
            continue
        b = _blocker(state, head)
        if b is None or not b.could_use(state, host):
            continue
        count += 1
        if not warm:
            _replace(step, head, passed=head.passed + 1)
    return count


def kept_for_queue(step: Step, pool: Pool, host: Host) -> int:
    """How many waiting requests of ``pool``'s priority or higher could use ``host``
    (a warm VM is not admitted there while any does)."""
    return overtakes(step, pool, host, warm=True)


def starving_hold(state: State, pool: Pool, host: Host) -> bool:
    """Whether a waiting request passed :data:`BACKFILL_LIMIT` times, of ``pool``'s
    priority or higher, could use ``host`` (nothing new is admitted there then)."""
    for lane in list(state.queue.lanes):
        head = state.queue.head(lane, state.waiting)
        if head is None or head.passed < BACKFILL_LIMIT:
            continue
        head_pool = state.pools.get(head.pool)
        if head_pool is None or head_pool.priority < pool.priority:
            continue
        b = _blocker(state, head)
        if b is not None and b.could_use(state, host):
            return True
    return False


def idle_fit(state: State, entry: Waiting) -> HostName | None:
    """A host whose idle room ``entry`` fits now (its pool under its maximum, its tenant
    under what it may use), unless the backfill rule keeps that room for a request
    overtaken too often; ``None`` when there is none. After every input this is
    ``None`` for every waiting request (what the tests and the scenario check)."""
    pool = state.pools.get(entry.pool)
    blocker = _blocker(state, entry)
    if pool is None or blocker is None or pool_at_max(state, pool, entry.kind) is not None:
        return None
    if tenant_refusal(state, pool, blocker.claims) is not None:
        return None
    found = choose_host(state, pool, pool.flavor, blocker.claims, selected=entry.host)
    if isinstance(found, PlacementResult) or starving_hold(state, pool, found[0]):
        return None
    return found[0].name
