"""Long-lived operation: lease-history pruning by ``--journal-retention`` (the store's
writer), ``reconciler audit``'s note about it, and abandoned cold reservations released
by the leader after ``--reservation-timeout`` (CONTRACT.md "Retention")."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from reconciler.cli.commands.audit import audit_lines
from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.model import InstanceName
from reconciler.core.state import Effects, State, is_reserved_cold
from reconciler.replica.reservation_reaper import abandon_request_id
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from reconciler.store.transactions import PRUNE_WINDOW
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.folding import commit

T0 = 1_796_205_600  # 2026-12-02T10:00:00Z


def at(second: int, seq: int, item: tuple[str, dict[str, Any]]) -> Message:
    hours, rest = divmod(second, 3600)
    minutes, seconds = divmod(rest, 60)
    return Message(
        seq=seq,
        timestamp=f"2026-12-02T{10 + hours:02d}:{minutes:02d}:{seconds:02d}Z",
        input=b.message(seq, item).input,
    )


def journal(db: Path) -> list[tuple[int, str, int]]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT input_seq, lease_id, at FROM journal ORDER BY id").fetchall()


async def churn(store: Store, state: State, *, pairs: int, every_s: int = 10) -> None:
    """Admit and release ``pairs`` VMs, one pair per ``every_s`` seconds, a batch each."""
    seq = state.applied_seq
    for n in range(pairs):
        fx = Effects()
        for item in (b.admit(f"r{n}", "p", f"i{n}"), b.cmd("release", f"x{n}", instance=f"i{n}")):
            seq += 1
            fold(state, at(n * every_s, seq, item), fx)
        assert await commit(store, state, fx, applied_seq=seq)


async def a_store(db: Path, *, journal_retention_s: int | None) -> tuple[Store, State]:
    store = await Store.open(db, journal_retention_s=journal_retention_s)
    state = State()
    fx = Effects()
    fold(state, at(0, 1, b.snapshot("h1", cpu=8)), fx)
    fold(state, at(0, 2, b.pool("p", cpu=2, memory_mib=0, disk_gib=0)), fx)
    assert await commit(store, state, fx, applied_seq=2)
    return store, state


async def test_the_writer_prunes_lease_history_older_than_the_journal_retention(
    tmp_path: Path,
) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=100)
    async with store:
        await churn(store, state, pairs=60, every_s=10)  # 600 s of stream time
        before, rows = await store.journal_pruned()
    kept = journal(db)
    newest = kept[-1][2]
    assert newest == T0 + 590
    # pruned in bursts: never more than the retention plus its slack (1 s) behind
    assert all(row_at >= newest - 100 - 1 - 10 for _, _, row_at in kept)
    assert before > T0 and rows == 60 * 2 - len(kept)  # admit, release: 2 rows a pair
    assert before <= min(row_at for _, _, row_at in kept)


async def test_without_journal_retention_all_history_stays(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=None)
    async with store:
        await churn(store, state, pairs=30, every_s=100)
        assert await store.journal_pruned() == (0, 0)
    assert len(journal(db)) == 30 * 2


async def test_the_journal_refuses_deletes_that_are_not_pruning(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=50)
    async with store:
        await churn(store, state, pairs=20, every_s=10)
    with closing(sqlite3.connect(db)) as conn:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM journal")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE journal SET event = 'forged'")


async def test_a_backlog_is_pruned_a_window_per_batch(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=None)
    async with store:
        await churn(store, state, pairs=(PRUNE_WINDOW // 2) + 100, every_s=0)
    store = await Store.open(db, journal_retention_s=10)
    async with store:  # a later batch, far later: everything before is old
        fx = Effects()
        seq = state.applied_seq + 1
        fold(state, at(3600, seq, b.admit("late", "p", "late")), fx)
        assert await commit(store, state, fx, applied_seq=seq)
        _, rows = await store.journal_pruned()
    assert rows == PRUNE_WINDOW  # the first window only; the next batches take the rest
    assert state_digest(state) == state_digest(await _loaded(db))


async def _loaded(db: Path) -> State:
    async with await Store.open(db) as store:
        return await store.load_state()


async def test_audit_says_when_history_was_pruned(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=100)
    async with store:
        await churn(store, state, pairs=30, every_s=10)
    lines = await audit_lines("i29", db=db, nats=None, prefix="rc")
    assert lines[0].startswith("history pruned: journal rows before 2026-12-02T10:")
    assert "--journal-retention" in lines[0]
    (note, *_) = await audit_lines("i29", db=db, nats=None, prefix="rc", as_json=True)
    assert '"type":"history-pruned"' in note


async def test_without_pruning_audit_has_no_note(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    store, state = await a_store(db, journal_retention_s=None)
    async with store:
        await churn(store, state, pairs=3)
    lines = await audit_lines("i1", db=db, nats=None, prefix="rc")
    assert lines[0].startswith("lease ")


async def test_a_cold_reservation_never_created_is_released_by_the_leader(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    config = fast_config(
        nats_url, tmp_path / "rc.db", reservation_timeout_s=1.0, status_progress_interval_s=0.3
    )
    async with running_replica(config) as replica:
        await bus.send(b.snapshot("h1", cpu=8), b.pool("p", cpu=4, memory_mib=0, disk_gib=0))
        await bus.send(b.admit("crashed", "p", "vm-1"), b.admit("fine", "p", "vm-2"))
        await bus.send(b.cmd("mark-created", "made", instance="vm-2"))
        admitted = await bus.decision("crashed")
        assert admitted["outcome"] == "admitted"
        assert (await bus.decision("made"))["outcome"] == "ok"
        lease_id = admitted["lease"]["lease_id"]
        # its creator crashed: no mark-created ever comes, and the host is full meanwhile
        released = await bus.decision(abandon_request_id(lease_id), within_s=15)
        assert (released["verb"], released["lease"]["state"]) == ("release", "released")
        await bus.send(b.admit("after", "p", "vm-3"))
        assert (await bus.decision("after"))["outcome"] == "admitted"  # capacity is back
        assert replica.pipeline is not None
        state = replica.pipeline.state
        created = state.lease_of_instance("vm-2")
        assert created is not None and created.state.value == "created"  # not reaped
        reserved = {i for i, le in state.leases.items() if is_reserved_cold(le)}
        assert reserved == {state.by_instance[InstanceName("vm-3")]}


def test_run_and_replay_take_the_retention_options() -> None:
    from click.testing import CliRunner

    from reconciler.cli.main import cli

    runner = CliRunner()
    run_help = runner.invoke(cli, ["run", "--help"], terminal_width=200).output
    for option, env in (
        ("--decision-retention", "RC_DECISION_RETENTION"),
        ("--journal-retention", "RC_JOURNAL_RETENTION"),
        ("--reservation-timeout", "RC_RESERVATION_TIMEOUT"),
    ):
        assert option in run_help and env in run_help
    replay_help = runner.invoke(cli, ["replay", "--help"], terminal_width=200).output
    assert "--decision-retention" in replay_help
    refused = runner.invoke(cli, ["run", "--decision-retention", "0"])
    assert refused.exit_code == 2 and "decision-retention" in refused.output


async def test_a_store_call_cancelled_mid_request_leaves_the_writer_in_step(
    tmp_path: Path,
) -> None:
    """A leader stepping down cancels its outbox marks: the replica's next commit must
    still work (a long-lived replica under load steps down now and then)."""
    import anyio

    db = tmp_path / "rc.db"
    store = await Store.open(db, writer_process=True)
    async with store:
        state = State()
        fx = Effects()
        fold(state, at(0, 1, b.snapshot("h1", cpu=8)), fx)
        assert await commit(store, state, fx, applied_seq=1)
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled before the request even starts its round trip
            await store.mark_published_through(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.mark_published_through, 1)
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()  # cancelled while it waits for the reply
        fx = Effects()
        fold(state, at(1, 2, b.pool("p", cpu=2, memory_mib=0, disk_gib=0)), fx)
        assert await commit(store, state, fx, applied_seq=2)
        assert await store.published_seq() == 1
