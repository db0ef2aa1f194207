"""Boot delay, fault injection, the ``/_sim/`` control surface, listening and the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from pylxd import Client

from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import OperationFailed
from reconciler.incus.events import LifecycleStream
from reconciler.incus.simulator import (
    Fleet,
    FleetOptions,
    HostShape,
    Listen,
    SimulatorThread,
    default_fleet,
    fleet_from_json,
    read_fleet_file,
)
from reconciler.incus.simulator.shapes import host_tls, shape_from_json, shape_to_json
from reconciler.incus.views import InstanceSpec
from tests.incus.conftest import CPU_HOST, GPU_HOST, make_fleet


def spec(name: str) -> InstanceSpec:
    return InstanceSpec(name=name, image="debian/13")


async def actions(events: LifecycleStream, count: int, timeout_s: float = 2.0) -> list[str]:
    found: list[str] = []
    with anyio.fail_after(timeout_s):
        while len(found) < count:
            found.append(str((await events.__anext__())["metadata"]["action"]))
    return found


async def quiet_for(events: LifecycleStream, seconds: float) -> bool:
    with anyio.move_on_after(seconds) as scope:
        await events.__anext__()
    return scope.cancelled_caught


@pytest.fixture
async def cpu_host(fleet: Fleet) -> AsyncIterator[IncusHost]:
    host = IncusHost(
        IncusEndpoint(host=CPU_HOST, url=fleet.endpoints[CPU_HOST]), operation_timeout_s=5
    )
    yield host
    await host.aclose()


# ---------------------------------------------------------------------- boot


@pytest.mark.incus_version("7")  # 6.0 has no instance-agent-started: test_simulator_lts.py
async def test_the_agent_starts_after_the_boot_delay(fleet: Fleet, cpu_host: IncusHost) -> None:
    fleet.host(CPU_HOST).set_boot_delay(0.4)
    await cpu_host.create_instance(spec("b1"))
    async with cpu_host.lifecycle_events() as events:
        started = time.monotonic()
        await cpu_host.start_instance("b1")
        assert await actions(events, 1) == ["instance-started"]
        view = await cpu_host.get_instance("b1")
        assert view is not None and view.status_code == 103
        assert await actions(events, 2) == ["instance-agent-started", "instance-ready"]
        assert time.monotonic() - started >= 0.4
    view = await cpu_host.get_instance("b1")
    assert view is not None and (view.status, view.status_code) == ("Ready", 113)


async def test_without_ready_reports_the_vm_stays_running(socket_dir: Path) -> None:
    options = FleetOptions(boot_delay_s=0.05, report_ready=False, incus_version="7")
    async with make_fleet(socket_dir, options=options) as quiet:
        host = IncusHost(IncusEndpoint(host=CPU_HOST, url=quiet.endpoints[CPU_HOST]))
        await host.create_instance(spec("r1"))
        async with host.lifecycle_events() as events:
            await host.start_instance("r1")
            assert await actions(events, 2) == ["instance-started", "instance-agent-started"]
            assert await quiet_for(events, 0.2)
        view = await host.get_instance("r1")
        assert view is not None and view.status_code == 103
        await host.aclose()


async def test_a_boot_that_never_completes(fleet: Fleet, cpu_host: IncusHost) -> None:
    fleet.host(CPU_HOST).fail_next("boot", name="h1")
    await cpu_host.create_instance(spec("h1"))
    async with cpu_host.lifecycle_events() as events:
        await cpu_host.start_instance("h1")
        assert await actions(events, 1) == ["instance-started"]
        assert await quiet_for(events, 0.3)  # six boot delays: no agent, never ready
    view = await cpu_host.get_instance("h1")
    assert view is not None and view.status == "Running"


# ---------------------------------------------------------------------- faults


async def test_counted_faults_then_recovery(fleet: Fleet, cpu_host: IncusHost) -> None:
    fleet.host(CPU_HOST).fail_next("create", count=2)
    for name in ("c1", "c2"):
        with pytest.raises(OperationFailed, match="simulated failure"):
            await cpu_host.create_instance(spec(name))
    await cpu_host.create_instance(spec("c3"))
    assert [i.name for i in await cpu_host.list_instances()] == ["c3"]


def _outcomes(rate_seed: int) -> list[bool]:
    from reconciler.incus.simulator.host import SimHost, SimInstance

    host = SimHost(HostShape(name="h"), seed=rate_seed)
    host.set_failure_rate("start", 0.5)
    inst = SimInstance(name="x", project="default")
    return [host._draw("start", inst) for _ in range(40)]


def test_failure_rates_are_seeded_and_repeatable() -> None:
    first, again, other = _outcomes(7), _outcomes(7), _outcomes(8)
    assert first == again and first != other
    assert 5 < sum(first) < 35


def test_fault_arguments_are_checked() -> None:
    from reconciler.incus.simulator.host import SimHost

    host = SimHost(HostShape(name="h"))
    with pytest.raises(ValueError, match="unknown fault"):
        host.fail_next("explode")
    with pytest.raises(ValueError, match="within"):
        host.set_failure_rate("start", 1.5)


# ---------------------------------------------------------------------- control surface


async def sim(http: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
    async with http.request(method, f"/_sim{path}", json=body) as response:
        answer = await response.json()
    assert response.status == 200 and answer["ok"], answer
    return answer["result"]


async def test_http_controls_mirror_the_python_ones(
    fleet: Fleet, http: aiohttp.ClientSession, cpu_host: IncusHost
) -> None:
    async with cpu_host.lifecycle_events() as events:
        added = await sim(
            http,
            "POST",
            "/instances",
            {"name": "f1", "project": "ci", "status": "Running", "silent": False},
        )
        assert added == {"name": "f1", "project": "ci", "status": "Running"}
        assert await actions(events, 1) == ["instance-created"]
        await sim(http, "POST", "/instances/f1/poweroff", {"project": "ci"})
        assert await actions(events, 1) == ["instance-shutdown"]
        await sim(http, "POST", "/instances/f1/status", {"project": "ci", "status": "Error"})
        assert await sim(http, "POST", "/instances/f1/remove", {"project": "ci"}) is True
        assert await quiet_for(events, 0.2)  # status change and removal were silent
    state = await sim(http, "GET", "/state")
    assert state["name"] == CPU_HOST and state["instances"] == []
    assert state["fingerprint"] == host_tls(CPU_HOST).fingerprint


async def test_http_faults_boot_delay_resources_projects(
    fleet: Fleet, http: aiohttp.ClientSession, cpu_host: IncusHost
) -> None:
    faults = await sim(http, "POST", "/faults", {"kind": "start", "count": 1})
    assert faults["counted"]["start"] == 1
    faults = await sim(http, "POST", "/faults", {"kind": "boot", "rate": 0.25})
    assert faults["rates"]["boot"] == 0.25
    await sim(http, "DELETE", "/faults")
    assert fleet.host(CPU_HOST).faults.counted["start"] == 0
    timing = await sim(http, "POST", "/boot-delay", {"seconds": 0.5})
    assert timing["boot_delay_s"] == 0.5
    shape = await sim(
        http,
        "POST",
        "/resources",
        {
            "cpu": 8,
            "gpus": [
                {"pci_address": "0000:05:00.0", "model": "NVIDIA L4", "product": "AD104GL [L4]"}
            ],
        },
    )
    assert shape["cpu"] == 8
    found = await cpu_host.resources()
    assert found.cpu == 8 and [(g.model, g.memory_mib) for g in found.gpus] == [
        ("NVIDIA L4", 23034)
    ]
    assert await sim(http, "POST", "/projects", {"name": "garm-project"}) == [
        "ci",
        "default",
        "garm-project",
    ]


async def test_http_control_errors(http: aiohttp.ClientSession) -> None:
    async with http.post("/_sim/instances/ghost/status", json={"status": "Running"}) as response:
        assert response.status == 404 and not (await response.json())["ok"]
    async with http.post("/_sim/faults", json={"kind": "explode"}) as response:
        assert response.status == 400
    async with http.post("/_sim/boot-delay", data=b"[1]") as response:
        assert response.status == 400


async def test_drop_event_streams_over_http(
    http: aiohttp.ClientSession, cpu_host: IncusHost
) -> None:
    async with cpu_host.lifecycle_events() as events:
        await anyio.sleep(0.05)
        assert await sim(http, "POST", "/events/drop", {}) == 1
        with pytest.raises(Exception, match="closed by the server"), anyio.fail_after(2):
            await events.__anext__()


def test_controls_from_another_thread(sim_thread: SimulatorThread) -> None:
    host = sim_thread.host(GPU_HOST)
    sim_thread.call(lambda: host.add_instance("t1", status="Stopped"))
    client = Client(endpoint=sim_thread.endpoints[GPU_HOST])
    try:
        assert client.instances.exists("t1")
        assert sim_thread.call(lambda: host.remove_instance("t1")) is True
        assert not client.instances.exists("t1")
        assert sim_thread.call(host.drop_event_streams) == 0
    finally:
        client.api.session.close()


# ---------------------------------------------------------------------- shapes, listening


def test_default_fleet_shapes() -> None:
    shapes = default_fleet(8)
    assert [s.name for s in shapes] == [f"host-0{i}" for i in range(1, 9)]
    gpu_hosts = [s for s in shapes if s.gpus]
    assert [s.name for s in gpu_hosts] == ["host-04", "host-08"]
    assert all(len(s.gpus) == 4 and {g.numa_node for g in s.gpus} == {0, 1} for s in gpu_hosts)
    assert all(shape_from_json(shape_to_json(s)) == s for s in shapes)
    assert host_tls("host-01") == host_tls("host-01")
    assert host_tls("host-01").fingerprint != host_tls("host-02").fingerprint
    with pytest.raises(ValueError, match="unknown host shape keys"):
        shape_from_json({"name": "x", "cpus": 4})
    with pytest.raises(ValueError, match="duplicate host name"):
        fleet_from_json({"hosts": [{"name": "a"}, {"name": "a"}]})


async def test_tcp_listening_on_consecutive_ports(socket_dir: Path) -> None:
    probe = Fleet(default_fleet(1), listen=Listen.parse("tcp:127.0.0.1:0"))
    async with probe:
        base = int(probe.endpoints["host-01"].rsplit(":", 1)[1])
    fleet = Fleet(
        default_fleet(3),
        listen=Listen.parse(f"tcp:127.0.0.1:{base}"),
        fleet_file=socket_dir / "tcp.json",
    )
    try:
        async with fleet:
            assert fleet.endpoints == {
                f"host-0{i}": f"http://127.0.0.1:{base + i - 1}" for i in (1, 2, 3)
            }
            listed = read_fleet_file(socket_dir / "tcp.json")
            assert {name: entry["url"] for name, entry in listed.items()} == fleet.endpoints
            host = IncusHost(IncusEndpoint(host="host-03", url=fleet.endpoints["host-03"]))
            assert (await host.server_info()).server_name == "host-03"
            await host.aclose()
    except OSError as exc:  # another process took one of the ports meanwhile
        pytest.skip(f"consecutive ports not free: {exc}")
    with pytest.raises(ValueError, match="unix:DIR or tcp:HOST:PORT"):
        Listen.parse("udp:1")


async def test_the_fleet_file_lists_every_host(fleet: Fleet, socket_dir: Path) -> None:
    listed = read_fleet_file(socket_dir / "fleet.json")
    assert sorted(listed) == ["host-01", "host-02", "host-03", "host-04"]
    entry = listed[GPU_HOST]
    assert entry["url"] == fleet.endpoints[GPU_HOST]
    assert entry["socket"] == str(socket_dir / f"{GPU_HOST}.socket")
    assert entry["fingerprint"] == host_tls(GPU_HOST).fingerprint
    assert len(entry["shape"]["gpus"]) == 4


async def test_stop_removes_sockets_and_the_fleet_file(socket_dir: Path) -> None:
    async with make_fleet(socket_dir, hosts=2):
        assert sorted(p.name for p in os.scandir(socket_dir)) == [
            "fleet.json",
            "host-01.socket",
            "host-02.socket",
        ]
    assert list(os.scandir(socket_dir)) == []


def test_sim_incus_runs_as_a_subprocess(socket_dir: Path) -> None:
    fleet_file = socket_dir / "fleet.json"
    description = socket_dir / "describe.json"
    description.write_bytes(
        orjson.dumps(
            {
                "hosts": [
                    {"name": "alpha", "cpu": 16, "projects": ["garm-project"]},
                    {"name": "beta", "gpus": [{"pci_address": "0000:3b:00.0"}]},
                ]
            }
        )
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reconciler.cli.main",
            "sim-incus",
            "--listen",
            f"unix:{socket_dir}",
            "--fleet",
            str(description),
            "--fleet-file",
            str(fleet_file),
            "--boot-delay",
            "0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": ""},
    )
    try:
        deadline = time.monotonic() + 20
        while not fleet_file.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no fleet file"
            time.sleep(0.05)
        hosts = read_fleet_file(fleet_file)
        client = Client(endpoint=hosts["beta"]["url"])
        try:
            assert client.resources["gpu"]["total"] == 1
            assert [p.name for p in client.projects.all()] == ["default"]
        finally:
            client.api.session.close()
        process.send_signal(signal.SIGTERM)
        stdout, _ = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0
    listed = [line for line in stdout.decode().splitlines() if line.startswith(("alpha", "beta"))]
    assert listed == [f"{n} {hosts[n]['url']}" for n in ("alpha", "beta")]
    assert list(socket_dir.iterdir()) == [description]
