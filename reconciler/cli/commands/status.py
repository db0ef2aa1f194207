"""``reconciler status``: hosts and pools at a glance, read from a replica's store.

The store is opened read-only (a file that is not a replica's store is refused and left
untouched). The numbers are the ones the leader publishes on ``out.status.…``
(:mod:`reconciler.core.status`), computed from the committed state; reading the store
works whether the replica runs (SQLite's WAL lets a reader in) or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import click
import orjson

from reconciler.cli.options import db_option, oneshot_log_options
from reconciler.core.model import HostName, PoolName
from reconciler.core.status import (
    failed_leases,
    host_status,
    pool_status,
    queue_status,
    tenant_status,
    with_warm_claims,
)
from reconciler.store.errors import StoreError
from reconciler.store.sqlite import Store

__all__ = ["overview_lines", "status"]


async def overview_lines(db: Path, *, as_json: bool = False) -> list[str]:
    async with await Store.open_readonly(db) as store:
        state = await store.load_state()
        claims = await store.warm_claims()
    seq = state.applied_seq
    hosts = [host_status(state, HostName(h), as_of_seq=seq) for h in sorted(state.hosts)]
    pools = [
        with_warm_claims(row, claims.get(p, (0, 0)))
        for p in sorted(state.pools)
        if (row := pool_status(state, PoolName(p), as_of_seq=seq)) is not None
    ]
    failures = failed_leases(state)
    queues, tenants = queue_status(state), tenant_status(state)
    if as_json:
        tables = (
            ("host", hosts),
            ("pool", pools),
            ("failure", failures),
            ("queue", queues),
            ("tenant", tenants),
        )
        return [
            orjson.dumps({"type": kind, **row}).decode()
            for kind, rows in tables
            for row in rows
            if row is not None
        ]
    lines = [f"applied up to input {seq}; {len(state.leases)} leases in the journal", ""]
    lines.append(
        f"{'HOST':<20} {'SCHED':<9} {'CPU free/alloc':>15} {'MEM MiB free/alloc':>21} "
        f"{'DISK GiB free/alloc':>20} {'GPUS free':<12} LEASES"
    )
    for row in hosts:
        if row is not None:
            gpus_total = len(state.hosts[HostName(row["host"])].gpus)
            lines.append(_host_line({**row, "gpus_total": gpus_total}))
    lines.append("")
    lines.append(
        f"{'POOL':<20} {'READY':>5} {'BOOT':>5} {'CLAIMED':>7} {'DRAIN':>5} {'VICTIMS':>7} "
        f"{'PENDING':>7} {'INSTANCES':>9}  {'WARM min/max':<12}  HIT RATIO (claimed/claims)"
    )
    for row in pools:
        if row is not None:
            lines.append(_pool_line(row))
    if queues:
        lines += ["", f"{'QUEUE (pool)':<20} {'TENANT':<12} {'WAITING':>7}  FIRST IN LINE"]
        lines += [_queue_line(row) for row in queues]
    if tenants:
        lines += ["", f"{'TENANT':<20} {'WEIGHT':>6} {'SHARE':>7} {'WAITING':>7}  USAGE/QUOTA"]
        lines += [_tenant_line(row) for row in tenants]
    if failures:
        shown = failures[:_FAILURES_SHOWN]
        more = len(failures) - len(shown)
        lines += ["", f"FAILURES (newest first{f'; {more} more: --json' if more else ''})"]
        lines += [_failure_line(row) for row in shown]
    return lines


#: failures listed in the text view (all of them with --json)
_FAILURES_SHOWN = 10


def _schedulable(row: dict[str, Any]) -> str:
    """``yes``, ``no`` (its snapshot says so), or an operator's cordon: ``cordoned``,
    ``draining``, and ``drained`` once a draining host holds no lease."""
    cordon = row.get("cordon")
    if cordon == "draining" and not row["leases_by_state"]:
        return "drained"
    if cordon is not None:
        return str(cordon)
    return "yes" if row["schedulable"] else "no"


def _failure_line(row: dict[str, Any]) -> str:
    return (
        f"  {row['lease_id']} {row['instance']} on {row['host']} ({row['pool']}, "
        f"{row['state']}): {row['fault']}"
    )


def _pair(row: dict[str, Any], key: str) -> str:
    return f"{row['free'][key]}/{row['allocatable'][key]}"


def _host_line(row: dict[str, Any]) -> str:
    leases = ", ".join(f"{n} {state}" for state, n in row["leases_by_state"].items()) or "-"
    gpus = _gpus(row)
    return (
        f"{row['host']:<20} {_schedulable(row):<9} "
        f"{_pair(row, 'cpu'):>15} {_pair(row, 'memory_mib'):>21} "
        f"{_pair(row, 'disk_gib'):>20} {gpus:<12} {leases}"
    )


def _gpus(row: dict[str, Any]) -> str:
    """Free GPU indexes; ``none free`` when the host has GPUs and all are taken, ``-`` when
    it has none."""
    free = ",".join(str(i) for i in row["gpus_free"])
    if free:
        return free
    return "none free" if row.get("gpus_total", 0) else "-"


def _hit_ratio(row: dict[str, Any]) -> str:
    claims = row["warm_claims"]
    total = claims["claimed"] + claims["no_warm"]
    if not total:
        return "-"
    return f"{claims['hit_ratio']:.0%} ({claims['claimed']}/{total})"


def _queue_line(row: dict[str, Any]) -> str:
    return (
        f"{row['pool']:<20} {row['tenant'] or '-':<12} {row['waiting']:>7}  "
        f"{row['head']} ({row['head_reason']}, queued {row['head_queued_at']}); "
        f"first deadline {row['earliest_deadline']}"
    )


def _tenant_line(row: dict[str, Any]) -> str:
    quota = row["quota"]
    parts = [
        f"{name} {used}/{'-' if quota[name] is None else quota[name]}"
        for name, used in row["usage"].items()
    ]
    cohort = f" cohort {row['cohort']}" if row["cohort"] else ""
    return (
        f"{row['tenant']:<20} {row['weight']:>6} {row['share']:>7.3f} {row['waiting']:>7}  "
        f"{', '.join(parts)}{cohort}"
    )


def _pool_line(row: dict[str, Any]) -> str:
    warm = f"{row['min_ready']}/{row['max_ready']}"
    return (
        f"{row['pool']:<20} {row['ready']:>5} {row['booting']:>5} {row['claimed']:>7} "
        f"{row['draining']:>5} {row['victims']:>7} {row['pending_requests']:>7} "
        f"{row['instances']:>9}  {warm:<12}  {_hit_ratio(row)}"
    )


@click.command("status")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print host and pool status as JSON lines.")
@oneshot_log_options
def status(db: Path, as_json: bool, log_format: str, log_level: str) -> None:
    """Hosts and pools at a glance, from the store of a (running or stopped) replica."""
    if not db.exists():
        raise click.ClickException(f"no store at {db} (use --db or RC_DB)")
    try:
        lines = anyio.run(lambda: overview_lines(db, as_json=as_json))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in lines:
        click.echo(line)
