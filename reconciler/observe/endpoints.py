"""Prometheus metrics and the health probes on one address (``--metrics-addr``).

Rules (docs/operations.md, "Observe"):

- Nothing on a program's hot path touches Prometheus: a program keeps plain counters,
  and its collector turns them into metric families when ``/metrics`` is scraped. Each
  server has its own registry, so several programs can live in one process (tests, the
  demo) without sharing series.
- ``/metrics`` also has the process's own series (``process_resident_memory_bytes``,
  ``process_cpu_seconds_total``…) and the garbage collector's (``python_gc_*``).
- ``/healthz`` answers 200 while the program's event loop turns: the server runs on that
  loop, so a loop held by a blocking call answers nothing and the probe's timeout fails
  it. It says nothing about NATS or Incus: restarting a program does not bring either
  back.
- ``/readyz`` answers 200 when the program's readiness says so and 503 otherwise, with
  the program's JSON document in both cases (what *ready* means is each program's own:
  docs/operations.md lists them).
- Labels are bounded by configuration, never by traffic: hosts come from the fleet the
  program was started with, and every other label from a fixed set of codes (verbs,
  outcomes, reasons). No instance name, id or error text is ever a label.
- aiohttp is imported when a server starts, not with this module: ``reconciler run``
  leaves it out of a process that serves no metrics (:mod:`reconciler.cli.entry`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import structlog
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "MetricsServer",
    "Readiness",
    "counter",
    "gauge",
    "labelled_counter",
    "labelled_gauge",
    "parse_addr",
]

logger = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Readiness:
    """What ``/readyz`` answers: ready or not, and the document that says why."""

    ready: bool
    detail: Mapping[str, Any] = field(default_factory=dict)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def labelled_counter(
    name: str,
    doc: str,
    labels: Sequence[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> CounterMetricFamily:
    """A counter family of ``(label values, value)`` samples, in the order given."""
    return _filled(CounterMetricFamily(name, doc, labels=list(labels)), samples)


def labelled_gauge(
    name: str,
    doc: str,
    labels: Sequence[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> GaugeMetricFamily:
    """A gauge family of ``(label values, value)`` samples, in the order given."""
    return _filled(GaugeMetricFamily(name, doc, labels=list(labels)), samples)


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


def _filled(family: _Family, samples: Iterable[tuple[Sequence[str], float]]) -> _Family:
    for values, value in samples:
        family.add_metric(list(values), float(value))
    return family


def parse_addr(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:9108"``, ``":9108"`` or ``"[::1]:9108"`` → ``(host, port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics address must be HOST:PORT, not {addr!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one address (see the module's rules)."""

    def __init__(
        self,
        *,
        addr: str,
        collectors: Iterable[Collector],
        readiness: Callable[[], Awaitable[Readiness]],
    ) -> None:
        self.host, self.port = parse_addr(addr)
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in collectors:
            self.registry.register(collector)
        # the process's own: resident memory, CPU seconds, open files (process_*), and
        # the garbage collector's collections by generation (python_gc_*)
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._readiness = readiness
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        from aiohttp import web

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=self.exported(), headers={"Content-Type": CONTENT_TYPE})

        async def healthz(request: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def readyz(request: web.Request) -> web.Response:
            readiness = await self._readiness()
            return web.Response(
                body=orjson.dumps(dict(readiness.detail)),
                status=200 if readiness.ready else 503,
                content_type="application/json",
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
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

    def exported(self) -> bytes:
        """What ``/metrics`` answers now."""
        return generate_latest(self.registry)
