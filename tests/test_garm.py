"""The GARM provider end to end on a simulated fleet: ``reconciler run``, the bridge and
the executor over a real nats-server and real pylxd, and the provider run as GARM runs
it (a process per call, a bare environment, GARM's JSON)."""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.incus.simulator import Fleet
from reconciler.replica.runtime import Replica
from tests import builders as b
from tests.bus import BusClient
from tests.garm_support import (
    CA_PEM,
    CONTROLLER,
    GARM_POOL,
    MARKER,
    TOKEN,
    Call,
    Garm,
    bootstrap,
    executable,
    install_template,
    write_config,
)
from tests.natsserver import NatsServer
from tests.simfleet import sim_fleet
from tests.test_e2e_incus import until, whole_system

pytestmark = pytest.mark.timeout(180)

COLD = "ci-cold"  # GARM flavor "small" -> reconciler pool "ci-cold"
WARM = "ci-warm"


@dataclass
class World:
    fleet: Fleet
    bus: BusClient
    garm: Garm
    replica: Replica


def instances(fleet: Fleet) -> dict[str, Any]:
    return {
        name: inst
        for host in sorted(fleet.endpoints)
        for (_, name), inst in fleet.host(host).instances.items()
    }


def host_of(fleet: Fleet, name: str) -> str:
    return next(h for h in sorted(fleet.endpoints) if any(n == name for _, n in fleet.host(h).instances))


async def leases(bus: BusClient, pool: str | None = None) -> list[dict[str, Any]]:
    reply = await bus.query("pool", {} if pool is None else {"pool": pool})
    assert reply["ok"], reply
    found: list[dict[str, Any]] = reply["result"]["leases"]
    return found


@contextlib.asynccontextmanager
async def world(
    nc: Client, nats_url: str, tmp_path: Path, *, hosts: int = 1, **pools: Any
) -> AsyncIterator[World]:
    bus = BusClient(nc)
    async with sim_fleet(hosts) as fleet, whole_system(nats_url, tmp_path, fleet, bus) as replica:
        for item in pools.values():
            await bus.send(item)
        config = write_config(
            tmp_path / "garm-provider.toml",
            nats_url=nats_url,
            hosts=fleet.endpoints,
            pools={"small": COLD, "warm": WARM, "big": "ci-big"},
        )
        yield World(fleet, bus, Garm(config), replica)


def cold_pool(cpu: int = 4) -> tuple[str, dict[str, Any]]:
    return b.pool(COLD, cpu=cpu, memory_mib=4096, disk_gib=20)


async def test_a_cold_create_is_admitted_created_listed_and_deleted_twice(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with world(nc, nats_url, tmp_path, cold=cold_pool()) as w:
        created = await w.garm.create(bootstrap("garm-cold-1", "small"))
        assert created.code == 0, created.text
        answer = created.json()
        assert answer["name"] == answer["provider_id"] == "garm-cold-1"
        assert answer["status"] == "running" and "provider_fault" not in answer
        inst = instances(w.fleet)["garm-cold-1"]
        assert inst.config["user.runner-controller-id"] == CONTROLLER
        assert inst.config["user.runner-pool-id"] == GARM_POOL
        assert inst.config["user.os-type"] == "linux" and inst.config["user.os-arch"] == "amd64"
        assert inst.config["limits.cpu"] == "4"
        user_data = inst.config["cloud-init.user-data"]
        assert user_data.startswith("#cloud-config\n") and install_template("garm-cold-1") in user_data
        (lease,) = await leases(w.bus, COLD)
        assert lease["instance"] == "garm-cold-1" and lease["job"] == "garm-cold-1"
        assert lease["state"] == "created"

        listed = await w.garm.list()
        assert listed.code == 0, listed.text
        assert [(i["name"], i["provider_id"]) for i in listed.json()] == [("garm-cold-1",) * 2]
        assert (await w.garm.list("another-pool")).json() == []
        got = await w.garm.get("garm-cold-1")
        assert got.code == 0 and got.json()["status"] == "running"

        for _ in range(2):  # delete twice: the second finds nothing and succeeds
            deleted = await w.garm.delete("garm-cold-1")
            assert deleted.code == 0, deleted.text
        assert "garm-cold-1" not in instances(w.fleet)
        assert await leases(w.bus) == []
        missing = await w.garm.get("garm-cold-1")
        assert missing.code == 30, missing.text
