"""The SQLite store (reconciler.store.sqlite): exact reloads at every cut, one
forward-only transaction per batch, outbox and journal, migrations, error translation,
the entity codec, files private to their owner, and the rows the fold's retention evicted
deleted."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import stat
import tempfile
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import aiosqlite
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.messages import Output
from reconciler.core.model import (
    ClassName,
    HostName,
    JobId,
    LeaseId,
    LeaseState,
    PoolName,
    RequestId,
)
from reconciler.core.state import Effects, State
from reconciler.store import (
    SchemaTooNew,
    Store,
    StoreClosed,
    StoreError,
    encode_batch,
)
from reconciler.store import migrations as mig
from reconciler.store.codec import CodecError
from reconciler.store.digest import state_digest
from reconciler.store.outbox_rows import unpack_outputs
from tests.core.test_fold_properties import out_tuples
from tests.core.test_retention import Clocked
from tests.support import builders as b
from tests.support.builders import admit, cmd, message, pool, snapshot
from tests.support.folding import commit, fold_batch, transitions_at, unsent_outbox

# ============================================================================ scenario

ADOPTEE_TAGS = {
    "user.rc.lease-id": "L-from-another-journal",
    "user.rc.pool": "warm",
    "user.rc.kind": "warm",
    "user.rc.job": "job-a",
}


def scenario_items() -> list[tuple[str, dict[str, Any]]]:
    """Hosts with GPUs, a GPU profile (revised) and policies (one rejected), classes
    (one rejected), pools, warm leases ready, claimed and injected, an adoption, foreign
    load, a preemption whose gate opens, one still pending on a suspect victim, a drain,
    releases, a re-sent request id, a re-render, suspicion and verification."""
    return [
        b.gpu_profile("a100-default", power_limit_w=300, persistence=True),
        b.snapshot(
            "h1",
            cpu=10,
            gpus=[b.gpu(0), b.gpu(1), b.gpu(2, numa=1), b.gpu(3, numa=1)],
            labels={"zone": "a", "gpu": "yes"},
            gpu_profile="a100-default",
        ),
        b.snapshot("h2", cpu=12, memory_mib=32768, labels={"zone": "b"}),
        b.gpu_policy(
            "mig-on-a",
            priority=1,
            overrides={"mig_mode": "enabled", "compute_mode": "exclusive-process"},
            host_labels={"zone": "a"},
        ),
        b.gpu_policy(
            "no-ecc-3",
            priority=2,
            overrides={"ecc": False, "power_limit_w": None},
            indexes=[3],
            models=["A100"],
        ),
        b.gpu_policy("bad", overrides={"mig_mode": "sideways"}),
        b.gpu_class("a100", count=1, model="A100"),
        b.gpu_class("broken", count=0),
        b.pool("warm", min_ready=1, max_ready=4, max_instances=10, host_selector={"zone": "b"}),
        b.pool("warm-a", max_ready=3, max_instances=10, priority=1, host_selector={"zone": "a"}),
        b.pool("gpu", claims=[{"name": "g", "class": "a100"}], priority=5, placement="spread"),
        b.pool("big", cpu=6, memory_mib=8192, priority=9),
        b.admit("w1", "warm", "w-1", kind="warm"),
        b.admit("w2", "warm", "w-2", kind="warm"),
        b.admit("w3", "warm", "w-3", kind="warm"),
        b.lifecycle("h2", "instance-created", "w-1"),
        b.lifecycle("h2", "instance-ready", "w-1"),
        b.lifecycle("h2", "instance-ready", "w-2"),
        b.lifecycle("h2", "instance-ready", "w-3"),
        b.cmd("claim-warm", "c1", pool="warm", job="job-1"),
        b.cmd("mark-warm-injected", "inj1", instance="w-1", job="job-1"),
        b.admit("g1", "gpu", "gpu-1", job="job-g"),
        b.cmd("mark-created", "mc-g1", instance="gpu-1"),
        b.cmd("claim-warm", "c1", pool="warm", job="job-1"),  # same request id: re-sent
        b.inventory(
            "h2",
            [
                b.instance("w-1"),
                b.instance("w-2"),
                b.instance("w-3"),
                b.instance("foreign", cpu=1),
                b.instance("adoptee", config=ADOPTEE_TAGS),
            ],
        ),
        b.admit("big1", "big", "big-1", preemptible=True, host="h2"),  # 26: two victims
        b.lifecycle("h2", "instance-deleted", "w-2"),
        b.lifecycle("h2", "instance-deleted", "w-3"),
        b.snapshot("h2", revision=2, cpu=12, memory_mib=32768, labels={"zone": "b"}),  # gate
        b.cmd("mark-created", "mc-big1", instance="big-1"),
        b.admit("wa1", "warm-a", "wa-1", kind="warm"),
        b.admit("wa2", "warm-a", "wa-2", kind="warm"),
        b.admit("wa3", "warm-a", "wa-3", kind="warm"),
        b.lifecycle("h1", "instance-ready", "wa-1"),
        b.lifecycle("h1", "instance-ready", "wa-2"),
        b.lifecycle("h1", "instance-ready", "wa-3"),
        b.admit("big2", "big", "big-2", preemptible=True),  # 37: victims wa-2, wa-3
        b.admit("big2", "big", "big-2", preemptible=True),  # re-sent: current phase
        b.cmd("authorize-warm-drain", "d1", instance="wa-1"),
        b.lifecycle("h1", "instance-deleted", "wa-3"),
        b.cmd("release", "rel-g1", instance="gpu-1"),
        b.cmd("release", "rel-none", instance="nobody"),
        b.cmd("mark-deleting", "md1", instance="w-1"),
        b.admit("g2", "gpu", "gpu-2"),
        b.cmd("mark-created", "mc-g2", instance="gpu-2"),
        b.inventory("h1", [b.instance("wa-1"), b.instance("wa-2")], revision=1),
        b.gpu_profile("a100-default", revision=2, mig_mode="enabled"),
        b.cmd("render-runtime", "rr1", instance="gpu-2"),
        b.observation("h1", "gpu-2", present=True, checked_revision=1),
        b.inventory("h1", [b.instance("wa-1")], revision=2),
        b.observation("h1", "gpu-2", present=True, checked_revision=2),
        b.admit("nope", "no-such-pool", "x-1"),
    ]


MESSAGES: list[Message] = [b.message(i, item) for i, item in enumerate(scenario_items(), 1)]
N = len(MESSAGES)

PERSISTED = (
    "applied_seq",
    "hosts",
    "pools",
    "classes",
    "profiles",
    "policies",
    "leases",
    "decisions",
    "jobs",
)
DERIVED = (
    "by_instance",
    "on_host",
    "pool_counts",
    "booked",
    "gpus_held",
    "pool_booking",
    "pool_warm_unclaimed",
    "pool_ready",
    "pool_booting",
    "host_order",
)


def folded(messages: Sequence[Message]) -> tuple[State, Effects]:
    state = State()
    return state, fold_batch(state, messages)


FULL_STATE, FULL_FX = folded(MESSAGES)


def reindexed(state: State) -> State:
    """The persisted part of ``state`` with freshly rebuilt indexes."""
    fresh = State(**{name: _copy(getattr(state, name)) for name in PERSISTED})
    fresh.reindex()
    return fresh


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def assert_same_state(loaded: State, expected: State) -> None:
    for name in PERSISTED:
        assert getattr(loaded, name) == getattr(expected, name), name
    reference = reindexed(expected)
    for name in DERIVED:
        assert getattr(loaded, name) == getattr(reference, name), name


def outputs(fx: Effects) -> list[tuple[str, str | None, bytes]]:
    return [(o.subject, o.msg_id, o.payload) for o in fx.outputs]


def transitions(fx: Effects) -> list[tuple[int, str, str, str | None, str]]:
    return [(t.input_seq, t.lease_id, t.event, t.from_state, t.to_state) for t in fx.transitions]


def raw_rows(db: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return [tuple(r) for r in conn.execute(sql, params)]


def all_outbox(db: Path) -> list[tuple[str, str | None, bytes]]:
    rows = raw_rows(db, "SELECT outputs FROM outbox_batches ORDER BY input_seq")
    return [output for (blob,) in rows for output in unpack_outputs(bytes(blob))]


def all_journal(db: Path) -> list[tuple[int, str, str, str | None, str]]:
    sql = "SELECT input_seq, lease_id, event, from_state, to_state FROM journal ORDER BY id"
    return [tuple(r) for r in raw_rows(db, sql)]


def test_the_scenario_covers_what_it_claims() -> None:
    leases = FULL_STATE.leases
    states = {le.state for le in leases.values()}
    assert {LeaseState.CLAIMED, LeaseState.CREATED, LeaseState.RESERVED} <= states
    assert {LeaseState.DRAINING, LeaseState.VICTIM, LeaseState.DELETING} <= states
    assert LeaseState.RELEASED in states
    assert leases[LeaseId("L37")].awaiting_victims == ("L32",)  # still pending at the end
    assert leases[LeaseId("L32")].suspect_revision == 2
    assert any(le.adopted for le in leases.values())
    assert any(le.gpus for le in leases.values())
    assert FULL_STATE.hosts[HostName("h2")].foreign_instances == ("foreign",)
    assert set(FULL_STATE.policies) == {"mig-on-a", "no-ecc-3"}
    assert FULL_STATE.profiles["a100-default"].revision == 2
    assert len(FULL_STATE.jobs) == 3
    phases = {orjson.loads(o.payload).get("outcome") for o in FULL_FX.outputs}
    assert {"admitted", "pending", "claimed", "rejected", "authorized", "ok"} <= phases
    # a gate opened during the run (big1), not only at the end
    assert [t.to_state for t in FULL_FX.transitions if t.lease_id == "L26"] == [
        "reserved",
        "created",
    ]


# ============================================================================ cut tests


@pytest.mark.parametrize("cut", range(N + 1))
async def test_reload_at_every_cut_gives_the_same_state_and_outputs(
    tmp_path: Path, cut: int
) -> None:
    db = tmp_path / "rc.db"
    prefix_state, prefix_fx = folded(MESSAGES[:cut])
    async with await Store.open(db) as store:
        committed = await commit(store, prefix_state, prefix_fx, applied_seq=cut)
        assert committed is (cut > 0)
    async with await Store.open(db) as store:
        loaded = await store.load_state()
        assert_same_state(loaded, prefix_state)
        # the bus redelivers from the start: the fold skips what is at or below the
        # position, so only the rest has effects
        rest_fx = fold_batch(loaded, MESSAGES)
        assert await commit(store, loaded, rest_fx, applied_seq=N) is (cut < N)
    async with await Store.open(db) as store:
        final = await store.load_state()
        assert await store.applied_seq() == N
    assert_same_state(final, FULL_STATE)
    assert all_outbox(db) == outputs(FULL_FX)
    assert all_journal(db) == transitions(FULL_FX)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    cuts=st.sets(st.integers(min_value=1, max_value=N - 1), max_size=12),
    restarts=st.sets(st.integers(min_value=1, max_value=N - 1), max_size=4),
)
async def test_any_batching_with_restarts_gives_the_same_result(
    cuts: set[int], restarts: set[int]
) -> None:
    """Batches of any size, with the process restarting (reload from disk) at some batch
    ends; the final state, the outbox and the journal do not depend on either."""
    bounds = sorted(cuts | {N})
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "rc.db"
        store = await Store.open(db)
        state = State()
        try:
            start = 0
            for end in bounds:
                fx = fold_batch(state, MESSAGES[start:end])
                assert await commit(store, state, fx, applied_seq=end)
                if end in restarts:
                    await store.close()
                    store = await Store.open(db)
                    state = await store.load_state()
                start = end
            final = await store.load_state()
        finally:
            await store.close()
        assert_same_state(final, FULL_STATE)
        assert all_outbox(db) == outputs(FULL_FX)
        assert all_journal(db) == transitions(FULL_FX)


async def test_warm_claims_are_summed_per_pool_across_batches(tmp_path: Path) -> None:
    """The warm hit ratio's counts: every claim-warm decided for a new job on a known
    pool, by outcome, whatever the batching; a request id re-sent counts once."""
    extra = [
        b.cmd("claim-warm", "c-miss", pool="big", job="job-miss"),  # no warm VM there
        b.cmd("claim-warm", "c-none", pool="nope", job="job-none"),  # unknown: not counted
    ]
    messages = [*MESSAGES, *(message(N + 1 + i, item) for i, item in enumerate(extra))]
    expected: dict[str, list[int]] = {}
    for pool_name, outcome in folded(messages)[1].warm_claims:
        expected.setdefault(pool_name, [0, 0])[outcome != "claimed"] += 1
    assert expected["warm"] == [1, 0] and expected["big"] == [0, 1] and "nope" not in expected
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await store.warm_claims() == {}
        state = State()
        for start, end in ((0, 18), (18, N), (N, len(messages))):
            fx = fold_batch(state, messages[start:end])
            assert await commit(store, state, fx, applied_seq=end)
        assert await store.warm_claims() == {p: tuple(n) for p, n in expected.items()}


async def test_an_encoded_batch_is_a_snapshot(tmp_path: Path) -> None:
    """``encode_batch`` then folding on while ``write`` runs: the batch is what was
    folded when it was encoded (pipelining is safe)."""
    state, fx = folded(MESSAGES[:20])
    batch = encode_batch(state, fx, applied_seq=20)
    more = fold_batch(state, MESSAGES[20:30])
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await store.write(batch)
        assert_same_state(await store.load_state(), folded(MESSAGES[:20])[0])
        assert await commit(store, state, more, applied_seq=30)
        assert_same_state(await store.load_state(), state)


async def test_lease_changes_rewrite_no_host_or_pool_row(tmp_path: Path) -> None:
    """A lease changing touches its host and pool (their status may change) but not
    their entities: the batch carries no host or pool row, and the state reloads whole."""
    state, fx = folded(MESSAGES[:16])
    more = fold_batch(state, MESSAGES[16:21])  # warm VMs ready, one claimed and injected
    assert more.hosts == {HostName("h2")} and more.pools == {PoolName("warm")}
    assert not more.host_rows and not more.pool_rows
    statements = [statement for statement, _ in encode_batch(state, more, applied_seq=21).writes]
    assert not [s for s in statements if "INTO hosts " in s or "INTO pools " in s]
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await commit(store, folded(MESSAGES[:16])[0], fx, applied_seq=16)
        assert await commit(store, state, more, applied_seq=21)
        assert_same_state(await store.load_state(), state)


async def test_the_database_is_wal_with_synchronous_normal(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        conn = store._conn
        assert conn is not None
        async with conn.execute("PRAGMA synchronous") as cur:
            assert await cur.fetchone() == (1,)  # NORMAL
    assert raw_rows(db, "PRAGMA journal_mode") == [("wal",)]  # persistent in the file


# ====================================================================== forward-only


async def counts(db: Path) -> tuple[int, ...]:
    async with aiosqlite.connect(db) as conn:
        out = []
        for table in ("leases", "decisions", "journal", "outbox_batches", "jobs", "hosts"):
            async with conn.execute(f"SELECT count(*) FROM {table}") as cur:
                row = await cur.fetchone()
                assert row is not None
                out.append(int(row[0]))
        return tuple(out)


async def test_a_batch_at_or_below_the_position_is_a_no_op(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    state, fx = folded(MESSAGES[:25])
    async with await Store.open(db) as store:
        assert await store.applied_seq() == 0
        assert await commit(store, state, fx, applied_seq=25)
        before = await counts(db)
        assert before[0] > 0
        assert not await commit(store, state, fx, applied_seq=25)
        assert not await commit(store, state, fx, applied_seq=3)
        assert not await commit(store, state, fx, applied_seq=0)
        assert await counts(db) == before
        assert await store.applied_seq() == 25
        more = fold_batch(state, MESSAGES[25:26])
        assert await commit(store, state, more, applied_seq=26)
        assert await store.applied_seq() == 26
        assert (await store.load_state()).applied_seq == 26


async def test_the_position_may_pass_messages_the_fold_never_saw(tmp_path: Path) -> None:
    """A batch whose last messages were dead-lettered: the position is the batch's."""
    state, fx = folded(MESSAGES[:10])
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await commit(store, state, fx, applied_seq=12)
        loaded = await store.load_state()
    assert loaded.applied_seq == 12
    assert fold(loaded, MESSAGES[11]).outputs == []  # seq 12: skipped


async def test_entities_absent_from_the_state_are_deleted(tmp_path: Path) -> None:
    state, fx = folded(MESSAGES[:30])
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await commit(store, state, fx, applied_seq=30)
        gone = Effects(
            host_rows={HostName("h1")},
            pool_rows={PoolName("gpu")},
            classes={ClassName("a100")},
            profiles={"a100-default"},
            policies={"mig-on-a"},
            leases={LeaseId("L22")},
            decisions={RequestId("g1")},
            jobs={JobId("job-g")},  # an unbound job is named, as retention's eviction does
        )
        named = {"hosts": "host_rows", "pools": "pool_rows"}
        for attr in ("hosts", "pools", "classes", "profiles", "policies", "leases", "decisions"):
            for key in getattr(gone, named.get(attr, attr)):
                del getattr(state, attr)[key]
        del state.jobs[JobId("job-g")]  # the job of lease L22
        state.reindex()
        assert await commit(store, state, gone, applied_seq=31)
        loaded = await store.load_state()
    for name in ("hosts", "pools", "classes", "profiles", "policies", "leases", "decisions"):
        assert getattr(loaded, name) == getattr(state, name), name
    assert loaded.jobs == state.jobs


# ============================================================================== outbox


DEAD_LETTER = Output("dlq.input.schema", "dlq:99", b'{"reason":"schema"}')


async def test_outbox_batches_are_published_through_a_position(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    state, fx = folded(MESSAGES[:14])
    expected = [*outputs(fx), (DEAD_LETTER.subject, DEAD_LETTER.msg_id, DEAD_LETTER.payload)]
    async with await Store.open(db) as store:
        fx.outputs.append(DEAD_LETTER)  # a dead letter goes to the outbox as the fold's do
        assert await commit(store, state, fx, applied_seq=14)
        snap = await store.outbox_snapshot()
        assert [(r.subject, r.msg_id, r.payload) for r in snap.rows] == expected
        assert {r.input_seq for r in snap.rows} == {14}
        assert (snap.applied_seq, snap.through_seq, snap.complete) == (14, 14, True)
        assert raw_rows(db, "SELECT count(*) FROM outbox_batches") == [(1,)]  # one row a batch

        more = fold_batch(state, MESSAGES[14:20])
        assert await commit(store, state, more, applied_seq=20)
        partial = await store.outbox_snapshot(limit=1)  # one batch of the two
        assert (partial.through_seq, partial.complete) == (14, False)
        assert await store.mark_published_through(partial.through_seq) == 1
        assert await store.mark_published_through(partial.through_seq) == 0  # idempotent
        rest = await store.outbox_snapshot()
        assert [(r.subject, r.msg_id, r.payload) for r in rest.rows] == outputs(more)
        assert (rest.through_seq, rest.complete) == (20, True)
        assert await store.published_seq() == 14
        await store.mark_published_through(rest.through_seq)
        assert await unsent_outbox(store) == []
        assert await store.published_seq() == 20
        await store.mark_published_through(3)  # never backwards
        assert await store.published_seq() == 20


async def test_a_batch_at_or_below_the_published_position_writes_no_outbox(
    tmp_path: Path,
) -> None:
    """A lagging replica folding what the leader already published sends nothing again."""
    state, fx = folded(MESSAGES[:14])
    async with await Store.open(tmp_path / "rc.db") as store:
        await store.mark_published_through(20)
        assert await commit(store, state, fx, applied_seq=14)
        assert await unsent_outbox(store) == []
        assert await store.applied_seq() == 14


async def test_unsent_outbox_survives_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    state = State()
    async with await Store.open(db) as store:
        for start in range(0, N, 10):
            end = min(start + 10, N)
            assert await commit(
                store, state, fold_batch(state, MESSAGES[start:end]), applied_seq=end
            )
        first = await store.outbox_snapshot(limit=2)
        await store.mark_published_through(first.through_seq)
    async with await Store.open(db) as store:
        rest = await unsent_outbox(store)
    assert [(r.subject, r.msg_id, r.payload) for r in first.rows + rest] == outputs(FULL_FX)


# ============================================================================= journal


async def test_lease_history_and_audit_queries(tmp_path: Path) -> None:
    async with await Store.open(tmp_path / "rc.db") as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
        history = await store.lease_history("L13")
        assert history == [
            {"input_seq": 13, "event": "admit", "from_state": None, "to_state": "reserved"},
            {"input_seq": 16, "event": "instance-created", "from_state": "reserved",
             "to_state": "created"},
            {"input_seq": 17, "event": "instance-ready", "from_state": "created",
             "to_state": "ready"},
            {"input_seq": 20, "event": "claim-warm", "from_state": "ready", "to_state": "claimed"},
            {"input_seq": 21, "event": "mark-warm-injected", "from_state": "claimed",
             "to_state": "injected"},
            {"input_seq": 43, "event": "mark-deleting", "from_state": "injected",
             "to_state": "deleting"},
        ]  # fmt: skip
        for lease_id in FULL_STATE.leases:
            assert [
                (h["input_seq"], lease_id, h["event"], h["from_state"], h["to_state"])
                for h in await store.lease_history(lease_id)
            ] == [t for t in transitions(FULL_FX) if t[1] == lease_id]
        assert await store.lease_history("L-unknown") == []

        preemption = await transitions_at(store, 26)
        assert [(t["lease_id"], t["to_state"]) for t in preemption] == [
            ("L14", "victim"),
            ("L15", "victim"),
            ("L26", "reserved"),
        ]
        (big1,) = await store.decisions_for(request_id="big1")
        assert big1 == FULL_STATE.decisions[RequestId("big1")]
        assert orjson.loads(big1.payload)["outcome"] == "admitted"
        by_lease = await store.decisions_for(lease_id="L37")
        assert [d.request_id for d in by_lease] == ["big2"]
        assert orjson.loads(by_lease[0].payload)["phase"] == "pending"
        with pytest.raises(TypeError):
            await store.decisions_for()


async def test_the_journal_is_append_only(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
    with sqlite3.connect(db) as conn:
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("UPDATE journal SET event = 'forged' WHERE id = 1")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("DELETE FROM journal")
    assert all_journal(db) == transitions(FULL_FX)


# ========================================================================== migrations


async def write_v1_database(db: Path, state: State, fx: Effects, applied_seq: int) -> None:
    """A database as a version-1 reconciler left it: schema 1, with a committed batch."""
    async with aiosqlite.connect(db, isolation_level=None) as conn:
        assert await mig.migrate(conn, target=1) == 1
        batch = encode_batch(state, fx, applied_seq=applied_seq)
        await conn.execute("BEGIN IMMEDIATE")
        for statement, params in batch.writes:
            if "outbox" in statement or "warm_claims" in statement:  # version 6
                continue
            for column in ("released_at", "final_at", "at"):  # added by version 5
                if f", {column})" in statement:
                    statement = statement.replace(f", {column})", ")").replace(", ?)", ")")
                    statement = statement.replace(f", {column} = excluded.{column}", "")
                    params = tuple(row[:-1] for row in params)
            await conn.executemany(statement, params)
        await conn.executemany(  # version 1 kept one outbox row per output
            "INSERT INTO outbox (input_seq, subject, msg_id, payload) VALUES (?, ?, ?, ?)",
            [(applied_seq, o.subject, o.msg_id, o.payload) for o in fx.outputs],
        )
        await conn.execute("UPDATE position SET applied_seq = ?", (applied_seq,))
        await conn.execute("COMMIT")


def schema_objects(db: Path) -> set[str]:
    return {name for (name,) in raw_rows(db, "SELECT name FROM sqlite_master")}


async def test_opening_a_v1_database_migrates_it(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    await write_v1_database(db, FULL_STATE, FULL_FX, N)
    assert raw_rows(db, "SELECT version FROM schema_version") == [(1,)]
    assert "journal_no_update" not in schema_objects(db)
    async with await Store.open(db) as store:
        assert await store.schema_version() == mig.LATEST
        assert_same_state(await store.load_state(), FULL_STATE)
        assert [r.payload for r in await unsent_outbox(store, 10_000)] == [
            o.payload for o in FULL_FX.outputs
        ]
    assert raw_rows(db, "SELECT version FROM schema_version") == [(mig.LATEST,)]
    assert {"journal_no_update", "journal_no_delete", "decisions_lease", "journal_input"} <= (
        schema_objects(db)
    )
    async with await Store.open(db) as store:  # reopening migrates nothing
        assert await store.schema_version() == mig.LATEST


async def test_a_database_newer_than_the_code_is_refused_untouched(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (mig.LATEST + 1,))
    before = db.read_bytes()
    newer, latest = mig.LATEST + 1, mig.LATEST
    with pytest.raises(
        SchemaTooNew, match=rf"schema version {newer}.*versions up to {latest}.*newer"
    ):
        await Store.open(db)
    assert isinstance(SchemaTooNew("x"), StoreError)
    assert raw_rows(db, "SELECT version FROM schema_version") == [(newer,)]
    assert db.read_bytes() == before


async def test_a_failing_migration_leaves_the_last_good_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)

    async def backfill(conn: aiosqlite.Connection) -> None:
        await conn.execute("INSERT INTO notes (text) VALUES ('half done')")
        await conn.execute("SELECT no_such_function()")

    broken = mig.Migration(mig.LATEST + 1, "notes", ("CREATE TABLE notes (text TEXT)", backfill))
    monkeypatch.setattr(mig, "MIGRATIONS", (*mig.MIGRATIONS, broken))
    with pytest.raises(StoreError, match="no_such_function") as info:
        await Store.open(db)
    assert isinstance(info.value.__cause__, sqlite3.Error)
    assert raw_rows(db, "SELECT version FROM schema_version") == [(mig.LATEST,)]
    assert "notes" not in schema_objects(db)
    monkeypatch.undo()
    async with await Store.open(db) as store:
        assert_same_state(await store.load_state(), FULL_STATE)


async def test_migrations_must_be_numbered_in_order(tmp_path: Path) -> None:
    async with aiosqlite.connect(tmp_path / "x.db", isolation_level=None) as conn:
        with pytest.raises(ValueError, match="numbered"):
            await mig.migrate(conn, migrations=[mig.MIGRATIONS[1]])


# ============================================================================== errors


async def test_a_corrupted_file_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    db.write_bytes(b"this is not an SQLite database, it only sits where one should\n" * 64)
    with pytest.raises(StoreError, match="cannot open store") as info:
        await Store.open(db)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


async def test_a_damaged_database_page_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(raw) > 4 * page
    raw[page : len(raw)] = b"\xa5" * (len(raw) - page)  # every page but the header
    db.write_bytes(bytes(raw))
    with pytest.raises(StoreError) as info:
        store = await Store.open(db)
        try:
            await store.load_state()
        finally:
            await store.close()
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


async def test_an_undecodable_row_is_a_store_error_naming_it(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
    for data in ('{"lease_id": "L13", ', '{"lease_id": "L13", "colour": "red"}'):
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE leases SET data = ? WHERE lease_id = 'L13'", (data,))
        async with await Store.open(db) as store:
            with pytest.raises(StoreError, match="leases row 'L13'") as info:
                await store.load_state()
        assert isinstance(info.value.__cause__, CodecError)


async def test_an_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError) as info:
        await Store.open(tmp_path / "no" / "such" / "dir" / "rc.db")
    assert isinstance(info.value.__cause__, sqlite3.Error)


async def test_a_closed_store_says_so(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "rc.db")
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreClosed):
        await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
    with pytest.raises(StoreError):
        await unsent_outbox(store)


async def test_unencodable_state_is_a_store_error_before_any_write(tmp_path: Path) -> None:
    state, fx = folded(MESSAGES[:5])
    host = state.hosts[HostName("h1")]
    state.hosts[HostName("h1")] = dataclasses.replace(host, snapshot_revision=2**64)
    async with await Store.open(tmp_path / "rc.db") as store:
        with pytest.raises(StoreError, match="hosts 'h1'"):
            await commit(store, state, fx, applied_seq=5)
        assert await store.applied_seq() == 0


# ========================================================================= concurrency


async def test_concurrent_calls_do_not_interleave_transactions(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    state = State()
    published: list[tuple[str, str | None, bytes]] = []
    async with await Store.open(db) as store:

        async def publisher() -> None:
            for _ in range(30):
                snap = await store.outbox_snapshot(limit=1)
                published.extend((r.subject, r.msg_id, r.payload) for r in snap.rows)
                await store.mark_published_through(snap.through_seq)
                await asyncio.sleep(0)

        async def consumer() -> None:
            for start in range(0, N, 5):
                end = min(start + 5, N)
                fx = fold_batch(state, MESSAGES[start:end])
                assert await commit(store, state, fx, applied_seq=end)

        await asyncio.gather(publisher(), consumer())
        assert_same_state(await store.load_state(), FULL_STATE)
        rest = await unsent_outbox(store)
    assert published + [(r.subject, r.msg_id, r.payload) for r in rest] == outputs(FULL_FX)


async def test_a_cancelled_commit_is_all_or_nothing(tmp_path: Path) -> None:
    """A commit is one call on the database thread: cancelling its caller at any point
    leaves it either fully written or not written at all, never half."""
    db = tmp_path / "rc.db"
    for delay in (0, 0.0005, 0.002, 0.01):
        db.unlink(missing_ok=True)
        async with await Store.open(db) as store:
            task = asyncio.create_task(commit(store, FULL_STATE, FULL_FX, applied_seq=N))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            applied = await store.applied_seq()
            assert applied in (0, N)
            if applied == 0:
                assert await counts(db) == (0, 0, 0, 0, 0, 0)
                assert await commit(store, FULL_STATE, FULL_FX, applied_seq=N)
            assert_same_state(await store.load_state(), FULL_STATE)
        assert all_outbox(db) == outputs(FULL_FX)


def test_packed_outputs_round_trip_in_order() -> None:
    from reconciler.store.outbox_rows import pack_outputs

    outputs = [
        ("out.decision.r1", "decision:r1:final", b'{"a":1}'),
        ("out.status.host.h1", None, b"{}"),
        ("out.exec.h\\u00e9.create", "create:L1", b""),
        ("out.dlq.decode", "dlq:7", bytes(range(256)) * 300),
    ]
    assert unpack_outputs(pack_outputs(outputs)) == outputs
    assert unpack_outputs(pack_outputs([])) == []


@pytest.mark.parametrize("writer_process", [False, True])
async def test_a_new_store_is_private_to_its_owner(tmp_path: Path, writer_process: bool) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db, writer_process=writer_process) as store:
        await store.mark_published_through(0)
    files = list(tmp_path.iterdir())  # noqa: ASYNC240 - a test's own directory
    assert files  # the database (and its WAL, shared memory and writer lock)
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


async def test_the_store_deletes_what_the_fold_evicted(tmp_path: Path) -> None:
    run = Clocked(retention=20)
    async with await Store.open(tmp_path / "rc.db") as store:
        fx = run.send(snapshot("h1", cpu=8))
        fx.extend(run.send(pool("p", cpu=2, memory_mib=0, disk_gib=0)))
        for n in range(40):
            fold_fx = run.send(admit(f"r{n}", "p", f"i{n}", job=f"j{n}"), after=1)
            fx.extend(fold_fx)
            fx.extend(run.send(cmd("release", f"rel{n}", instance=f"i{n}")))
            if n % 7 == 6:
                assert await commit(store, run.state, fx, applied_seq=run.state.applied_seq)
                fx = Effects()
        assert await commit(store, run.state, fx, applied_seq=run.state.applied_seq)
        loaded = await store.load_state(decision_retention_s=20)
    with closing(sqlite3.connect(tmp_path / "rc.db")) as conn:
        counts = {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("decisions", "leases", "jobs")
        }
    assert state_digest(loaded) == state_digest(run.state)
    assert counts == {
        "decisions": len(run.state.decisions),
        "leases": len(run.state.leases),
        "jobs": len(run.state.jobs),
    }
    assert len(run.state.decisions) < 25  # 80 decided, only the last 20 s kept
    # folding on from the loaded state evicts exactly what the in-memory one does
    item = cmd("release", "late", instance="x")
    msg = Message(seq=run.seq + 1, timestamp="2026-12-02T11:00:00Z", input=message(1, item).input)
    assert out_tuples(fold(loaded, msg)) == out_tuples(fold(run.state, msg))
    assert state_digest(loaded) == state_digest(run.state)


async def test_the_queue_is_written_as_it_changes(tmp_path: Path) -> None:
    """A request queued, then admitted: its row is written, then deleted, with the
    batch that queued or admitted it."""
    fleet = b.Fleet()
    async with await Store.open(tmp_path / "rc.db") as store:
        fx = fleet.send(snapshot("h1", cpu=4), pool("p"), admit("a1", "p", "i1"))
        fx.extend(fleet.send(admit("a2", "p", "i2"), admit("q", "p", "i3", wait_s=60)))
        assert await commit(store, fleet.state, fx, applied_seq=fleet.state.applied_seq)
        loaded = await store.load_state()
        assert list(loaded.waiting) == ["q"]
        assert state_digest(loaded) == state_digest(fleet.state)
        fx = fleet.send(cmd("release", "r1", instance="i1"))
        assert await commit(store, fleet.state, fx, applied_seq=fleet.state.applied_seq)
        loaded = await store.load_state()
    assert not loaded.waiting
    assert state_digest(loaded) == state_digest(fleet.state)
