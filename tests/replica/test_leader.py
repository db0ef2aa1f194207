"""Leader election over the KV bucket, and replicas handing leadership over.

Liveness lives in the leader (DESIGN.md, principle 1): exactly one replica publishes at a
time, a graceful stop hands over at once, a lost key stops the leader's work at once, and
followers prune their outbox from the leader's published position.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.bus.streams import LEADER_KEY, StreamNames, ensure_streams
from reconciler.replica.leader import SAFETY, LeaderElection, Leadership
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.natsserver import NatsServer

pytestmark = pytest.mark.timeout(60)

NAMES = StreamNames.for_prefix("rc")


async def test_one_of_two_campaigners_leads_and_a_resignation_hands_over(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, NAMES, leader_ttl_s=2.0)
    working: list[str] = []

    def election(holder: str) -> LeaderElection:
        return LeaderElection(js, bucket=NAMES.leader_bucket, holder=holder, ttl_s=2.0)

    async def work(leadership: Leadership) -> None:
        working.append(leadership.holder)
        await anyio.sleep_forever()

    a, b_ = election("a"), election("b")
    async with anyio.create_task_group() as outer:
        scope_a = anyio.CancelScope()

        async def run_a() -> None:
            with scope_a:
                await a.run(work)

        outer.start_soon(run_a)
        with anyio.fail_after(5):
            while not working:  # noqa: ASYNC110 - polling the test's own list
                await anyio.sleep(0.01)
        outer.start_soon(b_.run, work)
        await anyio.sleep(1.0)
        assert working == ["a"] and a.leading is not None and b_.leading is None
        entry = await (await js.key_value(NAMES.leader_bucket)).get(LEADER_KEY)
        assert entry.value is not None
        value = orjson.loads(entry.value)
        assert value["holder"] == "a"
        scope_a.cancel()  # a graceful stop resigns: b takes over well before the TTL
        with anyio.fail_after(1.5):
            while working != ["a", "b"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        outer.cancel_scope.cancel()


class Watched:
    """Leader work that records when it starts and when it is stopped."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.stopped = anyio.Event()

    async def __call__(self, leadership: Leadership) -> None:
        self.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.stopped.set()


async def test_a_leader_whose_key_is_taken_stops_its_work_at_once(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, NAMES, leader_ttl_s=3.0)
    kv = await js.key_value(NAMES.leader_bucket)
    election = LeaderElection(js, bucket=NAMES.leader_bucket, holder="a", ttl_s=3.0)
    work = Watched()
    async with anyio.create_task_group() as tg:
        tg.start_soon(election.run, work)
        with anyio.fail_after(5):
            await work.started.wait()
        # an operator (or a partition's other side) replaces the key
        await kv.purge(LEADER_KEY)
        await kv.create(LEADER_KEY, b'{"holder": "usurper"}')
        with anyio.fail_after(3.0):  # the next renewal (ttl/3) is refused
            await work.stopped.wait()
        assert election.leading is None
        tg.cancel_scope.cancel()


async def test_replicas_share_the_work_and_fail_over(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    first = fast_config(nats_url, tmp_path / "a.db", replica="a")
    second = fast_config(nats_url, tmp_path / "b.db", replica="b")
    async with running_replica(first) as a, running_replica(second, ready=False) as b_:
        await bus.send(b.snapshot("h1"), b.pool("web"), b.admit("r1", "web", "vm-1"))
        await bus.decision("r1")
        await bus.wait_caught_up()
        assert a.leader_ready and not b_.leader_ready
        # the follower folded the same inputs and learns what the leader published
        assert b_.store is not None and b_.pipeline is not None
        with anyio.fail_after(5):
            while await b_.store.published_seq() < 3:  # noqa: ASYNC110 - polling the store
                await anyio.sleep(0.05)
        assert (await b_.store.outbox_snapshot()).rows == []
        assert b_.pipeline.state.lease_of_instance("vm-1") is not None
    # both stopped; now only the second one runs and leads
    async with running_replica(second) as b_:
        await bus.send(b.admit("r2", "web", "vm-2"))
        assert (await bus.decision("r2"))["lease"]["instance"] == "vm-2"
    ids = [m.msg_id for m in await bus.outputs("rc.out.decision.>")]
    assert ids == ["decision:r1:final", "decision:r2:final"]


async def test_a_follower_takes_over_when_the_leader_stops(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    a_cfg = fast_config(nats_url, tmp_path / "a.db", replica="a")
    b_cfg = fast_config(nats_url, tmp_path / "b.db", replica="b")
    async with running_replica(b_cfg, ready=False) as follower:
        async with running_replica(a_cfg, ready=False):
            await bus.send(b.snapshot("h1"), b.pool("web"), b.admit("r1", "web", "vm-1"))
            await bus.decision("r1")
        # the leader (whichever it was) may be gone: the survivor leads within the TTL
        with anyio.fail_after(5):
            while not follower.leader_ready:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        await bus.send(b.admit("r2", "web", "vm-2"))
        await bus.decision("r2")
    async with await Store.open(tmp_path / "b.db") as store:
        assert (await store.outbox_snapshot()).rows == []
    ids = [m.msg_id for m in await bus.outputs("rc.out.decision.>")]
    assert sorted(ids, key=str) == ["decision:r1:final", "decision:r2:final"]


async def test_a_leader_cut_off_from_nats_steps_down_before_its_key_expires(
    nc: Client, nats_server: NatsServer
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the NATS server cannot be paused here")
    js = nc.jetstream()
    ttl = 2.0
    await ensure_streams(js, NAMES, leader_ttl_s=ttl)
    election = LeaderElection(js, bucket=NAMES.leader_bucket, holder="a", ttl_s=ttl)
    work = Watched()
    async with anyio.create_task_group() as tg:
        tg.start_soon(election.run, work)
        with anyio.fail_after(5):
            await work.started.wait()
        await anyio.to_thread.run_sync(nats_server.pause)
        try:
            began = anyio.current_time()
            with anyio.fail_after(ttl):  # well before the bucket could let anyone in
                await work.stopped.wait()
            assert anyio.current_time() - began <= ttl * SAFETY + 0.1
        finally:
            await anyio.to_thread.run_sync(nats_server.resume)
        tg.cancel_scope.cancel()
