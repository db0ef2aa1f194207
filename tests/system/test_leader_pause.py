"""A leader frozen past its TTL under load (SIGSTOP, as a GC pause, a VM migration or a
saturated host would), then resumed (SIGCONT), steps down and goes on as a follower:
the process stays up, its store stays intact, and nothing is lost or doubled.

It used to die, about one pause in three to six, with ``StoreError: … commit up to seq
N: a request was interrupted``: stepping down cancelled the leader's outbox mark in the
middle of its exchange with the store's writer process, and the caches' next commit
found the pipe out of step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support.bus import BusClient
from tests.support.workload import mixed
from tests.system.test_faults import applied_seq, check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TTL_S = 1.5
PAUSES = 6
#: commands a second while the leader is paused and resumed
RATE = 400


def spawn_replica(nats_url: str, name: str, db: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "reconciler.cli.main", "run",
                "--nats-url", nats_url, "--db", str(db), "--replica", name,
                "--leader-ttl", str(TTL_S), "--status-debounce", "0.2",
                "--log-format", "json", "--log-level", "info",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


async def leader_of(bus: BusClient) -> str | None:
    kv = await bus.js.key_value(bus.names.leader_bucket)
    try:
        entry = await kv.get("leader")
    except Exception:
        return None
    holder = orjson.loads(entry.value or b"{}").get("holder")
    return str(holder) if holder else None


def stepped_down(log: Path) -> int:
    return sum(
        1
        for line in log.read_text().splitlines()
        if '"leader.stepped_down"' in line and "renewal overdue" in line
    )


async def test_a_paused_leader_steps_down_and_goes_on_as_a_follower(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    load = mixed(RATE * 3 * PAUSES, seed=14)
    await bus.send_many(load.setup)
    names = ("a", "b")
    dbs = {n: tmp_path / f"{n}.db" for n in names}
    logs = {n: tmp_path / f"{n}.log" for n in names}
    procs = {n: spawn_replica(nats_url, n, dbs[n], logs[n]) for n in names}
    paused: list[str] = []
    try:
        await bus.wait_caught_up(within_s=60)
        sent = 0

        async def produce() -> None:
            # a steady RATE commands a second, in slices of 50 ms
            nonlocal sent
            step = RATE // 20
            while sent < len(load.items):
                await bus.send_many(load.items[sent : sent + step])
                sent = min(sent + step, len(load.items))
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            for _ in range(PAUSES):
                await anyio.sleep(1.0)
                with anyio.fail_after(30):
                    while (leader := await leader_of(bus)) not in procs:  # noqa: ASYNC110
                        await anyio.sleep(0.1)
                assert leader is not None
                before = stepped_down(logs[leader])
                procs[leader].send_signal(signal.SIGSTOP)
                await anyio.sleep(TTL_S * 2)
                procs[leader].send_signal(signal.SIGCONT)
                paused.append(leader)
                with anyio.fail_after(30):
                    while stepped_down(logs[leader]) == before:  # noqa: ASYNC110 - a file
                        await anyio.sleep(0.1)
                await anyio.sleep(1.0)  # long enough to die, as it used to
                for n, proc in procs.items():
                    assert proc.poll() is None, f"replica {n} died:\n{logs[n].read_text()[-4000:]}"
        await bus.wait_caught_up(within_s=120)
        head = (await bus.js.stream_info("RC_IN")).state.last_seq
        with anyio.fail_after(60):
            while any(applied_seq(db) < head for db in dbs.values()):  # noqa: ASYNC110
                await anyio.sleep(0.1)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        codes = {n: await anyio.to_thread.run_sync(p.wait) for n, p in procs.items()}
    for n in names:
        text = logs[n].read_text()
        assert codes[n] == 0, text[-4000:]
        assert "StoreError" not in text and "interrupted" not in text, text[-4000:]
    assert len(paused) == PAUSES
    # exactly once, and both stores equal a clean replay of the stream
    await check_exactly_once(bus, load, dbs["a"])
    async with await Store.open(dbs["a"]) as a, await Store.open(dbs["b"]) as b:
        assert state_digest(await a.load_state()) == state_digest(await b.load_state())
