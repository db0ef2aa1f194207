"""The demo: a scripted fleet folded, message by message, into a SQLite journal.

Every message goes the production path: JSON bytes on a contract subject → the decoder
(size, JSON, subject, JSON Schema, domain checks) → the fold → one store transaction per
batch (state, journal, outbox, position). At the end the database is reopened, its state
is compared with the one in memory, and every decision is summarised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import click
import orjson

from reconciler.bus.codec import BadInput, decode
from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.state import Effects, State
from reconciler.store.sqlite import Store


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
            "warm": {"min_ready": 2, "max_ready": 3, "protect_min_ready": False},
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
    decisions: list[dict[str, Any]]
    dead_letters: list[tuple[str, str]]
    commands: Counter[str]


async def run_demo(db: Path, *, echo: bool = True) -> Summary:
    """Fold the script into ``db``; return what was decided."""
    await anyio.Path(db).unlink(missing_ok=True)
    state = State()
    summary = Summary([], [], Counter())
    seq = 0
    async with await Store.open(db) as store:
        for title, subject, payload in script():
            data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
            seq += 1
            decoded = decode(subject, data)
            if isinstance(decoded, BadInput):
                summary.dead_letters.append((decoded.reason, decoded.error))
                if echo:
                    click.secho(
                        f"  [{seq:>3}] {title}: dead-lettered ({decoded.reason}) {decoded.error}",
                        fg="yellow",
                    )
                continue
            msg = Message(
                seq=seq,
                timestamp=f"2026-12-02T10:00:{seq:02d}Z",
                input=decoded.input,
                subject=subject,
            )
            fx = fold(state, msg, Effects())
            await store.commit(state, fx, applied_seq=seq)
            for out in fx.outputs:
                body = orjson.loads(out.payload)
                if out.subject.startswith("out.decision."):
                    summary.decisions.append(body)
                    if echo:
                        _echo_decision(seq, title, body)
                else:
                    summary.commands[out.subject.rsplit(".", 1)[-1]] += 1
                    if echo:
                        click.echo(f"  [{seq:>3}]   → {out.subject} {body.get('instance', '')}")
        reloaded = await store.load_state()
    if reloaded.leases != state.leases or reloaded.hosts != state.hosts:
        raise click.ClickException("state reloaded from SQLite differs from the folded state")
    return summary


def _echo_decision(seq: int, title: str, body: dict[str, Any]) -> None:
    lease = body.get("lease") or {}
    where = f" {lease.get('instance')}@{lease.get('host')}" if lease else ""
    gpus = f" gpus={lease['gpus']}" if lease.get("gpus") else ""
    why = f" ({body['reason']})" if "reason" in body else ""
    color = {"admitted": "green", "claimed": "green", "ok": "green", "pending": "cyan"}.get(
        body["outcome"], "red"
    )
    label = f"{title}: " if title else ""
    click.echo(f"  [{seq:>3}] {label}{body['verb']} {body['request_id']} → ", nl=False)
    click.secho(f"{body['phase']} {body['outcome']}{why}{where}{gpus}", fg=color)
