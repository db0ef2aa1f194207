"""Fixtures for the Incus simulator and the pylxd adapter.

Every test gets a fresh fleet with short timings (boot 50 ms, operations kept 0.3 s,
pings every 0.2 s) on unix sockets in a short temporary directory (AF_UNIX paths are
limited to 107 bytes, pytest's ``tmp_path`` can be longer). ``sim_thread`` runs the
fleet on its own loop for blocking pylxd calls made directly from a test.

The fleet plays Incus 6.0 LTS (the simulator's default) unless the test is marked
``@pytest.mark.incus_version("7")`` or a module overrides the ``incus_version`` fixture
(``tests/incus/test_client.py`` runs every adapter test against both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import anyio
import pytest

from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.simulator import (
    DEFAULT_VERSION,
    Fleet,
    FleetOptions,
    Listen,
    SimulatorThread,
    default_fleet,
)

FAST = FleetOptions(
    boot_delay_s=0.05,
    operation_retention_s=0.3,
    ping_interval_s=0.2,
)
PROJECTS = ("ci",)
GPU_HOST = "host-04"  # every 4th default host has 4 GPUs on 2 NUMA nodes
CPU_HOST = "host-01"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "incus_version(v): the simulated Incus release, 6.0 (default) or 7"
    )


@pytest.fixture
def incus_version(request: pytest.FixtureRequest) -> str:
    """The Incus release the fleet plays (the ``incus_version`` mark, else the default)."""
    marker = request.node.get_closest_marker("incus_version")
    return str(marker.args[0]) if marker is not None else DEFAULT_VERSION


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sim-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_fleet(
    socket_dir: Path,
    *,
    options: FleetOptions = FAST,
    hosts: int = 4,
    incus_version: str | None = None,
) -> Fleet:
    if incus_version is not None:
        options = dataclasses.replace(options, incus_version=incus_version)
    return Fleet(
        default_fleet(hosts, projects=PROJECTS),
        listen=Listen(kind="unix", directory=socket_dir),
        options=options,
        fleet_file=socket_dir / "fleet.json",
    )


@pytest.fixture
async def fleet(socket_dir: Path, incus_version: str) -> AsyncIterator[Fleet]:
    """A started four-host fleet on this test's event loop."""
    async with make_fleet(socket_dir, incus_version=incus_version) as running:
        yield running


@pytest.fixture
async def gpu_host(fleet: Fleet) -> AsyncIterator[IncusHost]:
    """The adapter for the fleet's GPU host."""
    host = IncusHost(
        IncusEndpoint(host=GPU_HOST, url=fleet.endpoints[GPU_HOST]),
        request_timeout_s=5.0,
        operation_timeout_s=5.0,
    )
    try:
        yield host
    finally:
        await host.aclose()


@pytest.fixture
def sim_thread(socket_dir: Path, incus_version: str) -> Iterator[SimulatorThread]:
    """A started fleet on its own loop and thread, for blocking pylxd calls."""
    with SimulatorThread(make_fleet(socket_dir, incus_version=incus_version)) as running:
        yield running


@contextlib.asynccontextmanager
async def unix_http(fleet: Fleet, host: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw aiohttp client on ``host``'s unix socket (paths relative to the API root)."""
    socket = fleet.socket(host)
    assert socket is not None
    async with aiohttp.ClientSession(
        "http://localhost", connector=aiohttp.UnixConnector(path=str(socket))
    ) as session:
        yield session


@pytest.fixture
async def http(fleet: Fleet) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw HTTP client on the CPU host."""
    async with unix_http(fleet, CPU_HOST) as session:
        yield session


async def until_booted(fleet: Fleet, host: str, name: str, *, project: str = "default") -> None:
    """Wait (at most 5 s) until ``name`` on ``host`` runs its agent (past the boot delay)."""
    instance = fleet.host(host).instances[(project, name)]
    with anyio.fail_after(5):
        while True:  # polled: the boot timer has no event to wait on
            if instance.agent_running:
                return
            await anyio.sleep(0.01)


def wait_until(condition: Callable[[], bool], *, timeout_s: float = 5.0) -> None:
    """Poll ``condition`` from a synchronous test until it holds, or fail."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
