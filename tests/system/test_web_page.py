"""``reconciler web`` in a real browser: headless Chromium loads the page served against
a running system (a real nats-server, a replica, the bridge and the executor on the
simulated Incus fleet) and the test reads what the page shows: the hosts, the pools, a
decision's reason, and a lease's trail after a click on its link."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from nats.aio.client import Client

from reconciler.core.model import PoolName
from reconciler.web.server import Queries, WebConfig, WebServer
from tests.support import builders as b
from tests.support.browser import chromium, chromium_binary
from tests.support.bus import BusClient
from tests.support.simfleet import sim_fleet
from tests.system.test_e2e_simulated import until, whole_system

pytestmark = pytest.mark.timeout(60)

POOL = "web"


async def test_the_page_shows_hosts_pools_decisions_and_a_trail_after_a_click(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    chromium_binary()  # skips (or fails, in CI) before anything starts
    bus = BusClient(nc)
    async with sim_fleet(2) as fleet, whole_system(nats_url, tmp_path, fleet, bus) as replica:
        assert replica.pipeline is not None
        state = replica.pipeline.state
        await bus.send(b.pool(POOL, cpu=2, memory_mib=4096, disk_gib=20, min_ready=2, max_ready=3))
        await until(
            "two warm VMs ready", lambda: len(state.pool_ready.get(PoolName(POOL), ())) == 2
        )
        await bus.send(b.cmd("claim-warm", "claim-1", pool=POOL, job="job-1"))
        claimed = (await bus.decision("claim-1"))["lease"]
        await bus.send(b.admit("nope-1", "no-such-pool", "vm-x"))
        assert (await bus.decision("nope-1"))["reason"] == "unknown-pool"

        server = WebServer(
            WebConfig(host="127.0.0.1", port=0, refresh_s=0), Queries(nc, prefix="rc", wait_s=5)
        )
        await server.start()
        try:
            async with chromium() as browser:
                await browser.goto(server.url)

                hosts = await browser.texts("tr.host td.name")
                assert hosts == sorted(fleet.endpoints)
                assert await browser.text("#totals .hosts-card .count") == str(len(hosts))
                cpu = await browser.text("tr.host[data-host='host-01'] td:nth-child(3)")
                assert "vCPU" in cpu
                (pool,) = await browser.texts(f"tr.pool[data-pool='{POOL}']")
                assert pool.split("\t")[0] == POOL and "2/3" in pool
                assert "100 % (1/1)" in pool  # the warm hit ratio: one claim found a VM
                rejected = await browser.text("tr.decision[data-request='nope-1']")
                assert "rejected" in rejected and "unknown-pool" in rejected
                claim = await browser.text("tr.decision[data-request='claim-1']")
                assert "claimed" in claim and claimed["lease_id"] in claim

                await browser.click("tr.decision[data-request='claim-1'] a.lease")

                assert (await browser.url()).endswith(f"/lease/{claimed['lease_id']}")
                heading = await browser.text("#lease h2")
                assert claimed["lease_id"] in heading and "claimed" in heading
                assert "job-1" in await browser.text("#lease dl")
                trail = await browser.texts("#trail tbody tr")
                assert any("→ reserved" in row for row in trail)
                assert any("→ ready" in row for row in trail)
                assert any("claim-warm" in row and "claimed" in row for row in trail)
        finally:
            with anyio.CancelScope(shield=True):
                await server.stop()
