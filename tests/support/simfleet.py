"""A simulated Incus fleet for the bus-level tests (bridge, executor, end to end).

The fleet runs on the test's event loop, on unix sockets in a short temporary directory
(AF_UNIX paths are limited to 107 bytes; pytest's ``tmp_path`` can be longer), with
short timings. The pylxd adapter calls it from worker threads, as in production.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from reconciler.incus.client import IncusEndpoint
from reconciler.incus.simulator import Fleet, FleetOptions, Listen, default_fleet

FAST = FleetOptions(boot_delay_s=0.1, operation_retention_s=1.0, ping_interval_s=0.5)
#: in the default fleet every 4th host has 4 GPUs on 2 NUMA nodes
GPU_HOST = "host-04"


@contextlib.asynccontextmanager
async def sim_fleet(
    hosts: int = 4, *, projects: tuple[str, ...] = ("ci",), options: FleetOptions = FAST
) -> AsyncIterator[Fleet]:
    directory = Path(tempfile.mkdtemp(prefix="sim-"))
    try:
        async with Fleet(
            default_fleet(hosts, projects=projects),
            listen=Listen(kind="unix", directory=directory),
            options=options,
            fleet_file=directory / "fleet.json",
        ) as fleet:
            yield fleet
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def endpoints(fleet: Fleet) -> tuple[IncusEndpoint, ...]:
    return tuple(IncusEndpoint(host=name, url=url) for name, url in sorted(fleet.endpoints.items()))
