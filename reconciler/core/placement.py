"""Placement with DRA semantics: claims resolved against classes, hosts filtered and scored.

A request is a demand (the pool's flavor) plus claims. A host is *unsuitable* unless every
claim fits there together with the demand. Among suitable hosts the pool's placement
decides: ``pack`` takes the host left with the least free room, ``spread`` the most; the
host name breaks ties. GPU choice takes the lowest free matching indexes, preferring a set
on one NUMA node.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from reconciler.core.candidates import Scorer
from reconciler.core.frozen import fast_init
from reconciler.core.model import (
    ZERO,
    ClaimSpec,
    Gpu,
    GpuRequest,
    Host,
    HostName,
    Lease,
    Placement,
    Pool,
    ResolvedClaim,
    Resources,
)
from reconciler.core.state import State


class Fit(enum.IntEnum):
    """How far a host got in the filter; higher is closer to fitting."""

    SELECTOR = 0  # labels do not match the pool's or a class's selector
    UNSCHEDULABLE = 1
    STRUCTURE = 2  # not enough matching GPUs even on an empty host
    CAPACITY = 3  # would fit an empty host, but not now
    FITS = 4


#: the rejection reason for the best stage any host reached
REASON_FOR_FIT = {
    Fit.SELECTOR: "no-suitable-host",
    Fit.UNSCHEDULABLE: "host-unschedulable",
    Fit.STRUCTURE: "no-suitable-host",
    Fit.CAPACITY: "insufficient-capacity",
}


# Fit's members as module constants: on Python 3.11 ``Fit.FITS`` goes through the enum
# metaclass's ``__getattr__`` hook (about 100 ns, a global about 10 ns), and placement
# names them for every host it scores.
_SELECTOR = Fit.SELECTOR
_UNSCHEDULABLE = Fit.UNSCHEDULABLE
_STRUCTURE = Fit.STRUCTURE
_CAPACITY = Fit.CAPACITY
_FITS = Fit.FITS
_SPREAD = Placement.SPREAD
#: ``Fit(stage)`` by indexing (an enum call is a Python-level call of ~300 ns)
_FIT_OF: tuple[Fit, ...] = tuple(sorted(Fit))
#: lower-case stage names, for rejection details (``.name`` is a Python-level descriptor)
STAGE_NAMES: dict[int, str] = {f: f.name.lower() for f in Fit}


class ClaimError(ValueError):
    """A claim that cannot be resolved against its class (``invalid-claim``)."""


# ------------------------------------------------------------------------- claims


def merge_claims(pool: Pool, extra: Sequence[ClaimSpec]) -> list[ClaimSpec]:
    """The pool's claims, with a request's claim of the same name replacing the pool's."""
    if not pool.claims and not extra:
        return []
    by_name = {c.name: c for c in pool.claims}
    for claim in extra:
        by_name[claim.name] = claim
    return [by_name[name] for name in sorted(by_name)]


def _merge_gpu(claim: ClaimSpec, base: GpuRequest | None) -> GpuRequest | None:
    own = claim.gpu
    if own is None:
        return base
    if base is None:
        return own
    for attr in ("vendor", "model"):
        mine, theirs = getattr(own, attr), getattr(base, attr)
        if mine is not None and theirs is not None and mine != theirs:
            raise ClaimError(
                f"claim {claim.name!r} asks {attr} {mine!r} but class "
                f"{claim.class_name!r} names {theirs!r}"
            )
    if own.count < base.count:
        raise ClaimError(
            f"claim {claim.name!r} asks {own.count} GPUs, fewer than class "
            f"{claim.class_name!r}'s {base.count}"
        )
    if (
        own.min_memory_mib is not None
        and base.min_memory_mib is not None
        and own.min_memory_mib < base.min_memory_mib
    ):
        raise ClaimError(
            f"claim {claim.name!r} lowers min_memory_mib below class {claim.class_name!r}'s"
        )
    return GpuRequest(
        count=own.count,
        vendor=own.vendor if own.vendor is not None else base.vendor,
        model=own.model if own.model is not None else base.model,
        min_memory_mib=(
            own.min_memory_mib if own.min_memory_mib is not None else base.min_memory_mib
        ),
    )


def resolve_claims(state: State, claims: Iterable[ClaimSpec]) -> list[ResolvedClaim]:
    """Merge each claim into its class; raise :class:`ClaimError` naming the problem."""
    resolved = []
    for claim in claims:
        cls = state.classes.get(claim.class_name)
        if cls is None:
            raise ClaimError(f"claim {claim.name!r} names unknown class {claim.class_name!r}")
        gpu = _merge_gpu(claim, cls.gpu)
        if gpu is not None and gpu.count < 1:
            raise ClaimError(f"claim {claim.name!r} asks for {gpu.count} GPUs")
        resolved.append(
            ResolvedClaim(
                name=claim.name, class_name=cls.name, gpu=gpu, host_selector=cls.host_selector
            )
        )
    return resolved


# ------------------------------------------------------------------------ booking


@fast_init
@dataclass(frozen=True, slots=True)
class Booking:
    """What is booked on one host right now."""

    booked: Resources
    used_gpus: frozenset[int]


def _booked(state: State, host: Host) -> tuple[int, int, int]:
    """Booked CPU, memory and disk: every lease that books capacity, plus foreign
    instances (what :func:`booking` counts, without the objects)."""
    row = state.booked.get(host.name)
    foreign = host.foreign_demand
    if row is None:
        return foreign.cpu, foreign.memory_mib, foreign.disk_gib
    return row[0] + foreign.cpu, row[1] + foreign.memory_mib, row[2] + foreign.disk_gib


def booking(state: State, host: Host, *, without: Iterable[Lease] = ()) -> Booking:
    """Booked capacity: every lease that books capacity, plus foreign instances."""
    cpu, mem, disk = _booked(state, host)
    held = state.gpus_held.get(host.name)
    if not without:
        used = set(held) if held else set()
    else:
        counts = dict(held) if held else {}
        for lease in without:
            if lease.books_capacity and lease.host == host.name:
                d = lease.booked_demand
                cpu -= d.cpu
                mem -= d.memory_mib
                disk -= d.disk_gib
                for ix in lease.booked_gpus:
                    counts[ix] -= 1
        used = {ix for ix, n in counts.items() if n > 0}
    used.update(host.foreign_gpus)
    return Booking(Resources(cpu, mem, disk), frozenset(used))


# ------------------------------------------------------------------------- GPUs


def _pick(candidates: list[Gpu], count: int) -> tuple[int, ...] | None:
    """Lowest matching indexes, a single NUMA node preferred."""
    if len(candidates) < count:
        return None
    by_node: dict[int, list[int]] = {}
    for gpu in candidates:
        by_node.setdefault(gpu.numa_node, []).append(gpu.index)
    one_node = [tuple(sorted(ix)[:count]) for ix in by_node.values() if len(ix) >= count]
    if one_node:
        return min(one_node)
    return tuple(sorted(g.index for g in candidates)[:count])


def assign_gpus(
    host: Host, claims: Sequence[ResolvedClaim], free: frozenset[int] | set[int]
) -> tuple[int, ...] | None:
    """GPU indexes for all claims together, or None when they do not all fit.

    Claims are served most constrained first (fewest matching GPUs on the host), then by
    name, so that a narrow claim is not starved by a broad one.
    """
    gpu_claims = [c for c in claims if c.gpu is not None]
    if not gpu_claims:
        return ()
    order = sorted(
        gpu_claims,
        key=lambda c: (sum(1 for g in host.gpus if c.gpu and c.gpu.matches(g)), c.name),
    )
    available = set(free)
    chosen: list[int] = []
    for claim in order:
        assert claim.gpu is not None
        request = claim.gpu
        candidates = [g for g in host.gpus if g.index in available and request.matches(g)]
        picked = _pick(candidates, request.count)
        if picked is None:
            return None
        available.difference_update(picked)
        chosen.extend(picked)
    return tuple(sorted(chosen))


# ------------------------------------------------------------------------ filter


def _selected(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


_NO_GPUS: frozenset[int] = frozenset()


@fast_init
@dataclass(frozen=True, slots=True)
class HostFit:
    host: Host
    fit: Fit
    gpus: tuple[int, ...] = ()
    left: Resources = ZERO


def evaluate(
    state: State,
    host: Host,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    *,
    without: Iterable[Lease] = (),
) -> HostFit:
    """How far ``host`` gets through the filter for this request.

    This runs once per host per admission, so it stays on plain integers and only
    touches GPUs when a claim asks for them.
    """
    labels = host.labels
    if (pool.host_selector and not _selected(labels, pool.host_selector)) or (
        claims and not all(_selected(labels, c.host_selector) for c in claims)
    ):
        return HostFit(host, _SELECTOR)
    if not host.schedulable or host.cordon is not None:  # host.admits, spelled out
        return HostFit(host, _UNSCHEDULABLE)
    cap, rsv = host.capacity, host.reserve
    a_cpu, a_mem, a_disk = (
        cap.cpu - rsv.cpu,
        cap.memory_mib - rsv.memory_mib,
        cap.disk_gib - rsv.disk_gib,
    )
    wants_gpus = bool(claims) and any(c.gpu is not None for c in claims)
    every_gpu = frozenset(g.index for g in host.gpus) if wants_gpus else _NO_GPUS
    if (
        demand.cpu > a_cpu
        or demand.memory_mib > a_mem
        or demand.disk_gib > a_disk
        or (wants_gpus and assign_gpus(host, claims, every_gpu) is None)
    ):
        return HostFit(host, _STRUCTURE)
    # the common case (no GPUs, nothing set aside) needs the booked scalars only
    book = booking(state, host, without=without) if without or wants_gpus else None
    if book is not None:
        b_cpu, b_mem, b_disk = book.booked.cpu, book.booked.memory_mib, book.booked.disk_gib
    else:
        b_cpu, b_mem, b_disk = _booked(state, host)
    l_cpu = a_cpu - b_cpu - demand.cpu
    l_mem = a_mem - b_mem - demand.memory_mib
    l_disk = a_disk - b_disk - demand.disk_gib
    if l_cpu < 0 or l_mem < 0 or l_disk < 0:
        return HostFit(host, _CAPACITY)
    gpus: tuple[int, ...] = ()
    if book is not None and wants_gpus:
        assigned = assign_gpus(host, claims, every_gpu - book.used_gpus)
        if assigned is None:
            return HostFit(host, _CAPACITY)
        gpus = assigned
    return HostFit(host, _FITS, gpus, Resources(l_cpu, l_mem, l_disk))


def _room(fit: HostFit) -> float:
    """Free fraction left after placing, summed over the dimensions the host has."""
    cap, rsv, left = fit.host.capacity, fit.host.reserve, fit.left
    total = 0.0
    for free, have in (
        (left.cpu, cap.cpu - rsv.cpu),
        (left.memory_mib, cap.memory_mib - rsv.memory_mib),
        (left.disk_gib, cap.disk_gib - rsv.disk_gib),
    ):
        if have > 0:
            total += free / have
    return total


def choose(fits: Sequence[HostFit], placement: Placement) -> HostFit:
    """The winning host among fitting ones: pack or spread, then host name."""
    if placement is Placement.SPREAD:
        return min(fits, key=lambda f: (-_room(f), f.host.name))
    return min(fits, key=lambda f: (_room(f), f.host.name))


@fast_init
@dataclass(frozen=True, slots=True)
class PlacementResult:
    chosen: HostFit | None
    reason: str | None
    fits: tuple[HostFit, ...]
    #: when nothing fits: how many hosts reached each filter stage
    stages: dict[Fit, int] = field(default_factory=dict)


def _claims_scorer(
    state: State, pool: Pool, demand: Resources, claims: Sequence[ResolvedClaim], spread: bool
) -> Scorer:
    """A host's stage and score (None: no fit; lower is better): :func:`evaluate`, then
    :func:`_room`, its negation when the pool spreads."""

    def score(name: HostName) -> tuple[int, float | None]:
        fit = evaluate(state, state.hosts[name], pool, demand, claims)
        if fit.fit is not _FITS:
            return fit.fit, None
        return fit.fit, (-_room(fit) if spread else _room(fit))

    return score


def _scalar_scorer(state: State, pool: Pool, demand: Resources, spread: bool) -> Scorer:
    """:func:`_claims_scorer` for a request without claims, on plain integers and
    without a :class:`HostFit`.

    Placement scores a host every time its booking changed (a few hosts per admission),
    so this is the hot path of admission. It must stay exactly :func:`evaluate`'s
    filter for ``claims=()`` and ``without=()``, and :func:`_room`'s arithmetic in the
    same order (so the float is bit for bit the same); the golden and property tests
    compare it with a full evaluation.
    """
    hosts = state.hosts
    booked = state.booked
    selector = pool.host_selector
    d_cpu, d_mem, d_disk = demand.cpu, demand.memory_mib, demand.disk_gib

    def score(name: HostName) -> tuple[int, float | None]:
        host = hosts[name]
        if selector and not _selected(host.labels, selector):
            return _SELECTOR, None
        if not host.schedulable or host.cordon is not None:  # host.admits
            return _UNSCHEDULABLE, None
        cap, rsv = host.capacity, host.reserve
        a_cpu = cap.cpu - rsv.cpu
        a_mem = cap.memory_mib - rsv.memory_mib
        a_disk = cap.disk_gib - rsv.disk_gib
        if d_cpu > a_cpu or d_mem > a_mem or d_disk > a_disk:
            return _STRUCTURE, None
        foreign = host.foreign_demand
        l_cpu = a_cpu - foreign.cpu - d_cpu
        l_mem = a_mem - foreign.memory_mib - d_mem
        l_disk = a_disk - foreign.disk_gib - d_disk
        row = booked.get(name)
        if row is not None:
            l_cpu -= row[0]
            l_mem -= row[1]
            l_disk -= row[2]
        if l_cpu < 0 or l_mem < 0 or l_disk < 0:
            return _CAPACITY, None
        room = 0.0
        if a_cpu > 0:
            room += l_cpu / a_cpu
        if a_mem > 0:
            room += l_mem / a_mem
        if a_disk > 0:
            room += l_disk / a_disk
        return _FITS, (-room if spread else room)

    return score


def _shape_key(
    state: State, pool: Pool, demand: Resources, claims: Sequence[ResolvedClaim]
) -> Hashable:
    """Everything but host state that a host's evaluation depends on."""
    if not claims:
        # the demand as a plain tuple: a dataclass's __hash__ is a Python-level call
        return (pool.name, pool.seq, (demand.cpu, demand.memory_mib, demand.disk_gib), ())
    return (
        pool.name,
        pool.seq,
        demand,
        tuple(
            (c.name, c.class_name, c.gpu, state.classes[c.class_name].seq)
            if c.class_name in state.classes
            else (c.name, c.class_name, c.gpu, -1)
            for c in claims
        ),
    )


#: where a request goes: the host, and the GPU indexes it takes there
Chosen = tuple[Host, tuple[int, ...]]


def place(
    state: State,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    *,
    selected: HostName | None = None,
) -> PlacementResult:
    """Place a request. With ``selected``, only that host is considered."""
    found = choose_host(state, pool, demand, claims, selected=selected)
    if isinstance(found, PlacementResult):
        return found
    chosen = evaluate(state, found[0], pool, demand, claims)
    return PlacementResult(chosen, None, (chosen,))


def choose_host(
    state: State,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    *,
    selected: HostName | None = None,
) -> Chosen | PlacementResult:
    """:func:`place`'s answer, the winner as its host and GPU indexes only: the fold's
    admission takes nothing else from it, and the winner's :class:`HostFit` and the
    :class:`PlacementResult` around it are left unbuilt. When nothing fits, the same
    :class:`PlacementResult` as :func:`place`'s."""
    if selected is not None:
        host = state.hosts.get(selected)
        if host is None:
            return PlacementResult(None, "selected-host-unsuitable", ())
        fit = evaluate(state, host, pool, demand, claims)
        if fit.fit is _FITS:
            return fit.host, fit.gpus
        reason = "host-unschedulable" if fit.fit is _UNSCHEDULABLE else "selected-host-unsuitable"
        return PlacementResult(None, reason, (fit,))
    key = _shape_key(state, pool, demand, claims)
    index = state.candidates
    # a shape's scorer is made once, and kept by the index for its next placements
    score = index.scorers.get(key)
    made = score is None
    if score is None:
        spread = pool.placement is _SPREAD
        score = (
            _claims_scorer(state, pool, demand, claims, spread)
            if claims
            else _scalar_scorer(state, pool, demand, spread)
        )
    winner, stages = index.best(key, state.host_order, score)
    if made:
        index.scorers[key] = score
    if winner is not None:
        host = state.hosts[winner]
        if not claims:  # no claim, no GPU
            return host, ()
        chosen = evaluate(state, host, pool, demand, claims)
        return chosen.host, chosen.gpus
    reached = [_FIT_OF[stage] for stage, n in stages.items() if n > 0]
    best = max(reached, default=_SELECTOR)
    return PlacementResult(None, REASON_FOR_FIT[best], (), {f: stages[f] for f in reached})


def capacity_bound(
    state: State,
    pool: Pool,
    demand: Resources,
    claims: Sequence[ResolvedClaim],
    names: Iterable[HostName],
) -> list[HostFit]:
    """The hosts among ``names`` that fail only on capacity now (preemption's field)."""
    known = sorted({n for n in names if n in state.hosts})
    fits = (evaluate(state, state.hosts[n], pool, demand, claims) for n in known)
    return [f for f in fits if f.fit is _CAPACITY]


def unsuitable_hosts(
    state: State,
    pool: Pool,
    claims: Sequence[ResolvedClaim],
    potential: Sequence[str],
) -> list[str]:
    """The subset of ``potential`` where the request cannot be placed now."""
    out = []
    for name in potential:
        host = state.hosts.get(HostName(name))
        if host is None or evaluate(state, host, pool, pool.flavor, claims).fit is not _FITS:
            out.append(name)
    return out
