"""The fair-sharing scenario on a real bus (issue 26): two tenants of weights 1 and 3
flood four hosts; every request ends with exactly one final decision, none waits while
room it fits stands idle, admissions while both wait go about 1:3, and the replay finds
no divergence."""

from __future__ import annotations

from pathlib import Path

from reconciler.bus.connection import ConnectOptions
from reconciler.demo.fair_share import run_fair_share


async def test_two_tenants_share_four_hosts_by_weight(nats_url: str, tmp_path: Path) -> None:
    nats = ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.1, connect_timeout_s=1.0)
    report = await run_fair_share(
        nats, tmp_path / "rc.db", per_tenant=80, job_s=(0.1, 0.3), interval_s=1.0
    )
    print("\n".join(report.lines()))
    assert report.requests == 160 and len(report.finals) == 160
    assert all(n == 1 for n in report.finals.values())
    assert report.outcomes == {"admitted": 160}
    assert not report.idle_while_waiting and report.batches_checked > 0
    assert report.divergences == 0 and report.replayed_inputs > 320
    light, heavy = report.contended
    assert 2.0 <= heavy / light <= 4.5, report.contention_line()
    assert report.ok
