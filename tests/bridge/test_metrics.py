"""``reconciler bridge`` is observable: run as the real command against a real nats-server
and the simulated Incus fleet through real pylxd, it serves ``/healthz``, ``/readyz`` and
Prometheus metrics on ``--metrics-addr`` (reconciler.bridge.metrics), and its per-host
counters move with what happens (an event forwarded, a host's event stream lost and
connected again)."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
import pytest

from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.simulator import Fleet, FleetOptions, Listen, SimulatorThread
from reconciler.incus.simulator import default_fleet as sim_hosts
from reconciler.incus.views import InstanceSpec
from tests.support.programs import on_bus, program, two_free_ports, value, wait_for

pytestmark = pytest.mark.timeout(90)

PREFIX = "rcm"

NAMES = StreamNames.for_prefix(PREFIX)

FAST = FleetOptions(boot_delay_s=0.1, operation_retention_s=1.0, ping_interval_s=0.5)

ONE, TWO = "host-01", "host-02"


def test_the_bridge_serves_its_probes_and_counts_per_host(tmp_path: Path, nats_url: str) -> None:
    port = two_free_ports()
    hosts = {ONE: f"http://127.0.0.1:{port}", TWO: f"http://127.0.0.1:{port + 1}"}
    incus = [a for host, url in hosts.items() for a in ("--incus", f"{host}={url}")]
    args = ["bridge", *incus, "--nats-url", nats_url, "--prefix", PREFIX]
    args += ["--metrics-addr", "127.0.0.1:0", "--resync-interval", "60"]
    on_bus(nats_url, lambda js: ensure_streams(js, NAMES))
    with program(args, tmp_path / "bridge.log") as bridge:
        bridge.serving()
        # no Incus yet: alive, not ready, and the document says which hosts are missing
        assert bridge.get("/healthz") == (200, b"ok\n")
        status, body = bridge.get("/readyz")
        assert status == 503
        assert orjson.loads(body)["hosts"][ONE]["connected"] is False
        samples = bridge.metrics()
        assert value(samples, "rc_bridge_host_connected", host=ONE) == 0
        assert value(samples, "rc_bridge_ready") == 0
        assert value(samples, "rc_bridge_nats_connected") == 1

        listen = Listen(kind="tcp", address="127.0.0.1", base_port=port)
        fleet = Fleet(sim_hosts(2, projects=("ci",)), listen=listen, options=FAST)
        with SimulatorThread(fleet) as sim:
            assert sim.endpoints == hosts
            hosts_ready = bridge.ready(30)["hosts"]
            assert {h: d["caught_up"] for h, d in hosts_ready.items()} == {ONE: True, TWO: True}
            samples = bridge.metrics()
            for host in (ONE, TWO):
                assert value(samples, "rc_bridge_host_connected", host=host) == 1
                for kind in ("snapshot", "inventory"):
                    resyncs = value(samples, "rc_bridge_resyncs_total", host=host, kind=kind)
                    assert resyncs is not None and resyncs >= 1
                assert value(samples, "rc_bridge_reconnects_total", host=host) == 0
                assert value(samples, "rc_bridge_events_forwarded_total", host=host) == 0
            inventories = value(samples, "rc_bridge_resyncs_total", host=ONE, kind="inventory")

            # an instance made through pylxd: its events are forwarded, an inventory follows
            anyio.run(_create_instance, IncusEndpoint(host=ONE, url=hosts[ONE]))
            wait_for(
                lambda: (
                    (value(bridge.metrics(), "rc_bridge_events_forwarded_total", host=ONE) or 0)
                    >= 2
                ),
                15,
                "instance-created and instance-started forwarded",
            )
            wait_for(
                lambda: (
                    (
                        (
                            value(
                                bridge.metrics(),
                                "rc_bridge_resyncs_total",
                                host=ONE,
                                kind="inventory",
                            )
                        )
                        or 0
                    )
                    > (inventories or 0)
                ),
                15,
                "an inventory after the creation",
            )
            assert value(bridge.metrics(), "rc_bridge_events_forwarded_total", host=TWO) == 0

            # host-02's event stream is lost: the bridge connects again and counts it
            sim.call(lambda: sim.host(TWO).drop_event_streams())
            wait_for(
                lambda: value(bridge.metrics(), "rc_bridge_reconnects_total", host=TWO) == 1,
                15,
                "host-02 connected again",
            )
            bridge.ready(15)
            samples = bridge.metrics()
            assert value(samples, "rc_bridge_reconnects_total", host=ONE) == 0
            assert value(samples, "rc_bridge_host_connected", host=TWO) == 1

        # Incus gone for good: the hosts are disconnected, the bridge no longer ready
        wait_for(
            lambda: value(bridge.metrics(), "rc_bridge_host_connected", host=ONE) == 0,
            20,
            "the bridge to notice Incus gone",
        )
        assert bridge.get("/readyz")[0] == 503
        assert bridge.get("/healthz")[0] == 200
    assert bridge.process.returncode == 0


async def _create_instance(endpoint: IncusEndpoint) -> None:
    host = IncusHost(endpoint)
    try:
        spec = InstanceSpec.for_lease(
            name="w-1", image="ubuntu/24.04", lease_id="L1", pool="small", kind="warm"
        )
        await host.create_instance(spec)
        await host.start_instance("w-1", project="default")
    finally:
        await host.aclose()
