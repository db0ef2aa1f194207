"""The fleet as metrics: capacity, pools, decisions and waits (docs/operations.md,
"Metrics").

Rules:

- Gauges are read from the replica's folded state when ``/metrics`` is scraped
  (:func:`fleet_families`): every synced replica answers the same, leader or not. The
  fleet's aggregates are always there (``rc_fleet_capacity``, ``rc_fleet_booked``,
  ``rc_fleet_hosts``: a handful of series however many hosts); one series per host
  (``rc_host_capacity``, ``rc_host_booked``, ``rc_host_schedulable``) only with
  ``--metrics-per-host``: at 10,000 hosts that is 90,000 series, which a Prometheus
  may not want. Pools are configuration, tens of them: their series are always there.
- Counters and histograms are kept by :class:`FleetWatch`, a commit listener, from what
  each committed batch's effects say (its decisions, its claim-warm outcomes, its lease
  transitions) and the stream times of its inputs: nothing on the fold's path, nothing
  the fold reads. The lifecycle histograms measure stream time between two inputs (an
  admission and the lifecycle event that made its VM ready…), so every replica that
  folded both inputs observes the same value; a lease admitted before this replica
  started is not observed.
- Only the decision latency is the leader's: the time from an input's stream timestamp
  to the stream's confirmation of the decision it got, observed by the outbox publisher
  for what it publishes as batches commit (not for a drain of the store after an
  election, which republishes the previous leader's outputs).
- Labels are codes and configured names, never ids (:mod:`reconciler.observe.endpoints`).
"""

from __future__ import annotations

import bisect
import calendar
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import orjson
from prometheus_client.core import HistogramMetricFamily, Metric

from reconciler.core.messages import DECISION_HEAD, Output
from reconciler.core.model import CLAIMED, COLD, CREATED, READY, WARM, HostName, LeaseId
from reconciler.core.state import POOL_COUNTS, State
from reconciler.observe.endpoints import labelled_counter, labelled_gauge
from reconciler.replica.pipeline import Commit

__all__ = [
    "DECISION_BUCKETS",
    "LIFECYCLE_BUCKETS",
    "FleetWatch",
    "Histogram",
    "fleet_families",
    "stream_seconds",
]

#: decision latency buckets, seconds (the design's target: p99 ≤ 20 ms)
DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: boot, inject and start buckets, seconds
LIFECYCLE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
RESOURCES = ("cpu", "memory_mib", "disk_gib", "gpus")

#: transitions that end a wait: ready (warm boot), created (cold start), claimed (the
#: start of an injection's wait), injected
_ENDS = frozenset({str(READY), str(CREATED), str(CLAIMED), "injected"})

_SECONDS: dict[str, int] = {}


def stream_seconds(timestamp: str) -> float | None:
    """An RFC 3339 UTC stream time (``2026-12-05T20:53:21.123456789Z``) as epoch seconds;
    ``None`` for one that is not."""
    head = timestamp[:19]
    whole = _SECONDS.get(head)
    if whole is None:
        try:
            whole = calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None
        if len(_SECONDS) > 4096:
            _SECONDS.clear()
        _SECONDS[head] = whole
    rest = timestamp[19:]
    if rest.startswith("."):
        digits = rest[1:].rstrip("Z")
        if digits.isdigit():
            return whole + float("0." + digits)
    return float(whole)


@dataclass(slots=True)
class Histogram:
    """Cumulative buckets kept as plain counts (Prometheus reads them at scrape)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        value = max(value, 0.0)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


def _histograms(
    name: str, doc: str, label: str, series: dict[str, Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, hist in sorted(series.items()):
        family.add_metric([value], hist.buckets(), hist.total)
    return family


class FleetWatch:
    """Counters and histograms of the fleet, from committed batches (a commit listener)
    and from the outbox publisher's confirmations (the decision latency)."""

    def __init__(
        self,
        *,
        state: Callable[[], State | None] = lambda: None,
        warm_claims: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        #: (verb, outcome, reason or "none") -> decisions
        self.verdicts: Counter[tuple[str, str, str]] = Counter()
        #: (pool, "claimed" | "no-warm") -> claim-warm decisions, from the store's totals on
        self.warm_claims: Counter[tuple[str, str]] = Counter()
        for pool, (claimed, missed) in (warm_claims or {}).items():
            self.warm_claims[(pool, "claimed")] = claimed
            self.warm_claims[(pool, "no-warm")] = missed
        self.decision_latency: dict[str, Histogram] = {}
        self.warm_boot: dict[str, Histogram] = {}
        self.warm_inject: dict[str, Histogram] = {}
        self.cold_start: dict[str, Histogram] = {}
        #: lease -> (pool, stream time) of the admission or claim a later transition ends
        self._admitted: dict[LeaseId, tuple[str, float]] = {}
        self._claimed: dict[LeaseId, tuple[str, float]] = {}
        #: the state the pipeline folds into now (it is replaced when a fold fails)
        self._state = state

    # -------------------------------------------------------------- commits

    def notify(self, commit: Commit) -> None:
        """Commit listener: count the batch's decisions and follow its transitions."""
        fx = commit.fx
        verdicts = self.verdicts
        for verb, outcome, reason in fx.verdicts:
            verdicts[(verb, outcome, reason or "none")] += 1
        for pool, outcome in fx.warm_claims:
            self.warm_claims[(pool, outcome)] += 1
        state = self._state()
        if fx.transitions and state is not None:
            self._follow(commit, state)

    def _follow(self, commit: Commit, state: State) -> None:
        times: dict[int, float | None] | None = None
        for t in commit.fx.transitions:
            to = t.to_state
            if t.from_state is None:
                lease = state.leases.get(t.lease_id)
                if lease is None or lease.adopted:
                    continue
                if times is None:
                    times = _times(commit)
                at = times.get(t.input_seq)
                if at is not None:
                    self._admitted[t.lease_id] = (lease.pool, at)
                continue
            if to in _ENDS:
                if times is None:
                    times = _times(commit)
                at = times.get(t.input_seq)
                if at is not None:
                    self._moved(state, t.lease_id, to, at)
            elif to in ("deleting", "released", "victim", "draining"):
                self._admitted.pop(t.lease_id, None)
                self._claimed.pop(t.lease_id, None)

    def _moved(self, state: State, lease_id: LeaseId, to: str, at: float) -> None:
        lease = state.leases.get(lease_id)
        kind = lease.kind if lease is not None else None
        if to == READY and kind is WARM:
            start = self._admitted.pop(lease_id, None)
            if start is not None:
                _at(self.warm_boot, start[0]).observe(at - start[1])
        elif to == CREATED and kind is COLD:
            start = self._admitted.pop(lease_id, None)
            if start is not None:
                _at(self.cold_start, start[0]).observe(at - start[1])
        elif to == CLAIMED and lease is not None:
            self._admitted.pop(lease_id, None)
            self._claimed[lease_id] = (lease.pool, at)
        elif to == "injected":
            start = self._claimed.pop(lease_id, None)
            if start is not None:
                _at(self.warm_inject, start[0]).observe(at - start[1])

    # ------------------------------------------------------------ published

    def published(self, outputs: Iterable[Output], *, now: float | None = None) -> None:
        """The stream confirmed ``outputs`` (the leader's publisher): observe each
        decision's latency from its input's stream time (its ``decided_at``)."""
        confirmed = time.time() if now is None else now
        for out in outputs:
            # a decision re-sent for a request decided before carries no outcome: its
            # input time is the first request's, and it was observed then
            if out.outcome is None or not out.subject.startswith(DECISION_HEAD):
                continue
            try:
                body = orjson.loads(out.payload)
                verb, decided = str(body["verb"]), stream_seconds(str(body["decided_at"]))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if decided is not None:
                _at(self.decision_latency, verb, DECISION_BUCKETS).observe(confirmed - decided)

    # --------------------------------------------------------------- export

    def families(self) -> Iterator[Metric]:
        yield labelled_counter(
            "rc_decision_outcomes",
            "Decisions committed, by verb, outcome and reason (none: no reason)",
            ["verb", "outcome", "reason"],
            ((list(key), n) for key, n in sorted(self.verdicts.items())),
        )
        yield labelled_counter(
            "rc_warm_claims",
            "Claim-warm decisions per pool: claimed (a ready warm VM) or no-warm",
            ["pool", "outcome"],
            ((list(key), n) for key, n in sorted(self.warm_claims.items())),
        )
        yield _histograms(
            "rc_decision_latency_seconds",
            "Input's stream time to its decision confirmed by the stream (leader only)",
            "verb",
            self.decision_latency,
        )
        yield _histograms(
            "rc_warm_boot_seconds",
            "Warm admission to its VM ready, stream time",
            "pool",
            self.warm_boot,
        )
        yield _histograms(
            "rc_warm_inject_seconds",
            "Warm claim to its job injected, stream time",
            "pool",
            self.warm_inject,
        )
        yield _histograms(
            "rc_cold_start_seconds",
            "Cold admission to its instance created, stream time",
            "pool",
            self.cold_start,
        )


def _at(
    series: dict[str, Histogram], key: str, bounds: tuple[float, ...] = LIFECYCLE_BUCKETS
) -> Histogram:
    hist = series.get(key)
    if hist is None:
        hist = series[key] = Histogram(bounds)
    return hist


def _times(commit: Commit) -> dict[int, float | None]:
    return {d.stream_seq: stream_seconds(d.timestamp) for d in commit.deliveries}


# ------------------------------------------------------------------ gauges


def _host_figures(state: State, name: HostName) -> tuple[Sequence[int], Sequence[int]]:
    """``(allocatable, booked)`` of a host as cpu, memory_mib, disk_gib, gpus; booked
    counts leases and foreign instances, as admission and ``reconciler status`` do."""
    host = state.hosts[name]
    alloc = host.allocatable
    row = state.booked.get(host.name)
    foreign = host.foreign_demand
    held = state.gpus_held.get(host.name)
    used = len(set(held) | host.foreign_gpus) if held else len(host.foreign_gpus)
    booked = (
        (row[0] if row else 0) + foreign.cpu,
        (row[1] if row else 0) + foreign.memory_mib,
        (row[2] if row else 0) + foreign.disk_gib,
        used,
    )
    return (alloc.cpu, alloc.memory_mib, alloc.disk_gib, len(host.gpus)), booked


def _fleet_totals(state: State) -> tuple[list[int], list[int], Counter[str]]:
    """``(allocatable, booked, hosts by condition)`` of the whole fleet, in one pass
    over the hosts and one over the booked rows (a scrape at 10,000 hosts runs this
    between two batches of the fold: it stays a few milliseconds)."""
    cpu = mem = disk = gpus = 0
    b_cpu = b_mem = b_disk = b_gpus = 0
    conditions: Counter[str] = Counter()
    gpus_held, booked = state.gpus_held, state.booked
    for host in state.hosts.values():
        cap, res, foreign = host.capacity, host.reserve, host.foreign_demand
        cpu += cap.cpu - res.cpu
        mem += cap.memory_mib - res.memory_mib
        disk += cap.disk_gib - res.disk_gib
        gpus += len(host.gpus)
        b_cpu += foreign.cpu
        b_mem += foreign.memory_mib
        b_disk += foreign.disk_gib
        held = gpus_held.get(host.name)
        if held:
            b_gpus += len(held.keys() | host.foreign_gpus) if host.foreign_gpus else len(held)
        else:
            b_gpus += len(host.foreign_gpus)
        row = booked.get(host.name)
        if row is not None:
            b_cpu += row[0]
            b_mem += row[1]
            b_disk += row[2]
        if host.cordon is not None:
            conditions[str(host.cordon)] += 1
        elif host.schedulable:
            conditions["schedulable"] += 1
        else:
            conditions["unschedulable"] += 1
    return [cpu, mem, disk, gpus], [b_cpu, b_mem, b_disk, b_gpus], conditions


def _host_condition(state: State, name: HostName) -> str:
    host = state.hosts[name]
    if host.cordon is not None:
        return str(host.cordon)
    return "schedulable" if host.schedulable else "unschedulable"


HOST_CONDITIONS = ("schedulable", "unschedulable", "cordoned", "draining")


def fleet_families(state: State, *, per_host: bool) -> Iterator[Metric]:
    """The fleet's gauges, read from ``state`` now (see the module's rules)."""
    host_rows = (
        [
            (name, *_host_figures(state, name), _host_condition(state, name))
            for name in state.host_order
        ]
        if per_host
        else []
    )
    capacity, booked, conditions = _fleet_totals(state)
    yield labelled_gauge(
        "rc_fleet_capacity",
        "Allocatable (capacity - reserve) of every known host, by resource",
        ["resource"],
        (([r], capacity[i]) for i, r in enumerate(RESOURCES)),
    )
    yield labelled_gauge(
        "rc_fleet_booked",
        "Booked by leases and foreign instances on every host",
        ["resource"],
        (([r], booked[i]) for i, r in enumerate(RESOURCES)),
    )
    yield labelled_gauge(
        "rc_fleet_hosts",
        "Hosts by condition: schedulable, unschedulable (its snapshot), cordoned, draining",
        ["condition"],
        (([c], conditions.get(c, 0)) for c in HOST_CONDITIONS),
    )
    if per_host:
        yield labelled_gauge(
            "rc_host_capacity",
            "A host's allocatable (capacity - reserve), by resource",
            ["host", "resource"],
            (([h, r], alloc[i]) for h, alloc, _, _ in host_rows for i, r in enumerate(RESOURCES)),
        )
        yield labelled_gauge(
            "rc_host_booked",
            "A host's booked capacity (leases and foreign instances), by resource",
            ["host", "resource"],
            (([h, r], used[i]) for h, _, used, _ in host_rows for i, r in enumerate(RESOURCES)),
        )
        yield labelled_gauge(
            "rc_host_schedulable",
            "1 when new leases may be placed on the host (schedulable, not cordoned)",
            ["host"],
            (([h], 1 if cond == "schedulable" else 0) for h, _, _, cond in host_rows),
        )
    yield from _pool_families(state)


POOL_STATES = ("ready", *POOL_COUNTS)


def _pool_families(state: State) -> Iterator[Metric]:
    pools = sorted(state.pools)
    rows: list[tuple[list[str], float]] = []
    for name in pools:
        held = state.pool_counts.get(name, {})
        rows.append(([name, "ready"], len(state.pool_ready.get(name, ()))))
        rows.extend(([name, count], held.get(count, 0)) for count in POOL_COUNTS)
    yield labelled_gauge(
        "rc_pool_leases",
        "A pool's active leases by state: ready, booting, claimed, draining, victims, "
        "pending_requests",
        ["pool", "state"],
        rows,
    )
    yield labelled_gauge(
        "rc_pool_instances",
        "A pool's leases that book capacity (its max_instances counts them)",
        ["pool"],
        (([name], state.pool_booking.get(name, 0)) for name in pools),
    )
    yield labelled_gauge(
        "rc_pool_warm_target",
        "A pool's warm settings: min_ready and max_ready",
        ["pool", "bound"],
        (
            ([name, bound], getattr(state.pools[name].warm, bound))
            for name in pools
            for bound in ("min_ready", "max_ready")
        ),
    )
