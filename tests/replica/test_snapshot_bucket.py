"""Snapshots (issue 15): canonical bytes with a digest, published by the leader to the
object store ``<prefix>_snapshots``; a new replica starts from the newest one, a replay of
a stream whose oldest inputs aged out starts from one, and a tampered one is refused.
All over a real nats-server and real SQLite files."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.replay.replay import ReplayError, replay_into
from reconciler.replica.snapshot_bucket import (
    SnapshotBucket,
    SnapshotPublisher,
    object_name,
    restore_newest,
)
from reconciler.store.digest import state_digest
from reconciler.store.snapshot_format import (
    Snapshot,
    SnapshotError,
    decode_snapshot,
    read_snapshot,
    restore_batch,
)
from reconciler.store.sqlite import Store
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.workload import Workload, mixed

pytestmark = pytest.mark.timeout(120)


async def digest_of(db: Path) -> str:
    async with await Store.open(db) as store:
        return state_digest(await store.load_state())


async def fold_some(bus: BusClient, nats_url: str, db: Path, commands: int, seed: int) -> None:
    """Run one replica over a mixed workload until it has folded and published it all."""
    load = mixed(commands, seed=seed)
    async with running_replica(fast_config(nats_url, db, snapshot_interval_s=0)):
        await bus.send_many(load.setup + load.items)
        await bus.wait_caught_up()


async def fold_with_snapshot(bus: BusClient, nats_url: str, db: Path, load: Workload) -> Snapshot:
    """Run one replica over ``load``: its first half, then a snapshot taken by the leader's
    publisher, then the second half, all folded and published. The snapshot taken."""
    half = len(load.items) // 2
    async with running_replica(fast_config(nats_url, db, snapshot_interval_s=0)) as replica:
        await bus.send_many(load.setup + load.items[:half])
        await bus.wait_caught_up()
        assert replica.store is not None
        bucket = SnapshotBucket(bus.js, "rc")
        taken = await SnapshotPublisher(store=replica.store, bucket=bucket, interval_s=1).take()
        assert taken is not None
        await bus.send_many(load.items[half:])
        await bus.wait_caught_up()
    return taken


def tamper(data: bytes) -> bytes:
    """The snapshot with one lease's JSON changed (still well-formed)."""
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b'["leases",'):
            row = orjson.loads(line)
            row[2]["instance"] = row[2]["instance"] + "x"
            lines[i] = orjson.dumps(row)
            return b"\n".join(lines)
    raise AssertionError("no lease in the snapshot")


async def test_a_snapshot_round_trips_with_the_state_digest(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    await fold_some(bus, nats_url, db, 300, seed=3)
    async with await Store.open(db) as store:
        state = await store.load_state()
        snapshot = await store.call(read_snapshot, "read snapshot")
    assert snapshot.applied_seq == state.applied_seq > 0
    assert snapshot.digest == state_digest(state)  # computed from the rows, not decoded
    assert await store_snapshot_is_canonical(db, snapshot.data)
    decoded = decode_snapshot(snapshot.data)
    assert state_digest(decoded.state) == snapshot.digest
    assert decoded.state.leases == state.leases and decoded.state.jobs == state.jobs
    restored = tmp_path / "restored.db"
    async with await Store.open(restored) as fresh:
        assert await fresh.write(restore_batch(decoded))
        again = await fresh.load_state()
    assert state_digest(again) == snapshot.digest
    assert again.booked == state.booked and again.pool_counts == state.pool_counts


async def store_snapshot_is_canonical(db: Path, data: bytes) -> bool:
    """Two reads of the same committed state give the same bytes."""
    async with await Store.open(db) as store:
        return (await store.call(read_snapshot, "read snapshot")).data == data


async def test_a_snapshot_whose_digest_does_not_match_is_refused(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    await fold_some(bus, nats_url, db, 100, seed=4)
    async with await Store.open(db) as store:
        snapshot = await store.call(read_snapshot, "read snapshot")
    with pytest.raises(SnapshotError, match="digest"):
        decode_snapshot(tamper(snapshot.data))
    with pytest.raises(SnapshotError, match="not a reconciler-snapshot"):
        decode_snapshot(b'{"format": "other"}\n')
    with pytest.raises(SnapshotError, match="line 2"):
        decode_snapshot(snapshot.data.split(b"\n")[0] + b"\n[not json\n")
    # in the bucket: a new replica's restore skips it and writes nothing
    bucket = SnapshotBucket(bus.js, "rc")
    await bucket.put(snapshot)
    obs = await bus.js.object_store("rc_snapshots")
    await obs.put(object_name(snapshot.applied_seq), tamper(snapshot.data))
    async with await Store.open(tmp_path / "empty.db") as empty:
        assert await restore_newest(bucket, empty, stream_last=10**9) is None
        assert await empty.applied_seq() == 0
    with pytest.raises(SnapshotError, match="digest"):
        await bucket.fetch(snapshot.applied_seq)


async def test_the_leader_publishes_snapshots_and_a_new_replica_starts_from_one(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    first_db = tmp_path / "first.db"
    load = mixed(400, seed=5)
    bucket = SnapshotBucket(bus.js, "rc")
    config = fast_config(nats_url, first_db, snapshot_interval_s=0.2, snapshot_keep=2)
    async with running_replica(config):
        await bus.send_many(load.setup + load.items)
        await bus.wait_caught_up()
        applied = int((await bus.result("health"))["applied_seq"])
        with anyio.fail_after(20):
            while not (positions := await bucket.positions()) or positions[-1] < applied:  # noqa: ASYNC110 - another process's bucket
                await anyio.sleep(0.1)
    assert len(positions) <= 2  # the older ones were pruned
    newest = positions[-1]
    later = mixed(50, seed=6)
    await bus.send_many(later.items)  # a tail the new replica folds after the snapshot
    second_db = tmp_path / "second.db"
    async with running_replica(fast_config(nats_url, second_db, snapshot_interval_s=0)) as r:
        await bus.wait_caught_up()
        assert r.pipeline is not None
        folded = r.pipeline.folded + sum(r.pipeline.dead_letters.values())
        head = int((await bus.js.stream_info("RC_IN")).state.last_seq or 0)
        assert folded <= head - newest  # only the tail, not the stream from seq 1
        health = await bus.result("health")
        assert health["applied_seq"] == head
    # the same state as folding the whole stream from seq 1, and the same decisions
    whole = await replay_into(nc)
    assert whole.ok and whole.snapshot_seq == 0
    assert await digest_of(second_db) == whole.digest


async def test_replay_of_an_aged_out_stream_starts_from_a_snapshot(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    taken = await fold_with_snapshot(bus, nats_url, db, mixed(600, seed=8))
    live = await digest_of(db)
    whole = await replay_into(nc)
    assert whole.ok and whole.snapshot_seq == 0 and whole.digest == live
    # the oldest inputs age out: the stream now starts after the snapshot's position
    await bus.js.purge_stream("RC_IN", seq=taken.applied_seq + 1)
    info = (await bus.js.stream_info("RC_IN")).state
    assert info.first_seq == taken.applied_seq + 1
    report = await replay_into(nc)
    assert report.divergences == []
    assert report.snapshot_seq == taken.applied_seq
    assert report.snapshot_digest == taken.digest
    assert report.first_seq == taken.applied_seq + 1
    assert report.digest == live
    assert report.compared > 0 and report.inputs == info.last_seq - taken.applied_seq
    # every decision after the snapshot is compared: the whole replay compared those too
    decided_after = sum(
        1
        for m in await bus.outputs("rc.out.decision.>")
        if m.msg_id is not None and m.json()["input_seq"] > taken.applied_seq
    )
    assert report.compared >= decided_after > 0


async def test_replay_refuses_an_aged_out_stream_without_a_good_snapshot(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    await fold_some(bus, nats_url, db, 100, seed=9)
    head = int((await bus.js.stream_info("RC_IN")).state.last_seq or 0)
    await bus.js.purge_stream("RC_IN", seq=head - 10)
    with pytest.raises(ReplayError, match="aged out"):
        await replay_into(nc)
    # a snapshot whose bytes were changed is refused, with the reason
    async with await Store.open(db) as store:
        snapshot = await store.call(read_snapshot, "read snapshot")
    obs = await SnapshotBucket(bus.js, "rc")._open(create=True)
    assert obs is not None
    await obs.put(object_name(snapshot.applied_seq), tamper(snapshot.data))
    with pytest.raises(ReplayError, match="digest"):
        await replay_into(nc)


def test_the_replay_command_says_it_started_from_a_snapshot(nats_url: str, tmp_path: Path) -> None:
    import nats
    from click.testing import CliRunner

    from reconciler.cli.main import cli

    db = tmp_path / "rc.db"

    async def prepare() -> int:
        nc = await nats.connect(nats_url)
        try:
            bus = BusClient(nc)
            await bus.ensure_streams()
            taken = await fold_with_snapshot(bus, nats_url, db, mixed(200, seed=12))
            await bus.js.purge_stream("RC_IN", seq=taken.applied_seq + 1)
            return taken.applied_seq
        finally:
            await nc.close()

    seq = anyio.run(prepare)
    runner = CliRunner()
    text = runner.invoke(cli, ["replay", "--nats-url", nats_url, "--log-level", "error"])
    assert text.exit_code == 0, text.output
    assert f"started from the snapshot at seq {seq} (digest " in text.output
    assert f"replayed inputs {seq + 1}.." in text.output and "no divergences" in text.output
    as_json = runner.invoke(
        cli, ["replay", "--nats-url", nats_url, "--json", "--from-snapshot", "--log-level", "error"]
    )
    report = orjson.loads(as_json.output)
    assert as_json.exit_code == 0 and report["ok"] and report["snapshot_seq"] == seq


async def test_an_empty_replica_refuses_an_aged_out_stream_without_a_snapshot(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    from reconciler.replica.replica import Replica, StartupError

    bus = BusClient(nc)
    await bus.ensure_streams()
    await fold_some(bus, nats_url, tmp_path / "rc.db", 60, seed=13)
    head = int((await bus.js.stream_info("RC_IN")).state.last_seq or 0)
    await bus.js.purge_stream("RC_IN", seq=head - 5)
    fresh = tmp_path / "fresh.db"
    with pytest.raises(StartupError, match="aged out"):
        await Replica(fast_config(nats_url, fresh, snapshot_interval_s=0)).run(stop=anyio.Event())
    async with await Store.open(fresh) as store:
        assert await store.applied_seq() == 0  # nothing was written


async def test_a_snapshot_of_another_stream_is_never_used(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    from reconciler.replica.snapshot_bucket import stream_identity

    bus = BusClient(nc)
    await bus.ensure_streams()
    db = tmp_path / "rc.db"
    await fold_some(bus, nats_url, db, 60, seed=14)
    async with await Store.open(db) as store:
        snapshot = await store.call(read_snapshot, "read snapshot")
    # taken from a stream since deleted and created again: another history
    await SnapshotBucket(bus.js, "rc", "2020-01-01T00:00:00+00:00").put(snapshot)
    current = SnapshotBucket(bus.js, "rc", await stream_identity(bus.js, "RC_IN"))
    assert await current.positions() == []
    async with await Store.open(tmp_path / "empty.db") as empty:
        assert await restore_newest(current, empty, stream_last=10**9) is None
        assert await empty.applied_seq() == 0
    with pytest.raises(ReplayError, match="no usable snapshot"):
        await replay_into(nc, from_snapshot=True)
    # the same snapshot, named for this stream, is used
    await current.put(snapshot)
    assert await current.positions() == [snapshot.applied_seq]


async def test_snapshot_objects_are_read_in_chunks_and_checked(nc: Client) -> None:
    """The bucket reads an object of many chunks whole, and refuses one whose bytes do
    not match its size and SHA-256 (a chunk added behind the object store's back)."""
    bus = BusClient(nc)
    bucket = SnapshotBucket(bus.js, "rc")
    await bucket.ensure()
    obs = await bus.js.object_store("rc_snapshots")
    blob = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes: 9 chunks of 128 KiB
    await obs.put("state-0000000000000007", blob)
    store = await bucket._open(create=False)
    assert store is not None
    assert await bucket._read(store, "state-0000000000000007") == blob
    assert await bucket._read(store, "state-0000000000000007") == blob  # and again
    info = await obs.get_info("state-0000000000000007")
    await bus.js.publish(f"$O.rc_snapshots.C.{info.nuid}", b"extra")
    with pytest.raises(SnapshotError, match="damaged"):
        await bucket._read(store, "state-0000000000000007")
    with pytest.raises(SnapshotError, match="no object"):
        await bucket._read(store, "state-0000000000000008")
