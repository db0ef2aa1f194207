"""The leader's queue timer on a real bus: a request that waits is decided within a
second of its deadline although nothing else arrives; one admitted before its deadline
is not timed out; a release cancels one that waits."""

from __future__ import annotations

import time
from pathlib import Path

from nats.aio.client import Client

from reconciler.core.waiting import epoch_ms
from reconciler.replica.queue_timer import timeout_request_id
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica


def test_a_timeout_request_id_is_one_subject_token() -> None:
    assert timeout_request_id("req-1") == "queue-timeout-req-1"
    assert timeout_request_id("req-1", 2) == "queue-timeout-req-1-2"
    long = timeout_request_id("r" * 128)
    assert len(long) <= 128 and long.startswith("queue-timeout-")


async def test_a_wait_ends_within_a_second_of_its_deadline_on_an_idle_bus(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")):
        await bus.send(b.snapshot("h1", cpu=4), b.pool("p"))
        await bus.send(b.admit("a1", "p", "vm-1"), b.admit("a2", "p", "vm-2"))
        await bus.send(b.admit("q", "p", "vm-3", wait_s=2), b.admit("c", "p", "vm-4", wait_s=30))
        queued = await bus.decision("q", phase="pending")
        assert (queued["outcome"], queued["position"]) == ("queued", 1)
        assert (await bus.decision("c", phase="pending"))["position"] == 2
        await bus.send(b.cmd("release", "rc", instance="vm-4"))
        cancelled = await bus.decision("c")
        assert (cancelled["outcome"], cancelled["reason"]) == ("rejected", "cancelled")
        ended = await bus.decision("q", within_s=6)
        observed = time.time()
        assert (ended["outcome"], ended["reason"]) == ("rejected", "queue-timeout")
        # the pending decision's time is the admit's JetStream timestamp
        deadline_s = (epoch_ms(queued["decided_at"]) or 0) / 1000 + 2
        decided_s = (epoch_ms(ended["decided_at"]) or 0) / 1000
        assert deadline_s <= decided_s < deadline_s + 1.0
        assert observed < deadline_s + 1.5
        timed = await bus.decision(timeout_request_id("q"))
        assert timed["outcome"] == "ok"
