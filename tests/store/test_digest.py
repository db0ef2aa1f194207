"""The state digest with known lease encodings (reconciler.store.digest's rules): the
same digest as without, whatever the known entries are, and a decoded snapshot records
every lease's encoding as its verification digest computed it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from reconciler.core.model import Lease, LeaseId
from reconciler.core.state import State
from reconciler.store.codec import encode
from reconciler.store.digest import state_digest
from reconciler.store.snapshot_format import (
    DecodedSnapshot,
    decode_snapshot,
    read_snapshot,
    restore_batch,
)
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.workload import mixed


def folded_state() -> State:
    load = mixed(300, seed=5)
    fleet = b.Fleet()
    fleet.send(*load.setup, *load.items)
    assert len(fleet.state.leases) > 100
    return fleet.state


def test_a_digest_records_every_lease_with_its_encoding() -> None:
    state = folded_state()
    record: dict[LeaseId, tuple[Lease, bytes]] = {}
    assert state_digest(state, record=record) == state_digest(state)
    assert record.keys() == state.leases.keys()
    for lease_id, (lease, data) in record.items():
        assert lease is state.leases[lease_id]
        assert data == encode(lease)


def test_known_encodings_give_the_same_digest_when_some_are_stale() -> None:
    state = folded_state()
    plain = state_digest(state)
    known: dict[LeaseId, tuple[Lease, bytes]] = {}
    state_digest(state, record=known)
    ids = sorted(state.leases)
    # replaced by an equal copy, by a changed lease, removed, and one that is new
    state.leases[ids[0]] = dataclasses.replace(state.leases[ids[0]])
    state.leases[ids[1]] = dataclasses.replace(state.leases[ids[1]], ready_seq=12345)
    del state.leases[ids[2]]
    new = dataclasses.replace(state.leases[ids[3]], lease_id=LeaseId("zz-new"))
    state.leases[new.lease_id] = new
    # an entry whose object is not the state's, with bytes that would change the digest
    known[ids[4]] = (dataclasses.replace(state.leases[ids[4]]), b"not the encoding")
    changed = state_digest(state)
    assert changed != plain
    assert state_digest(state, known=known) == changed
    assert state_digest(state, known={}) == changed


def test_a_known_encoding_is_taken_for_the_very_same_object() -> None:
    """White box: the known bytes are what is hashed when the object is the state's (so
    they must be its encoding, as a recording digest gives them)."""
    state = folded_state()
    lease_id = sorted(state.leases)[0]
    lease = state.leases[lease_id]
    equal = {lease_id: (dataclasses.replace(lease), b"{}")}
    same = {lease_id: (lease, b"{}")}
    assert state_digest(state, known=equal) == state_digest(state)
    assert state_digest(state, known=same) != state_digest(state)


async def test_a_decoded_snapshot_keeps_its_lease_encodings(tmp_path: Path) -> None:
    state = folded_state()
    whole = DecodedSnapshot(state=state, published_seq=0, digest="")
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await store.write(restore_batch(whole))
        snapshot = await store.call(read_snapshot, "read snapshot")
    assert snapshot.digest == state_digest(state)
    decoded = decode_snapshot(snapshot.data)
    encodings = decoded.lease_encodings
    assert encodings.keys() == decoded.state.leases.keys() == state.leases.keys()
    for lease_id, (lease, data) in encodings.items():
        assert lease is decoded.state.leases[lease_id]
        assert data == encode(lease)
        assert sys.getsizeof(data) < len(data) + 64  # a bytes of its own size
    assert state_digest(decoded.state, known=encodings) == snapshot.digest


def queued_state() -> State:
    fleet = b.Fleet()
    fleet.send(b.snapshot("h1", cpu=4), b.pool("p"))
    fleet.send(b.admit("a1", "p", "vm-1"), b.admit("a2", "p", "vm-2"))
    fleet.send(b.admit("q1", "p", "vm-3", wait_s=60), b.admit("q2", "p", "vm-4", wait_s=60))
    assert len(fleet.state.waiting) == 2
    return fleet.state


async def test_waiting_requests_survive_the_store_and_a_snapshot(tmp_path: Path) -> None:
    state = queued_state()
    whole = DecodedSnapshot(state=state, published_seq=0, digest="")
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await store.write(restore_batch(whole))
        snapshot = await store.call(read_snapshot, "read snapshot")
        loaded = await store.load_state()
    assert snapshot.digest == state_digest(state) == state_digest(loaded)
    assert loaded.waiting == state.waiting
    assert loaded.queue.per_pool == state.queue.per_pool == {"p": 2}
    decoded = decode_snapshot(snapshot.data)
    assert decoded.state.waiting == state.waiting


def test_a_state_that_never_queued_keeps_its_digest() -> None:
    """The queue's section is in the digest only while something waits."""
    state = queued_state()
    with_queue = state_digest(state)
    waiting = dict(state.waiting)
    state.waiting.clear()
    without = state_digest(state)
    assert with_queue != without
    assert b"[waiting]" not in without.encode()
    state.waiting.update(waiting)
