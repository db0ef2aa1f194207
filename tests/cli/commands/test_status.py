"""``reconciler status`` shows the admission queue and the tenants' usage against their
quota (issue 26), from a replica's store."""

from __future__ import annotations

from pathlib import Path

import orjson

from reconciler.cli.commands.status import overview_lines
from reconciler.store.snapshot_format import DecodedSnapshot, restore_batch
from reconciler.store.sqlite import Store
from tests.support.builders import Fleet, admit, pool, snapshot


async def test_status_shows_queues_and_tenants(tmp_path: Path) -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("p"))
    f.send(("config.tenant", {"v": 1, "tenant": "team", "pools": ["p"], "quota": {"cpu": 8}}))
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("q1", "p", "vm-3", wait_s=60), admit("q2", "p", "vm-4", wait_s=60))
    db = tmp_path / "rc.db"
    async with await Store.open(db) as store:
        assert await store.write(restore_batch(DecodedSnapshot(f.state, 0, "")))
    text = "\n".join(await overview_lines(db))
    assert "QUEUE (pool)" in text
    assert "p                    team               2  q1 (insufficient-capacity" in text
    assert "cpu 4/8" in text and "instances 2/-" in text
    rows = [orjson.loads(line) for line in await overview_lines(db, as_json=True)]
    (queue,) = [r for r in rows if r["type"] == "queue"]
    assert (queue["pool"], queue["waiting"], queue["head"]) == ("p", 2, "q1")
    (tenant,) = [r for r in rows if r["type"] == "tenant"]
    assert tenant["usage"]["cpu"] == 4 and tenant["quota"]["cpu"] == 8
