"""The 3-node cluster of ``compose/`` under a steady command load, from its own files
(:mod:`tests.support.cluster`): two ``reconciler run`` processes with the replica user's least
privilege; SIGKILL the node that leads ``RC_IN``, later the node the leader replica is
connected to, and restart them. Every command is decided exactly once, no
``Nats-Msg-Id`` appears twice on ``RC_OUT``, and both replicas' stores equal a clean
replay of the stream. The figures (commands, kills, the longest gap without decisions,
doubles) are printed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import anyio
import orjson
import pytest
from nats.js import JetStreamContext

from reconciler.bus.connection import connect
from reconciler.bus.sending import publish
from reconciler.replay.replay import replay_into
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support.builders import subject_of
from tests.support.bus import BusClient, leader_holder, stream_messages
from tests.support.cluster import Deployment, Node, deployment
from tests.support.state_diff import differences
from tests.support.workload import mixed, publish_steadily
from tests.system.test_deployment import cli_options, reconciler
from tests.system.test_faults import applied_seq

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

COMMANDS = 3000
RATE = 150  # commands a second


def spawn(dep: Deployment, name: str, db: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "reconciler.cli.main", "run",
                *cli_options(dep, name),
                "--db", str(db), "--replica", name, "--stream-replicas", "3",
                "--leader-ttl", "2", "--status-debounce", "0.2",
                "--log-format", "json", "--log-level", "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


def connected_node(dep: Deployment, connection: str) -> Node | None:
    """The node a client named ``connection`` is connected to (monitoring ``/connz``)."""
    for node in dep.nodes.values():
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            url = f"http://127.0.0.1:{node.http_port}/connz?limit=1024"
            with urllib.request.urlopen(url, timeout=1) as resp:
                conns = json.load(resp).get("connections") or []
        except OSError:
            continue
        if any(c.get("name") == connection for c in conns):
            return node
    return None


#: how long RC_IN's end must stay put, both replicas at it, before they are stopped
CALM_S = 1.5


async def settled(js: JetStreamContext, bus: BusClient, dbs: dict[str, Path]) -> int:
    """RC_IN's end once both replicas applied it, the leader published every output up to
    it, and it stayed put for :data:`CALM_S`. The leader's own inputs (warm top-ups, 50 ms
    after the commits that open a deficit) come after the producer's last: stopped just
    after those commits, one replica could apply a top-up the other never saw."""
    with anyio.fail_after(180):
        while True:
            head = (await js.stream_info("RC_IN")).state.last_seq
            while any(applied_seq(db) < head for db in dbs.values()):  # noqa: ASYNC110
                await anyio.sleep(0.2)
            await bus.wait_caught_up(within_s=60)
            await anyio.sleep(CALM_S)
            if (await js.stream_info("RC_IN")).state.last_seq == head:
                return head


async def test_node_kills_under_load_decide_every_command_exactly_once(tmp_path: Path) -> None:
    with deployment(tmp_path / "cluster") as dep:
        args = ["provision", *cli_options(dep, "admin"), "--stream-replicas", "3"]
        args += ["--leader-ttl", "2"]  # the replicas' own TTL: they may not change it
        done = await anyio.to_thread.run_sync(lambda: reconciler(*args))
        assert done.returncode == 0, done.stderr
        admin = await connect(dep.options("admin"))
        js = admin.jetstream()
        load = mixed(COMMANDS, seed=21)
        for i, (kind, payload) in enumerate(load.setup):
            await publish(js, subject_of((kind, payload)), orjson.dumps(payload), msg_id=f"s{i}")
        names = ("replica-1", "replica-2")
        dbs = {n: tmp_path / f"{n}.db" for n in names}
        logs = {n: tmp_path / f"{n}.log" for n in names}
        procs = {n: spawn(dep, n, dbs[n], logs[n]) for n in names}
        kills: list[str] = []
        killed_at: list[float] = []
        try:
            sent_ids: list[str] = []

            async def produce() -> None:
                await publish_steadily(js, load.items, per_second=RATE, sent=sent_ids)

            async def kill_and_restart(node: Node, why: str) -> None:
                await anyio.to_thread.run_sync(node.kill)
                kills.append(f"{node.name} ({why}) at {len(sent_ids)} inputs sent")
                killed_at.append(time.time())
                await anyio.sleep(4.0)
                await anyio.to_thread.run_sync(node.start)
                await anyio.to_thread.run_sync(lambda: dep.wait_ready((node.name,), 60))

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                with anyio.fail_after(60):
                    while len(sent_ids) < len(load.items) // 5:  # noqa: ASYNC110 - a counter
                        await anyio.sleep(0.1)
                info = await js.stream_info("RC_IN")
                leader = info.cluster.leader if info.cluster else None
                assert leader in dep.nodes, info.cluster
                await kill_and_restart(dep.nodes[leader], "RC_IN stream leader")
                with anyio.fail_after(60):
                    while len(sent_ids) < len(load.items) // 2:  # noqa: ASYNC110 - a counter
                        await anyio.sleep(0.1)
                holder = await leader_holder(js, within_s=30)
                node = await anyio.to_thread.run_sync(
                    lambda: connected_node(dep, f"reconciler-{holder}")
                )
                assert node is not None, holder
                await kill_and_restart(node, f"the node of leader {holder}")
            for n, proc in procs.items():
                assert proc.poll() is None, f"{n} died:\n{logs[n].read_text()[-4000:]}"
            head = await settled(js, BusClient(admin), dbs)
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            codes = {n: await anyio.to_thread.run_sync(p.wait) for n, p in procs.items()}
        for n in names:
            assert codes[n] == 0, logs[n].read_text()[-4000:]
        # nothing came in while they stopped: both stores are at the replay's end
        end = (await js.stream_info("RC_IN")).state.last_seq
        assert end == head, f"RC_IN went from {head} to {end} while the replicas stopped"
        # what is on RC_OUT, with the stream's own timestamps
        out = [(m.subject, m.msg_id, m.at) for m in await stream_messages(js, "RC_OUT", "rc.out.>")]
        ids = [msg_id for _, msg_id, _ in out if msg_id]
        doubles = [i for i, n in Counter(ids).items() if n > 1]
        decided = {s.rsplit(".", 1)[1] for s, _, _ in out if ".decision." in s}
        undecided = set(load.commands) - decided
        stamps = sorted(t for s, _, t in out if ".decision." in s)
        gaps = sorted(((b - a, a) for a, b in itertools.pairwise(stamps)), reverse=True)
        gap = gaps[0][0] if gaps else 0.0
        # where the longest gaps began, in seconds after each kill
        after_kill = [(round(g, 2), [round(at - k, 2) for k in killed_at]) for g, at in gaps[:3]]
        report = await replay_into(admin, prefix="rc")
        digests = {}
        states = {}
        for n, db in dbs.items():
            async with await Store.open(db) as store:
                states[n] = await store.load_state()
                digests[n] = state_digest(states[n])
        await admin.close()
        print(
            f"\nfailover: {len(load.commands)} commands ({len(sent_ids)} inputs) at ~{RATE}/s; "
            f"kills: {kills}; longest gap without decisions: {gap:.2f} s "
            f"(longest gaps, and when they began after each kill: {after_kill}); "
            f"outputs {len(out)}, doubles {len(doubles)}, undecided {len(undecided)}; "
            f"replay divergences {len(report.divergences)}, "
            f"digests equal: {set(digests.values()) == {report.digest}}"
        )
        # each divergence, and whether this test's own read of RC_OUT holds its id: a
        # "missing" output that is there was lost by the replay's reader, not the outbox
        on_out = set(ids)
        for d in report.divergences:
            print(f"divergence {d.kind} {d.msg_id} on {d.subject}: on RC_OUT {d.msg_id in on_out}")
        # each replica's store against the replay's digest, and where the two stores differ
        for n, state in states.items():
            print(
                f"{n}: applied_seq {state.applied_seq} (head {head}), digest "
                f"{'equal to' if digests[n] == report.digest else 'NOT'} the replay's; "
                f"{len(state.leases)} leases, {len(state.decisions)} decisions, "
                f"{len(state.jobs)} jobs, {len(state.released_at)} released"
            )
        if len(set(digests.values())) > 1:
            first, second = names
            differ = differences(states[first], states[second], names=(first, second))
            print("where the stores differ:\n" + "\n".join(differ))
        assert len(kills) == 2
        assert doubles == []
        assert undecided == set()
        assert report.divergences == []
        assert set(digests.values()) == {report.digest}
        for n in names:
            text = logs[n].read_text()
            assert "Traceback" not in text and "StoreError" not in text, text[-4000:]
