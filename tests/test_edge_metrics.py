"""``reconciler bridge`` and ``reconciler executor`` are observable: each, run as the real
command against a real nats-server and the simulated Incus fleet through real pylxd,
serves ``/healthz``, ``/readyz`` and Prometheus metrics on ``--metrics-addr``, and the
counters move with what happens (an event forwarded, a host's event stream lost and
connected again, a create Incus refuses, a command given up, a malformed command).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.simulator import Fleet, FleetOptions, Listen, SimulatorThread
from reconciler.incus.simulator import default_fleet as sim_hosts
from reconciler.incus.views import InstanceSpec
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.timeout(90)

PREFIX = "rcm"
NAMES = StreamNames.for_prefix(PREFIX)
FAST = FleetOptions(boot_delay_s=0.1, operation_retention_s=1.0, ping_interval_s=0.5)
ONE, TWO = "host-01", "host-02"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ------------------------------------------------------------------ the processes


class Program:
    """``reconciler <args>`` as a child process logging JSON lines to a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "reconciler.cli", *args, "--log-format", "json"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.base = ""

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [orjson.loads(line) for line in lines if line.startswith("{")]

    def serving(self) -> str:
        """The base URL of its metrics server, once it listens (port 0 was asked)."""

        def port() -> int | None:
            for event in self.events():
                if event.get("event") == "metrics.listening":
                    return int(event["port"])
            assert self.process.poll() is None, self.log.read_text()
            return None

        found = wait_for(port, 20, "the metrics server to listen")
        self.base = f"http://127.0.0.1:{found}"
        return self.base

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def ready(self, within_s: float) -> dict[str, Any]:
        """``/readyz``'s document once it answers 200 (the NATS connection is up)."""
        wait_for(lambda: self.get("/readyz")[0] == 200, within_s, "/readyz to answer 200")
        document: dict[str, Any] = orjson.loads(self.get("/readyz")[1])
        assert document["nats_connected"] is True
        return document

    def metrics(self) -> Samples:
        status, body = self.get("/metrics")
        assert status == 200
        return parse(body.decode())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for(check: Callable[[], Any], within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"waited {within_s} s for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def program(args: list[str], log: Path) -> Iterator[Program]:
    running = Program(args, log)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="em-"))  # AF_UNIX paths are short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def two_free_ports() -> int:
    """A port P with P and P + 1 free now (the simulated hosts listen there later)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


async def _with_bus(url: str, work: Callable[[Any], Any]) -> Any:
    nc = await nats.connect(url, connect_timeout=2)
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def on_bus(url: str, work: Callable[[Any], Any]) -> Any:
    return anyio.run(_with_bus, url, work)


# ------------------------------------------------------------------ the bridge


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


# ------------------------------------------------------------------ the executor


def create(host: str, instance: str, lease: str, **changes: Any) -> dict[str, Any]:
    """An ``exec.create`` command as the leader publishes it."""
    return {
        "v": 1,
        "command_id": f"create:{lease}",
        "host": host,
        "instance": instance,
        "project": "ci",
        "lease_id": lease,
        "pool": "small",
        "image": "ubuntu/24.04",
        "profiles": ["default"],
        "demand": {"cpu": 2, "memory_mib": 4096, "disk_gib": 20},
        "gpus": [],
        "instance_type": "virtual-machine",
        **changes,
    }


def delete(host: str, instance: str, lease: str) -> dict[str, Any]:
    return {
        "v": 1,
        "command_id": f"delete:{lease}",
        "host": host,
        "instance": instance,
        "project": "ci",
        "lease_id": lease,
        "reason": "drained",
    }


async def _publish(js: Any, commands: list[tuple[str, dict[str, Any]]]) -> None:
    for verb, body in commands:
        subject = f"{PREFIX}.out.exec.{body['host']}.{verb}"
        headers = {"Nats-Msg-Id": body["command_id"]}
        await js.publish(subject, orjson.dumps(body), headers=headers)


def test_the_executor_serves_its_probes_and_counts_per_host_and_verb(
    tmp_path: Path, nats_server: NatsServer, socket_dir: Path
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the test stops and starts the nats-server")
    nats_url = nats_server.url
    fleet = Fleet(
        sim_hosts(2, projects=("ci",)),
        listen=Listen(kind="unix", directory=socket_dir),
        options=FAST,
        fleet_file=socket_dir / "fleet.json",
    )
    on_bus(nats_url, lambda js: ensure_streams(js, NAMES))
    args = ["executor", "--incus-fleet", str(socket_dir / "fleet.json")]
    args += ["--nats-url", nats_url, "--prefix", PREFIX, "--db", str(tmp_path / "ex.db")]
    args += ["--metrics-addr", "127.0.0.1:0", "--max-attempts", "2"]
    args += ["--retry-base", "0.05", "--retry-cap", "0.2"]
    with SimulatorThread(fleet) as sim, program(args, tmp_path / "executor.log") as executor:
        executor.serving()
        bound = {h: d["consumer_bound"] for h, d in executor.ready(20)["hosts"].items()}
        assert bound == {ONE: True, TWO: True}
        assert executor.get("/healthz") == (200, b"ok\n")
        samples = executor.metrics()
        # every outcome and refusal is there from the start, at 0: the first one is an
        # increase Prometheus sees
        for host in (ONE, TWO):
            for verb in ("create", "delete"):
                for outcome in ("created", "deleted", "absent", "rejected", "gave-up"):
                    labels = {"host": host, "verb": verb, "outcome": outcome}
                    assert value(samples, "rc_executor_commands_finished_total", **labels) == 0
            assert (
                value(samples, "rc_executor_commands_refused_total", host=host, reason="schema")
                == 0
            )
            assert value(samples, "rc_executor_consumer_bound", host=host) == 1
        assert value(samples, "rc_executor_ready") == 1

        sim.call(lambda: sim.host(TWO).fail_next("create", count=5))
        commands = [
            # Incus refuses it (no such profile): rejected at once, never retried
            ("create", create(ONE, "w-1", "L1", profiles=["default", "gpu-nope"])),
            # fails for a reason that may pass, twice (--max-attempts 2): given up
            ("create", create(TWO, "w-2", "L2")),
            # not what the schema says: refused before Incus
            ("create", create(ONE, "w-3", "L3", demand={"cpu": -1})),
            ("delete", delete(ONE, "w-9", "L9")),  # nothing there: done, absent
            ("create", create(ONE, "w-4", "L4")),
        ]
        on_bus(nats_url, lambda js: _publish(js, commands))

        expected = {
            (ONE, "create", "rejected"): 1,
            (ONE, "create", "created"): 1,
            (ONE, "delete", "absent"): 1,
            (TWO, "create", "gave-up"): 1,
        }

        def counted() -> Samples | None:
            """The page once every command finished and nothing is held or waiting."""
            samples = executor.metrics()
            finished = all(
                value(samples, "rc_executor_commands_finished_total", host=h, verb=v, outcome=o)
                == n
                for (h, v, o), n in expected.items()
            )
            idle = all(
                value(samples, gauge, host=h) == 0
                for h in (ONE, TWO)
                for gauge in ("rc_executor_commands_held", "rc_executor_backlog")
            )
            return samples if finished and idle else None

        samples = wait_for(counted, 20, "the commands to finish")
        for (host, verb, outcome), n in expected.items():
            labels = {"host": host, "verb": verb, "outcome": outcome}
            assert value(samples, "rc_executor_commands_finished_total", **labels) == n, labels
        assert (
            value(
                samples,
                "rc_executor_commands_finished_total",
                host=TWO,
                verb="create",
                outcome="created",
            )
            == 0
        )
        retries = value(
            samples,
            "rc_executor_command_retries_total",
            host=TWO,
            verb="create",
            failure="operation-failed",
        )
        assert retries == 1
        assert value(samples, "rc_executor_commands_refused_total", host=ONE, reason="schema") == 1
        assert value(samples, "rc_executor_commands_refused_total", host=TWO, reason="schema") == 0
        for host in (ONE, TWO):
            assert value(samples, "rc_executor_commands_held", host=host) == 0
            assert value(samples, "rc_executor_backlog", host=host) == 0
        # the log lines tell the same story
        events = [e["event"] for e in executor.events()]
        assert events.count("command.gave_up") == events.count("command.rejected") == 1

        # NATS gone: alive, not ready, and the document says so; back: ready again
        nats_server.stop()
        wait_for(lambda: executor.get("/readyz")[0] == 503, 15, "/readyz to answer 503")
        document = orjson.loads(executor.get("/readyz")[1])
        assert document["nats_connected"] is False
        assert value(executor.metrics(), "rc_executor_nats_connected") == 0
        assert executor.get("/healthz")[0] == 200
        nats_server.start()
        bound = {h: d["consumer_bound"] for h, d in executor.ready(30)["hosts"].items()}
        assert bound == {ONE: True, TWO: True}
    assert executor.process.returncode == 0
