"""The executor's own database (reconciler.executor.records): finished commands, private."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from reconciler.executor.records import ExecutorStore, FinishedCommand

pytestmark = pytest.mark.timeout(60)

CPU, OTHER = "host-01", "host-02"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "executor.db"


async def test_store_keeps_the_first_record_and_prunes_old_ones(db: Path) -> None:
    now = [1000.0]
    async with await ExecutorStore.open(db, clock=lambda: now[0]) as store:
        first = FinishedCommand(
            command_id="delete:L1:drained",
            verb="delete",
            host=CPU,
            project="ci",
            instance="w-1",
            lease_id="L1",
            outcome="deleted",
            stream_seq=7,
        )
        assert (await store.record(first)).finished_at == 1000.0
        again = dataclasses.replace(first, outcome="absent", stream_seq=9)
        assert (await store.record(again)).outcome == "deleted"
        assert await store.lease_deleted(host=CPU, lease_id="L1") is not None
        assert await store.lease_deleted(host=OTHER, lease_id="L1") is None
        now[0] = 2000.0
        await store.record(dataclasses.replace(first, command_id="x", outcome="rejected"))
        assert await store.prune(retention_s=500) == 1
        assert await store.finished("delete:L1:drained") is None
        assert await store.finished("x") is not None
    with pytest.raises(ValueError, match="unknown outcome"):
        dataclasses.replace(first, outcome="maybe")


async def test_a_new_executor_database_is_private(tmp_path: Path) -> None:
    db = tmp_path / "exec.db"
    store = await ExecutorStore.open(db)
    await store.close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
