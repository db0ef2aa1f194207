"""The SQLite journal: one transaction per batch, forward-only, exact round trips."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.state import Effects, State
from reconciler.store.journal import SCHEMA_VERSION, SchemaTooNew, Store, StoreError
from tests import builders as b


def scenario() -> list[Message]:
    """Hosts with GPUs, pools, classes, warm leases ready and claimed, a preemption
    pending on its victims, releases, a GPU profile and a policy."""
    items: list[tuple[str, dict[str, Any]]] = [
        b.snapshot(
            "h1",
            cpu=8,
            memory_mib=32768,
            gpus=[b.gpu(0), b.gpu(1, numa=1)],
            gpu_profile="p1",
            labels={"zone": "a"},
        ),
        b.snapshot("h2", cpu=4, memory_mib=16384),
        b.gpu_profile("p1", power_limit_w=250),
        b.gpu_policy("ecc-on", overrides={"ecc": True, "mig_mode": "enabled"}, models=["A100"]),
        b.gpu_class("a100", count=1, model="A100"),
        b.pool("warm", min_ready=1, max_ready=4, max_instances=10),
        b.pool("gpu", claims=[{"name": "g", "class": "a100"}], cpu=2, priority=5),
        b.admit("w1", "warm", "w-1", kind="warm"),
        b.admit("w2", "warm", "w-2", kind="warm"),
        b.admit("w3", "warm", "w-3", kind="warm"),
        b.lifecycle("h2", "instance-ready", "w-1"),
        b.lifecycle("h2", "instance-ready", "w-2"),
        b.lifecycle("h1", "instance-ready", "w-3"),
        b.cmd("claim-warm", "c1", pool="warm", job="job-1"),
        b.admit("g1", "gpu", "gpu-1"),
        b.admit("cold-big", "warm", "cold-1", preemptible=True),
        b.admit("cold-big2", "warm", "cold-2", preemptible=True),
        b.inventory("h2", [b.instance("w-1"), b.instance("foreign", cpu=1)]),
        b.cmd("release", "rel1", instance="gpu-1"),
        b.cmd("mark-deleting", "del1", instance="w-2"),
        b.lifecycle("h2", "instance-deleted", "w-2"),
        b.gpu_class("bad", count=0),
        b.cmd("claim-warm", "c1", pool="warm", job="job-1"),
    ]
    return [b.message(i + 1, item) for i, item in enumerate(items)]


def fold_all(messages: list[Message]) -> tuple[State, list[tuple[str, str | None, bytes]]]:
    state = State()
    fx = Effects()
    for msg in messages:
        fold(state, msg, fx)
    return state, [(o.subject, o.msg_id, o.payload) for o in fx.outputs]


def _nonempty(value: Any) -> Any:
    """Derived indexes may keep emptied entries; they mean the same as absent ones."""
    return {k: v for k, v in value.items() if v} if isinstance(value, dict) else value


def same_state(a: State, c: State) -> None:
    for attr in (
        "applied_seq",
        "hosts",
        "pools",
        "classes",
        "profiles",
        "policies",
        "leases",
        "decisions",
        "jobs",
        "by_instance",
        "on_host",
        "in_pool",
        "pool_ready",
        "pool_booking",
        "pool_warm_unclaimed",
        "host_order",
    ):
        assert _nonempty(getattr(a, attr)) == _nonempty(getattr(c, attr)), attr


async def test_state_loaded_at_every_cut_point_equals_the_state_folded_in_memory(
    tmp_path: Path,
) -> None:
    messages = scenario()
    expected, expected_outputs = fold_all(messages)
    for cut in range(len(messages) + 1):
        db = tmp_path / f"cut{cut}.db"
        state = State()
        outputs = []
        async with await Store.open(db) as store:
            fx = Effects()
            for msg in messages[:cut]:
                fold(state, msg, fx)
            if cut:
                assert await store.commit(state, fx, applied_seq=cut)
            outputs.extend((o.subject, o.msg_id, o.payload) for o in fx.outputs)
        async with await Store.open(db) as store:
            loaded = await store.load_state()
            same_state(loaded, state)
            fx = Effects()
            for msg in messages[cut:]:
                fold(loaded, msg, fx)
            outputs.extend((o.subject, o.msg_id, o.payload) for o in fx.outputs)
            if cut < len(messages):
                await store.commit(loaded, fx, applied_seq=len(messages))
        same_state(loaded, expected)
        assert outputs == expected_outputs, f"outputs differ after a cut at {cut}"
        async with await Store.open(db) as store:
            same_state(await store.load_state(), expected)


async def test_a_batch_at_or_below_the_position_is_a_no_op(tmp_path: Path) -> None:
    messages = scenario()
    state, _ = fold_all(messages[:5])
    async with await Store.open(tmp_path / "j.db") as store:
        fx = Effects()
        assert await store.commit(state, fx, applied_seq=5)
        rows = len(await store.unsent_outbox())
        assert not await store.commit(state, fold(state, messages[5]), applied_seq=5)
        assert not await store.commit(state, Effects(), applied_seq=3)
        assert await store.applied_seq() == 5
        assert len(await store.unsent_outbox()) == rows


async def test_outbox_keeps_outputs_until_marked_sent(tmp_path: Path) -> None:
    messages = scenario()
    state = State()
    fx = Effects()
    for msg in messages:
        fold(state, msg, fx)
    async with await Store.open(tmp_path / "j.db") as store:
        await store.commit(state, fx, applied_seq=len(messages))
        unsent = await store.unsent_outbox()
        assert [(r.subject, r.msg_id, r.payload) for r in unsent] == [
            (o.subject, o.msg_id, o.payload) for o in fx.outputs
        ]
        await store.mark_sent([r.id for r in unsent[:3]])
        assert [r.id for r in await store.unsent_outbox()] == [r.id for r in unsent[3:]]


async def test_journal_keeps_every_transition_of_a_lease_in_order(tmp_path: Path) -> None:
    messages = scenario()
    state = State()
    fx = Effects()
    for msg in messages:
        fold(state, msg, fx)
    lease = state.lease_of_instance("w-2")
    assert lease is not None
    async with await Store.open(tmp_path / "j.db") as store:
        await store.commit(state, fx, applied_seq=len(messages))
        history = await store.lease_history(lease.lease_id)
    assert [(h["from_state"], h["to_state"]) for h in history] == [
        (None, "reserved"),
        ("reserved", "ready"),
        ("ready", "deleting"),
        ("deleting", "released"),
    ]
    assert [h["input_seq"] for h in history] == sorted(h["input_seq"] for h in history)


async def test_a_database_from_a_newer_reconciler_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    async with await Store.open(db):
        pass
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaTooNew, match="upgrade the reconciler"):
        await Store.open(db)


async def test_reopening_keeps_the_schema_version(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    for _ in range(2):
        async with await Store.open(db):
            pass
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(1,)]


async def test_a_corrupted_file_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "bad.db"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        await Store.open(db)
