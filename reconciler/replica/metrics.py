"""A replica's Prometheus metrics and probes (``reconciler run --metrics-addr``).

Rules:

- The pipeline, the leader's workers and the query responder keep plain counters;
  :class:`RuntimeCollector` reads them when ``/metrics`` is scraped, on the server every
  program shares (:mod:`reconciler.observe.endpoints`). With ``--store-writer process``
  the writer child's memory is not in the process's series.
- The fleet's series (capacity, pools, decisions, waits) are described in
  :mod:`reconciler.replica.fleet_metrics`; one series per host only with ``per_host``.
- ``/healthz`` answers 200 while the event loop runs; ``/readyz`` answers 200 once the
  pipeline is synced and 503 before, with the health document (the ``health`` query's
  result) as JSON in both cases.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from reconciler.core.fold.queue import tenant_of
from reconciler.core.state import State
from reconciler.observe.endpoints import (
    MetricsServer,
    Readiness,
    counter,
    gauge,
    labelled_counter,
    labelled_gauge,
)
from reconciler.replica.fleet_metrics import FleetWatch, fleet_families
from reconciler.replica.queue_stats import ENDINGS, WAIT_BUCKETS, QueueStats

__all__ = ["RuntimeCollector", "RuntimeFacts", "queue_families", "replica_metrics_server"]


def queue_families(stats: QueueStats, state: State | None) -> Iterator[Metric]:
    """The admission queue's metric families: depth by pool and tenant (from the
    state), requests by how they ended, and the histogram of time queued."""
    depth = (
        sorted(
            ((pool, tenant_of(state, pool) or ""), n) for pool, n in state.queue.per_pool.items()
        )
        if state is not None
        else []
    )
    yield labelled_gauge(
        "rc_queue_depth",
        "Requests waiting in the admission queue, by pool and tenant",
        ["pool", "tenant"],
        (([pool, tenant], n) for (pool, tenant), n in depth),
    )
    yield labelled_counter(
        "rc_queue_requests",
        "Admission requests by how they ended: at-once (admitted without waiting), "
        "after-waiting, timed-out, cancelled, refused (while waiting)",
        ["ended"],
        (([how], stats.ended[how]) for how in ENDINGS),
    )
    cumulative, running = [], 0
    for bound, n in zip((*map(str, WAIT_BUCKETS), "+Inf"), stats.buckets, strict=True):
        running += n
        cumulative.append((bound, running))
    yield HistogramMetricFamily(
        "rc_queue_wait_seconds",
        "Time requests spent in the admission queue (message time), by how long",
        buckets=cumulative,
        sum_value=stats.wait_sum,
    )


class RuntimeFacts(Protocol):
    """What the collector reads from a running replica."""

    def facts(self) -> dict[str, Any]: ...

    def fleet_state(self) -> tuple[State | None, FleetWatch | None]: ...


class RuntimeCollector(Collector):
    """Turns a replica's counters, and its fleet (:mod:`reconciler.replica.fleet_metrics`),
    into metric families at scrape time."""

    def __init__(self, runtime: RuntimeFacts, *, per_host: bool = False) -> None:
        self.runtime = runtime
        self.per_host = per_host

    def collect(self) -> Iterator[Metric]:
        f = self.runtime.facts()
        yield gauge("rc_applied_seq", "Last stream sequence committed to the store", f["applied"])
        yield gauge("rc_stream_last_seq", "Last sequence of the input stream seen", f["head"])
        yield gauge("rc_caches_synced", "1 once the caches caught up with the stream", f["synced"])
        yield gauge("rc_leader", "1 while this replica holds the leader key", f["leader"])
        yield gauge("rc_leader_ready", "1 once the leader's workers run", f["leader_ready"])
        yield counter("rc_inputs_folded", "Input messages folded", f["folded"])
        yield counter("rc_batches_committed", "Batches committed to the store", f["batches"])
        yield counter("rc_commit_seconds", "Time spent in store commits (sum)", f["commit_seconds"])
        yield labelled_counter(
            "rc_dead_letters",
            "Input messages dead-lettered, by reason",
            ["reason"],
            (([reason], n) for reason, n in sorted(f["dead_letters"].items())),
        )
        yield counter("rc_decisions", "Decisions committed", f["decisions"])
        yield counter("rc_executor_commands", "Executor commands committed", f["commands"])
        yield counter("rc_outbox_published", "Outputs confirmed by the stream", f["published"])
        yield counter("rc_status_published", "Status messages published", f["status"])
        yield counter("rc_queries_answered", "Queries answered", f["queries"])
        yield counter(
            "rc_consumer_restarts", "Times the input consumer was (re)started", f["restarts"]
        )
        state, fleet = self.runtime.fleet_state()
        if state is not None:
            yield from fleet_families(state, per_host=self.per_host)
        if fleet is not None:
            yield from fleet.families()
        queue = f.get("queue")
        if isinstance(queue, QueueStats):
            yield from queue_families(queue, state)


def replica_metrics_server(
    *,
    addr: str,
    runtime: RuntimeFacts,
    health: Callable[[], Awaitable[dict[str, Any]]],
    per_host: bool = False,
) -> MetricsServer:
    """The replica's server: its counters and its fleet, and ready once its pipeline is
    synced."""

    async def readiness() -> Readiness:
        document = await health()
        return Readiness(ready=bool(document.get("caches_synced")), detail=document)

    return MetricsServer(
        addr=addr, collectors=[RuntimeCollector(runtime, per_host=per_host)], readiness=readiness
    )
