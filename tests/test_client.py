"""The producer's client (reconciler.client) against a real nats-server and an in-process
replica: commands awaited to their final decision, idempotently; queries asked once or
until a synced replica answers; config published with its rejections; and each failure
(no stream, no replica, no decision, an error reply) named for what it is."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.client import (
    NoDecision,
    NoReplica,
    NoStream,
    QueryFailed,
    ReconcilerClient,
)
from reconciler.core.messages import Decision, Origin
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica

pytestmark = pytest.mark.timeout(60)


def admit(request_id: str, instance: str, **fields: object) -> dict[str, object]:
    return {"v": 1, "request_id": request_id, "pool": "web", "instance": instance, **fields}


async def test_a_command_is_sent_once_and_answered_by_its_final_decision(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    client = ReconcilerClient(nc, origin=Origin.GARM)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(b.snapshot("h1", cpu=8), b.pool("web", cpu=4))
        seen: list[Decision] = []
        first = await client.command(
            "admit", admit("r1", "vm-1", kind="cold"), within_s=10, on_decision=seen.append
        )
        assert (first.verb, first.phase, first.outcome) == ("admit", "final", "admitted")
        assert first.lease is not None and first.lease.instance == "vm-1"
        assert seen == [first]
        again = await client.command("admit", admit("r1", "vm-1", kind="cold"), within_s=10)
        assert again == first == await client.last_decision("r1")
        commands = await bus.inputs("rc.in.cmd.admit")
        assert [(m.msg_id, orjson.loads(m.data)["request_id"]) for m in commands] == [
            ("garm:r1", "r1")
        ]  # the stored decision answered the second call: nothing sent again
        assert await client.last_decision("nobody") is None


async def test_a_preemption_is_waited_through_its_pending_decision(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    client = ReconcilerClient(nc, origin=Origin.DEMO)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(
            b.snapshot("h1", cpu=4, memory_mib=8192, disk_gib=40),
            b.pool("web", cpu=4, memory_mib=8192, disk_gib=40, max_ready=1),
            b.admit("w1", "web", "warm-1", kind="warm"),
            b.lifecycle("h1", "instance-ready", "warm-1"),
        )
        await bus.wait_caught_up()
        payload = admit("cold", "cold-1", kind="cold")
        pending = await client.command("admit-preemptible", payload, within_s=10, first=True)
        assert (pending.phase, pending.outcome) == ("pending", "pending")
        assert pending.victims is not None and [v.instance for v in pending.victims] == ["warm-1"]
        seen: list[Decision] = []
        async with anyio.create_task_group() as tg:

            async def finish() -> None:
                seen.append(await client.command("admit-preemptible", payload, within_s=10))

            tg.start_soon(finish)
            await anyio.sleep(0.3)
            await bus.send(
                b.lifecycle("h1", "instance-deleted", "warm-1"),
                b.inventory("h1", [], revision=2),
            )
        assert [(d.phase, d.outcome) for d in seen] == [("final", "admitted")]
        assert [m.msg_id for m in await bus.inputs("rc.in.cmd.admit-preemptible")] == ["demo:cold"]


async def test_decisions_are_watched_from_before_the_command_is_published(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    client = ReconcilerClient(nc, origin=Origin.CLI)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(b.snapshot("h1"), b.pool("web"))
        async with client.watch("r2") as watch:
            sent = await client.send("admit", admit("r2", "vm-2", kind="cold"))
            assert (sent.subject, sent.duplicate) == ("rc.in.cmd.admit", False)
            final = await watch.final(within_s=10)
        assert final.outcome == "admitted"
        again = await client.send("admit", admit("r2", "vm-2", kind="cold"))
        assert again.duplicate and again.seq == sent.seq
        async with client.watch("r2") as watch:
            stored = await client.last_decision("r2")
            assert await watch.final(within_s=0.1, stored=stored) == final


async def test_no_stream_no_decision_and_no_replica_are_errors(nc: Client) -> None:
    client = ReconcilerClient(nc, prefix="nothing", origin=Origin.CLI)
    with pytest.raises(NoStream) as no_stream:
        await client.send("release", {"v": 1, "request_id": "r", "instance": "vm"})
    assert no_stream.value.stream == "NOTHING_IN"
    with pytest.raises(NoReplica) as none:
        await client.ask("health", {}, timeout_s=1.0)
    assert not none.value.responders
    with pytest.raises(NoReplica, match=r"no replica answered within 0\.3 s"):
        await client.query("lease", {"identifier": "vm"}, within_s=0.3)
    assert await client.health() is None
    assert not await client.wait_applied(1, within_s=0.2)
    bus = BusClient(nc, prefix="nothing")
    await bus.ensure_streams()  # streams, but no replica to decide
    with pytest.raises(NoDecision, match=r"no final decision for r within 0\.2 s"):
        await client.command("release", {"v": 1, "request_id": "r", "instance": "vm"}, within_s=0.2)


async def test_queries_once_and_until_answered(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    client = ReconcilerClient(nc, origin=Origin.GARM)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(b.snapshot("h1"), b.pool("web"), b.admit("r1", "web", "vm-1"))
        await bus.wait_caught_up()
        lease = await client.query("lease", {"identifier": "vm-1"}, within_s=5)
        assert lease["instance"] == "vm-1" and lease["history"]
        assert await client.query("lease", {"identifier": "nobody"}, within_s=5) is None
        with pytest.raises(QueryFailed, match="query lease failed: invalid"):
            await client.query("lease", {"identifier": 3}, within_s=5)
        reply = await client.ask("resolve", {"identifier": "vm-1"}, timeout_s=5)
        assert (reply.ok, reply.result) == (True, {"instance": "vm-1"})
        health = await client.health()
        assert health is not None and health["caches_synced"] is True
        assert await client.wait_applied(health["applied_seq"], within_s=5)


async def test_config_is_published_once_and_its_rejections_reported(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    client = ReconcilerClient(nc, origin=Origin.CLI)
    good, bad = b.pool("web")[1], b.pool("odd", min_ready=3, max_ready=1)[1]
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        async with client.config_rejections() as rejections:
            first = await client.publish_config("pool", "web", good)
            second = await client.publish_config("pool", "odd", bad)
            assert await client.wait_applied(second.seq, within_s=10)
            found = await rejections.of({first.seq, second.seq}, within_s=2)
        assert [(r.kind, r.name, r.input_seq) for r in found] == [("pool", "odd", second.seq)]
        assert "min_ready 3 > max_ready 1" in found[0].error
        again = await client.publish_config("pool", "web", good)
        assert again.duplicate and again.seq == first.seq
