"""The page's HTML, rendered from the queries' answers (see the package's rules).

The functions take the ``result`` of the ``fleet``, ``decisions`` and ``lease`` queries
(docs/interface.md, "Queries") as they come off the bus, and return a whole HTML
document. Nothing here does I/O or reads a clock: the time shown is passed in.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import jinja2

__all__ = ["Bar", "lease_path", "render_lease", "render_overview", "render_problem"]


@dataclass(frozen=True, slots=True)
class Bar:
    """A capacity bar: ``used`` of ``total``, with the text shown beside it."""

    used: float
    total: float
    text: str

    @property
    def percent(self) -> float:
        """How full, 0 to 100 (an over-committed resource shows full)."""
        if self.total <= 0:
            return 100.0 if self.used > 0 else 0.0
        return max(0.0, min(100.0, 100.0 * self.used / self.total))

    @property
    def level(self) -> str:
        """``low``, ``high`` (from 75 %), ``full`` (from 95 %) or ``none`` (nothing to book)."""
        if self.total <= 0 and self.used <= 0:
            return "none"
        if self.used > self.total or self.percent >= 95:
            return "full"
        return "high" if self.percent >= 75 else "low"


def _mib(value: float) -> str:
    return f"{value / 1024:.1f} GiB" if abs(value) >= 1024 else f"{value:g} MiB"


def resource_bars(
    booked: Mapping[str, Any], total: Mapping[str, Any], gpus: tuple[int, int]
) -> list[tuple[str, Bar]]:
    """The four bars of a host or of the fleet: cpu, memory, disk, GPUs (booked/total)."""
    cpu_b, cpu_t = int(booked.get("cpu", 0)), int(total.get("cpu", 0))
    mem_b, mem_t = int(booked.get("memory_mib", 0)), int(total.get("memory_mib", 0))
    disk_b, disk_t = int(booked.get("disk_gib", 0)), int(total.get("disk_gib", 0))
    return [
        ("cpu", Bar(cpu_b, cpu_t, f"{cpu_b}/{cpu_t} vCPU")),
        ("memory", Bar(mem_b, mem_t, f"{_mib(mem_b)} / {_mib(mem_t)}")),
        ("disk", Bar(disk_b, disk_t, f"{disk_b}/{disk_t} GiB")),
        ("gpus", Bar(gpus[0], gpus[1], f"{gpus[0]}/{gpus[1]}" if gpus[1] else "none")),
    ]


def schedulability(host: Mapping[str, Any]) -> str:
    """What ``reconciler status`` says of a host: ``yes``, ``no`` (its snapshot),
    ``cordoned``, ``draining``, or ``drained`` (draining and empty)."""
    cordon = host.get("cordon")
    if cordon == "draining" and not host.get("leases_by_state"):
        return "drained"
    if cordon:
        return str(cordon)
    return "yes" if host.get("schedulable") else "no"


def _host_view(host: Mapping[str, Any]) -> dict[str, Any]:
    total_gpus = int(host.get("gpus_total", 0))
    free = len(host.get("gpus_free", ()))
    return {
        "name": host.get("host"),
        "schedulable": schedulability(host),
        "bars": resource_bars(
            host.get("booked", {}), host.get("allocatable", {}), (total_gpus - free, total_gpus)
        ),
        "leases": sorted(dict(host.get("leases_by_state", {})).items()),
        "foreign": int(host.get("foreign_instances", 0)),
    }


def _pool_view(pool: Mapping[str, Any]) -> dict[str, Any]:
    ready, booting, claimed = (int(pool.get(k, 0)) for k in ("ready", "booting", "claimed"))
    min_ready, max_ready = int(pool.get("min_ready", 0)), int(pool.get("max_ready", 0))
    # the warm bar's scale: the target's maximum, or what there is when that is more
    scale = max(max_ready, ready + booting, min_ready, 1)
    claims = pool.get("warm_claims")
    hit: str | None = None
    if isinstance(claims, Mapping):
        claimed_n, missed = int(claims.get("claimed", 0)), int(claims.get("no_warm", 0))
        total = claimed_n + missed
        hit = f"{100 * claimed_n / total:.0f} % ({claimed_n}/{total})" if total else "-"
    return {
        "name": pool.get("pool"),
        "ready": ready,
        "booting": booting,
        "claimed": claimed,
        "min_ready": min_ready,
        "max_ready": max_ready,
        "ready_pct": 100.0 * ready / scale,
        "booting_pct": 100.0 * booting / scale,
        "min_pct": 100.0 * min_ready / scale,
        "below_min": ready + booting < min_ready,
        "draining": int(pool.get("draining", 0)),
        "victims": int(pool.get("victims", 0)),
        "pending": int(pool.get("pending_requests", 0)),
        "instances": int(pool.get("instances", 0)),
        "max_instances": pool.get("max_instances"),
        "hit": hit,
    }


def lease_path(identifier: str) -> str:
    """``/lease/<identifier>``, the identifier quoted whole (a job's ``/`` too)."""
    return "/lease/" + quote(identifier, safe="")


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reconciler.web", "templates"),
        autoescape=True,  # every value from the bus is escaped
        # a field an older replica does not send renders as nothing
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["lease_path"] = lease_path
    env.filters["mib"] = _mib
    return env


def render_overview(
    fleet: Mapping[str, Any] | None,
    decisions: Mapping[str, Any] | None,
    *,
    now: str,
    refresh_s: int = 0,
    problem: str | None = None,
    queue: Mapping[str, Any] | None = None,
) -> str:
    """The page at ``/``: the fleet's totals, a page of hosts, every pool, the requests
    waiting in the admission queue (the ``queue`` answer, when there is one) and the most
    recent decisions; ``problem`` (a replica did not answer) is shown above them."""
    hosts: Sequence[Mapping[str, Any]] = fleet.get("hosts", []) if fleet else []
    totals = fleet.get("totals") if fleet else None
    total_bars = None
    if isinstance(totals, Mapping):
        alloc, booked = totals.get("allocatable", {}), totals.get("booked", {})
        total_bars = resource_bars(
            booked, alloc, (int(booked.get("gpus", 0)), int(alloc.get("gpus", 0)))
        )
    pools = [_pool_view(p) for p in (fleet.get("pools", []) if fleet else [])]
    return (
        _environment()
        .get_template("overview.html")
        .render(
            now=now,
            refresh_s=refresh_s,
            problem=problem,
            fleet=fleet,
            totals=totals,
            total_bars=total_bars,
            hosts=[_host_view(h) for h in hosts],
            pools=pools,
            any_hit=any(p["hit"] is not None for p in pools),
            decisions=list(decisions.get("decisions", [])) if decisions else [],
            waiting=list(queue.get("requests", [])) if queue else [],
            waiting_total=int(queue.get("total", 0) or 0) if queue else 0,
        )
    )


def trail(lease: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A lease's transitions and decisions as one list, in stream order (a decision
    after the transitions of the same input)."""
    rows: list[tuple[int, int, dict[str, Any]]] = []
    for entry in lease.get("history", []):
        if isinstance(entry, Sequence) and not isinstance(entry, str | Mapping):
            seq, event, src, dst = entry
            entry = {"input_seq": seq, "event": event, "from_state": src, "to_state": dst}
        rows.append((int(entry["input_seq"]), 0, {"type": "transition", **entry}))
    for decision in lease.get("decisions", []):
        rows.append((int(decision.get("input_seq") or 0), 1, {"type": "decision", **decision}))
    rows.sort(key=lambda row: (row[0], row[1]))
    return [row for _, _, row in rows]


def render_lease(
    identifier: str, lease: Mapping[str, Any] | None, *, now: str, problem: str | None = None
) -> str:
    """The page at ``/lease/<identifier>``: the lease, then its trail; a page that says
    nothing is known by ``identifier`` when ``lease`` is ``None``."""
    return (
        _environment()
        .get_template("lease.html")
        .render(
            now=now,
            refresh_s=0,
            identifier=identifier,
            lease=lease,
            trail=trail(lease) if lease else [],
            problem=problem,
        )
    )


def render_problem(title: str, message: str, *, now: str) -> str:
    """A page that only says what went wrong (an unknown path, a refused request)."""
    return (
        _environment()
        .get_template("problem.html")
        .render(now=now, refresh_s=0, title=title, problem=message)
    )
