"""The pipeline (consume → fold → commit → ack) on its own: an input consumer over a real
nats-server, a real SQLite store, and nothing else of a replica.

What it must do (reconciler/replica/pipeline.py): batch what is there, fold in stream
order, commit position, state and outbox together, and only then acknowledge; skip what
was folded already; dead-letter bad input without touching the state; say when it has
caught up; stop cleanly; and never acknowledge what a failed commit did not write.
Verdicts are observed as the server relays them: a second connection subscribes to the
consumer's ack subjects.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from reconciler.bus.decoder import Decoder
from reconciler.bus.input_consumer import InputConsumer
from reconciler.bus.reader import parse_ack_subject
from reconciler.core.messages import Output
from reconciler.replica.pipeline import MERGE_LIMIT, Commit, Pipeline
from reconciler.store.digest import state_digest
from reconciler.store.errors import StoreError
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.bus import BusClient

pytestmark = pytest.mark.timeout(60)

DURABLE = "pipeline"
FLEET = [
    b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
    b.pool("web", cpu=1, memory_mib=1024, disk_gib=10, min_ready=0, max_ready=0),
]


def admits(first: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    return [b.admit(f"a{i}", "web", f"vm-{i}") for i in range(first, first + count)]


@dataclass
class Verdicts:
    """What the pipeline answered, as the server relayed it: ``(verdict, stream_seq)``."""

    seen: list[tuple[bytes, int]] = field(default_factory=list)

    def acked(self) -> int:
        """The highest stream sequence acknowledged (cumulatively) so far."""
        return max((seq for verdict, seq in self.seen if verdict == b"+ACK"), default=0)

    def terminated(self) -> list[int]:
        return [seq for verdict, seq in self.seen if verdict == b"+TERM"]


@dataclass
class Line:
    """A running pipeline and what can be seen of it."""

    pipeline: Pipeline
    store: Store
    bus: BusClient
    verdicts: Verdicts
    commits: list[Commit]
    #: the committed position when each verdict arrived (appended by the spy)
    committed_at_verdict: list[int]

    def outputs(self) -> list[Output]:
        return [out for commit in self.commits for out in commit.fx.outputs]

    async def folded_up_to(self, seq: int, *, within_s: float = 10.0) -> None:
        """Until ``seq`` is folded, committed and acknowledged."""
        with anyio.fail_after(within_s):
            while self.pipeline.committed_seq < seq or self.verdicts.acked() < seq:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    async def folded_ahead(self, seq: int, *, within_s: float = 10.0) -> None:
        """Until ``seq`` is folded into the state, committed or not."""
        with anyio.fail_after(within_s):
            while self.pipeline.state.applied_seq < seq:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    async def with_fleet(self) -> None:
        """The host and the pool of :data:`FLEET` folded and committed (seqs 1 and 2)."""
        await self.bus.send(*FLEET)
        await self.folded_up_to(2)


@asynccontextmanager
async def pipeline(
    nc: Client,
    nats_url: str,
    db: Path,
    *,
    batch: int = 50,
    from_seq: int | None = None,
    writer_process: bool = False,
) -> AsyncIterator[Line]:
    """The pipeline over ``db``, its consumer started after the store's position (or at
    ``from_seq``), running until the block ends (then stopped, as a replica stops)."""
    bus = BusClient(nc)
    await bus.ensure_streams()
    verdicts = Verdicts()
    spy = await nats.connect(nats_url)
    async with await Store.open(db, writer_process=writer_process) as store:
        state = await store.load_state()
        consumer = InputConsumer(
            nc, bus.js, stream="RC_IN", durable=DURABLE, batch=batch, fetch_timeout_s=0.3
        )
        pipeline = Pipeline(
            store=store, state=state, consumer=consumer, decoder=Decoder(), prefix="rc"
        )
        line = Line(pipeline, store, bus, verdicts, commits=[], committed_at_verdict=[])
        pipeline.add_listener(line.commits.append)

        async def on_verdict(msg: Msg) -> None:
            verdicts.seen.append((msg.data, parse_ack_subject(msg.subject)[0]))
            line.committed_at_verdict.append(pipeline.committed_seq)

        sub = await spy.subscribe(f"$JS.ACK.RC_IN.{DURABLE}.>", cb=on_verdict)
        await spy.flush()
        await consumer.start(from_seq=from_seq or state.applied_seq + 1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipeline.run)
                yield line
                pipeline.stop()
        finally:
            await consumer.close()
            # the last verdicts: sent, relayed to the spy, handed to its callback
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await nc.flush()
                await spy.flush()
                while sub.pending_msgs:  # noqa: ASYNC110 - nats-py's callback queue
                    await anyio.sleep(0.01)
                await anyio.lowlevel.checkpoint()
            await spy.close()


class DatabaseLock:
    """Another connection holding the database's write lock (as an operator's ``sqlite3``
    shell in a write transaction would): commits wait for it, up to the store's busy
    timeout (5 s)."""

    def __init__(self, db: Path) -> None:
        self._conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        self._held = False

    async def __aenter__(self) -> DatabaseLock:
        await anyio.to_thread.run_sync(self._conn.execute, "BEGIN IMMEDIATE")
        self._held = True
        return self

    async def release(self) -> None:
        if self._held:
            self._held = False
            await anyio.to_thread.run_sync(self._conn.execute, "ROLLBACK")

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
        self._conn.close()


# ------------------------------------------------------------------------- batching


async def test_what_is_waiting_is_folded_in_batches_and_committed_once_each(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    await bus.send(*FLEET, *admits(0, 118))  # 120 inputs before the line starts
    async with pipeline(nc, nats_url, tmp_path / "rc.db", batch=50) as line:
        await line.folded_up_to(120)
        sizes = [c.inputs for c in line.commits]
        assert sum(sizes) == 120 and len(sizes) >= 2  # never one transaction per input...
        assert max(sizes) <= MERGE_LIMIT * 50  # ...nor more than a batch may grow to
        assert [c.applied_seq for c in line.commits] == sorted(
            {c.applied_seq for c in line.commits}
        )
        decisions = [o for o in line.outputs() if o.subject.startswith("out.decision.")]
        assert [o.msg_id for o in decisions] == [f"decision:a{i}:final" for i in range(118)]
        assert await line.store.applied_seq() == 120
        live = state_digest(line.pipeline.state)
    async with await Store.open(tmp_path / "rc.db") as reopened:
        assert state_digest(await reopened.load_state()) == live  # what was folded is stored
    info = await bus.js.consumer_info("RC_IN", DURABLE)
    assert info.num_ack_pending == 0 and info.ack_floor.stream_seq == 120


async def test_what_arrives_while_a_commit_waits_joins_the_next_commit(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "rc.db"
    async with pipeline(nc, nats_url, db, batch=20) as line:
        await line.with_fleet()
        before = len(line.commits)
        async with DatabaseLock(db):
            for item in admits(0, 30):
                await line.bus.send(item)  # one at a time: each fetched on its own
            await line.folded_ahead(32, within_s=10)
            assert line.pipeline.committed_seq < 32  # nothing of it committed yet
        await line.folded_up_to(32)
        # the batch handed to the blocked commit, then what gathered meanwhile
        assert len(line.commits) - before <= 3
        assert sum(c.inputs for c in line.commits[before:]) == 30


# ------------------------------------------------------------- ack after commit


@pytest.mark.parametrize("writer_process", [False, True], ids=["thread", "process"])
async def test_nothing_is_acknowledged_before_it_is_committed(
    nc: Client, nats_url: str, tmp_path: Path, writer_process: bool
) -> None:
    db = tmp_path / "rc.db"
    async with pipeline(nc, nats_url, db, batch=10, writer_process=writer_process) as line:
        await line.with_fleet()
        async with DatabaseLock(db):
            # no more than the batch handed over and one grown to MERGE_LIMIT batches
            await line.bus.send(*admits(0, 12))
            await line.folded_ahead(14, within_s=4)
            await anyio.sleep(0.3)
            assert line.verdicts.acked() == 2  # folded, not committed: not acknowledged
        await line.folded_up_to(14)
    # every verdict came after the commit that covers it
    for (verdict, seq), committed in zip(
        line.verdicts.seen, line.committed_at_verdict, strict=True
    ):
        assert seq <= committed, (verdict, seq, committed)
    # one cumulative ack per commit, not one per input
    assert len(line.verdicts.seen) == len(line.commits)


# ------------------------------------------------------------ redeliveries, skipped


async def test_deliveries_at_or_below_the_applied_sequence_are_acked_not_folded(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "rc.db"
    async with pipeline(nc, nats_url, db) as line:
        await line.bus.send(*FLEET, *admits(0, 8))
        await line.folded_up_to(10)
        digest = state_digest(line.pipeline.state)
        folded = line.pipeline.folded
    # the same store, its consumer started at the stream's beginning: 1..10 come again
    async with pipeline(nc, nats_url, db, from_seq=1) as again:
        assert again.pipeline.state.applied_seq == 10
        await again.bus.send(*admits(8, 2))
        await again.folded_up_to(12)
        assert state_digest(again.pipeline.state) != digest
        assert again.pipeline.folded == 2  # the two new ones only
        outputs = again.outputs()
        assert [o.msg_id for o in outputs if o.subject.startswith("out.decision.")] == [
            "decision:a8:final",
            "decision:a9:final",
        ]
        assert all(c.applied_seq > 10 for c in again.commits)
        assert again.verdicts.acked() == 12 and not again.verdicts.terminated()
    assert folded == 10


# ------------------------------------------------------------------- dead letters


async def test_bad_input_is_dead_lettered_in_order_terminated_and_changes_nothing(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nc, nats_url, tmp_path / "rc.db") as line:
        bus = line.bus
        await bus.send(*FLEET, admits(0, 1)[0])  # 1, 2, 3
        await line.folded_up_to(3)
        before = state_digest(await line.store.load_state())
        await bus.send_raw("rc.in.cmd.admit", b"not json")  # 4
        await bus.send_raw("rc.in.cmd.admit", b'{"v": 1, "request_id": "r"}')  # 5: schema
        await bus.send_raw("rc.in.nonsense", b"{}")  # 6: no such subject
        await line.folded_up_to(6)
        after = await line.store.load_state()
        assert after.applied_seq == 6  # passed over...
        after.applied_seq = 3
        assert state_digest(after) == before  # ...and nothing else changed
        await bus.send(admits(1, 1)[0])  # 7
        await line.folded_up_to(7)
        subjects = [o.subject for o in line.outputs()]
        assert subjects == [
            "out.decision.a0",
            "out.dlq.decode",
            "out.dlq.schema",
            "out.dlq.schema",
            "out.decision.a1",
        ]
        dead = [o for o in line.outputs() if o.subject.startswith("out.dlq.")]
        assert [o.msg_id for o in dead] == ["dlq:4", "dlq:5", "dlq:6"]
        assert sorted(line.verdicts.terminated()) == [4, 5, 6]  # never redelivered
        assert sum(c.dead_letters for c in line.commits) == 3
        assert line.pipeline.dead_letters == {"decode": 1, "schema": 2}


# ---------------------------------------------------------------- caught up, synced


async def test_synced_once_the_stream_head_seen_at_start_is_committed(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    await bus.send(*FLEET, *admits(0, 28))  # 30 inputs: the head at start
    async with pipeline(nc, nats_url, tmp_path / "rc.db", batch=10) as line:
        # the head is read at start; synced only once it is committed, not folded
        with anyio.fail_after(10):
            while line.pipeline.head_at_start == 0:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert line.pipeline.head_at_start == 30
        await line.pipeline.synced.wait()
        assert line.pipeline.committed_seq >= 30
        assert await line.store.applied_seq() >= 30
        # inputs published later do not make it unsynced
        await bus.send(*admits(28, 5))
        await line.folded_up_to(35)
        assert line.pipeline.synced.is_set()


async def test_synced_at_once_on_an_empty_stream_and_not_before_the_commit(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nc, nats_url, tmp_path / "empty.db") as line:
        with anyio.fail_after(5):
            await line.pipeline.synced.wait()
        assert line.pipeline.head_at_start == 0
    await BusClient(nc).send(*FLEET)
    db = tmp_path / "rc.db"
    async with await Store.open(db):
        pass  # created, so that it can be locked before the line starts
    async with DatabaseLock(db) as lock, pipeline(nc, nats_url, db) as line:
        await line.folded_ahead(2, within_s=10)
        await anyio.sleep(0.2)
        assert not line.pipeline.synced.is_set()  # folded, not committed
        await lock.release()
        with anyio.fail_after(5):
            await line.pipeline.synced.wait()
        assert line.pipeline.committed_seq == 2


# -------------------------------------------------------------------- error paths


async def test_a_failed_commit_stops_the_line_and_acknowledges_none_of_it(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "rc.db"
    async with pipeline(nc, nats_url, db, batch=5) as line:
        await line.with_fleet()
    # the disk "fills up": every commit past seq 4 fails, in SQLite itself
    with sqlite3.connect(db) as conn:
        conn.execute(
            "CREATE TRIGGER full BEFORE UPDATE OF applied_seq ON position "
            "WHEN NEW.applied_seq > 4 BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    await BusClient(nc).send(*admits(0, 6))  # 3..8
    with pytest.raises(BaseExceptionGroup) as failed:
        async with pipeline(nc, nats_url, db, batch=5) as failing:
            with anyio.fail_after(10):
                await anyio.sleep_forever()
    assert failed.group_contains(StoreError, match="disk is full")
    assert failing.verdicts.acked() <= 4  # what failed to commit was not acknowledged
    async with await Store.open(db) as store:
        assert await store.applied_seq() <= 4
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TRIGGER full")
    # started again, the line folds what was not committed: every input decided once
    async with pipeline(nc, nats_url, db, batch=5) as line:
        await line.folded_up_to(8)
    decided = [
        str(o.msg_id)
        for attempt in (failing, line)
        for o in attempt.outputs()
        if o.subject.startswith("out.decision.")
    ]
    assert sorted(decided) == sorted(f"decision:a{i}:final" for i in range(6))


async def test_stopping_commits_and_acknowledges_the_batch_in_hand(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "rc.db"
    async with pipeline(nc, nats_url, db, batch=10) as line:
        await line.with_fleet()
        async with DatabaseLock(db):
            await line.bus.send(*admits(0, 15))
            await line.folded_ahead(17, within_s=10)
            line.pipeline.stop()  # asked to stop with folded batches waiting for the commit
        # leaving the block waits for run() to return
    assert line.pipeline.committed_seq == 17 and line.verdicts.acked() == 17
    async with await Store.open(db) as store:
        assert await store.applied_seq() == 17


async def test_a_stop_while_waiting_for_deliveries_returns_at_once(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nc, nats_url, tmp_path / "rc.db") as line:
        await line.pipeline.synced.wait()
        await anyio.sleep(0.1)  # waiting on a fetch now
        started = anyio.current_time()
        line.pipeline.stop()
    assert anyio.current_time() - started < 1.0
