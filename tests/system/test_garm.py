"""The GARM provider end to end on a simulated fleet: ``reconciler run``, the bridge and
the executor over a real nats-server and real pylxd, and the provider run as GARM runs
it (a process per call, a bare environment, GARM's JSON)."""

from __future__ import annotations

import base64
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.core.model import PoolName
from reconciler.incus.simulator import Fleet
from reconciler.replica.replica import Replica
from tests.support import builders as b
from tests.support.bus import BusClient
from tests.support.garm import (
    CA_PEM,
    CONTROLLER,
    GARM_POOL,
    GARM_PROXY_ENV,
    MARKER,
    TOKEN,
    Call,
    Garm,
    bootstrap,
    install_template,
    write_config,
)
from tests.support.natsserver import NatsServer
from tests.support.simfleet import endpoints, sim_fleet
from tests.system.test_e2e_simulated import system_on, until

pytestmark = pytest.mark.timeout(180)

#: the provider's processes load the machine: a longer leader lease than the tests' 2 s
#: keeps a starved replica from stepping down midway (see the final report)
LEADER_TTL_S = 15.0


def whole_system(
    nats_url: str, tmp_path: Path, fleet: Fleet, bus: BusClient
) -> contextlib.AbstractAsyncContextManager[Replica]:
    return system_on(nats_url, tmp_path, endpoints(fleet), bus, leader_ttl_s=LEADER_TTL_S)


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


def ready(w: World, pool: str) -> int:
    assert w.replica.pipeline is not None
    return len(w.replica.pipeline.state.pool_ready.get(PoolName(pool), ()))


async def leases(bus: BusClient, pool: str | None = None) -> list[dict[str, Any]]:
    reply = await bus.query("pool", {} if pool is None else {"pool": pool})
    assert reply["ok"], reply
    found: list[dict[str, Any]] = reply["result"]["leases"]
    return found


def queue_wait(seconds: int) -> str:
    """The provider's config lines for a create that waits ``seconds`` in the queue
    (``bootstrap_timeout - boot_time``; 0: refused at once, as before queues)."""
    return f"bootstrap_timeout = {300 + seconds}\nboot_time = 300"


@contextlib.asynccontextmanager
async def world(
    nc: Client,
    nats_url: str,
    tmp_path: Path,
    *,
    hosts: int = 1,
    wait_s: int = 0,
    tables: str = "",
    **pools: Any,
) -> AsyncIterator[World]:
    """The system with ``pools`` (any config items) and the provider's config, whose
    create waits ``wait_s`` in the queue; ``tables``: more TOML tables for it."""
    bus = BusClient(nc)
    async with sim_fleet(hosts) as fleet, whole_system(nats_url, tmp_path, fleet, bus) as replica:
        for item in pools.values():
            await bus.send(item)
        config = write_config(
            tmp_path / "garm-provider.toml",
            nats_url=nats_url,
            hosts=fleet.endpoints,
            pools={"small": COLD, "warm": WARM, "big": "ci-big"},
            extra=queue_wait(wait_s) + "\n" + tables,
        )
        yield World(fleet, bus, Garm(config), replica)


@contextlib.asynccontextmanager
async def decided(nc: Client, request_id: str) -> AsyncIterator[anyio.Event]:
    """An event set when a decision for ``request_id`` is published (a core NATS
    subscription: lighter than reading the stream back on a loaded machine)."""
    seen = anyio.Event()

    async def on_message(_msg: Any) -> None:
        seen.set()

    sub = await nc.subscribe(f"rc.out.decision.{request_id}", cb=on_message)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


def provider_seconds(call: Call) -> float:
    """A call's time from its NATS connection to its last log line: the provider's own
    work, without the interpreter's start-up (which dominates on a loaded machine)."""
    stamps = [
        datetime.fromisoformat(orjson.loads(line)["timestamp"])
        for line in call.stderr.splitlines()
        if line.startswith(b"{")
    ]
    return (stamps[-1] - stamps[0]).total_seconds()


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
        # GARM records addresses from the create's answer only: it waited for one
        (address,) = answer["addresses"]
        assert address["type"] == "public" and address["address"].startswith("10.42.0.")
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
        assert listed.json()[0]["addresses"] == answer["addresses"]
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
        await until("a warm VM is ready", lambda: ready(w, WARM) == 1)
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
        (prepare, _), (command, _env) = inst.executed
        assert prepare[:2] == ["mkdir", "-p"] and "/usr/local/share/ca-certificates" in prepare
        assert command[:2] == ["/bin/sh", "-c"] and TOKEN not in command[2]
        lease = next(le for le in await leases(w.bus, WARM) if le["instance"] == vm)
        assert lease["state"] == "injected" and lease["job"] == "garm-warm-1"

        again = await w.garm.create(bootstrap("garm-warm-1", "warm"))  # run again: no-op
        assert again.code == 0 and again.json() == answer and len(inst.executed) == 2

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
        await until("two warm VMs ready", lambda: ready(w, WARM) == 2)
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


@pytest.mark.parametrize("kill_at", ["admission", "instance"])
async def test_a_create_killed_midway_and_retried_resumes_its_attempt(
    nc: Client, nats_url: str, tmp_path: Path, kill_at: str
) -> None:
    async with world(nc, nats_url, tmp_path, cold=cold_pool()) as w:
        body = bootstrap("garm-kill-1", "small")

        async with decided(nc, "garm-admit-1-garm-kill-1") as admission:

            async def admission_decided() -> None:
                await admission.wait()

            async def instance_exists() -> None:
                await until("the instance exists", lambda: "garm-kill-1" in instances(w.fleet), 60)

            when = admission_decided if kill_at == "admission" else instance_exists
            assert await w.garm.create_killed(body, when=when) is None
        again = await w.garm.create(body)
        assert again.code == 0, again.text
        assert again.json()["provider_id"] == "garm-kill-1"
        (lease,) = await leases(w.bus)
        assert lease["state"] == "created" and lease["job"] == "garm-kill-1"
        admissions = {
            m.json()["request_id"] for m in await w.bus.inputs("rc.in.cmd.admit-preemptible")
        }
        assert admissions == {"garm-admit-1-garm-kill-1"}  # resumed, not admitted twice
        assert list(instances(w.fleet)) == ["garm-kill-1"]
        assert (await w.garm.delete("garm-kill-1")).code == 0
        assert instances(w.fleet) == {} and await leases(w.bus) == []


async def test_list_after_a_restart_of_everything(
    nc: Client, nats_url: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    warm = b.pool(WARM, cpu=2, memory_mib=2048, disk_gib=10, min_ready=1, max_ready=1)
    async with sim_fleet(1) as fleet:
        config = write_config(
            tmp_path / "garm-provider.toml",
            nats_url=nats_url,
            hosts=fleet.endpoints,
            pools={"small": COLD, "warm": WARM},
            extra=queue_wait(0),
        )
        garm = Garm(config)
        async with whole_system(nats_url, tmp_path, fleet, bus) as replica:
            await bus.send(cold_pool(), warm)
            w = World(fleet, bus, garm, replica)
            await until("a warm VM is ready", lambda: ready(w, WARM) == 1)
            assert (await garm.create(bootstrap("garm-a-1", "small"))).code == 0
            assert (await garm.create(bootstrap("garm-b-1", "warm"))).code == 0
            before = sorted((i["name"], i["provider_id"]) for i in (await garm.list()).json())
        nats_server.restart()
        (tmp_path / "again").mkdir()
        async with whole_system(nats_url, tmp_path / "again", fleet, bus):
            listed = await garm.list()
            assert listed.code == 0, listed.text
            after = sorted((i["name"], i["provider_id"]) for i in listed.json())
            assert after == before and [n for n, _ in after] == ["garm-a-1", "garm-b-1"]
            assert all(i["status"] == "running" for i in listed.json())
            for name in ("garm-a-1", "garm-b-1"):
                assert (await garm.delete(name)).code == 0
            assert {le["job"] for le in await leases(bus) if "job" in le} == set()


async def test_twenty_concurrent_creates_on_a_two_host_fleet(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """GARM starts one process per runner, all at once: admission is the judge. Three
    of them are SIGKILLed once admission answered, and retried."""
    capacity = 32  # vCPUs per simulated host; a runner takes 4: 16 fit on two hosts
    async with world(nc, nats_url, tmp_path, hosts=2, cold=cold_pool(cpu=4)) as w:
        names = [f"garm-burst-{i:02d}" for i in range(20)]
        killed = set(names[:3])
        calls: dict[str, Call] = {}
        started = time.monotonic()

        async def one(name: str) -> None:
            body = bootstrap(name, "small")
            if name in killed:
                async with decided(nc, f"garm-admit-1-{name}") as admission:
                    first = await w.garm.create_killed(body, when=admission.wait)
                if first is None:  # killed: GARM retries the same name
                    calls[name] = await w.garm.create(body)
                    return
            calls[name] = await w.garm.create(body)

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(one, name)
        burst = time.monotonic() - started
        admitted = sorted(n for n, c in calls.items() if c.code == 0)
        rejected = sorted(n for n, c in calls.items() if c.code != 0)
        assert all("insufficient-capacity" in calls[n].text for n in rejected), [
            calls[n].text[-300:] for n in rejected
        ]
        assert len(admitted) == 16 and len(rejected) == 4
        per_host = {
            host: sum(int(i.config["limits.cpu"]) for i in w.fleet.host(host).instances.values())
            for host in sorted(w.fleet.endpoints)
        }
        assert all(cpu <= capacity for cpu in per_host.values()), per_host
        assert sorted(instances(w.fleet)) == admitted
        listed = await w.garm.list()
        assert sorted(i["name"] for i in listed.json()) == admitted

        async with anyio.create_task_group() as tg:  # GARM deletes them all, by name
            for name in names:
                tg.start_soon(w.garm.delete, name)
        assert instances(w.fleet) == {}
        left = await leases(w.bus)
        assert left == [], left
        assert w.replica.pipeline is not None
        state = w.replica.pipeline.state
        assert all(not le.active for le in state.leases.values())
        assert all(not booked or booked == [0, 0, 0] for booked in state.booked.values())

        secrets = (TOKEN.encode(), CA_PEM, CA_PEM.split(b"\n")[1])
        messages = [*await w.bus.inputs(), *await w.bus.outputs()]
        assert messages and not [m.subject for m in messages if any(s in m.data for s in secrets)]
        times = sorted(calls[n].seconds for n in admitted)
        own = sorted(provider_seconds(calls[n]) for n in admitted)
        print(
            f"\nGARM burst: 20 creates ({len(killed)} killed and retried) in {burst:.2f} s: "
            f"{len(admitted)} admitted, {len(rejected)} rejected for capacity; "
            f"admitted create median {statistics.median(times):.2f} s, max {times[-1]:.2f} s "
            f"(after start-up, from NATS connected to exit: median "
            f"{statistics.median(own):.2f} s, max {own[-1]:.2f} s); "
            f"vCPU per host {per_host} of {capacity}; "
            f"after deletes: {len(instances(w.fleet))} instances, {len(left)} leases; "
            f"{len(messages)} bus messages, none with the token or CA bundle"
        )


async def test_interface_v011_as_garm_calls_it_and_remove_all_is_controller_wide(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """GARM v0.1.1 adds GARM_POOL_ID and GARM_POOL_EXTRASPECS (its wrapper, with the
    instance token) to every instance command, and always a pool id to
    RemoveAllInstances; GARM passes its proxy variables through. The token reaches no
    answer, no log line and no bus message, failures included."""
    async with world(nc, nats_url, tmp_path, cold=cold_pool(cpu=10)) as w:  # 3 fit
        garm = Garm(w.garm.config, interface_version="v0.1.1", passed=GARM_PROXY_ENV)
        other = Garm(w.garm.config, controller="9f0c4a52-0d7e-4a8e-b1e2-3c4d5e6f7a8b")
        calls = [
            await garm.create(bootstrap("garm-v11-a", "small", pool_id="pool-a")),
            await garm.create(bootstrap("garm-v11-b", "small", pool_id="pool-b")),
            await other.create(bootstrap("garm-other-1", "small")),
        ]
        assert [c.code for c in calls] == [0, 0, 0], [c.text for c in calls]
        refused = await garm.create(bootstrap("garm-v11-c", "small", pool_id="pool-a"))
        assert refused.code == 1 and "insufficient-capacity" in refused.text
        broken = bootstrap("garm-v11-d", "small", pool_id="pool-a")
        broken["extra_specs"]["runner_install_template"] = base64.b64encode(
            f"#!/bin/sh\n# {TOKEN}\n{{{{ .CallbackToken | nope }}}}\n".encode()
        ).decode()
        failed = await garm.create(broken)
        assert failed.code == 1 and "function 'nope' is not defined" in failed.text
        got = await garm.get("garm-v11-a")
        assert got.code == 0 and got.json()["name"] == "garm-v11-a"
        listed = await garm.list("pool-a")
        assert listed.code == 0 and [i["name"] for i in listed.json()] == ["garm-v11-a"]
        calls += [refused, failed, got, listed]

        removed = await garm.remove_all("pool-a")  # GARM names a pool; all of ours go
        assert removed.code == 0, removed.text
        assert sorted(instances(w.fleet)) == ["garm-other-1"]
        assert [le["instance"] for le in await leases(w.bus)] == ["garm-other-1"]
        gone = await garm.delete("garm-v11-b")
        assert gone.code == 0, gone.text
        calls += [removed, gone]

        assert not [c.text for c in calls if TOKEN in c.text]
        messages = [*await w.bus.inputs(), *await w.bus.outputs()]
        assert not [m.subject for m in messages if TOKEN.encode() in m.data]
