"""Read-only answers over the folded state (docs/interface.md, "Queries").

Each function returns the ``result`` of a reply or raises :class:`QueryError` with one
of the contract's codes. The journal history of the ``lease`` query lives in the store,
so the adapter adds it to :func:`lease`'s answer (and, when asked, the decisions that name
the lease, as :func:`decision_summary` shows them); ``config-check`` needs its items
decoded against their schemas first, so the adapter decodes them and asks
:func:`config_check`.

``fleet`` and ``decisions`` are what ``reconciler web`` shows: a page of hosts with the
fleet's totals and every pool, and the most recent decisions. Both answer in time and
bytes bounded by their ``limit``, whatever the size of the fleet's history: hosts are
paged in name order, and the newest final decisions are found through the retention
index (:class:`~reconciler.core.expiry.ExpiryIndex`, by second), not by a scan.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from reconciler.core import inputs as ev
from reconciler.core.configs import CONFIG_KINDS, diff_payloads
from reconciler.core.fold.config import plan_change
from reconciler.core.fold.queue import ordered, tenant_of
from reconciler.core.model import (
    ClaimSpec,
    ClassName,
    GpuRequest,
    HostName,
    JobId,
    Lease,
    LeaseId,
    Pool,
    PoolName,
)
from reconciler.core.placement import (
    ClaimError,
    booking,
    merge_claims,
    resolve_claims,
    unsuitable_hosts,
)
from reconciler.core.runtime import effective_runtime, is_stale
from reconciler.core.state import DecisionRecord, State
from reconciler.core.status import host_status, pool_status
from reconciler.core.waiting import iso_ms


class QueryError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _text(request: Mapping[str, Any], key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise QueryError("invalid", f"{key!r} must be a non-empty string")
    return value


def find_lease(state: State, identifier: str) -> Lease:
    """A job identity, provider id (instance name), lease id or instance name."""
    lease_id = state.jobs.get(JobId(identifier))
    if lease_id is None and LeaseId(identifier) in state.leases:
        lease_id = LeaseId(identifier)
    lease = state.leases.get(lease_id) if lease_id else state.lease_of_instance(identifier)
    if lease is None:
        raise QueryError("not-found", f"nothing is known as {identifier!r}")
    return lease


def resolve(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    return {"instance": find_lease(state, _text(request, "identifier")).instance}


def lease(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    return find_lease(state, _text(request, "identifier")).as_dict()


def assignments(state: State, request: Mapping[str, Any]) -> list[dict[str, Any]]:
    host, uid = _text(request, "host"), _text(request, "uid")
    return [
        le.as_dict()
        for le in sorted(state.leases.values(), key=lambda le: le.lease_id)
        if le.active and le.host == host and le.host_uid == uid
    ]


def runtime(state: State, request: Mapping[str, Any]) -> list[dict[str, Any]]:
    lease_id = LeaseId(_text(request, "lease_id"))
    found = state.leases.get(lease_id)
    if found is None or not found.active:
        raise QueryError("not-found", f"no active lease {lease_id!r}")
    if is_stale(state, found):
        raise QueryError(
            "stale-runtime-inputs",
            f"lease {lease_id} was rendered against other GPU inputs or profile revision of "
            f"host {found.host}; re-render it (cmd render-runtime)",
        )
    return effective_runtime(state, found)


def _claims(raw: Any) -> list[ClaimSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise QueryError("invalid", "'claims' must be a list")
    out = []
    for item in raw:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("name"), str)
            or not isinstance(item.get("class"), str)
        ):
            raise QueryError("invalid", "each claim needs string 'name' and 'class'")
        gpu = (item.get("parameters") or {}).get("gpu")
        request = None
        if gpu is not None:
            count = gpu.get("count", 1) if isinstance(gpu, dict) else None
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise QueryError("invalid", "claim parameters.gpu.count must be an integer ≥ 0")
            request = GpuRequest(
                count, gpu.get("vendor"), gpu.get("model"), gpu.get("min_memory_mib")
            )
        out.append(ClaimSpec(item["name"], ClassName(item["class"]), request))
    return out


def unsuitable(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    pool = state.pools.get(PoolName(_text(request, "pool")))
    if pool is None:
        raise QueryError("not-found", f"no pool named {request.get('pool')!r}")
    potential = request.get("potential_hosts")
    if not isinstance(potential, list) or not all(isinstance(h, str) for h in potential):
        raise QueryError("invalid", "'potential_hosts' must be a list of host names")
    try:
        claims = resolve_claims(state, merge_claims(pool, _claims(request.get("claims"))))
    except ClaimError as exc:
        raise QueryError("invalid", str(exc)) from exc
    return {"unsuitable": unsuitable_hosts(state, pool, claims, potential)}


def _pool_view(pool: Pool) -> dict[str, Any]:
    return {
        "pool": pool.name,
        "flavor": pool.flavor.as_dict(),
        "image": pool.image,
        "profiles": list(pool.profiles),
        "project": pool.project,
        "instance_type": str(pool.instance_type or "virtual-machine"),
        "warm": {"min_ready": pool.warm.min_ready, "max_ready": pool.warm.max_ready},
    }


def _lease_view(state: State, found: Lease) -> dict[str, Any]:
    out = found.as_dict()
    out["project"] = found.project
    host = state.hosts.get(found.host)
    by_index = {g.index: g.pci_address for g in host.gpus} if host is not None else {}
    out["gpu_pci"] = [by_index[i] for i in found.gpus if i in by_index]
    return out


def pool_leases(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    """A pool's configuration and every active lease of it; without ``pool``, every
    active lease of every pool (what a GARM controller lists)."""
    name = request.get("pool")
    if name is not None and (not isinstance(name, str) or not name or len(name) > 128):
        raise QueryError("invalid", "'pool' must be a pool name")
    pool = state.pools.get(PoolName(name)) if name is not None else None
    leases = [
        _lease_view(state, le)
        for le in sorted(state.leases.values(), key=lambda le: le.lease_id)
        if le.active and (name is None or le.pool == name)
    ]
    return {"pool": _pool_view(pool) if pool is not None else None, "leases": leases}


def config(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    """The config in force, as ``{kind, payload}`` items that ``apply`` accepts back:
    every item of ``kind``, or the one named ``name``; without ``kind``, everything."""
    kind, name = request.get("kind"), request.get("name")
    if kind is not None and kind not in CONFIG_KINDS:
        known = ", ".join(CONFIG_KINDS)
        raise QueryError("invalid", f"'kind' must be one of {known}, not {kind!r}")
    if name is not None and (kind is None or not isinstance(name, str)):
        raise QueryError("invalid", "'name' needs a 'kind'")
    items: list[dict[str, Any]] = []
    for spec in CONFIG_KINDS.values():
        if kind is not None and spec.kind != kind:
            continue
        table = spec.table(state)
        if name is not None and name not in table:
            raise QueryError("not-found", f"there is no {spec.kind} named {name!r}")
        names = [name] if name is not None else sorted(table)
        items += [{"kind": spec.kind, "payload": spec.payload(table[n])} for n in names]
    return {"items": items}


def config_check(state: State, change: ev.ApplyConfig) -> dict[str, Any]:
    """What ``apply-config`` would do with ``change``, without doing it: the fold's own
    checks (:func:`reconciler.core.fold.config.plan_change`), and for each update the
    fields it changes, ``[path, current, new]``."""
    results = plan_change(state, change)
    items: list[dict[str, Any]] = []
    for index, result in enumerate(results):
        entry = result.as_dict()
        if result.change == "updated":
            item = change.items[index]
            spec = CONFIG_KINDS[item.kind]
            current = spec.payload(spec.table(state)[item.name])
            wanted = spec.payload(spec.build(item.config, 0))
            entry["fields"] = [
                [path, _shown(old), _shown(new)]
                for path, old, new in diff_payloads(current, wanted)
            ]
        items.append(entry)
    return {"ok": all(r.error is None for r in results), "items": items}


#: waiting requests in one ``queue`` answer: by default, and at most (a row is under
#: 700 bytes, so the reply stays inside a NATS message with 10,000 waiting)
QUEUE_REQUESTS = 500
QUEUE_REQUESTS_MAX = 1000


def queue(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    """The waiting requests in the order they would be admitted (:mod:`reconciler.core.
    waiting`): all, or those of one ``pool`` or one ``tenant``, the first ``limit`` of
    them; ``position`` is each one's place in its pool's queue, 1-based; ``total``
    counts every one that matched."""
    limit = _limit(request, default=QUEUE_REQUESTS, most=QUEUE_REQUESTS_MAX)
    pool, tenant = request.get("pool"), request.get("tenant")
    for key, value in (("pool", pool), ("tenant", tenant)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > 128):
            raise QueryError("invalid", f"{key!r} must be a name")
    positions: dict[PoolName, int] = {}
    requests: list[dict[str, Any]] = []
    total = 0
    for entry in ordered(state):
        position = positions[entry.pool] = positions.get(entry.pool, 0) + 1
        tenant_name = tenant_of(state, entry.pool)
        if (pool is not None and entry.pool != pool) or (
            tenant is not None and tenant_name != tenant
        ):
            continue
        total += 1
        if len(requests) == limit:
            continue
        requests.append(
            {
                "request_id": entry.request_id,
                "pool": entry.pool,
                "tenant": tenant_name,
                "position": position,
                "reason": entry.reason,
                "queued_at": entry.queued_at,
                "deadline": iso_ms(entry.deadline_ms),
                "instance": entry.instance,
                "kind": entry.kind.value,
                "verb": entry.verb,
                "overtaken": entry.passed,
            }
        )
    return {"requests": requests, "total": total}


def _shown(value: Any) -> Any:
    """A payload's value as JSON carries it; a field one side lacks is ``null``."""
    return value if isinstance(value, str | int | float | bool | list | dict) else None


def _limit(request: Mapping[str, Any], *, default: int, most: int) -> int:
    value = request.get("limit", default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise QueryError("invalid", f"'limit' must be an integer from 1 to {most}")
    return value


#: hosts in one ``fleet`` answer: by default, and at most (each row is under 1 KiB, so
#: the reply stays well inside a NATS message)
FLEET_HOSTS = 100
FLEET_HOSTS_MAX = 500


def fleet(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    """A page of hosts (their status payloads, in name order, after the host ``after``),
    every pool's status, and the fleet's totals over every host."""
    limit = _limit(request, default=FLEET_HOSTS, most=FLEET_HOSTS_MAX)
    after = request.get("after")
    if after is not None and (not isinstance(after, str) or len(after) > 256):
        raise QueryError("invalid", "'after' must be a host name")
    order = state.host_order
    start = bisect.bisect_right(order, after) if after else 0
    names = order[start : start + limit]
    seq = state.applied_seq
    hosts = []
    for name in names:
        row = host_status(state, name, as_of_seq=seq)
        if row is not None:
            hosts.append({**row, "gpus_total": len(state.hosts[name].gpus)})
    pools = [pool_status(state, PoolName(p), as_of_seq=seq) for p in sorted(state.pools)]
    return {
        "applied_seq": seq,
        "hosts": hosts,
        "hosts_total": len(order),
        "next_after": names[-1] if start + limit < len(order) else None,
        "pools": [p for p in pools if p is not None],
        "totals": fleet_totals(state),
    }


def fleet_totals(state: State) -> dict[str, Any]:
    """Allocatable and booked capacity summed over every host, GPUs too, and the hosts
    by whether they take new work: ``schedulable``, ``unschedulable`` (their snapshot
    says so), ``cordoned`` or ``draining`` (an operator said so)."""
    cpu = mem = disk = b_cpu = b_mem = b_disk = gpus = gpus_booked = 0
    by_sched = {"schedulable": 0, "unschedulable": 0, "cordoned": 0, "draining": 0}
    for name in state.host_order:
        host = state.hosts[HostName(name)]
        alloc, book = host.allocatable, booking(state, host)
        cpu, mem, disk = cpu + alloc.cpu, mem + alloc.memory_mib, disk + alloc.disk_gib
        b_cpu += book.booked.cpu
        b_mem += book.booked.memory_mib
        b_disk += book.booked.disk_gib
        gpus += len(host.gpus)
        gpus_booked += len(book.used_gpus)
        if host.cordon is not None:
            by_sched[host.cordon if host.cordon in by_sched else "cordoned"] += 1
        else:
            by_sched["schedulable" if host.schedulable else "unschedulable"] += 1
    return {
        "allocatable": {"cpu": cpu, "memory_mib": mem, "disk_gib": disk, "gpus": gpus},
        "booked": {"cpu": b_cpu, "memory_mib": b_mem, "disk_gib": b_disk, "gpus": gpus_booked},
        "hosts": by_sched,
    }


#: decisions in one ``decisions`` answer: by default, and at most (a summary's texts are
#: bounded, so 200 stay well inside a NATS message)
DECISIONS = 50
DECISIONS_MAX = 200
_SUMMARY_KEYS = ("request_id", "verb", "phase", "outcome", "reason", "detail")
_SUMMARY_LEASE_KEYS = ("lease_id", "instance", "host", "pool", "kind", "state", "job")
_DETAIL_CHARS = 1024


def decision_summary(payload: bytes) -> dict[str, Any]:
    """What a page shows of a decision: its request, verb, phase, outcome, reason and
    detail, its input and time, and the lease it names (id, instance, host, pool, kind,
    state, job); not its victims' or config items' lists, which may be long."""
    body = orjson.loads(payload)
    out: dict[str, Any] = {k: body[k] for k in _SUMMARY_KEYS if body.get(k) is not None}
    if isinstance(out.get("detail"), str) and len(out["detail"]) > _DETAIL_CHARS:
        out["detail"] = out["detail"][:_DETAIL_CHARS] + "…"
    out["input_seq"] = body.get("input_seq")
    out["decided_at"] = body.get("decided_at")
    lease_body = body.get("lease")
    if isinstance(lease_body, dict):
        out["lease"] = {
            k: lease_body[k] for k in _SUMMARY_LEASE_KEYS if lease_body.get(k) is not None
        }
    return out


def decisions(state: State, request: Mapping[str, Any]) -> dict[str, Any]:
    """The most recent decisions, newest first (by the input that decided them): the
    final decisions the state keeps, and the pending ones of admissions still waiting
    at a launch gate; at most ``limit`` (:func:`decision_summary` of each)."""
    limit = _limit(request, default=DECISIONS, most=DECISIONS_MAX)
    picked: dict[str, DecisionRecord] = {}
    for lease_ids in state.gated_on_host.values():
        for lease_id in lease_ids:
            request_id = state.leases[lease_id].request_id
            record = state.decisions.get(request_id) if request_id is not None else None
            if record is not None:
                picked[record.request_id] = record
    buckets = state.expiry.decisions
    wanted = limit
    while True:  # the newest seconds first, as many as it takes to find ``limit``
        seconds = heapq.nlargest(wanted, buckets)
        finals: dict[str, DecisionRecord] = {}
        for second in seconds:
            for request_id in buckets[second]:
                record = state.decisions.get(request_id)
                if record is not None and record.phase == "final" and record.final_at == second:
                    finals[request_id] = record
            if len(finals) >= limit:
                break
        if len(finals) >= limit or len(seconds) == len(buckets):
            break
        wanted *= 4
    picked.update(finals)
    summaries = [decision_summary(r.payload) for r in picked.values()]
    summaries.sort(key=lambda d: (d["input_seq"] or 0, d["request_id"]), reverse=True)
    return {"decisions": summaries[:limit], "applied_seq": state.applied_seq}


#: query name -> function; ``health`` needs runtime facts and is answered by the adapter
QUERIES: dict[str, Callable[[State, Mapping[str, Any]], Any]] = {
    "resolve": resolve,
    "lease": lease,
    "assignments": assignments,
    "effective-runtime": runtime,
    "unsuitable-hosts": unsuitable,
    "pool": pool_leases,
    "config": config,
    "fleet": fleet,
    "decisions": decisions,
    "queue": queue,
}
#: the queries a replica answers itself: ``health`` (runtime facts) and ``config-check``
#: (its items decoded against their schemas first, then :func:`config_check`)
ADAPTER_QUERIES = ("health", "config-check")
