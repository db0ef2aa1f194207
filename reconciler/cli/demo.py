"""The demo: a scripted fleet driven over NATS JetStream through ``reconciler run``.

On a fresh machine it starts a local nats-server (JetStream in a temporary directory),
runs one replica of the reconciler in this process (SQLite file ``--db``), and publishes
the story below on the contract's subjects: hosts with and without GPUs, a GPU profile
and class, two pools, warm VMs booting and a job claiming one, GPU jobs, cold jobs
filling the CPU hosts, one preemption through its launch gate, and two bad inputs that
are dead-lettered. Every decision is printed as it comes back on the OUT stream; at the
end a summary, and a replay of the input stream that must reproduce every decision and
the store's state digest.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
from nats.aio.msg import Msg

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.embedded import embedded_nats
from reconciler.controller.replay import replay_into
from reconciler.controller.runtime import Replica, RunConfig
from reconciler.store.digest import state_digest


def _res(cpu: int, mem: int, disk: int) -> dict[str, int]:
    return {"cpu": cpu, "memory_mib": mem, "disk_gib": disk}


def _gpu(index: int, numa: int) -> dict[str, Any]:
    return {
        "index": index,
        "vendor": "nvidia",
        "model": "L40S",
        "memory_mib": 46068,
        "pci_address": f"0000:{0x41 + index:02x}:00.0",
        "numa_node": numa,
    }


def _lifecycle(host: str, action: str, name: str) -> dict[str, Any]:
    return {
        "v": 1,
        "host": host,
        "event": {
            "type": "lifecycle",
            "timestamp": "2026-12-02T10:00:00.000000000Z",
            "metadata": {
                "action": action,
                "source": f"/1.0/instances/{name}",
                "name": name,
                "project": "ci",
            },
            "location": "none",
            "project": "ci",
        },
    }


def _observed(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "project": "ci",
        "status": "Running",
        "status_code": 103,
        "type": "virtual-machine",
        "config": {},
        "resources": _res(4, 8192, 40),
        "gpus": [],
    }


def _snapshot(host: str, revision: int, cpu: int, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "v": 1,
        "host": host,
        "uid": f"{host}-uid",
        "revision": revision,
        "schedulable": True,
        "labels": {"gpu": "yes" if gpus else "no"},
        "capacity": _res(cpu, cpu * 4096, 1000),
        "reserve": _res(2, 4096, 50),
        "gpus": gpus,
        "gpu_profile": "compute" if gpus else None,
    }


def script() -> Iterator[tuple[str, str, dict[str, Any] | bytes]]:
    """(what it shows, subject, payload) for every step of the story."""
    yield "host cpu-a: 16 vCPUs", "rc.in.host.cpu-a.snapshot", _snapshot("cpu-a", 1, 16, [])
    yield "host cpu-b: 8 vCPUs", "rc.in.host.cpu-b.snapshot", _snapshot("cpu-b", 1, 8, [])
    yield (
        "host gpu-a: 32 vCPUs, 4 GPUs on 2 NUMA nodes",
        "rc.in.host.gpu-a.snapshot",
        _snapshot("gpu-a", 1, 32, [_gpu(0, 0), _gpu(1, 0), _gpu(2, 1), _gpu(3, 1)]),
    )
    yield (
        "GPU profile",
        "rc.in.config.gpu-profile.compute",
        {
            "v": 1,
            "name": "compute",
            "revision": 1,
            "defaults": {
                "mig_mode": "disabled",
                "compute_mode": "exclusive-process",
                "persistence": True,
                "power_limit_w": 300,
                "ecc": True,
            },
        },
    )
    yield (
        "class l40s (1 GPU)",
        "rc.in.config.class.l40s",
        {
            "v": 1,
            "class": "l40s",
            "parameters": {"gpu": {"count": 1, "model": "L40S"}},
            "host_selector": {"gpu": "yes"},
        },
    )
    yield (
        "pool linux-small: warm 3, 4 vCPUs",
        "rc.in.config.pool.linux-small",
        {
            "v": 1,
            "pool": "linux-small",
            "flavor": _res(4, 8192, 40),
            "claims": [],
            # min_ready 0: the story admits its warm VMs itself (the leader's top-ups
            # would name theirs after stream sequences)
            "warm": {"min_ready": 0, "max_ready": 3, "protect_min_ready": False},
            "max_instances": 20,
            "priority": 0,
            "host_selector": {"gpu": "no"},
            "placement": "pack",
            "image": "images:ubuntu/24.04",
            "profiles": ["default"],
            "project": "ci",
        },
    )
    yield (
        "pool ml-gpu: 2 GPUs per job",
        "rc.in.config.pool.ml-gpu",
        {
            "v": 1,
            "pool": "ml-gpu",
            "flavor": _res(8, 32768, 200),
            "claims": [{"name": "gpus", "class": "l40s", "parameters": {"gpu": {"count": 2}}}],
            "warm": {"min_ready": 0, "max_ready": 0, "protect_min_ready": False},
            "max_instances": 4,
            "priority": 10,
            "host_selector": {},
            "placement": "spread",
            "image": "images:ubuntu/24.04",
            "profiles": ["gpu"],
            "project": "ci",
        },
    )
    for i in range(1, 4):
        yield (
            f"warm top-up w{i}",
            "rc.in.cmd.admit",
            {
                "v": 1,
                "request_id": f"top-up-{i}",
                "pool": "linux-small",
                "instance": f"warm-{i}",
                "kind": "warm",
            },
        )
    # pack fills the smaller host first: warm-1 lands on cpu-b, warm-2 and warm-3 on cpu-a
    for i, host in ((1, "cpu-b"), (2, "cpu-a"), (3, "cpu-a")):
        yield (
            f"warm-{i} boots",
            f"rc.in.host.{host}.lifecycle",
            _lifecycle(host, "instance-created", f"warm-{i}"),
        )
        yield (
            f"warm-{i} ready",
            f"rc.in.host.{host}.lifecycle",
            _lifecycle(host, "instance-ready", f"warm-{i}"),
        )
    yield (
        "job 1001 takes a warm VM",
        "rc.in.cmd.claim-warm",
        {
            "v": 1,
            "request_id": "claim-1001",
            "pool": "linux-small",
            "job": "job-1001",
        },
    )
    yield (
        "same job again: same VM",
        "rc.in.cmd.claim-warm",
        {
            "v": 1,
            "request_id": "claim-1001-retry",
            "pool": "linux-small",
            "job": "job-1001",
        },
    )
    yield (
        "GARM injects the runner",
        "rc.in.cmd.mark-warm-injected",
        {
            "v": 1,
            "request_id": "inject-1001",
            "job": "job-1001",
            "instance": "warm-1",
        },
    )
    yield (
        "two GPU jobs",
        "rc.in.cmd.admit",
        {
            "v": 1,
            "request_id": "ml-1",
            "pool": "ml-gpu",
            "instance": "ml-1",
            "kind": "cold",
        },
    )
    yield (
        "",
        "rc.in.cmd.admit",
        {
            "v": 1,
            "request_id": "ml-2",
            "pool": "ml-gpu",
            "instance": "ml-2",
            "kind": "cold",
        },
    )
    yield (
        "a third GPU job finds no GPUs",
        "rc.in.cmd.admit",
        {
            "v": 1,
            "request_id": "ml-3",
            "pool": "ml-gpu",
            "instance": "ml-3",
            "kind": "cold",
        },
    )
    yield (
        "cold jobs fill the CPU hosts",
        "rc.in.cmd.admit",
        {
            "v": 1,
            "request_id": "cold-1",
            "pool": "linux-small",
            "instance": "cold-1",
            "kind": "cold",
        },
    )
    yield (
        "a cold job that fits nowhere preempts an idle warm VM",
        "rc.in.cmd.admit-preemptible",
        {
            "v": 1,
            "request_id": "cold-2",
            "pool": "linux-small",
            "instance": "cold-2",
            "kind": "cold",
        },
    )
    yield "bad input: malformed JSON is dead-lettered", "rc.in.cmd.admit", b"{not json"
    yield (
        "bad input: hostile instance name",
        "rc.in.cmd.admit",
        {
            "v": 1,
            "request_id": "evil",
            "pool": "linux-small",
            "instance": "../etc",
            "kind": "cold",
        },
    )
    yield (
        "the executor deletes the victim",
        "rc.in.host.cpu-a.lifecycle",
        _lifecycle("cpu-a", "instance-deleted", "warm-3"),
    )
    yield (
        "a fresh inventory proves the fit: the gate opens",
        "rc.in.host.cpu-a.inventory",
        {
            "v": 1,
            "host": "cpu-a",
            "uid": "cpu-a-uid",
            "revision": 1,
            "instances": [_observed("warm-2"), _observed("cold-1")],
        },
    )
    yield (
        "the cold job finishes",
        "rc.in.cmd.release",
        {
            "v": 1,
            "request_id": "rel-cold-1",
            "instance": "cold-1",
        },
    )


@dataclass
class Summary:
    decisions: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    commands: Counter[str] = field(default_factory=Counter)
    digest: str = ""
    replay_divergences: int = -1
    nats_url: str = ""


async def run_demo(
    db: Path, *, nats_url: str | None = None, echo: bool = True, prefix: str = "rc"
) -> Summary:
    """Run the story against ``nats_url`` (or a nats-server started here) into ``db``."""
    for suffix in ("", "-wal", "-shm"):
        await anyio.Path(f"{db}{suffix}").unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if nats_url is None:
            server = stack.enter_context(embedded_nats())
            nats_url = server.url
            if echo:
                click.secho(f"nats-server (JetStream) at {nats_url}, pid {server.pid}", dim=True)
        return await _drive(db, nats_url=nats_url, echo=echo, prefix=prefix)


async def _drive(db: Path, *, nats_url: str, echo: bool, prefix: str) -> Summary:
    summary = Summary(nats_url=nats_url)
    opts = ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.2, initial_timeout_s=10)
    config = RunConfig(
        nats=opts, db=db, prefix=prefix, replica="demo", leader_ttl_s=3.0, status_debounce_s=0.2
    )
    replica = Replica(config)
    stop = anyio.Event()
    nc = await connect(ConnectOptions(urls=(nats_url,), name="demo-driver", initial_timeout_s=10))
    try:
        arrived: dict[str, dict[str, Any]] = {}
        shown: set[tuple[str, str]] = set()
        commands: list[dict[str, Any]] = []
        changed = anyio.Event()

        async def on_output(msg: Msg) -> None:
            nonlocal changed
            subject = msg.subject.removeprefix(f"{prefix}.")
            body = orjson.loads(msg.data)
            if subject.startswith("out.exec."):
                summary.commands[subject.rsplit(".", 1)[1]] += 1
                commands.append(body)
            arrived[subject] = body
            changed.set()
            changed = anyio.Event()

        await nc.subscribe(f"{prefix}.out.>", cb=on_output)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(replica.run, stop=stop))
            with anyio.fail_after(30):
                while not replica.leader_ready:  # noqa: ASYNC110 - a flag set by the replica
                    await anyio.sleep(0.02)
            if echo:
                click.secho(f"reconciler replica 'demo' leads; store {db}\n", dim=True)
            js = nc.jetstream()
            for title, subject, payload in script():
                data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
                rid = payload.get("request_id") if isinstance(payload, dict) else None
                headers = {"Nats-Msg-Id": f"demo:{rid}"} if rid else None
                ack = await js.publish(subject, data, headers=headers)
                body = await _wait_for(
                    arrived,
                    request_id=rid,
                    seq=ack.seq,
                    dead_letter=isinstance(payload, bytes),
                    changed=lambda: changed,
                )
                if body is None:
                    await anyio.sleep(0.05)  # an input without an answer of its own
                _record(summary, title, ack.seq, subject, body, echo=echo)
                if body is not None and "request_id" in body:
                    shown.add((body["request_id"], body["phase"]))
                for later in _new_decisions(arrived, shown):  # e.g. a launch gate opening
                    _record(summary, "", ack.seq, subject, later, echo=echo)
                while commands:
                    command = commands.pop(0)
                    if echo:
                        what = command.get("reason", "create")
                        where = f"{command['instance']} on {command['host']}"
                        click.secho(f"        → executor command: {what} {where}", dim=True)
            assert replica.caches is not None
            with anyio.fail_after(30):
                while replica.caches.committed_seq < ack.seq:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await anyio.sleep(0.5)  # the outbox's last round, and the status debounce
            summary.digest = state_digest(replica.caches.state)
            stop.set()
        report = await replay_into(nc, prefix=prefix)
        summary.replay_divergences = len(report.divergences)
        if report.digest != summary.digest:
            raise click.ClickException("the replay's state digest differs from the store's")
    finally:
        await nc.close()
    return summary


async def _wait_for(
    arrived: dict[str, dict[str, Any]],
    *,
    request_id: str | None,
    seq: int,
    dead_letter: bool,
    changed: Callable[[], anyio.Event],
    within_s: float = 15.0,
) -> dict[str, Any] | None:
    """What an input caused on the bus: its dead letter, or its command's decision."""
    with anyio.fail_after(within_s):
        while True:
            for subject, body in arrived.items():
                if subject.startswith("out.dlq.") and body.get("stream_seq") == seq:
                    return body
            if request_id is None and not dead_letter:
                return None
            if f"out.decision.{request_id}" in arrived:
                return arrived[f"out.decision.{request_id}"]
            await changed().wait()


def _new_decisions(
    arrived: dict[str, dict[str, Any]], shown: set[tuple[str, str]]
) -> list[dict[str, Any]]:
    fresh = []
    for subject, body in arrived.items():
        if subject.startswith("out.decision."):
            key = (body["request_id"], body["phase"])
            if key not in shown:
                shown.add(key)
                fresh.append(body)
    return fresh


def _record(
    summary: Summary,
    title: str,
    seq: int,
    subject: str,
    body: dict[str, Any] | None,
    *,
    echo: bool,
) -> None:
    label = f"{title}: " if title else ""
    if body is None:
        if echo and title:
            click.echo(f"  [{seq:>3}] {title}  ({subject})")
        return
    if "stream_seq" in body:
        summary.dead_letters.append(body)
        if echo:
            click.secho(f"  [{seq:>3}] {label}dead-lettered: {body['error']}", fg="yellow")
        return
    summary.decisions.append(body)
    if echo:
        _echo_decision(seq, label, body)


def _echo_decision(seq: int, label: str, body: dict[str, Any]) -> None:
    lease = body.get("lease") or {}
    where = f" {lease.get('instance')}@{lease.get('host')}" if lease else ""
    gpus = f" gpus={lease['gpus']}" if lease.get("gpus") else ""
    victims = body.get("victims")
    preempts = f" preempting {[v['instance'] for v in victims]}" if victims else ""
    why = f" ({body['reason']})" if "reason" in body else ""
    color = {"admitted": "green", "claimed": "green", "ok": "green", "pending": "cyan"}.get(
        body["outcome"], "red"
    )
    click.echo(f"  [{seq:>3}] {label}{body['verb']} {body['request_id']} → ", nl=False)
    phase = "" if body["phase"] == body["outcome"] else f"{body['phase']} "
    click.secho(f"{phase}{body['outcome']}{why}{where}{gpus}{preempts}", fg=color)
