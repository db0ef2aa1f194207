"""Failures that come back as inputs (issue 25), on the real Incus 6.0 daemon
(tests/support/realincus.py) with ``reconciler run``, the bridge, the executor and GARM's
provider over a real nats-server:

- a cold runner whose create Incus refuses (an image it does not have): the provider
  reports it on the bus, the fold releases the lease at once with Incus's error as its
  fault, GARM's ``GetInstance`` answers ``status: error`` with that fault, and the room
  is free for the retry;
- a warm pool whose creates Incus refuses (a profile it does not have): the executor
  reports each, the fold releases each lease, and the pool backs off instead of asking
  again at once, for ever.

The tests print what the issue asked to see (run with ``-s``)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.core.model import HostName, PoolName
from tests.support.garm import bootstrap
from tests.support.realincus import RealIncus
from tests.system.test_e2e_simulated import until
from tests.system.test_garm_real_incus import HOST, container_pool, names, real_world

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(120)]


def show(title: str, text: Any) -> None:
    print(f"\n----- {title} -----\n{str(text).rstrip()}")


async def test_a_create_the_real_daemon_refuses_releases_the_lease_and_garm_sees_the_fault(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, replica):
        kind, payload = container_pool(real_incus, "real-cold")
        payload["image"] = "no-such-image"  # Incus has no such image: it refuses the create
        await bus.send((kind, payload))
        created = None
        with anyio.fail_after(30):  # until the bridge's first snapshot is folded
            while created is None or "unknown host" in created.text:
                created = await garm.create(bootstrap("garm-bad-1", "small"))
                if "unknown host" not in created.text:
                    break
                await anyio.sleep(0.5)
        show("GARM CreateInstance", f"exit {created.code}\n{created.text}")
        assert created.code == 1
        assert "creating garm-bad-1 on real-01" in created.text
        assert "garm-bad-1" not in names(real_incus)

        # the provider's failure input, and what the fold made of it
        (report,) = await bus.inputs(f"rc.in.host.{HOST}.failure")
        show("the failure input", report.data.decode())
        assert report.msg_id is not None and report.msg_id.endswith(":create")
        lease = None
        with anyio.fail_after(10):
            while lease is None or lease.get("state") != "released":
                lease = (await bus.query("lease", {"identifier": "garm-bad-1"}))["result"]
                await anyio.sleep(0.1)
        show("query lease garm-bad-1", lease)
        assert lease["fault"].startswith("create failed: creating garm-bad-1 on real-01")
        admitted, failed = lease["history"]
        assert admitted["to_state"] == "reserved"
        assert (failed["event"], failed["to_state"]) == ("create-failed", "released")
        assert replica.pipeline is not None
        assert replica.pipeline.state.booked.get(HostName(HOST), [0, 0, 0]) == [0, 0, 0]

        got = await garm.get("garm-bad-1")
        show("GARM GetInstance garm-bad-1", f"exit {got.code}\n{got.text}")
        assert got.code == 0, got.text
        answer = got.json()
        assert (answer["name"], answer["provider_id"], answer["status"]) == (
            "garm-bad-1",
            "garm-bad-1",
            "error",
        )
        fault = base64.b64decode(answer["provider_fault"]).decode()
        assert fault == lease["fault"]

        # GARM retries with the same name: a new attempt, on the room the first freed
        retried = await garm.create(bootstrap("garm-bad-1", "small"))
        assert retried.code == 1
        reply = await bus.query("lease", {"identifier": "garm-bad-1~2"})
        assert reply["ok"] and reply["result"]["job"] == "garm-bad-1~2"


async def test_a_warm_pool_whose_creates_the_real_daemon_refuses_backs_off(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (_garm, bus, replica):
        kind, payload = container_pool(real_incus, "real-warm", min_ready=1, max_ready=1)
        payload["profiles"] = ["default", "no-such-profile"]
        await bus.send((kind, payload))
        reports: list[Any] = []
        with anyio.fail_after(60):
            while len(reports) < 3:
                reports = await bus.inputs(f"rc.in.host.{HOST}.failure")
                await anyio.sleep(0.2)
        show("the executor's failure inputs", "\n".join(r.data.decode() for r in reports[:3]))
        assert {r.json()["action"] for r in reports} == {"create"}
        assert all("no-such-profile" in r.json()["error"] for r in reports)
        assert replica.pipeline is not None
        state = replica.pipeline.state
        released = [state.leases[lid] for lid in (r.json()["lease_id"] for r in reports[:3])]
        assert all(le.state.value == "released" and le.fault for le in released)
        await until(
            "no warm lease of the pool left booting",
            lambda: not state.pool_booting.get(PoolName("real-warm")),
        )
        # the top-up waits longer each time (0.5 s, 1 s, 2 s, 4 s …): in the 3 s after
        # the third failure, one more try at most (a pool asking at once would make ~10)
        await anyio.sleep(3)
        later = await bus.inputs(f"rc.in.host.{HOST}.failure")
        show("failures 3 s after the third", len(later))
        assert len(later) <= len(reports) + 1
        admits = [m for m in await bus.inputs("rc.in.cmd.admit") if "topup-" in m.data.decode()]
        assert len(admits) <= len(later) + 1
        assert not names(real_incus)
