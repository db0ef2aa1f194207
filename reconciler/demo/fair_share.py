"""The fair-sharing scenario (issue 26): two tenants of weights 1 and 3 flood a small
fleet, every job is released as it completes, and the queue shares what frees up.

One replica runs in this process on a real NATS JetStream; a driver publishes the
config (hosts, one pool per tenant, the tenants), then ``per_tenant`` admissions of each
tenant, interleaved, each waiting up to ``wait_s``; each admitted job runs a random
while (seeded) and is released. It reports:

- the tenants' admissions per interval (a table that converges to their weights);
- every request's final decisions (exactly one each);
- the requests that waited while room they fit stood idle, checked after every
  committed batch against the replica's own state
  (:func:`reconciler.core.fold.queue.idle_fit`; none expected);
- ``reconciler replay``'s divergences over the whole stream (none expected).

``python -m reconciler.demo.fair_share`` (``scripts/fair-share``) runs it on a local
nats-server and prints the table; it exits 1 when a check fails.
"""

from __future__ import annotations

import logging
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog
from nats.aio.msg import Msg

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.embedded import embedded_nats
from reconciler.client import ReconcilerClient
from reconciler.core.fold.queue import idle_fit
from reconciler.core.messages import DEFAULT_PREFIX, Origin
from reconciler.replay.replay import replay_into
from reconciler.replica.pipeline import Commit
from reconciler.replica.replica import Replica, RunConfig

__all__ = ["FairShareReport", "main", "run_fair_share"]


@dataclass(slots=True)
class FairShareReport:
    """What the scenario saw; see the module's rules."""

    tenants: tuple[str, ...]
    weights: tuple[int, ...]
    interval_s: float
    #: per interval, the admissions of each tenant (in ``tenants`` order)
    intervals: list[list[int]] = field(default_factory=list)
    #: request id -> how many final decisions it got
    finals: Counter[str] = field(default_factory=Counter)
    #: final outcomes ("admitted", "rejected (queue-timeout)", …) -> how many
    outcomes: Counter[str] = field(default_factory=Counter)
    #: requests that waited while room they fit stood idle (after some batch)
    idle_while_waiting: set[str] = field(default_factory=set)
    #: batches checked for idle room
    batches_checked: int = 0
    divergences: int = -1
    replayed_inputs: int = 0
    requests: int = 0
    #: (seconds since the flood, tenant index) of each admission, in arrival order
    admissions: list[tuple[float, int]] = field(default_factory=list)

    @property
    def contended(self) -> tuple[int, int]:
        """Each tenant's admissions while both still had requests to admit (up to the
        first tenant's last admission, the initial fill of the empty fleet apart)."""
        last = [max((t for t, i in self.admissions if i == n), default=0.0) for n in (0, 1)]
        until = min(last)
        counts = [0, 0]
        for at, n in self.admissions[self.initial :]:
            if at <= until:
                counts[n] += 1
        return counts[0], counts[1]

    #: admissions decided at once, before anything waited (the empty fleet's fill)
    initial: int = 0

    @property
    def ok(self) -> bool:
        return (
            len(self.finals) == self.requests
            and all(n == 1 for n in self.finals.values())
            and not self.idle_while_waiting
            and self.divergences == 0
        )

    def table(self) -> list[str]:
        """The admissions per interval, with the ratio of the second tenant's to the
        first's."""
        a, b = self.tenants
        lines = [f"{'interval':>12}  {a:>8}  {b:>8}  {b}/{a}"]
        for n, row in enumerate(self.intervals):
            ratio = f"{row[1] / row[0]:.2f}" if row[0] else "-"
            start = n * self.interval_s
            lines.append(
                f"{start:5.0f}-{start + self.interval_s:<4.0f} s  {row[0]:>8}  {row[1]:>8}  {ratio}"
            )
        totals = [sum(r[i] for r in self.intervals) for i in range(2)]
        lines.append(f"{'total':>12}  {totals[0]:>8}  {totals[1]:>8}")
        lines.append(self.contention_line())
        return lines

    def lines(self) -> list[str]:
        single = sum(1 for n in self.finals.values() if n == 1)
        return [
            *self.table(),
            "",
            f"final decisions: {single} of {self.requests} requests have exactly one "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.outcomes.items()))})",
            f"waited while room they fit stood idle: {len(self.idle_while_waiting)} "
            f"(checked after each of {self.batches_checked} committed batches)",
            f"replay: {self.replayed_inputs} inputs folded again, {self.divergences} divergences",
        ]

    def contention_line(self) -> str:
        light, heavy = self.contended
        ratio = f"{heavy / light:.2f}" if light else "-"
        return (
            f"while both tenants waited (after the first {self.initial} admissions at once): "
            f"{self.tenants[0]} {light}, {self.tenants[1]} {heavy}: "
            f"{ratio} (weights {self.weights[0]}:{self.weights[1]})"
        )


def _snapshot(host: str, vms: int) -> dict[str, Any]:
    return {
        "v": 1,
        "host": host,
        "uid": f"uid-{host}",
        "revision": 1,
        "schedulable": True,
        "labels": {},
        "capacity": {"cpu": 2 * vms, "memory_mib": 2048 * vms, "disk_gib": 20 * vms},
        "reserve": {"cpu": 0, "memory_mib": 0, "disk_gib": 0},
        "gpus": [],
    }


async def run_fair_share(
    nats: ConnectOptions,
    db: Path,
    *,
    prefix: str = DEFAULT_PREFIX,
    hosts: int = 4,
    vms_per_host: int = 4,
    per_tenant: int = 200,
    weights: tuple[int, int] = (1, 3),
    job_s: tuple[float, float] = (0.2, 0.6),
    interval_s: float = 2.0,
    wait_s: int = 600,
    seed: int = 26,
) -> FairShareReport:
    """Run the scenario (see the module's rules) and report."""
    tenants = ("light", "heavy")
    report = FairShareReport(tenants, weights, interval_s, requests=2 * per_tenant)
    rng = random.Random(seed)
    replica = Replica(
        RunConfig(
            nats=nats,
            db=db,
            prefix=prefix,
            replica="fair-share",
            leader_ttl_s=3.0,
            status_debounce_s=0.2,
            status_progress_interval_s=5.0,
        )
    )
    stop = anyio.Event()
    nc = await connect(nats)
    client = ReconcilerClient(nc, prefix=prefix, origin=Origin.DEMO)
    ours = {f"{t}-{i}": t for t in tenants for i in range(per_tenant)}
    released = anyio.Event()
    releases_left = len(ours)
    started = time.monotonic()

    def check(commit: Commit) -> None:
        state = replica.pipeline.state if replica.pipeline is not None else None
        if state is None:
            return
        report.batches_checked += 1
        for entry in state.waiting.values():
            if idle_fit(state, entry) is not None:
                report.idle_while_waiting.add(entry.request_id)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: replica.run(stop=stop))
            with anyio.fail_after(30):
                await replica.started.wait()
                while not replica.leader_ready:  # noqa: ASYNC110 - a flag, no event
                    await anyio.sleep(0.05)
            assert replica.pipeline is not None
            replica.pipeline.add_listener(check)

            async def job(request_id: str) -> None:
                nonlocal releases_left
                await anyio.sleep(rng.uniform(*job_s))
                payload = {"v": 1, "request_id": f"done-{request_id}", "instance": request_id}
                await client.send("release", payload)
                releases_left -= 1
                if releases_left == 0:
                    released.set()

            async def on_decision(msg: Msg) -> None:
                nonlocal releases_left
                body = orjson.loads(msg.data)
                request_id = body.get("request_id")
                if request_id not in ours or body.get("phase") != "final":
                    return
                report.finals[request_id] += 1
                reason = body.get("reason")
                report.outcomes[body["outcome"] + (f" ({reason})" if reason else "")] += 1
                if body["outcome"] != "admitted":
                    releases_left -= 1
                    if releases_left == 0:
                        released.set()
                    return
                at = time.monotonic() - started
                if "waited" not in (body.get("detail") or ""):
                    report.initial += 1
                report.admissions.append((at, tenants.index(ours[request_id])))
                slot = int(at / interval_s)
                while len(report.intervals) <= slot:
                    report.intervals.append([0, 0])
                report.intervals[slot][tenants.index(ours[request_id])] += 1
                tg.start_soon(job, request_id)

            sub = await nc.subscribe(client.subjects.decisions, cb=on_decision)
            subjects = client.subjects
            for h in range(hosts):
                name = f"fs-host-{h}"
                snap = orjson.dumps(_snapshot(name, vms_per_host))
                await client.publish_input(subjects.host_input(name, "snapshot"), snap)
            for tenant, weight in zip(tenants, weights, strict=True):
                pool_name = f"{tenant}-pool"
                pool = {
                    "v": 1,
                    "pool": pool_name,
                    "flavor": {"cpu": 2, "memory_mib": 2048, "disk_gib": 20},
                    "max_instances": 1000,
                }
                await client.publish_config("pool", pool_name, pool)
                owner = {"v": 1, "tenant": tenant, "pools": [pool_name], "weight": weight}
                await client.publish_config("tenant", tenant, owner)
            started = time.monotonic()
            for i in range(per_tenant):
                for tenant in tenants:
                    request_id = f"{tenant}-{i}"
                    admit = {
                        "v": 1,
                        "request_id": request_id,
                        "pool": f"{tenant}-pool",
                        "instance": request_id,
                        "kind": "cold",
                        "wait_s": wait_s,
                    }
                    await client.send("admit", admit)
            with anyio.fail_after(wait_s + 60):
                await released.wait()
            await anyio.sleep(1.0)  # the last releases are folded
            await sub.unsubscribe()
            stop.set()
        replay = await replay_into(nc, prefix=prefix)
        report.divergences = len(replay.divergences)
        report.replayed_inputs = replay.inputs
    finally:
        await nc.close()
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m reconciler.demo.fair_share [PER_TENANT]``: the scenario on a local
    nats-server and a scratch store; prints the report; 1 when a check fails."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args = sys.argv[1:] if argv is None else argv
    per_tenant = int(args[0]) if args else 200
    with tempfile.TemporaryDirectory(prefix="rc-fair-share-") as scratch, embedded_nats() as server:
        nats = ConnectOptions(urls=(server.url,), reconnect_wait_s=0.2, initial_timeout_s=10)
        report = anyio.run(
            lambda: run_fair_share(nats, Path(scratch) / "rc.db", per_tenant=per_tenant)
        )
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
