"""GARM's creates wait their turn (issue 26): the provider run as GARM runs it, on a
simulated fleet with ``reconciler run`` over a real nats-server. Creates beyond the
fleet's capacity wait in the queue and are admitted, in order, as earlier runners are
deleted; a runner deleted while it waits is cancelled and never created; a create
killed while it waits finds its place again."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

from tests.support import builders as b
from tests.support.garm import TOKEN, Call, bootstrap
from tests.system.test_e2e_simulated import until
from tests.system.test_garm import COLD, World, cold_pool, instances, leases, world

pytestmark = pytest.mark.timeout(420)

#: a host of the simulated fleet has 32 vCPUs: four runners of 8 fill it
CAPACITY = 4
WAITING = 10
#: the provider's wait (``bootstrap_timeout - boot_time``): longer than the test needs
WAIT_S = 300


@dataclass
class Seen:
    """Decisions of the runners' admissions as they arrive (a core NATS subscription):
    the first ``queued`` one and the final one, each with when it was seen."""

    queued: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    final: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)

    def on(self, decision: dict[str, Any]) -> None:
        rid, now = str(decision["request_id"]), time.monotonic()
        if decision["outcome"] == "queued":
            self.queued.setdefault(rid, (now, decision))
        elif decision["phase"] == "final" and rid not in self.final:
            self.final[rid] = (now, decision)
            if decision["outcome"] == "admitted":
                self.admitted.append(rid)


@contextlib.asynccontextmanager
async def watching(nc: Client) -> AsyncIterator[Seen]:
    seen = Seen()

    async def on_message(msg: Any) -> None:
        decision = orjson.loads(msg.data)
        if str(decision["request_id"]).startswith("garm-admit-"):
            seen.on(decision)

    sub = await nc.subscribe("rc.out.decision.*", cb=on_message)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


def admit_id(runner: str) -> str:
    return f"garm-admit-1-{runner}"


async def waiting(w: World) -> list[dict[str, Any]]:
    reply = await w.bus.query("queue", {"pool": COLD})
    assert reply["ok"], reply
    found: list[dict[str, Any]] = reply["result"]["requests"]
    return found


async def test_creates_beyond_capacity_wait_and_are_admitted_as_runners_are_deleted(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    names = [f"garm-q-{i:02d}" for i in range(CAPACITY + WAITING)]
    first, queued = names[:CAPACITY], names[CAPACITY:]
    killed, cancelled = queued[2], queued[5]
    calls: dict[str, Call] = {}
    retried = anyio.Event()
    freed_by: dict[str, str] = {}  # runner admitted -> the runner whose deletion did it
    async with world(nc, nats_url, tmp_path, wait_s=WAIT_S, cold=cold_pool(cpu=8)) as w:
        for name in first:  # the fleet is full
            created = await w.garm.create(bootstrap(name, "small"))
            assert created.code == 0, created.text
            calls[name] = created
        running = list(first)

        async def create(name: str) -> None:
            body = bootstrap(name, "small")
            if name == killed:  # GARM's exec timeout kills it while it waits
                queued_seen = anyio.Event()

                async def on_queued(_msg: Any) -> None:
                    queued_seen.set()

                sub = await nc.subscribe(f"rc.out.decision.{admit_id(name)}", cb=on_queued)
                try:
                    assert await w.garm.create_killed(body, when=queued_seen.wait) is None
                finally:
                    await sub.unsubscribe()
                retried.set()
            calls[name] = await w.garm.create(body)  # (the retry, with the same name)

        async with watching(nc) as seen, anyio.create_task_group() as tg:
            for name in queued:
                tg.start_soon(create, name)
            await until(
                f"{WAITING} creates wait",
                lambda: len(seen.queued) == WAITING and retried.is_set(),
                120,
            )
            line = [r["instance"] for r in await waiting(w)]
            assert sorted(line) == sorted(queued), line

            # GARM deletes a runner still waiting: cancelled, never created
            deleted = await w.garm.delete(cancelled)
            assert deleted.code == 0, deleted.text
            await until("the cancelled create ends", lambda: cancelled in calls, 60)

            # each deletion of an earlier runner admits the next one in line
            while len(seen.final) < WAITING:
                ended = len(seen.final)
                earlier = running.pop(0)
                gone = await w.garm.delete(earlier)
                assert gone.code == 0, gone.text
                await until("the next one is admitted", lambda n=ended: len(seen.final) > n, 60)
                running.append(seen.admitted[-1].removeprefix("garm-admit-1-"))
                freed_by[running[-1]] = earlier
                await until("its create ends", lambda: running[-1] in calls, 60)
        assert sorted(instances(w.fleet)) == sorted(running)

        # the table the issue asks for
        print(f"\nGARM queue: {CAPACITY} runners fill the fleet, {WAITING} more wait")
        print(
            f"{'call':>4}  {'runner':<10} {'position':>8} {'waited s':>8}  "
            f"{'admitted when deleted':<21}  outcome"
        )
        calls_in_line = sorted(
            enumerate(queued, start=CAPACITY + 1),
            key=lambda nn: seen.queued[admit_id(nn[1])][1]["position"],
        )
        for number, name in calls_in_line:  # in the order they queued
            at, pending = seen.queued[admit_id(name)]
            ended_at, final = seen.final[admit_id(name)]
            outcome = final["outcome"] + (f" ({final['reason']})" if final.get("reason") else "")
            note = ", killed while waiting and retried" if name == killed else ""
            print(
                f"{number:>4}  {name:<10} {pending['position']:>8} {ended_at - at:>8.1f}  "
                f"{freed_by.get(name, '-'):<21}  {outcome}, exit {calls[name].code}{note}"
            )
        (queued_line,) = [
            line
            for line in calls[queued[0]].stderr.decode().splitlines()
            if '"garm.queued"' in line
        ]
        print(f"its log line while it waited: {queued_line}")

        # every waiting create ended with one final decision; the cancelled one never ran
        finals = {n: seen.final[admit_id(n)][1] for n in queued}
        assert finals[cancelled]["outcome"] == "rejected"
        assert finals[cancelled]["reason"] == "cancelled"
        assert calls[cancelled].code == 1 and "cancelled" in calls[cancelled].text
        assert cancelled not in instances(w.fleet)
        others = [n for n in queued if n != cancelled]
        assert all(finals[n]["outcome"] == "admitted" for n in others), finals
        assert all(calls[n].code == 0 for n in others), [calls[n].text[-300:] for n in others]
        # admitted in the order they queued (their position when they queued)
        order = sorted(others, key=lambda n: seen.queued[admit_id(n)][1]["position"])
        assert [r.removeprefix("garm-admit-1-") for r in seen.admitted] == order
        # the killed create's retry found its request: one admission sent, not two
        sent = await w.bus.inputs("rc.in.cmd.admit-preemptible")
        assert [m.json()["request_id"] for m in sent].count(admit_id(killed)) == 1
        assert all(m.json().get("wait_s") == WAIT_S for m in sent)

        for name in running:
            assert (await w.garm.delete(name)).code == 0
        assert instances(w.fleet) == {} and await leases(w.bus) == []
        assert await waiting(w) == []
        texts = [c.text for c in calls.values()]
        messages = [*await w.bus.inputs(), *await w.bus.outputs()]
        assert not [t for t in texts if TOKEN in t]
        assert not [m.subject for m in messages if TOKEN.encode() in m.data]


def tenant(name: str, pool: str) -> dict[str, Any]:
    """A tenant of one pool that may run one instance."""
    return {"v": 1, "tenant": name, "pools": [pool], "quota": {"instances": 1}}


async def test_a_garm_pool_waits_under_its_tenants_quota_config_first(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """GARM pool ``pool-a`` maps to reconciler pool ``ci-a`` (tenant ``org-a``) through the
    provider's ``[garm_pools]``, which wins over the extra specs; ``pool-b`` maps to
    ``ci-b`` (tenant ``org-b``) through its extra specs. Each tenant may run one runner:
    a second one of ``org-a`` waits for ``tenant-quota`` and is admitted when the first
    is deleted, while ``org-b``'s runs beside it."""
    tables = '[garm_pools]\n"pool-a" = "ci-a"'
    async with world(
        nc,
        nats_url,
        tmp_path,
        wait_s=WAIT_S,
        tables=tables,
        a=b.pool("ci-a", cpu=4, memory_mib=2048, disk_gib=10),
        b=b.pool("ci-b", cpu=4, memory_mib=2048, disk_gib=10),
    ) as w:
        for name, pool in (("org-a", "ci-a"), ("org-b", "ci-b")):
            await w.bus.send_raw(f"rc.in.config.tenant.{name}", orjson.dumps(tenant(name, pool)))

        def runner(name: str, garm_pool: str, named: str) -> dict[str, Any]:
            body = bootstrap(name, "small", pool_id=garm_pool)
            body["extra_specs"]["reconciler_pool"] = named
            return body

        first = await w.garm.create(runner("garm-ta-1", "pool-a", "ci-b"))  # config wins
        other = await w.garm.create(runner("garm-tb-1", "pool-b", "ci-b"))
        assert first.code == 0 and other.code == 0, (first.text, other.text)
        by_pool = {le["instance"]: le["pool"] for le in await leases(w.bus)}
        assert by_pool == {"garm-ta-1": "ci-a", "garm-tb-1": "ci-b"}
        assert '"pool_from":"garm_pools"' in first.stderr.decode()
        assert '"pool_from":"extra_specs"' in other.stderr.decode()

        calls: dict[str, Call] = {}

        async def second() -> None:
            calls["garm-ta-2"] = await w.garm.create(runner("garm-ta-2", "pool-a", "ci-b"))

        queued = anyio.Event()

        async def on_decision(_msg: Any) -> None:
            queued.set()

        sub = await nc.subscribe(f"rc.out.decision.{admit_id('garm-ta-2')}", cb=on_decision)
        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            with anyio.fail_after(60):
                await queued.wait()
            await sub.unsubscribe()
            reply = await w.bus.query("queue", {"tenant": "org-a"})
            (entry,) = reply["result"]["requests"]
            assert (entry["instance"], entry["pool"], entry["tenant"]) == (
                "garm-ta-2",
                "ci-a",
                "org-a",
            )
            assert entry["reason"] == "tenant-quota" and entry["position"] == 1
            assert (await w.garm.delete("garm-ta-1")).code == 0
        assert calls["garm-ta-2"].code == 0, calls["garm-ta-2"].text
        by_pool = {le["instance"]: le["pool"] for le in await leases(w.bus)}
        assert by_pool == {"garm-ta-2": "ci-a", "garm-tb-1": "ci-b"}
        for name in by_pool:
            assert (await w.garm.delete(name)).code == 0
        assert instances(w.fleet) == {}
