"""The bridge's Prometheus metrics and probes (``reconciler bridge --metrics-addr``).

Rules:

- Each :class:`~.bridge.HostBridge` keeps plain counters; :class:`BridgeCollector`
  reads them when ``/metrics`` is scraped (:mod:`reconciler.observe.endpoints`).
- Every series is labelled by ``host`` (the hosts the bridge was started with) and at
  most one more label from a fixed set (``kind``: ``snapshot`` or ``inventory``), so a
  bridge exports at most 9 series per host beyond its three own.
- **Ready** (``/readyz`` 200) when the NATS connection is up and *every* host's event
  stream is connected with the snapshot and inventory owed since it (re)connected
  published. A bridge with one host down is alive and serves the others, but not ready:
  the document names the host (``hosts.<host>.connected``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from nats.aio.client import Client
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from reconciler.bridge.bridge import HostBridge
from reconciler.observe.endpoints import (
    MetricsServer,
    Readiness,
    gauge,
    labelled_counter,
    labelled_gauge,
)

__all__ = ["BridgeCollector", "bridge_metrics_server", "bridge_readiness"]

_KINDS = ("snapshot", "inventory")


class BridgeCollector(Collector):
    """Turns the host bridges' counters into metric families at scrape time."""

    def __init__(self, hosts: Sequence[HostBridge], nc: Client) -> None:
        self.hosts = sorted(hosts, key=lambda h: h.host)
        self.nc = nc

    def collect(self) -> Iterator[Metric]:
        hosts = self.hosts
        yield labelled_counter(
            "rc_bridge_events_forwarded",
            "Incus lifecycle events published to the input stream",
            ["host"],
            (([h.host], h.published["lifecycle"]) for h in hosts),
        )
        yield labelled_counter(
            "rc_bridge_event_publish_retries",
            "Lifecycle event publishes tried again (NATS down, slow or restarting)",
            ["host"],
            (([h.host], h.publish_retries) for h in hosts),
        )
        yield labelled_counter(
            "rc_bridge_resyncs",
            "Host snapshots and inventories published",
            ["host", "kind"],
            (([h.host, kind], h.published[kind]) for h in hosts for kind in _KINDS),
        )
        yield labelled_counter(
            "rc_bridge_resync_failures",
            "Host snapshots and inventories that failed (Incus or NATS trouble; tried again)",
            ["host", "kind"],
            (([h.host, kind], h.failed[kind]) for h in hosts for kind in _KINDS),
        )
        yield labelled_counter(
            "rc_bridge_reconnects",
            "Times a host's event stream was connected again after the first time",
            ["host"],
            (([h.host], max(h.connections - 1, 0)) for h in hosts),
        )
        yield labelled_gauge(
            "rc_bridge_host_connected",
            "1 while the host's event stream is connected",
            ["host"],
            (([h.host], int(h.connected)) for h in hosts),
        )
        yield labelled_gauge(
            "rc_bridge_host_caught_up",
            "1 once the snapshot and inventory owed since the host (re)connected are published",
            ["host"],
            (([h.host], int(h.caught_up)) for h in hosts),
        )
        yield gauge("rc_bridge_nats_connected", "1 while connected to NATS", self.nc.is_connected)
        yield gauge("rc_bridge_ready", "1 while /readyz answers 200", _ready(hosts, self.nc))


def _ready(hosts: Sequence[HostBridge], nc: Client) -> bool:
    return nc.is_connected and all(h.connected and h.caught_up for h in hosts)


def bridge_readiness(hosts: Sequence[HostBridge], nc: Client) -> Readiness:
    """Ready, per the module's rules, with a document naming what is not."""
    detail: dict[str, Any] = {
        "nats_connected": nc.is_connected,
        "hosts": {
            h.host: {
                "connected": h.connected,
                "caught_up": h.caught_up,
                "connections": h.connections,
            }
            for h in sorted(hosts, key=lambda h: h.host)
        },
    }
    return Readiness(ready=_ready(hosts, nc), detail=detail)


def bridge_metrics_server(*, addr: str, hosts: Sequence[HostBridge], nc: Client) -> MetricsServer:
    """The bridge's ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr``."""

    async def readiness() -> Readiness:
        return bridge_readiness(hosts, nc)

    return MetricsServer(addr=addr, collectors=[BridgeCollector(hosts, nc)], readiness=readiness)
