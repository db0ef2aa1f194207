"""``reconciler run`` end to end over a real nats-server: every verb, duplicates, redelivery,
dead letters, queries and status, exactly as a producer and an observer see them."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.bus.decoder import Decoder
from reconciler.bus.input_consumer import InputConsumer
from reconciler.bus.schemas import load
from reconciler.core.model import HostName, PoolName
from reconciler.core.state import State
from reconciler.replay.replay import replay_into
from reconciler.replica.pipeline import Pipeline
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.timeout(90)

SCHEMAS = load()


def valid(relpath: str, body: Any) -> None:
    SCHEMAS.validator(relpath).validate(body)


def fleet() -> list[tuple[str, dict[str, Any]]]:
    return [
        b.snapshot("h1", cpu=16, memory_mib=65536, disk_gib=500),
        b.snapshot(
            "g1",
            cpu=32,
            memory_mib=131072,
            disk_gib=1000,
            gpus=[b.gpu(0), b.gpu(1), b.gpu(2, numa=1), b.gpu(3, numa=1)],
            labels={"gpu": "yes"},
            gpu_profile="std",
        ),
        b.gpu_profile("std", power_limit_w=300),
        b.gpu_class("a100", model="A100"),
        b.pool("web", cpu=4, memory_mib=8192, disk_gib=40, min_ready=0, max_ready=3),
        b.pool(
            "ml",
            cpu=8,
            memory_mib=16384,
            disk_gib=100,
            claims=[{"name": "gpus", "class": "a100", "parameters": {"gpu": {"count": 2}}}],
            host_selector={"gpu": "yes"},
        ),
    ]


async def test_every_verb_over_the_bus(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(*fleet())

        # admit (cold) and its refusals
        await bus.send(b.admit("a1", "web", "cold-1", host="h1"))
        d = await bus.decision("a1")
        assert (d["outcome"], d["lease"]["host"], d["lease"]["state"]) == (
            "admitted",
            "h1",
            "reserved",
        )
        valid("out/decision.json", d)
        await bus.send(b.admit("a2", "web", "cold-1"), b.admit("a3", "nope", "x-1"))
        assert (await bus.decision("a2"))["reason"] == "duplicate-instance"
        assert (await bus.decision("a3"))["reason"] == "unknown-pool"

        # mark-created, mark-deleting, release
        await bus.send(b.cmd("mark-created", "c1", instance="cold-1"))
        assert (await bus.decision("c1"))["lease"]["state"] == "created"
        await bus.send(b.cmd("mark-created", "c2", instance="ghost"))
        assert (await bus.decision("c2"))["reason"] == "no-lease"

        # warm: admit → exec create → lifecycle → claim → inject; drain another
        await bus.send(
            b.admit("w1", "web", "warm-1", kind="warm", host="h1"),
            b.admit("w2", "web", "warm-2", kind="warm", host="h1"),
        )
        assert (await bus.decision("w1"))["outcome"] == "admitted"
        create = (await bus.wait_output("rc.out.exec.h1.create")).json()
        valid("out/exec.create.json", create)
        assert create["instance"] in ("warm-1", "warm-2") and create["image"] == "ubuntu/24.04"
        await bus.send(
            b.cmd("claim-warm", "k0", pool="web", job="job-0"),
        )
        k0 = await bus.decision("k0")
        assert (k0["outcome"], k0.get("reason")) == ("no-warm", "not-ready")
        await bus.send(
            b.lifecycle("h1", "instance-created", "warm-1"),
            b.lifecycle("h1", "instance-ready", "warm-1"),
            b.lifecycle("h1", "instance-created", "warm-2"),
            b.lifecycle("h1", "instance-agent-started", "warm-2"),
            b.cmd("claim-warm", "k1", pool="web", job="job-1"),
        )
        k1 = await bus.decision("k1")
        assert k1["outcome"] == "claimed" and k1["lease"]["job"] == "job-1"
        claimed = k1["lease"]["instance"]
        other = "warm-2" if claimed == "warm-1" else "warm-1"
        await bus.send(
            b.cmd("mark-warm-injected", "i1", job="job-1", instance=claimed),
            b.cmd("mark-warm-injected", "i2", job="job-x", instance=claimed),
            b.cmd("authorize-warm-drain", "d1", instance=claimed),
            b.cmd("authorize-warm-drain", "d2", instance=other),
        )
        assert (await bus.decision("i1"))["lease"]["state"] == "injected"
        assert (await bus.decision("i2"))["reason"] == "wrong-job"
        assert (await bus.decision("d1"))["outcome"] == "refused"
        assert (await bus.decision("d2"))["outcome"] == "authorized"
        delete = (await bus.wait_output("rc.out.exec.h1.delete")).json()
        valid("out/exec.delete.json", delete)
        assert (delete["instance"], delete["reason"]) == (other, "drained")

        await bus.send(
            b.cmd("mark-deleting", "md1", instance="cold-1"),
            b.cmd("release", "r1", instance="cold-1"),
            b.cmd("release", "r2", instance="never-was"),
        )
        assert (await bus.decision("md1"))["lease"]["state"] == "deleting"
        assert (await bus.decision("r1"))["lease"]["state"] == "released"
        assert (await bus.decision("r2"))["outcome"] == "ok"

        # GPU claims, and a re-render of the runtime
        await bus.send(b.admit("m1", "ml", "ml-1"), b.cmd("render-runtime", "rr1", instance="ml-1"))
        m1 = await bus.decision("m1")
        assert (m1["lease"]["host"], m1["lease"]["gpus"]) == ("g1", [0, 1])
        assert (await bus.decision("rr1"))["outcome"] == "ok"
        runtime = await bus.result("effective-runtime", {"lease_id": m1["lease"]["lease_id"]})
        assert [g["index"] for g in runtime] == [0, 1]
        assert runtime[0]["runtime"]["power_limit_w"] == 300


async def test_preemption_hand_off_over_the_bus(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(
            b.snapshot("h1", cpu=8, memory_mib=16384, disk_gib=100),
            b.pool("web", cpu=4, memory_mib=8192, disk_gib=40, max_ready=2),
            b.admit("w1", "web", "warm-1", kind="warm"),
            b.admit("w2", "web", "warm-2", kind="warm"),
            b.lifecycle("h1", "instance-created", "warm-1"),
            b.lifecycle("h1", "instance-ready", "warm-1"),
            b.lifecycle("h1", "instance-created", "warm-2"),
            b.lifecycle("h1", "instance-ready", "warm-2"),
            b.admit("cold", "web", "cold-1", preemptible=True),
        )
        pending = await bus.decision("cold", phase="pending")
        assert pending["outcome"] == "pending" and len(pending["victims"]) == 1
        victim = pending["victims"][0]["instance"]
        delete = (await bus.wait_output("rc.out.exec.h1.delete")).json()
        assert (delete["instance"], delete["reason"]) == (victim, "preempted")
        # re-sending the command returns the current phase
        await bus.send(b.admit("cold", "web", "cold-1", preemptible=True), msg_ids=False)
        await bus.send(b.lifecycle("h1", "instance-deleted", victim))
        await anyio.sleep(0.2)
        cold = await bus.last_output("rc.out.decision.cold")
        assert cold is not None and cold.json()["phase"] == "pending"
        survivor = "warm-2" if victim == "warm-1" else "warm-1"
        await bus.send(b.inventory("h1", [b.instance(survivor, cpu=4, memory_mib=8192)]))
        final = await bus.decision("cold")
        assert (final["outcome"], final["lease"]["instance"]) == ("admitted", "cold-1")


async def test_duplicates_change_nothing(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)) as replica:
        await bus.send(*fleet(), b.admit("a1", "web", "vm-1"))
        first = await bus.decision("a1")
        # the same Nats-Msg-Id: the stream stores nothing new
        seqs = await bus.send(b.admit("a1", "web", "vm-1"))
        head = (await bus.result("health"))["stream_last_seq"]
        assert seqs == [head] and head == len(fleet()) + 1
        await bus.wait_caught_up()
        assert replica.pipeline is not None
        before = state_digest(replica.pipeline.state)
        # the same request id under another message id: decided already, re-sent unchanged
        await bus.send(b.admit("a1", "web", "vm-1", host="h1"), msg_ids=False)
        await bus.wait_caught_up()
        after = replica.pipeline.state
        assert after.applied_seq == head + 1
        after.applied_seq = head
        assert state_digest(after) == before
        after.applied_seq = head + 1
    decisions = await bus.outputs("rc.out.decision.a1")
    assert [m.msg_id for m in decisions] == ["decision:a1:final"]
    assert decisions[0].json() == first


async def test_a_batch_committed_but_not_acked_is_not_folded_twice(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)):
        await bus.send(*fleet(), b.admit("a1", "web", "vm-1"))
        await bus.decision("a1")
    # a replica that crashes between commit and ack: its consumer still holds the
    # messages unacked, and a fresh consumer re-delivers everything from seq 1
    async with await Store.open(db) as store:
        state = await store.load_state()
        committed = state.applied_seq
        digest = state_digest(state)
        consumer = InputConsumer(nc, bus.js, stream="RC_IN", durable="crashed", batch=100)
        await consumer.start(from_seq=1)
        pipeline = Pipeline(
            store=store, state=state, consumer=consumer, decoder=Decoder(), prefix="rc"
        )
        commits: list[Any] = []
        pipeline.add_listener(commits.append)

        async def stop_when_seen() -> None:
            while consumer.next_seq <= committed:  # noqa: ASYNC110 - polling a counter
                await anyio.sleep(0.01)
            await anyio.sleep(0.1)
            pipeline.stop()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_seen)
            await pipeline.run(head=committed)
        await consumer.close()
        assert commits == []  # every redelivery was at or below the position: skipped
        assert state_digest(pipeline.state) == digest
        assert (await store.outbox_snapshot()).rows == []
        assert await store.applied_seq() == committed
    # and a restarted replica publishes nothing again
    async with running_replica(fast_config(nats_url, db)):
        await bus.send(b.admit("a2", "web", "vm-2"))
        await bus.decision("a2")
    assert [m.msg_id for m in await bus.outputs("rc.out.decision.a1")] == ["decision:a1:final"]


async def test_bad_input_is_dead_lettered_and_the_line_goes_on(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")) as replica:
        await bus.send(*fleet())
        huge = orjson.dumps({"v": 1, "request_id": "huge", "pad": "x" * (2 * 1024 * 1024)})
        bad: list[tuple[str, bytes, str]] = [
            ("rc.in.cmd.admit", b"{not json", "decode"),
            ("rc.in.cmd.admit", b"[1, 2]", "decode"),
            ("rc.in.cmd.admit", b"\xff\xfe", "decode"),
            ("rc.in.cmd.admit", orjson.dumps({"v": 1, "request_id": "t", "pool": 7}), "schema"),
            ("rc.in.cmd.admit", orjson.dumps({"v": 2, "request_id": "t"}), "schema"),
            ("rc.in.cmd.admit", huge, "too-large"),
            ("rc.in.cmd.no-such-verb", b'{"v": 1, "request_id": "t"}', "schema"),
            ("rc.in.host.bad!name.snapshot", orjson.dumps(b.snapshot("h9")[1]), "schema"),
            ("rc.in.host.h1.extra.snapshot", orjson.dumps(b.snapshot("h1")[1]), "schema"),
            ("rc.in.host.h2.snapshot", orjson.dumps(b.snapshot("h3")[1]), "domain"),
            (
                "rc.in.cmd.admit",
                orjson.dumps(b.admit("evil", "web", "../../etc/passwd")[1]),
                "schema",
            ),
        ]
        for i, (subject, data, _) in enumerate(bad):
            await bus.send(b.admit(f"good-{i}", "web", f"vm-{i}"))
            await bus.send_raw(subject, data)
        await bus.send(b.admit("good-last", "web", "vm-last"))
        for i in range(len(bad)):
            assert (await bus.decision(f"good-{i}"))["outcome"] == "admitted"
        assert (await bus.decision("good-last"))["outcome"] == "admitted"
        letters = await bus.outputs("rc.out.dlq.>")
        assert [m.subject.rsplit(".", 1)[1] for m in letters] == [r for _, _, r in bad]
        for (subject, data, _), letter in zip(bad, letters, strict=True):
            body = letter.json()
            valid("out/dlq.json", body)
            assert body["subject"] == subject and body["error"]
            assert letter.msg_id == f"dlq:{body['stream_seq']}"
            assert base64.b64decode(body["payload_b64"]) == data[:65536]
        assert replica.pipeline is not None
        assert replica.pipeline.state.lease_of_instance("../../etc/passwd") is None
        assert set(replica.pipeline.state.hosts) == {"h1", "g1"}


async def test_queries(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(
            *fleet(), b.admit("a1", "web", "vm-1", job="job-1"), b.admit("m1", "ml", "ml-1")
        )
        lease = (await bus.decision("a1"))["lease"]
        await bus.decision("m1")
        for identifier in ("job-1", "vm-1", lease["lease_id"]):
            assert await bus.result("resolve", {"identifier": identifier}) == {"instance": "vm-1"}
        detail = await bus.result("lease", {"identifier": "job-1"})
        assert detail["history"] == [
            {
                "input_seq": int(lease["lease_id"].removeprefix("L")),
                "event": "admit",
                "from_state": None,
                "to_state": "reserved",
            }
        ]
        valid("query/lease.result.json", detail)
        assert "decisions" not in detail
        trail = await bus.result("lease", {"identifier": "job-1", "decisions": True})
        valid("query/lease.result.json", trail)
        assert [(d["request_id"], d["outcome"]) for d in trail["decisions"]] == [("a1", "admitted")]
        recent = await bus.result("decisions", {"limit": 5})
        valid("query/decisions.result.json", recent)
        assert [d["request_id"] for d in recent["decisions"]] == ["m1", "a1"]
        page = await bus.result("fleet", {})
        valid("query/fleet.result.json", page)
        assert [h["host"] for h in page["hosts"]] == ["g1", "h1"]
        assert {p["pool"] for p in page["pools"]} >= {"web", "ml"}
        no_claims = {"claimed": 0, "no_warm": 0, "hit_ratio": None}
        assert all(p["warm_claims"] == no_claims for p in page["pools"])
        mine = await bus.result("assignments", {"host": "h1", "uid": "uid-h1"})
        assert [le["instance"] for le in mine] == ["vm-1"]
        assert await bus.result("assignments", {"host": "h1", "uid": "other"}) == []
        unsuitable = await bus.result(
            "unsuitable-hosts", {"pool": "ml", "potential_hosts": ["h1", "g1", "zz"]}
        )
        assert unsuitable == {"unsuitable": ["h1", "zz"]}
        health = await bus.result("health")
        valid("query/health.result.json", health)
        assert health["leader_ready"] and health["caches_synced"]
        for name, request, code in (
            ("resolve", {"identifier": "nobody"}, "not-found"),
            ("resolve", {}, "invalid"),
            ("nosuch", {}, "invalid"),
            ("lease", [1], "invalid"),
        ):
            reply = await bus.query(name, request)
            valid("query/reply.json", reply)
            assert reply == {
                "ok": False,
                "error": {"code": code, "message": reply["error"]["message"]},
            }
        raw = await nc.request("rc.query.resolve", b"{oops", timeout=5)
        assert orjson.loads(raw.data)["error"]["code"] == "invalid"


async def test_queries_answer_cache_not_ready_until_synced(nc: Client, tmp_path: Path) -> None:
    from reconciler.replica.query_responder import QueryResponder

    async with await Store.open(tmp_path / "rc.db") as store:
        consumer = InputConsumer(nc, nc.jetstream(), stream="RC_IN", durable="x")
        pipeline = Pipeline(
            store=store, state=State(), consumer=consumer, decoder=Decoder(), prefix="rc"
        )

        async def health() -> dict[str, Any]:
            return {"caches_synced": pipeline.synced.is_set()}

        responder = QueryResponder(nc=nc, pipeline=pipeline, prefix="rc", health=health)
        reply = orjson.loads(await responder.answer("resolve", b'{"identifier": "x"}'))
        assert reply["error"]["code"] == "cache-not-ready"
        assert orjson.loads(await responder.answer("health", b"")) == {
            "ok": True,
            "result": {"caches_synced": False},
        }
        pipeline.synced.set()
        reply = orjson.loads(await responder.answer("resolve", b'{"identifier": "x"}'))
        assert reply["error"]["code"] == "not-found"


async def test_an_answer_too_large_for_a_message_is_an_error_that_says_so(
    nc: Client, tmp_path: Path
) -> None:
    from reconciler.core.messages import MAX_PAYLOAD_BYTES
    from reconciler.replica.query_responder import QueryResponder
    from tests.support.builders import Fleet

    n = 6000  # `assignments` of one host lists every lease: over 1 MiB
    f = Fleet()
    f.send(b.snapshot("h1"), b.pool("bulk", cpu=0, memory_mib=0, disk_gib=0, max_instances=n))
    f.send(*[b.admit(f"r{i}", "bulk", f"vm-{i:05d}-{'x' * 40}") for i in range(n)])
    async with await Store.open(tmp_path / "rc.db") as store:
        consumer = InputConsumer(nc, nc.jetstream(), stream="RC_IN", durable="x")
        pipeline = Pipeline(
            store=store, state=f.state, consumer=consumer, decoder=Decoder(), prefix="rc"
        )
        pipeline.synced.set()

        async def health() -> dict[str, Any]:
            return {}

        responder = QueryResponder(nc=nc, pipeline=pipeline, prefix="rc", health=health)
        uid = f.state.hosts[HostName("h1")].uid
        request = orjson.dumps({"host": "h1", "uid": uid})
        reply = await responder.answer("assignments", request)
        assert len(reply) < 1024
        error = orjson.loads(reply)["error"]
        assert error["code"] == "invalid"
        assert f"over the {MAX_PAYLOAD_BYTES} a message may carry: ask for less" in error["message"]


async def test_status_is_published_for_changed_hosts_and_pools(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(*fleet(), b.admit("a1", "web", "vm-1", host="h1"))
        await bus.decision("a1")
        with anyio.fail_after(10):
            while True:
                host = await bus.last_output("rc.out.status.host.h1")
                pool = await bus.last_output("rc.out.status.pool.web")
                if host and pool and host.json()["leases_by_state"] and pool.json()["instances"]:
                    break
                await anyio.sleep(0.05)
        h, p = host.json(), pool.json()
        valid("out/status.host.json", h)
        valid("out/status.pool.json", p)
        assert h["booked"] == {"cpu": 4, "memory_mib": 8192, "disk_gib": 40}
        assert h["free"]["cpu"] == 12 and h["leases_by_state"] == {"reserved": 1}
        assert host.msg_id is None
        gpu = await bus.wait_output("rc.out.status.host.g1")
        assert gpu.json()["gpus_free"] == [0, 1, 2, 3]


async def test_stop_finishes_the_batch_in_hand_and_a_restart_resumes(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    n = 4000
    await bus.ensure_streams()
    await bus.send(*fleet(), b.pool("bulk", cpu=0, memory_mib=0, disk_gib=0, max_instances=n))
    await bus.send_many([b.admit(f"r{i}", "bulk", f"vm-{i}") for i in range(n)])
    head = len(fleet()) + 1 + n
    async with running_replica(fast_config(nats_url, db, batch=20), ready=False) as replica:
        assert replica.pipeline is not None
        with anyio.fail_after(30):
            while replica.pipeline.committed_seq < head // 3:  # noqa: ASYNC110 - a counter
                await anyio.sleep(0.001)
    async with await Store.open(db) as store:
        applied = await store.applied_seq()
        state = await store.load_state()
    assert head // 3 <= applied < head  # stopped mid-load, on a batch boundary
    assert state.applied_seq == applied
    assert len([le for le in state.leases.values() if le.pool == "bulk"]) == applied - (head - n)
    async with running_replica(fast_config(nats_url, db)):
        await bus.wait_caught_up()
        assert (await bus.decision(f"r{n - 1}"))["outcome"] == "admitted"
    finals = [m.msg_id or "" for m in await bus.outputs("rc.out.decision.>")]
    assert len(finals) == len(set(finals)) == n


async def test_the_leader_tops_warm_pools_up_through_the_fold(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")) as replica:
        await bus.send(
            b.snapshot("h1", cpu=32, memory_mib=65536, disk_gib=500),
            b.pool("web", cpu=4, memory_mib=8192, disk_gib=40, min_ready=2, max_ready=3),
        )
        creates = await bus.wait_outputs("rc.out.exec.h1.create", 2)
        names = sorted(c.json()["instance"] for c in creates)
        assert names == ["web-w2-0", "web-w2-1"]  # named after the pool and the sequence
        decisions = await bus.outputs("rc.out.decision.>")
        assert sorted(d.json()["request_id"] for d in decisions) == [
            "topup-web-2-0",
            "topup-web-2-1",
        ]
        await anyio.sleep(0.3)
        assert len(await bus.outputs("rc.out.exec.h1.create")) == 2  # no more than asked
        # one boots and is claimed: the pool is short again, and asks for one more
        await bus.send(
            b.lifecycle("h1", "instance-created", "web-w2-0"),
            b.lifecycle("h1", "instance-ready", "web-w2-0"),
            b.cmd("claim-warm", "k1", pool="web", job="job-1"),
        )
        assert (await bus.decision("k1"))["lease"]["instance"] == "web-w2-0"
        await bus.wait_outputs("rc.out.exec.h1.create", 3)
        assert replica.pipeline is not None
        assert replica.pipeline.state.pool_warm_unclaimed[PoolName("web")] == 2


async def test_a_rejected_top_up_backs_off(nc: Client, nats_url: str, tmp_path: Path) -> None:
    """Each rejection in a row doubles the wait (0.5 s, 1 s, 2 s…): publishing the next
    top-up does not end the backoff, only an admitted one does; a new host looks again
    at once."""
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        # no host at all: every top-up is rejected
        await bus.send(b.pool("web", min_ready=1, max_ready=1))
        await anyio.sleep(4.2)
        tries = [d.json() for d in await bus.outputs("rc.out.decision.>")]
        assert tries and all(t["reason"] == "no-suitable-host" for t in tries)
        # at about 0, 0.5, 1.5 and 3.5 s (one every 0.55 s were nine)
        assert 3 <= len(tries) <= 5, [t["request_id"] for t in tries]
        await bus.send(b.snapshot("h1"))
        await bus.wait_outputs("rc.out.exec.h1.create", within_s=5)


async def test_the_line_waits_out_a_frozen_nats_server(
    nc: Client, nats_server: NatsServer, nats_url: str, tmp_path: Path
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the NATS server cannot be paused here")
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(*fleet(), b.admit("a1", "web", "vm-1"))
        await bus.decision("a1")
        await anyio.to_thread.run_sync(nats_server.pause)
        await anyio.sleep(4)  # fetches time out, the watchdog and the leader key lapse
        await anyio.to_thread.run_sync(nats_server.resume)
        await bus.send(b.admit("a2", "web", "vm-2"))
        assert (await bus.decision("a2", within_s=20))["outcome"] == "admitted"


async def test_a_graceful_stop_publishes_everything_committed(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)) as replica:
        await bus.send(*fleet(), *(b.admit(f"r{i}", "web", f"vm-{i}") for i in range(20)))
        assert replica.pipeline is not None
        with anyio.fail_after(10):
            while replica.pipeline.committed_seq < len(fleet()) + 20:  # noqa: ASYNC110
                await anyio.sleep(0.005)
    async with await Store.open(db) as store:
        assert (await store.outbox_snapshot()).rows == []
        assert await store.published_seq() == len(fleet()) + 20
    assert len(await bus.outputs("rc.out.decision.>")) == 20


async def test_a_leader_stopping_while_it_tops_up_decides_what_it_issued(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """Stopped while its warm pools are being topped up, the leader issues nothing more
    and folds the stream to its end first: every input, its own top-ups included, has
    its decisions on the bus (a replay finds nothing missing)."""
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")) as replica:
        host = b.snapshot("h1", cpu=64, memory_mib=262_144)
        await bus.send(host, b.pool("web", min_ready=40, max_ready=40))
        assert replica.pipeline is not None
        await bus.wait_outputs("rc.out.decision.>")  # the first top-up is decided: stop
    info = await nc.jetstream().stream_info("RC_IN")
    report = await replay_into(nc, prefix="rc")
    assert info.state.last_seq > 2, "the leader issued top-ups"
    assert report.divergences == []


async def test_a_warm_vm_that_never_boots_is_released_and_asked_for_again(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    config = fast_config(
        nats_url, tmp_path / "rc.db", warm_boot_timeout_s=1.0, status_progress_interval_s=0.3
    )
    async with running_replica(config):
        # no executor runs: the created VM never comes, and no event will say so
        await bus.send(b.snapshot("h1"), b.pool("web", min_ready=1, max_ready=1))
        first = (await bus.wait_outputs("rc.out.decision.>"))[0].json()
        assert first["request_id"].startswith("topup-web-")
        lease = first["lease"]
        expired = await bus.decision(f"expire-{lease['lease_id']}", within_s=10)
        assert (expired["verb"], expired["lease"]["state"]) == ("release", "released")
        with anyio.fail_after(10):
            while True:
                topups = [
                    d.json()
                    for d in await bus.outputs("rc.out.decision.>")
                    if d.json()["request_id"].startswith("topup-web-")
                ]
                if len(topups) >= 2:
                    break
                await anyio.sleep(0.05)
        assert topups[1]["lease"]["instance"] != lease["instance"]
