"""Exactly-once under faults (engineering rule 4): ``reconciler run`` SIGKILLed at random
points under load, and the NATS server restarted under load, lose nothing and double
nothing; a clean replay of the stream then reproduces the state and every decision."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import anyio
import pytest
from nats.aio.client import Client

from reconciler.replay.replay import replay_into
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support.bus import BusClient, fast_config, running_replica
from tests.support.natsserver import NatsServer
from tests.support.workload import Workload, mixed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

COMMANDS = 5000


def spawn_run(nats_url: str, db: Path, log: Path) -> subprocess.Popen[bytes]:
    """``reconciler run`` as its own process, as an operator starts it."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "reconciler.cli.main", "run",
                "--nats-url", nats_url, "--db", str(db), "--replica", "victim",
                "--leader-ttl", "1.5", "--status-debounce", "0.2",
                "--log-format", "json", "--log-level", "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


def applied_seq(db: Path) -> int:
    """The committed position of a store another process writes (0 before it exists)."""
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            return int(conn.execute("SELECT applied_seq FROM position").fetchone()[0])
        except sqlite3.OperationalError:  # not migrated yet
            return 0


async def check_exactly_once(bus: BusClient, load: Workload, db: Path) -> None:
    """Every command decided, no output twice, and the store equals a clean replay."""
    outputs = await bus.outputs()
    with_ids = [m.msg_id for m in outputs if m.msg_id is not None]
    doubled = [msg_id for msg_id, n in Counter(with_ids).items() if n > 1]
    assert doubled == []
    decided = {m.subject.rsplit(".", 1)[1] for m in outputs if ".decision." in m.subject}
    assert set(load.commands) <= decided
    finals = {
        i.split(":")[1] for i in with_ids if i.startswith("decision:") and i.endswith(":final")
    }
    pendings = {i.split(":")[1] for i in with_ids if i.endswith(":pending")}
    assert set(load.commands) <= finals | pendings
    async with await Store.open(db) as store:
        digest = state_digest(await store.load_state())
    report = await replay_into(bus.nc, prefix=bus.prefix)
    assert report.divergences == []
    assert report.digest == digest
    assert report.compared == len(with_ids)


async def test_sigkill_at_random_points_loses_and_doubles_nothing(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    load = mixed(COMMANDS, seed=11)
    await bus.send_many(load.setup)
    db, log = tmp_path / "rc.db", tmp_path / "run.log"
    rng = random.Random(5)
    # the whole load waits on the stream: each process is stopped (SIGSTOP) at a random
    # point of its progress, once it committed 5-25 % of what is left, whatever it is
    # doing then (fetching, folding, committing, publishing); how far behind the stream
    # it is gets read while it is stopped, then it is SIGKILLed. Driven by its progress,
    # never by wall time: however fast or loaded the machine, every kill lands mid-load
    # (at most a batch past a target that leaves three quarters of the rest to do)
    await bus.send_many(load.items)
    behind_at_kill: list[int] = []
    proc = spawn_run(nats_url, db, log)
    try:
        for _ in range(5):
            head = (await bus.js.stream_info("RC_IN")).state.last_seq
            before = applied_seq(db)
            target = before + max(1, int((head - before) * rng.uniform(0.05, 0.25)))
            with anyio.fail_after(120):
                while applied_seq(db) < target:  # another process's file
                    assert proc.poll() is None, log.read_text()[-4000:]
                    await anyio.sleep(0.002)
            proc.send_signal(signal.SIGSTOP)
            behind_at_kill.append(head - applied_seq(db))
            proc.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(proc.wait)
            proc = spawn_run(nats_url, db, log)
        await bus.wait_caught_up(within_s=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(proc.wait) == 0, log.read_text()[-4000:]
    # every kill landed mid-load: with inputs on the stream not yet committed
    assert all(behind > 0 for behind in behind_at_kill), behind_at_kill
    await check_exactly_once(bus, load, db)


async def test_a_nats_restart_mid_load_loses_nothing(
    nc: Client, nats_server: NatsServer, nats_url: str, tmp_path: Path
) -> None:
    if not nats_server.supports_faults:
        pytest.skip("the NATS server cannot be restarted here")
    bus = BusClient(nc)
    await bus.ensure_streams()
    load = mixed(COMMANDS // 2, seed=3)
    await bus.send_many(load.setup)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)):
        half = len(load.items) // 2
        await bus.send_many(load.items[:half])
        await anyio.to_thread.run_sync(nats_server.restart)  # graceful: JetStream flushed
        await send_retrying(bus, load.items[half : half + 500])
        await anyio.to_thread.run_sync(lambda: nats_server.restart(graceful=False))
        await send_retrying(bus, load.items[half + 500 :])
        await bus.wait_caught_up(within_s=60)
        await anyio.sleep(0.5)  # the last publish confirmations
    await check_exactly_once(bus, load, db)


async def send_retrying(bus: BusClient, items: list[tuple[str, dict[str, object]]]) -> None:
    """A producer that retries through an outage with the same ``Nats-Msg-Id``."""
    for item in items:
        with anyio.fail_after(30):
            while True:
                try:
                    await bus.send(item)
                    break
                except Exception:
                    await anyio.sleep(0.1)
