"""``reconciler executor`` is observable: run as the real command against a real
nats-server and the simulated Incus fleet through real pylxd, it serves ``/healthz``,
``/readyz`` and Prometheus metrics on ``--metrics-addr`` (reconciler.executor.metrics),
and its counters per host and verb move with what happens (a create Incus refuses, a
command given up, a malformed command).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.incus.simulator import Fleet, FleetOptions, Listen, SimulatorThread
from reconciler.incus.simulator import default_fleet as sim_hosts
from tests.support.natsserver import NatsServer
from tests.support.programs import Samples, on_bus, program, value, wait_for

pytestmark = pytest.mark.timeout(90)

PREFIX = "rcm"
NAMES = StreamNames.for_prefix(PREFIX)
FAST = FleetOptions(boot_delay_s=0.1, operation_retention_s=1.0, ping_interval_s=0.5)
ONE, TWO = "host-01", "host-02"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="em-"))  # AF_UNIX paths are short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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
