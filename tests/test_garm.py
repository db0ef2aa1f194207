"""The GARM provider end to end on a simulated fleet: ``reconciler run``, the bridge and
the executor over a real nats-server and real pylxd, and the provider run as GARM runs
it (a process per call, a bare environment, GARM's JSON)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    Garm,
    bootstrap,
    install_template,
    write_config,
)
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
    return next(
        h for h in sorted(fleet.endpoints) if any(n == name for _, n in fleet.host(h).instances)
    )


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
        assert (
            user_data.startswith("#cloud-config\n") and install_template("garm-cold-1") in user_data
        )
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


async def test_a_warm_claim_injects_the_bootstrap_and_delete_by_runner_name(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    warm = b.pool(WARM, cpu=2, memory_mib=2048, disk_gib=10, min_ready=1, max_ready=1)
    async with world(nc, nats_url, tmp_path, warm=warm) as w:
        await until(
            "a warm VM is ready", lambda: len(w.replica.caches.state.pool_ready.get(WARM, ())) == 1
        )  # type: ignore[union-attr]
        (vm,) = instances(w.fleet)
        created = await w.garm.create(bootstrap("garm-warm-1", "warm"))
        assert created.code == 0, created.text
        answer = created.json()
        assert answer["name"] == "garm-warm-1" and answer["provider_id"] == vm
        inst = instances(w.fleet)[vm]
        assert inst.config["user.runner-name"] == "garm-warm-1"
        assert inst.config["user.runner-controller-id"] == CONTROLLER
        script, mode = inst.files["/install_runner.sh"]
        assert mode == 0o755 and MARKER.encode() in script and TOKEN.encode() in script
        assert inst.files["/usr/local/share/ca-certificates/garm-ca-bundle.crt"][0] == CA_PEM
        ((command, _env),) = inst.executed
        assert command[:2] == ["/bin/sh", "-c"] and TOKEN not in command[2]
        lease = next(le for le in await leases(w.bus, WARM) if le["instance"] == vm)
        assert lease["state"] == "injected" and lease["job"] == "garm-warm-1"

        listed = (await w.garm.list()).json()
        assert {(i["name"], i["provider_id"]) for i in listed} == {("garm-warm-1", vm)}
        assert (await w.garm.get("garm-warm-1")).json()["provider_id"] == vm

        # GARM deletes by runner name when it has no provider id
        deleted = await w.garm.delete("garm-warm-1")
        assert deleted.code == 0, deleted.text
        assert vm not in instances(w.fleet)
        assert all(le["instance"] != vm for le in await leases(w.bus))
        assert (await w.garm.delete("garm-warm-1")).code == 0


async def test_a_preemption_waits_for_its_victim_then_creates(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    # host-01 has 32 vCPUs: two warm VMs of 10 leave 12, a cold runner of 20 needs one
    warm = b.pool(WARM, cpu=10, memory_mib=4096, disk_gib=10, min_ready=2, max_ready=2)
    big = b.pool("ci-big", cpu=20, memory_mib=4096, disk_gib=10, priority=10)
    async with world(nc, nats_url, tmp_path, warm=warm, big=big) as w:
        await until(
            "two warm VMs ready", lambda: len(w.replica.caches.state.pool_ready.get(WARM, ())) == 2
        )  # type: ignore[union-attr]
        before = set(instances(w.fleet))
        created = await w.garm.create(bootstrap("garm-big-1", "big"))
        assert created.code == 0, created.text
        assert "garm.decision_pending" in created.stderr.decode()
        assert created.json()["provider_id"] == "garm-big-1"
        assert len(before - set(instances(w.fleet))) == 1  # one victim deleted first
        (lease,) = await leases(w.bus, "ci-big")
        assert lease["state"] == "created"
        assert (await w.garm.delete("garm-big-1")).code == 0


async def test_a_retry_with_the_same_name_after_a_failed_create(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with world(nc, nats_url, tmp_path, cold=cold_pool()) as w:
        w.fleet.host("host-01").fail_next("create", message="disk on fire")
        failed = await w.garm.create(bootstrap("garm-retry-1", "small"))
        assert failed.code == 1 and "disk on fire" in failed.text
        # GARM marks the runner failed, deletes it by name, and creates it again
        assert (await w.garm.delete("garm-retry-1")).code == 0
        assert await leases(w.bus) == []
        again = await w.garm.create(bootstrap("garm-retry-1", "small"))
        assert again.code == 0, again.text
        (lease,) = await leases(w.bus)
        assert lease["instance"] == "garm-retry-1" and lease["job"] == "garm-retry-1~2"
        assert lease["state"] == "created"
        # a create run again after success resumes the same attempt: nothing new
        same = await w.garm.create(bootstrap("garm-retry-1", "small"))
        assert same.code == 0 and same.json() == again.json()
        assert [le["lease_id"] for le in await leases(w.bus)] == [lease["lease_id"]]
        assert (await w.garm.delete("garm-retry-1")).code == 0


async def test_a_rejection_is_exit_1_with_its_reason(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with world(nc, nats_url, tmp_path, cold=cold_pool(cpu=20)) as w:
        assert (await w.garm.create(bootstrap("garm-first-1", "small"))).code == 0
        rejected = await w.garm.create(bootstrap("garm-second-1", "small"))
        assert rejected.code == 1 and "insufficient-capacity" in rejected.text
        assert rejected.stdout == b""  # GARM stores stdout + stderr as the fault
        unknown = await w.garm.create(bootstrap("garm-x-1", "no-such-flavor"))
        assert unknown.code == 1 and "unknown-pool" in unknown.text
        assert set(instances(w.fleet)) == {"garm-first-1"}
