"""The replay's own reading and folding (reconciler.replay.replay and readers):
the streams read by a child process reproduce what the in-process readers do, and a fold
that failed live on one input (a bug) is replayed the way the live line recovered. All
over a real nats-server."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

import reconciler.replay.replay as replay_module
import reconciler.replica.pipeline as pipeline_module
from reconciler.bus.connection import ConnectOptions
from reconciler.bus.schemas import SCHEMAS_DIR_ENV
from reconciler.bus.streams import StreamNames
from reconciler.core.fold import fold_input
from reconciler.core.inputs import Input
from reconciler.core.messages import MAX_OUTPUT_BYTES
from reconciler.core.state import Effects, State
from reconciler.replay.readers import (
    COMPARE_STALL_S,
    Found,
    InputReader,
    OutputReader,
    StreamReader,
)
from reconciler.replay.replay import ReplayError, replay_into
from reconciler.replica.snapshot_bucket import SnapshotBucket, SnapshotPublisher, object_name
from reconciler.store.snapshot_format import read_snapshot
from reconciler.store.sqlite import Store
from tests.replica.test_pipeline_in_replica import lenient_pool_schemas
from tests.replica.test_snapshot_bucket import digest_of, fold_with_snapshot, tamper
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.workload import mixed

pytestmark = pytest.mark.timeout(120)


async def test_the_child_reader_replays_what_the_in_process_one_does(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    taken = await fold_with_snapshot(bus, nats_url, db, mixed(600, seed=11))
    live = await digest_of(db)
    opts = ConnectOptions.from_url(nats_url, name="test-replay")
    for from_snapshot in (False, True):
        local = await replay_into(nc, from_snapshot=from_snapshot, batch=7)
        child = await replay_into(nc, from_snapshot=from_snapshot, batch=7, connect_opts=opts)
        for report in (local, child):
            assert report.divergences == []
            assert report.digest == live
            assert report.snapshot_seq == (taken.applied_seq if from_snapshot else 0)
        assert (child.inputs, child.outputs, child.compared, child.dead_letters) == (
            local.inputs,
            local.outputs,
            local.compared,
            local.dead_letters,
        )
        assert child.compared > 0


async def test_a_divergence_is_found_by_the_child_reader(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db, snapshot_interval_s=0)):
        await bus.send(
            b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
            b.pool("web", cpu=1, memory_mib=1024, disk_gib=10, min_ready=0, max_ready=0),
            *[b.admit(f"a{i}", "web", f"vm-{i}") for i in range(5)],
        )
        await bus.wait_caught_up()
    decision = await bus.decision("a3")
    # a decision on the bus that the fold never made, under an id it did make
    await bus.js.publish(
        "rc.out.decision.admit",
        b'{"forged": true, "input_seq": 1}',
        headers={"Nats-Msg-Id": f"decision:{decision['request_id']}:x"},
    )
    opts = ConnectOptions.from_url(nats_url)
    report = await replay_into(nc, connect_opts=opts)
    assert [d.kind for d in report.divergences] == ["unexpected"]
    assert report.divergences[0].found == b'{"forged": true, "input_seq": 1}'


async def test_a_fold_bug_is_replayed_as_the_live_line_recovered(
    nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fold = fold_input  # what the pipeline calls

    def buggy_fold(state: State, seq: int, timestamp: str, item: Input, fx: Effects) -> Effects:
        if getattr(item, "request_id", None) == "a5":
            state.hosts.clear()  # half-changed, then the bug
            raise RuntimeError("a bug in the fold")
        return real_fold(state, seq, timestamp, item, fx)

    monkeypatch.setattr(pipeline_module, "fold_input", buggy_fold)
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)):
        await bus.send(
            b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
            b.pool("web", cpu=1, memory_mib=1024, disk_gib=10, min_ready=0, max_ready=0),
            *[b.admit(f"a{i}", "web", f"vm-{i}") for i in range(10)],
        )
        await bus.wait_caught_up()
        await bus.wait_output("rc.out.dlq.domain")
    live = await digest_of(db)
    # the fold in memory meets the bug, and the store-backed fold of the pipeline takes over
    with_store = replay_module._fold_stream
    calls = []

    async def fold_stream(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["db"])
        return await with_store(*args, **kwargs)

    monkeypatch.setattr(replay_module, "_fold_stream", fold_stream)
    for opts in (None, ConnectOptions.from_url(nats_url)):
        report = await replay_into(nc, connect_opts=opts)
        assert report.divergences == []
        assert report.dead_letters == 1 and report.inputs == 12
        assert report.digest == live
    assert calls == [None, None]


async def test_an_output_too_large_is_replayed_as_the_live_line_dead_lettered_it(
    nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input whose create command would be too large to carry is dead-lettered
    ``too-large`` live; the replay meets the same bound at the same input, and does the
    same (the schemas' bound on an image is lifted to make one)."""
    monkeypatch.setenv(SCHEMAS_DIR_ENV, str(lenient_pool_schemas(tmp_path)))
    kind, huge = b.pool("huge", min_ready=0, max_ready=1)
    huge["image"] = "i" * (MAX_OUTPUT_BYTES + 1_000)
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)):
        await bus.send(
            b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
            (kind, huge),
            b.admit("w1", "huge", "w-1", kind="warm"),
            b.pool("web", cpu=1, memory_mib=1024, disk_gib=10),
            b.admit("a1", "web", "vm-1"),
        )
        await bus.wait_caught_up()
        await bus.wait_output("rc.out.dlq.too-large")
    live = await digest_of(db)
    for opts in (None, ConnectOptions.from_url(nats_url)):
        report = await replay_into(nc, connect_opts=opts)
        assert report.divergences == []
        assert report.dead_letters == 1 and report.inputs == 5
        assert report.digest == live


async def test_a_refused_snapshot_stops_the_child_reader_too(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    load = mixed(200, seed=12)
    async with running_replica(fast_config(nats_url, db, snapshot_interval_s=0)) as replica:
        await bus.send_many(load.setup + load.items)
        await bus.wait_caught_up()
        assert replica.store is not None
        taken = await SnapshotPublisher(
            store=replica.store, bucket=SnapshotBucket(bus.js, "rc"), interval_s=1
        ).take()
        assert taken is not None
    async with await Store.open(db) as store:
        snapshot = await store.call(read_snapshot, "read snapshot")
    assert snapshot.applied_seq == taken.applied_seq
    obs = await SnapshotBucket(bus.js, "rc")._open(create=False)
    assert obs is not None
    await obs.put(object_name(taken.applied_seq), tamper(snapshot.data))
    await bus.js.purge_stream("RC_IN", seq=taken.applied_seq + 1)
    with anyio.fail_after(30), pytest.raises(ReplayError, match="digest"):
        await replay_into(nc, connect_opts=ConnectOptions.from_url(nats_url))
    # nothing of the replay's readers is left on the streams
    for stream in ("RC_IN", "RC_OUT"):
        names = [c.name async for c in _consumers(bus, stream)]
        assert not [n for n in names if n.startswith("replay-")]


async def _consumers(bus: BusClient, stream: str) -> AsyncIterator[Any]:
    for info in await bus.js.consumers_info(stream):
        yield info


async def test_a_reader_child_that_cannot_connect_fails_the_replay_with_the_reason(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    await bus.send(b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000))
    unreachable = ConnectOptions.from_url("nats://127.0.0.1:1", initial_timeout_s=1.0)
    with anyio.fail_after(30), pytest.raises(ReplayError, match="reading the streams failed"):
        await replay_into(nc, connect_opts=unreachable)


async def test_the_output_reader_hands_outputs_over_as_it_reads(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    """The reader child forwards what it keeps of the OUT stream while it reads (so the
    replay takes it in during the fold); forwarded and kept, in order, are every output
    with a Nats-Msg-Id, as the reader that keeps everything finds them."""
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db", snapshot_interval_s=0)):
        load = mixed(200, seed=13)
        await bus.send_many(load.setup + load.items)
        await bus.wait_caught_up()
    names = StreamNames.for_prefix("rc")
    js = nc.jetstream()
    out_last = int((await js.stream_info(names.out_stream)).state.last_seq or 0)
    whole = OutputReader(nc, js, names, chunk=40, since=None)
    handed: list[list[Found]] = []

    async def forward(found: list[Found]) -> None:
        handed.append(found)

    forwarding = OutputReader(
        nc, js, names, chunk=40, since=None, forward=forward, forward_every=50
    )
    for reader in (whole, forwarding):
        reader.until(out_last)
        await reader.run()
    assert len(whole.found) > 100
    assert len(handed) >= 2 and all(len(part) >= 50 for part in handed)
    assert [f for part in handed for f in part] + forwarding.found == whole.found


async def _thirty_outputs(nc: Client) -> StreamNames:
    bus = BusClient(nc)
    await bus.ensure_streams()
    js = nc.jetstream()
    for i in range(30):
        await js.publish(f"rc.out.decision.r{i}", b"{}", headers={"Nats-Msg-Id": f"out:r{i}"})
    return StreamNames.for_prefix("rc")


async def test_the_output_reader_reads_to_the_streams_end_when_named_one_behind_it(
    nc: Client,
) -> None:
    """The OUT stream's end as named once the fold is done can be behind the stream (a
    clustered stream answering just after its leader moved): once the reader reached
    it, it asks the end again until it stays put, and reads up to there."""
    names = await _thirty_outputs(nc)
    js = nc.jetstream()
    reader = OutputReader(nc, js, names, chunk=8, since=None)
    reader.until(12)  # what a stale answer would have said
    await reader.run()
    assert reader.last == 30
    assert [msg_id for _, msg_id, _, _ in reader.found] == [f"out:r{i}" for i in range(30)]


class _LosesOne(StreamReader):
    """A stream reader whose connection loses one delivery, of stream sequence ``lose``,
    once: what a network can lose between the server and the client. At the tail no
    later delivery shows the consumer's sequence skipping."""

    def __init__(self, *args: Any, lose: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose = lose

    def _on_message(
        self, generation: int, subject: str, reply: str, data: bytes, headers: bytes | None
    ) -> None:
        tokens = reply.split(".")
        seq = int(tokens[5]) if len(tokens) == 9 else int(tokens[7]) if len(tokens) >= 12 else 0
        if self.lose and seq == self.lose:
            self.lose = 0
            return
        super()._on_message(generation, subject, reply, data, headers)


async def test_a_delivery_lost_at_the_tail_is_read_again_not_waited_for(nc: Client) -> None:
    """The last delivery lost: the requests end with nothing short of the stream's
    known end, and the reader starts again after the last one taken, at once rather than
    after COMPARE_STALL_S (the output reader) or never (the inputs)."""
    names = await _thirty_outputs(nc)
    js = nc.jetstream()
    lossy = _LosesOne(nc, js, stream=names.out_stream, chunk=8, timeout_s=0.3, lose=30)
    taken: list[int] = []
    with anyio.fail_after(10):
        while lossy.last_taken < 30:
            taken += [seq for _, seq, _, _ in await lossy.take(until=30)]
    await lossy.close()
    assert taken == list(range(1, 31))
    # the output reader, once told the stream's end
    outputs = OutputReader(nc, js, names, chunk=8, since=None)
    outputs.reader = _LosesOne(nc, js, stream=names.out_stream, chunk=8, timeout_s=0.3, lose=30)
    outputs.until(30)
    with anyio.fail_after(COMPARE_STALL_S / 3):
        await outputs.run()
    assert [msg_id for _, msg_id, _, _ in outputs.found] == [f"out:r{i}" for i in range(30)]
    # the inputs' reader, which knows its last sequence from the start
    inputs = InputReader(nc, js, names, chunk=8)
    await inputs.start_inputs(1, 30)
    inputs._reader = _LosesOne(
        nc, js, stream=names.out_stream, chunk=8, timeout_s=0.3, start_seq=1, lose=30
    )
    seqs: list[int] = []
    with anyio.fail_after(10):
        while (batch := await inputs.take_inputs()) is not None:
            seqs += [seq for _, _, seq, _, _ in batch]
    await inputs.close_inputs()
    assert seqs == list(range(1, 31))


@pytest.mark.parametrize("flags", [["--no-websocket"], []])
def test_the_reader_child_loads_the_websocket_client_only_when_asked(flags: list[str]) -> None:
    """The child's start-up is paid while the snapshot is fetched: without a ``ws://``
    server it does not import aiohttp (nats-py's WebSocket transport)."""
    code = (
        "import sys; from reconciler.replay import reader_child; "
        f"reader_child.main({flags!r}); "
        "print('websocket' if sys.modules.get('aiohttp') is not None else 'none')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=b"", capture_output=True, timeout=60, check=True
    )
    # the child's stdout is its pipe to the replay: what it prints goes to stderr
    assert done.stderr.decode().split()[-1] == ("none" if flags else "websocket")


def test_the_reader_child_widens_its_pipe_to_the_replay() -> None:
    """Frames of inputs (about 150 KB for 1,000) wait in the pipe while the fold runs;
    at Linux's default 64 KiB they crossed only while the fold waited for them."""
    allowed = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    with subprocess.Popen(
        [sys.executable, "-m", "reconciler.replay.reader_child", "--no-websocket"],
        stdin=subprocess.DEVNULL,  # no request: it widens its pipe, then stops
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as child:
        assert child.stdout is not None
        child.wait(timeout=60)
        size = fcntl.fcntl(child.stdout.fileno(), fcntl.F_GETPIPE_SZ)
    assert size == min(4 << 20, allowed) > 65536


async def test_inputs_no_leader_decided_yet_are_undecided_not_divergences(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db", snapshot_interval_s=0)):
        await bus.send(
            b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
            b.pool("web", cpu=1, memory_mib=1024, disk_gib=10, min_ready=0, max_ready=0),
            *[b.admit(f"a{i}", "web", f"vm-{i}") for i in range(3)],
        )
        await bus.wait_caught_up()
        await bus.decision("a2")
    # no replica runs now: these stay undecided at the stream's tail
    await bus.send(*[b.admit(f"late{i}", "web", f"vm-late-{i}") for i in range(2)])
    opts = ConnectOptions.from_url(nats_url)
    report = await replay_into(nc, connect_opts=opts)
    assert report.divergences == [] and report.ok
    assert {d.kind for d in report.undecided} == {"undecided"}
    assert {d.msg_id.split(":")[1] for d in report.undecided} == {"late0", "late1"}

    # an output lost before the tail is still a divergence, the tail still undecided
    names = StreamNames.for_prefix("rc")
    first = await bus.decision("a0")
    seq = await _out_seq(nc, names.out_stream, first["request_id"])
    await bus.js.delete_msg(names.out_stream, seq)
    again = await replay_into(nc, connect_opts=opts)
    assert [d.kind for d in again.divergences] == ["missing"] and not again.ok
    assert len(again.undecided) == len(report.undecided)


async def _out_seq(nc: Client, stream: str, request_id: str) -> int:
    """The OUT stream's sequence of the decision of ``request_id``."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
        msg = await js.get_msg(stream, seq)
        if (msg.headers or {}).get("Nats-Msg-Id", "").startswith(f"decision:{request_id}:"):
            return seq
    raise AssertionError(f"no decision of {request_id} on {stream}")
