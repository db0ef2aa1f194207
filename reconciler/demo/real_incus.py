"""The demo on a real, local Incus (``reconciler demo --incus-real``): containers.

It starts a private Incus daemon (:mod:`reconciler.demo.local_incus`: its own directory,
no network, a busybox image whose init tells Incus it is ready), a local nats-server,
and, as in production, one replica of ``reconciler run``, ``reconciler bridge`` and
``reconciler executor`` talking to it over its unix socket through pylxd. Incus on a
machine without ``vhost_vsock`` runs containers only, so the pool says
``instance_type: container``.

The story: the bridge brings the host in (its real CPUs, memory and disk; the reserve
leaves two CPUs allocatable); the leader keeps a warm pool of two containers that
reach ``ready`` from the guest's own signal; a job claims one, finishes and is deleted,
and the pool refills; a preemptible cold job evicts an idle warm container and is
admitted only after the executor deleted it and a fresh inventory proved the room.
Every decision is printed with its input stream sequence; at the end the input stream
is replayed and must reproduce every decision and the state digest.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import click

from reconciler.bridge.bridge import Bridge, HostBridge, settings_from_json
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.embedded import embedded_nats
from reconciler.core.messages import DEFAULT_PREFIX
from reconciler.core.model import HostName
from reconciler.demo.local_incus import LocalIncus, start_local_incus, unavailable
from reconciler.demo.simulated import (
    Driver,
    Summary,
    _ready,
    _replica_and_executor,
    _Say,
    _state,
    _tell,
    _Watch,
)
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.views import InstanceSpec
from reconciler.replica.replica import Replica

__all__ = ["run_real_demo"]

HOST = "local"
POOL = "ci"
PROJECT = "default"


def _pool(image: str) -> dict[str, Any]:
    return {
        "v": 1,
        "pool": POOL,
        "flavor": {"cpu": 1, "memory_mib": 256, "disk_gib": 1},
        "warm": {"min_ready": 2, "max_ready": 2, "protect_min_ready": False},
        "max_instances": 10,
        "image": image,
        "profiles": ["default"],
        "project": PROJECT,
        "instance_type": "container",
    }


async def run_real_demo(
    db: Path, *, nats_url: str | None = None, echo: bool = True, prefix: str = DEFAULT_PREFIX
) -> Summary:
    """Run the story on a private local Incus; see the module's docstring."""
    reason = unavailable()
    if reason is not None:
        raise click.ClickException(f"--incus-real needs a local Incus: {reason}")
    for suffix in ("", "-wal", "-shm"):
        await anyio.Path(f"{db}{suffix}").unlink(missing_ok=True)
    say = _Say(echo=echo)
    summary = Summary()
    async with contextlib.AsyncExitStack() as stack:
        if nats_url is None:
            server = stack.enter_context(embedded_nats())
            nats_url = server.url
            say.note(f"nats-server with JetStream at {nats_url}")
        daemon = await anyio.to_thread.run_sync(lambda: stack.enter_context(start_local_incus()))
        say.note(f"private Incus {daemon.version} at {daemon.socket} (pid {daemon.pid})")
        await _story(db, nats_url=nats_url, daemon=daemon, prefix=prefix, say=say, summary=summary)
        summary.vms = sorted(f"{i['name']}@{HOST}" for i in daemon.instances())
    return summary


async def _story(
    db: Path, *, nats_url: str, daemon: LocalIncus, prefix: str, say: _Say, summary: Summary
) -> None:
    endpoint = IncusEndpoint(host=HOST, url=daemon.url)
    nats = ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.2, initial_timeout_s=10)
    replica, executor = await _replica_and_executor(nats, db, prefix, (endpoint,))
    resources = daemon.query("/1.0/resources")
    cpus = int(resources["cpu"]["total"]) if isinstance(resources, dict) else 2
    if cpus < 2:
        raise click.ClickException("--incus-real needs at least two CPUs")
    settings = settings_from_json(
        {"defaults": {"reserve": {"cpu": cpus - 2, "memory_mib": 1024, "disk_gib": 1}}}
    )
    bridge_host = IncusHost(endpoint)
    garm = IncusHost(endpoint)
    nc = await connect(replace(nats, name="demo-driver"))
    try:
        js = nc.jetstream()
        bridge = HostBridge(
            incus=bridge_host, js=js, prefix=prefix, settings=settings["*"], inventory_delay_s=0.2
        )
        watch = _Watch(say, summary, prefix)
        await nc.subscribe(watch.subjects.outputs, cb=watch.on_output)
        driver = Driver(nc, prefix)
        await _tell(
            functools.partial(_chapters, daemon, driver, garm, watch, replica, say),
            nc=nc,
            prefix=prefix,
            parts=(replica, executor, Bridge([bridge])),
            watch=watch,
            summary=summary,
            say=say,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()
            await bridge_host.aclose()
            await garm.aclose()


async def _chapters(
    daemon: LocalIncus,
    driver: Driver,
    garm: IncusHost,
    watch: _Watch,
    replica: Replica,
    say: _Say,
) -> None:
    say.step("The bridge brings the local Incus host in (snapshot and inventory)")
    await watch.until("the host", lambda: HOST in _state(replica).hosts)
    a = _state(replica).hosts[HostName(HOST)].allocatable
    say.note(f"{HOST}: {a.cpu} vCPU, {a.memory_mib} MiB, {a.disk_gib} GiB allocatable")

    say.step("An operator configures pool 'ci': busybox containers, keep 2 warm")
    await driver.configure("pool", POOL, _pool(daemon.image))

    say.step("The leader tops the warm pool up; the executor creates and starts containers")
    await watch.until("two warm containers ready", lambda: _ready(replica, POOL) >= 2, within_s=60)
    for inst in daemon.instances():
        say.note(f"{inst['name']}: {inst['type']}, status {inst['status']} (the guest said ready)")

    say.step("Job 1 claims a warm container; it runs, ends and GARM deletes it")
    claim = await driver.command("claim-warm", "claim-job-1", pool=POOL, job="job-1")
    assert claim.lease is not None
    name = claim.lease.instance
    say.note(f"claimed {name} at input seq {claim.input_seq}")
    await driver.command("mark-warm-injected", "inject-job-1", job="job-1", instance=name)
    await garm.destroy_instance(name, project=PROJECT)
    await watch.until("the pool refilled", lambda: _ready(replica, POOL) >= 2, within_s=60)
    say.note("instance-deleted released the lease; the leader refilled the pool")

    say.step("A cold job that fits nowhere evicts an idle warm container (admit-preemptible)")
    urgent: dict[str, Any] = {"pool": POOL, "instance": "urgent-1", "kind": "cold"}
    pending = await driver.command("admit-preemptible", "urgent-1", first=True, **urgent)
    victims = [v.instance for v in pending.victims or ()]
    say.note(f"{pending.phase} at input seq {pending.input_seq}: victims {victims}")
    final = await driver.command("admit-preemptible", "urgent-1", **urgent)
    say.note(f"{final.outcome} at input seq {final.input_seq}, after the victim was gone")
    if final.outcome == "admitted" and final.lease is not None:
        lease = final.lease
        spec = InstanceSpec.for_lease(
            name=lease.instance,
            image=daemon.image,
            lease_id=lease.lease_id,
            pool=lease.pool,
            kind=lease.kind,
            project=PROJECT,
            demand=lease.demand,
            instance_type="container",
        )
        await garm.create_instance(spec)
        await garm.start_instance(spec.name, project=PROJECT)
        say.note(f"GARM created and started {spec.name}")
