"""A seeded, mixed workload of contract inputs for load and fault tests.

Hosts and pools first, then commands of every verb with the lifecycle events a fleet
would send between them, so the fold exercises admission, warm pools, claims, drains,
preemption and releases. The same seed always gives the same inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from reconciler.bus.sending import publish
from tests.support import builders as b

Item = tuple[str, dict[str, Any]]


@dataclass
class Workload:
    setup: list[Item]
    items: list[Item]
    #: request ids of every command in ``items``, in order
    commands: list[str] = field(default_factory=list)


def mixed(commands: int, *, seed: int = 7, hosts: int = 8) -> Workload:
    rng = random.Random(seed)
    setup: list[Item] = [
        b.snapshot(f"h{i}", cpu=32, memory_mib=131072, disk_gib=2000) for i in range(hosts)
    ]
    setup += [
        b.pool("cold", cpu=2, memory_mib=4096, disk_gib=20, max_instances=commands),
        b.pool("warm", cpu=4, memory_mib=8192, disk_gib=40, min_ready=2, max_ready=6),
    ]
    items: list[Item] = []
    ids: list[str] = []
    live: list[str] = []  # cold instances admitted (maybe)
    warm: list[str] = []  # warm instances admitted (maybe), not yet booted
    n = 0

    def command(item: Item) -> None:
        items.append(item)
        ids.append(item[1]["request_id"])

    while len(ids) < commands:
        n += 1
        roll = rng.random()
        if roll < 0.45 or not live:
            name = f"c{n}"
            command(b.admit(f"a{n}", "cold", name))
            live.append(name)
        elif roll < 0.55:
            name = f"w{n}"
            command(b.admit(f"w{n}", "warm", name, kind="warm"))
            warm.append(name)
        elif roll < 0.62 and warm:
            name = warm.pop(0)
            # the VM boots on whichever host it was placed; lifecycle on another is a no-op
            for h in range(hosts):
                items.append(b.lifecycle(f"h{h}", "instance-created", name))
                items.append(b.lifecycle(f"h{h}", "instance-ready", name))
            command(b.cmd("claim-warm", f"k{n}", pool="warm", job=f"job-{n}"))
        elif roll < 0.75:
            name = live.pop(rng.randrange(len(live)))
            command(b.cmd("release", f"r{n}", instance=name))
        elif roll < 0.82:
            command(b.cmd("mark-created", f"m{n}", instance=rng.choice(live)))
        elif roll < 0.87:
            command(b.cmd("mark-deleting", f"d{n}", instance=f"c{rng.randrange(1, n + 1)}"))
        elif roll < 0.92:
            name = f"p{n}"
            command(b.admit(f"p{n}", "cold", name, preemptible=True))
            live.append(name)
        elif roll < 0.96:
            command(b.cmd("authorize-warm-drain", f"x{n}", instance=f"w{rng.randrange(1, n + 1)}"))
        else:
            # a duplicate request id: decided already, re-sent unchanged
            command(b.admit(ids[rng.randrange(len(ids))], "cold", f"dup{n}"))
            ids.pop()
    return Workload(setup=setup, items=items, commands=ids)


async def publish_steadily(
    js: Any, items: list[Item], *, per_second: int, sent: list[str], retry_for_s: float = 60.0
) -> None:
    """Publish ``items`` in order, about ``per_second`` a second (a tenth of them every
    100 ms), each with a deterministic ``Nats-Msg-Id`` (``in:<request_id>`` for commands,
    ``item:<index>`` for the rest) retried through a missing stream leader; every id is
    appended to ``sent`` once its publish was acknowledged."""
    step = max(1, per_second // 10)
    for start in range(0, len(items), step):
        tick = anyio.current_time()
        for i, (kind, payload) in enumerate(items[start : start + step]):
            rid = payload.get("request_id")
            msg_id = f"in:{rid}" if rid else f"item:{start + i}"
            await publish(
                js, b.subject_of((kind, payload)), orjson.dumps(payload),
                msg_id=msg_id, retry_for_s=retry_for_s,
            )  # fmt: skip
            sent.append(msg_id)
        await anyio.sleep(max(0.0, 0.1 - (anyio.current_time() - tick)))
