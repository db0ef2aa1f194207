"""The admission queue's metrics: depth by pool and tenant, requests by how they ended,
and the histogram of time queued, from the effects of real folds."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from reconciler.core.state import Effects
from reconciler.replica.metrics import queue_families
from reconciler.replica.pipeline import Commit
from reconciler.replica.queue_stats import QueueStats
from tests.support.builders import Fleet, admit, cmd, pool, snapshot


def test_the_queue_metrics_count_how_requests_ended() -> None:
    f = Fleet()
    stats = QueueStats()

    def send(*items: tuple[str, dict[str, object]]) -> None:
        fx: Effects = f.send(*items)
        stats.notify(Commit(applied_seq=f.seq, fx=fx, inputs=len(items), dead_letters=0))

    send(snapshot("h1", cpu=4), pool("p"), admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    send(admit("q1", "p", "vm-3", wait_s=60), admit("q2", "p", "vm-4", wait_s=60))
    send(admit("q3", "p", "vm-5", wait_s=1))
    send(cmd("release", "r1", instance="vm-1"))  # q1 admitted after waiting; q3 timed out
    send(cmd("release", "r4", instance="vm-4"))  # q2 cancelled
    assert stats.ended == {
        "at-once": 2,
        "after-waiting": 1,
        "timed-out": 1,
        "cancelled": 1,
        "refused": 0,
    }

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from queue_families(stats, f.state)

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    assert 'rc_queue_requests_total{ended="after-waiting"} 1.0' in text
    assert "rc_queue_wait_seconds_count 3.0" in text
    assert 'rc_queue_wait_seconds_bucket{le="+Inf"} 3.0' in text
