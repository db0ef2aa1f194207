"""The GARM provider against the real Incus 6.0 daemon (containers of the busybox test
image, tests/realincus.py), with ``reconciler run``, the bridge and the executor over a
real nats-server: the bootstrap really lands and runs in a claimed warm container, and
a cold runner is really created and deleted."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.garm.bootstrap import LOG_PATH, Injection
from reconciler.incus.client import IncusEndpoint
from reconciler.replica.runtime import Replica
from tests import builders as b
from tests.bus import BusClient
from tests.garm_support import CONTROLLER, GARM_POOL, MARKER, Garm, bootstrap, write_config
from tests.realincus import RealIncus
from tests.test_e2e_incus import system_on, until

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(120)]

HOST = "real-01"


def container_pool(real_incus: RealIncus, name: str, **kw: Any) -> tuple[str, dict[str, Any]]:
    kind, payload = b.pool(name, cpu=1, memory_mib=128, disk_gib=1, instance_type="container", **kw)
    payload["image"] = real_incus.image
    return kind, payload


@contextlib.asynccontextmanager
async def real_world(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> AsyncIterator[tuple[Garm, BusClient, Replica]]:
    bus = BusClient(nc)
    eps = (IncusEndpoint(host=HOST, url=real_incus.url),)
    async with system_on(nats_url, tmp_path, eps, bus, leader_ttl_s=15.0) as replica:
        config = write_config(
            tmp_path / "garm-provider.toml",
            nats_url=nats_url,
            hosts={HOST: str(real_incus.socket)},  # a socket path, as operators write it
            pools={"warm": "real-warm", "small": "real-cold"},
        )
        yield Garm(config), bus, replica


def names(real_incus: RealIncus) -> set[str]:
    return {str(i["name"]) for i in real_incus.instances()}


async def test_a_warm_claim_runs_the_bootstrap_in_the_container(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, replica):
        await bus.send(container_pool(real_incus, "real-warm", min_ready=1, max_ready=1))
        assert replica.caches is not None
        state = replica.caches.state
        await until(
            "a warm container is ready", lambda: bool(state.pool_ready.get("real-warm")), 60
        )  # type: ignore[call-overload]
        (warm,) = names(real_incus)

        created = await garm.create(bootstrap("garm-real-warm-1", "warm"))
        assert created.code == 0, created.text
        assert created.json()["provider_id"] == warm
        assert created.json()["name"] == "garm-real-warm-1"
        config = real_incus.query(f"/1.0/instances/{warm}")["config"]  # type: ignore[index]
        assert config["user.runner-controller-id"] == CONTROLLER
        assert config["user.runner-pool-id"] == GARM_POOL
        assert config["user.runner-name"] == "garm-real-warm-1"

        ran = ""
        with anyio.fail_after(30):  # the install script runs in the background
            while "garm-real-warm-1" not in ran:
                ran = real_incus.incus("exec", warm, "--", "cat", MARKER, check=False)
                await anyio.sleep(0.2)
        assert ran.strip() == "bootstrap of garm-real-warm-1 ran as root"
        # a call killed after the start and run again: the script is not started twice
        real_incus.incus("exec", warm, "--", *Injection(files=()).command)
        await anyio.sleep(1.0)
        ran = real_incus.incus("exec", warm, "--", "cat", MARKER)
        assert ran.strip() == "bootstrap of garm-real-warm-1 ran as root"
        log = real_incus.incus("exec", warm, "--", "cat", LOG_PATH)
        assert "already started" in log

        listed = (await garm.list()).json()
        assert [(i["name"], i["provider_id"], i["status"]) for i in listed] == [
            ("garm-real-warm-1", warm, "running")
        ]
        deleted = await garm.delete("garm-real-warm-1")
        assert deleted.code == 0, deleted.text
        assert warm not in names(real_incus)


async def test_a_cold_create_and_delete(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, _replica):
        await bus.send(container_pool(real_incus, "real-cold"))
        created = None
        with anyio.fail_after(30):  # until the bridge's first snapshot is folded
            while created is None or "unknown host" in created.text:
                created = await garm.create(bootstrap("garm-real-cold-1", "small"))
                if created.code == 0:
                    break
                await anyio.sleep(0.5)
        assert created.code == 0, created.text
        assert created.json()["provider_id"] == "garm-real-cold-1"
        inst = real_incus.query("/1.0/instances/garm-real-cold-1")
        assert isinstance(inst, dict)
        assert inst["type"] == "container" and inst["status"] in ("Running", "Ready")
        assert inst["config"]["user.runner-controller-id"] == CONTROLLER
        assert inst["config"]["cloud-init.user-data"].startswith("#cloud-config")
        assert (await garm.get("garm-real-cold-1")).json()["status"] == "running"

        for _ in range(2):
            deleted = await garm.delete("garm-real-cold-1")
            assert deleted.code == 0, deleted.text
        assert "garm-real-cold-1" not in names(real_incus)
        reply = await bus.query("pool", {})
        assert reply["ok"] and reply["result"]["leases"] == []
