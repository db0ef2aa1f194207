#!/usr/bin/env python3
"""In-memory fold throughput: how many mixed inputs per second the pure core applies.

Builds a realistic mix (snapshots, inventories, lifecycle events, cold and warm admits,
claims, preemptible admits, releases) through the same ``from_payload`` the decoder
uses, then times only the fold. Prints one JSON line.

    python scripts/bench_core.py [--inputs 200000] [--hosts 50]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reconciler.core.fold import fold
from reconciler.core.inputs import Message, from_payload
from reconciler.core.state import Effects, State


def _res(cpu: int, mem: int, disk: int) -> dict[str, int]:
    return {"cpu": cpu, "memory_mib": mem, "disk_gib": disk}


def _snapshot(host: str, revision: int) -> tuple[str, dict[str, Any]]:
    return (
        "host.snapshot",
        {
            "v": 1,
            "host": host,
            "uid": f"u-{host}",
            "revision": revision,
            "schedulable": True,
            "labels": {"zone": "a"},
            "capacity": _res(64, 262144, 2000),
            "reserve": _res(2, 4096, 50),
            "gpus": [],
        },
    )


def workload(n: int, hosts: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rnd = random.Random(seed)
    items: list[tuple[str, dict[str, Any]]] = []
    host_names = [f"host-{i:04d}" for i in range(hosts)]
    revision = dict.fromkeys(host_names, 0)
    for h in host_names:
        revision[h] += 1
        items.append(_snapshot(h, revision[h]))
    for pool, warm in (("cold-small", 0), ("warm-small", 4)):
        items.append(
            (
                "config.pool",
                {
                    "v": 1,
                    "pool": pool,
                    "flavor": _res(2, 4096, 20),
                    "claims": [],
                    "warm": {"min_ready": warm, "max_ready": warm * 50, "protect_min_ready": False},
                    "max_instances": 100000,
                    "priority": warm,
                    "image": "ubuntu/24.04",
                },
            )
        )
    live: list[str] = []
    warm_live: list[str] = []
    counter = 0
    while len(items) < n:
        counter += 1
        roll = rnd.random()
        rid = f"r{counter}"
        if roll < 0.35 or not live:
            name = f"vm-{counter}"
            kind = "warm" if roll < 0.12 else "cold"
            verb = "cmd.admit-preemptible" if roll > 0.30 else "cmd.admit"
            pool = "warm-small" if kind == "warm" else "cold-small"
            items.append(
                (
                    verb,
                    {
                        "v": 1,
                        "request_id": rid,
                        "pool": pool,
                        "instance": name,
                        "kind": "cold" if verb.endswith("preemptible") else kind,
                    },
                )
            )
            (warm_live if kind == "warm" and verb == "cmd.admit" else live).append(name)
        elif roll < 0.55:
            name = rnd.choice(live)
            items.append(("cmd.mark-created", {"v": 1, "request_id": rid, "instance": name}))
        elif roll < 0.65 and warm_live:
            name = warm_live.pop(0)
            h = "host-0000"
            items.append(
                (
                    "host.lifecycle",
                    {
                        "v": 1,
                        "host": h,
                        "event": {
                            "type": "lifecycle",
                            "timestamp": "2026-12-02T10:00:00Z",
                            "metadata": {
                                "action": "instance-ready",
                                "source": f"/1.0/instances/{name}",
                                "name": name,
                                "project": "default",
                            },
                        },
                    },
                )
            )
            live.append(name)
        elif roll < 0.72:
            items.append(
                (
                    "cmd.claim-warm",
                    {"v": 1, "request_id": rid, "pool": "warm-small", "job": f"job-{counter}"},
                )
            )
        elif roll < 0.90:
            name = live.pop(rnd.randrange(len(live)))
            items.append(("cmd.release", {"v": 1, "request_id": rid, "instance": name}))
        else:
            h = rnd.choice(host_names)
            revision[h] += 1
            items.append(_snapshot(h, revision[h]))
    return items[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=200_000)
    parser.add_argument("--hosts", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    items = workload(args.inputs, args.hosts, args.seed)
    messages = [
        Message(seq=i + 1, timestamp="2026-12-02T10:00:00Z", input=from_payload(kind, payload))
        for i, (kind, payload) in enumerate(items)
    ]
    state = State()
    outputs = 0
    start = time.perf_counter()
    for chunk in range(0, len(messages), 500):
        fx = Effects()
        for msg in messages[chunk : chunk + 500]:
            fold(state, msg, fx)
        outputs += len(fx.outputs)
    elapsed = time.perf_counter() - start
    print(
        orjson.dumps(
            {
                "bench": "core-fold",
                "inputs": len(messages),
                "hosts": args.hosts,
                "seconds": round(elapsed, 3),
                "fold_inputs_per_s": round(len(messages) / elapsed),
                "outputs": outputs,
                "leases": len(state.leases),
            }
        ).decode()
    )


if __name__ == "__main__":
    main()
