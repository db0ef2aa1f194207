"""``reconciler bridge`` against the real Incus 6.0 daemon, onto a real nats-server.

The bridge must be lossless: every lifecycle event Incus emitted (as its own
``incus monitor --type=lifecycle`` saw it) reaches ``rc.in.host.<host>.lifecycle``,
verbatim, including those right after (re)connection.
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from reconciler.bridge.bridge import Bridge, HostBridge, settings_from_json
from reconciler.bus.schemas import load
from reconciler.incus.client import IncusEndpoint, IncusHost
from tests.support.bus import BusClient
from tests.support.natsserver import NatsServer
from tests.support.realincus import RealIncus, launch_ready

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(90)]

HOST = "real-01"
SCHEMAS = load()


class Monitor:
    """``incus monitor --type=lifecycle --format=json``: what Incus itself emitted."""

    def __init__(self, daemon: RealIncus) -> None:
        self._process = subprocess.Popen(
            [
                "incus",
                "monitor",
                "--type=lifecycle",
                "--format=json",
                "--all-projects",
            ],
            env=daemon.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> list[dict[str, Any]]:
        """Stop it (by its own PID); every event it printed."""
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        return _json_objects(out.decode())


def _json_objects(text: str) -> list[dict[str, Any]]:
    decoder, found, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        found.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return found


@contextlib.contextmanager
def monitored(daemon: RealIncus) -> Iterator[Monitor]:
    monitor = Monitor(daemon)
    try:
        yield monitor
    finally:
        if monitor._process.poll() is None:
            monitor._process.kill()
            monitor._process.wait(timeout=10)
        if monitor._process.stdout is not None:
            monitor._process.stdout.close()


@contextlib.asynccontextmanager
async def bridged(
    daemon: RealIncus, bus: BusClient, *, publish_timeout_s: float = 5.0
) -> AsyncIterator[HostBridge]:
    host = IncusHost(IncusEndpoint(host=HOST, url=daemon.url), request_timeout_s=5)
    bridge = HostBridge(
        incus=host,
        js=bus.nc.jetstream(timeout=publish_timeout_s),
        prefix="rc",
        settings=settings_from_json({})["*"],
        resync_s=60,
        inventory_delay_s=0.1,
        backoff_s=0.1,
        max_backoff_s=0.5,
        idle_timeout_s=15,
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(Bridge([bridge]).run)
            yield bridge
            tg.cancel_scope.cancel()
    finally:
        await host.aclose()


def key(event: dict[str, Any]) -> tuple[str, str, str]:
    """What identifies one emitted event: its time, action and instance."""
    md = event["metadata"]
    return (event["timestamp"], md["action"], md["name"])


async def connected(bridge: HostBridge, times: int = 1) -> None:
    with anyio.fail_after(20):
        while bridge.connections < times:  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def lifecycle_on_bus(bus: BusClient, count: int) -> list[dict[str, Any]]:
    msgs = await bus.wait_inputs(f"rc.in.host.{HOST}.lifecycle", count, within_s=20)
    return [m.json() for m in msgs]


async def test_every_lifecycle_event_incus_emitted_reaches_the_bus(
    real_incus: RealIncus, nc: Client
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    with monitored(real_incus) as monitor:
        await anyio.sleep(0.3)  # the monitor is connected
        async with bridged(real_incus, bus) as bridge:
            await connected(bridge)
            for i in range(2):
                await anyio.to_thread.run_sync(launch_ready, real_incus, f"br-{i}")
                await anyio.to_thread.run_sync(
                    functools.partial(real_incus.incus, "delete", "--force", f"br-{i}")
                )
            await anyio.to_thread.run_sync(launch_ready, real_incus, "br-graceful")
            await anyio.to_thread.run_sync(
                lambda: real_incus.incus("stop", "--force", "br-graceful")
            )
            await anyio.sleep(0.5)
            emitted = monitor.stop()
            assert len(emitted) >= 2 * 5 + 4
            published = await lifecycle_on_bus(bus, len(emitted))
    for body in published:
        SCHEMAS.validator("in/host.lifecycle.json").validate(body)
        assert body["host"] == HOST
    assert sorted(key(b["event"]) for b in published) == sorted(key(e) for e in emitted)
    by_key = {key(e): e for e in emitted}
    for body in published:  # verbatim: exactly what Incus sent
        assert body["event"] == by_key[key(body["event"])]
    actions = [b["event"]["metadata"]["action"] for b in published]
    assert actions.count("instance-ready") == 3
    assert actions.count("instance-deleted") == 2


async def test_events_emitted_while_nats_is_frozen_are_published_once_it_answers(
    real_incus: RealIncus, nc: Client, nats_server: NatsServer
) -> None:
    """A publish that times out is retried; the event session is not torn down."""
    bus = BusClient(nc)
    await bus.ensure_streams()
    with monitored(real_incus) as monitor:
        await anyio.sleep(0.3)
        async with bridged(real_incus, bus, publish_timeout_s=0.5) as bridge:
            await connected(bridge)
            await bus.wait_inputs(f"rc.in.host.{HOST}.inventory", 1)
            nats_server.pause()
            try:
                await anyio.to_thread.run_sync(launch_ready, real_incus, "frozen-1")
                await anyio.sleep(1.5)  # several publish timeouts
            finally:
                nats_server.resume()
            await anyio.to_thread.run_sync(
                lambda: real_incus.incus("delete", "--force", "frozen-1")
            )
            await anyio.sleep(0.5)
            emitted = monitor.stop()
            published = await lifecycle_on_bus(bus, len(emitted))
            assert bridge.connections == 1
            assert bridge.publish_retries >= 1
    assert sorted(key(b["event"]) for b in published) == sorted(key(e) for e in emitted)
    actions = [b["event"]["metadata"]["action"] for b in published]
    assert {"instance-created", "instance-ready", "instance-deleted"} <= set(actions)


async def test_a_bridge_connecting_during_churn_misses_nothing_after_its_first_event(
    real_incus: RealIncus, nc: Client
) -> None:
    """Instances change while the bridge connects: from the first event it forwards on,
    every event Incus emitted reaches the bus (no gap after the upgrade)."""
    bus = BusClient(nc)
    await bus.ensure_streams()
    with monitored(real_incus) as monitor:
        await anyio.sleep(0.3)
        churned = anyio.Event()

        async def churn() -> None:
            for i in range(3):
                await anyio.to_thread.run_sync(launch_ready, real_incus, f"early-{i}")
            churned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(churn)
            await anyio.sleep(0.2)
            async with bridged(real_incus, bus) as bridge:
                await connected(bridge)
                with anyio.fail_after(60):
                    await churned.wait()
                await anyio.sleep(0.5)
        emitted = [key(e) for e in monitor.stop()]
    published = {key(m.json()["event"]) for m in await bus.inputs(f"rc.in.host.{HOST}.lifecycle")}
    first = min(emitted.index(k) for k in published)
    assert [k for k in emitted[first:] if k not in published] == []
    assert len(emitted) == 3 * 3


async def test_snapshot_and_inventory_of_the_real_host(real_incus: RealIncus, nc: Client) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    real_incus.launch("inv-1", config={"user.rc.lease-id": "L5", "user.rc.pool": "small"})
    async with bridged(real_incus, bus):
        snapshot = (await bus.wait_inputs(f"rc.in.host.{HOST}.snapshot"))[0].json()
        inventory = (await bus.wait_inputs(f"rc.in.host.{HOST}.inventory"))[0].json()
    SCHEMAS.validator("in/host.snapshot.json").validate(snapshot)
    SCHEMAS.validator("in/host.inventory.json").validate(inventory)
    resources = real_incus.query("/1.0/resources")
    assert isinstance(resources, dict)
    assert snapshot["capacity"]["cpu"] == resources["cpu"]["total"]
    assert snapshot["capacity"]["memory_mib"] == resources["memory"]["total"] // (1024 * 1024)
    assert snapshot["capacity"]["disk_gib"] > 0
    server = real_incus.query("/1.0")
    assert isinstance(server, dict)
    assert snapshot["uid"] == server["environment"]["certificate_fingerprint"]
    (inst,) = inventory["instances"]
    assert (inst["name"], inst["type"], inst["project"]) == ("inv-1", "container", "default")
    assert inst["status"] in ("Running", "Ready")
    assert inst["config"]["user.rc.lease-id"] == "L5"


async def test_the_bridge_reconnects_after_the_daemon_restarts(
    real_incus: RealIncus, nc: Client
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    async with bridged(real_incus, bus) as bridge:
        await connected(bridge)
        await anyio.to_thread.run_sync(real_incus.restart)
        await connected(bridge, 2)
        await anyio.to_thread.run_sync(launch_ready, real_incus, "after-restart")
        events = await lifecycle_on_bus(bus, 3)
        inventories = await bus.wait_inputs(f"rc.in.host.{HOST}.inventory", 2)
    actions = {e["event"]["metadata"]["action"] for e in events}
    assert {"instance-created", "instance-started", "instance-ready"} <= actions
    assert [e["event"]["metadata"]["name"] for e in events] == ["after-restart"] * len(events)
    revisions = [i.json()["revision"] for i in inventories]
    assert revisions == sorted(set(revisions))
