"""``reconciler status``: the warm hit ratio per pool, from the claims a store counted;
the admission queue and the tenants' usage against their quota (issue 26)."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
from click.testing import CliRunner

from reconciler.cli.commands.status import overview_lines
from reconciler.cli.main import cli
from reconciler.core.fold import fold
from reconciler.core.state import Effects, State
from reconciler.store.snapshot_format import DecodedSnapshot, restore_batch
from reconciler.store.sqlite import Store, encode_batch
from tests.support import builders as b
from tests.support.builders import Fleet, admit, message, pool, snapshot


async def write_store(db: Path) -> None:
    items = [
        b.snapshot("h1", cpu=32, memory_mib=65536, disk_gib=500),
        b.pool("web", cpu=2, memory_mib=2048, disk_gib=10, min_ready=1, max_ready=4),
        b.pool("ml", cpu=2, memory_mib=2048, disk_gib=10),
        b.admit("w1", "web", "warm-1", kind="warm"),
        b.admit("w2", "web", "warm-2", kind="warm"),
        b.lifecycle("h1", "instance-ready", "warm-1"),
        b.lifecycle("h1", "instance-ready", "warm-2"),
        b.cmd("claim-warm", "k1", pool="web", job="j1"),
        b.cmd("claim-warm", "k2", pool="web", job="j2"),
        b.cmd("claim-warm", "k3", pool="web", job="j3"),  # none left: no-warm
        b.cmd("claim-warm", "k1", pool="web", job="j1"),  # re-sent: counted once
    ]
    state, fx = State(), Effects()
    for seq, item in enumerate(items, start=1):
        fold(state, message(seq, item), fx)
    async with await Store.open(db) as store:
        assert await store.write(encode_batch(state, fx, applied_seq=len(items)))


def test_status_shows_each_pools_warm_hit_ratio(tmp_path: Path) -> None:
    db = tmp_path / "rc.db"
    anyio.run(write_store, db)
    runner = CliRunner()
    text = runner.invoke(cli, ["status", "--db", str(db)])
    assert text.exit_code == 0, text.output
    assert "HIT RATIO (claimed/claims)" in text.output
    web = next(line for line in text.output.splitlines() if line.startswith("web "))
    assert web.endswith("1/4           67% (2/3)"), web
    ml = next(line for line in text.output.splitlines() if line.startswith("ml "))
    assert ml.endswith("  -"), ml
    rows = [
        orjson.loads(line)
        for line in runner.invoke(cli, ["status", "--db", str(db), "--json"]).output.splitlines()
    ]
    pools = {r["pool"]: r["warm_claims"] for r in rows if r["type"] == "pool"}
    assert pools == {
        "ml": {"claimed": 0, "no_warm": 0, "hit_ratio": None},
        "web": {"claimed": 2, "no_warm": 1, "hit_ratio": 0.6667},
    }


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
