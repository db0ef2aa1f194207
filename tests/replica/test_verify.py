"""The leader's live verification of suspect leases (reconciler.replica.verify), on a
simulated fleet seen through the bridge, over a real nats-server."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.incus.views import InstanceSpec
from tests.bridge.test_bridge import bridged, valid
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.simfleet import endpoints, sim_fleet

pytestmark = pytest.mark.timeout(60)


async def test_suspect_leases_are_verified_live(nc: Client, nats_url: str, tmp_path: Any) -> None:
    """Missing from an inventory but answering the live GET: stays. Really gone: released."""
    bus = BusClient(nc)
    async with (
        sim_fleet(1) as fleet,
        running_replica(fast_config(nats_url, tmp_path / "rc.db", incus=endpoints(fleet))),
        bridged(fleet, bus) as (bridge,),
    ):
        await bus.wait_inputs("rc.in.host.host-01.snapshot")
        await bus.send(
            b.pool("web", cpu=2, memory_mib=4096, disk_gib=20),
            b.admit("a1", "web", "stays", host="host-01"),
            b.admit("a2", "web", "goes", host="host-01"),
        )
        leases = {}
        for rid in ("a1", "a2"):
            lease = (await bus.decision(rid))["lease"]
            leases[lease["instance"]] = lease["lease_id"]
            await bridge.incus.create_instance(
                InstanceSpec.for_lease(
                    name=lease["instance"], image="img", lease_id=lease["lease_id"], pool="web",
                    kind="cold",
                )
            )  # fmt: skip
        with anyio.fail_after(10):  # the bridge's inventory after the creates lists both
            while True:
                inventory = (await bus.inputs("rc.in.host.host-01.inventory"))[-1].json()
                if {i["name"] for i in inventory["instances"]} == {"stays", "goes"}:
                    break
                await anyio.sleep(0.05)
        # "goes" really disappears; "stays" is only missing from one (crafted) inventory
        fleet.host("host-01").remove_instance("goes", silent=True)
        uid = (await bus.inputs("rc.in.host.host-01.snapshot"))[0].json()["uid"]
        last = (await bus.inputs("rc.in.host.host-01.inventory"))[-1].json()["revision"]
        await bus.send(b.inventory("host-01", [], revision=last + 1, uid=uid))
        observations = await bus.wait_inputs("rc.in.host.host-01.observation", 2)
        seen = {o.json()["instance"]: o.json() for o in observations}
        for o in observations:
            valid("in/host.observation.json", o.json())
        assert seen["goes"]["present"] is False and seen["stays"]["present"] is True
        assert seen["stays"]["checked_revision"] == last + 1
        with anyio.fail_after(10):
            while True:
                goes = await bus.result("lease", {"identifier": "goes"})
                stays = await bus.result("lease", {"identifier": "stays"})
                if goes["state"] == "released" and "suspect" not in stays:
                    break
                await anyio.sleep(0.05)
        assert stays["state"] == "created"
        events = [h["event"] for h in goes["history"]]
        assert events[-1] == "verified-absent"
        assert orjson.loads(observations[0].data)["v"] == 1
