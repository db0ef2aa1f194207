"""Prometheus metrics and the health endpoints (``--metrics-addr``).

Rules:

- Nothing on the hot path touches Prometheus: the caches, the leader's workers and the
  query responder keep plain counters, and :class:`RuntimeCollector` reads them when
  ``/metrics`` is scraped. Each runtime has its own registry, so several replicas can
  live in one process (tests) without sharing series.
- ``/metrics`` also has the process's own series (``process_resident_memory_bytes``,
  ``process_cpu_seconds_total``…) and the garbage collector's (``python_gc_*``); with
  ``--store-writer process`` the writer child's memory is not in them.
- ``/healthz`` answers 200 while the event loop runs; ``/readyz`` answers 200 once the
  caches are synced and 503 before, with the health document as JSON in both cases.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import orjson
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["MetricsServer", "RuntimeCollector", "RuntimeFacts", "parse_addr"]

logger = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RuntimeFacts(Protocol):
    """What the collector reads from a running replica."""

    def facts(self) -> dict[str, Any]: ...


class RuntimeCollector(Collector):
    """Turns a replica's counters into metric families at scrape time."""

    def __init__(self, runtime: RuntimeFacts) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        f = self.runtime.facts()
        yield _gauge("rc_applied_seq", "Last stream sequence committed to the store", f["applied"])
        yield _gauge("rc_stream_last_seq", "Last sequence of the input stream seen", f["head"])
        yield _gauge("rc_caches_synced", "1 once the caches caught up with the stream", f["synced"])
        yield _gauge("rc_leader", "1 while this replica holds the leader key", f["leader"])
        yield _gauge("rc_leader_ready", "1 once the leader's workers run", f["leader_ready"])
        yield _counter("rc_inputs_folded", "Input messages folded", f["folded"])
        yield _counter("rc_batches_committed", "Batches committed to the store", f["batches"])
        yield _counter(
            "rc_commit_seconds", "Time spent in store commits (sum)", f["commit_seconds"]
        )
        dead = CounterMetricFamily(
            "rc_dead_letters", "Input messages dead-lettered, by reason", labels=["reason"]
        )
        for reason, n in sorted(f["dead_letters"].items()):
            dead.add_metric([reason], n)
        yield dead
        yield _counter("rc_decisions", "Decisions committed", f["decisions"])
        yield _counter("rc_executor_commands", "Executor commands committed", f["commands"])
        yield _counter("rc_outbox_published", "Outputs confirmed by the stream", f["published"])
        yield _counter("rc_status_published", "Status messages published", f["status"])
        yield _counter("rc_queries_answered", "Queries answered", f["queries"])
        yield _counter(
            "rc_consumer_restarts", "Times the input consumer was (re)started", f["restarts"]
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def parse_addr(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:9108"``, ``":9108"`` or ``"[::1]:9108"`` → ``(host, port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics address must be HOST:PORT, not {addr!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one address."""

    def __init__(
        self,
        *,
        addr: str,
        runtime: RuntimeFacts,
        health: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.host, self.port = parse_addr(addr)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(runtime))
        # the process's own: resident memory, CPU seconds, open files (process_*), and
        # the garbage collector's collections by generation (python_gc_*)
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._health = health
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        for address in runner.addresses:  # the real port when 0 was asked
            if isinstance(address, tuple):
                self.port = int(address[1])
                break
        logger.info("metrics.listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        health = await self._health()
        status = 200 if health.get("caches_synced") else 503
        return web.Response(
            body=orjson.dumps(health), status=status, content_type="application/json"
        )
