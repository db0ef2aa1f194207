"""The ``reconciler`` command line (reconciler.cli.main) as an operator runs it: ``run`` as
a process (signals, metrics, health), then ``replay``, ``audit`` and ``status`` on what it
did, and the options of every command validated and documented."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import orjson
import pytest
from click.testing import CliRunner

from reconciler.cli.main import cli
from reconciler.replica.collector import DEFAULT_GC_THRESHOLD
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.bus import BusClient
from tests.support.folding import commit

pytestmark = pytest.mark.timeout(90)

#: as the ``reconciler`` console script runs (reconciler.cli.entry)
RECONCILER = [sys.executable, "-m", "reconciler.cli"]


def on_bus(url: str, work: Callable[[BusClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        nc = await nats.connect(url, connect_timeout=2)
        try:
            return await work(BusClient(nc))
        finally:
            await nc.close()

    return anyio.run(main)


class RunningProcess:
    def __init__(self, url: str, db: Path, log: Path, *extra: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*RECONCILER, "run", "--nats-url", url, "--db", str(db), "--log-format", "json",
                 "--leader-ttl", "2", "--status-debounce", "0.1", *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                out.append(orjson.loads(line))
        return out

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(20)


@pytest.fixture
def served(nats_url: str, tmp_path: Path) -> Iterator[tuple[str, Path, RunningProcess]]:
    """A ``reconciler run`` process that decided a few commands, with metrics on."""
    db = tmp_path / "rc.db"
    process = RunningProcess(
        nats_url, db, tmp_path / "run.log", "--metrics-addr", "127.0.0.1:0", "--log-level", "debug"
    )

    async def drive(bus: BusClient) -> None:
        await bus.wait_caught_up(within_s=20)
        await bus.send(
            b.snapshot("h1", cpu=8, memory_mib=16384, disk_gib=200),
            b.pool("web", cpu=4, memory_mib=8192, disk_gib=40),
            b.admit("r1", "web", "vm-1", job="job-1"),
            b.cmd("mark-created", "c1", instance="vm-1"),
            b.admit("r2", "web", "vm-2"),
            b.admit("r3", "web", "vm-3"),
        )
        await bus.send_raw("rc.in.cmd.admit", b"not json")
        await bus.decision("r3")
        await bus.wait_caught_up()

    try:
        on_bus(nats_url, drive)
        yield nats_url, db, process
    finally:
        if process.proc.poll() is None:
            process.stop(signal.SIGKILL)


def metrics_port(process: RunningProcess) -> int:
    for line in process.lines():
        if line.get("event") == "metrics.listening":
            return int(line["port"])
    raise AssertionError("no metrics.listening line")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def aiohttp_loaded(pid: int) -> bool:
    """Whether aiohttp's extension modules are mapped into process ``pid``."""
    return "/aiohttp/" in Path(f"/proc/{pid}/maps").read_text()


def test_run_serves_metrics_and_health_and_stops_gracefully_on_sigterm(
    served: tuple[str, Path, RunningProcess],
) -> None:
    process = served[2]
    assert aiohttp_loaded(process.proc.pid)  # --metrics-addr: its server needs aiohttp
    port = metrics_port(process)
    assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
    status, body = get(f"http://127.0.0.1:{port}/readyz")
    assert status == 200 and orjson.loads(body)["caches_synced"] is True
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert re.search(r"^rc_applied_seq 7\.0$", text, re.M)
    assert re.search(r'^rc_dead_letters_total\{reason="decode"\} 1\.0$', text, re.M)
    assert re.search(r"^rc_decisions_total 4\.0$", text, re.M)
    assert re.search(r"^rc_leader 1\.0$", text, re.M)
    assert re.search(r"^process_resident_memory_bytes [0-9.e+]+$", text, re.M)
    assert re.search(r'^python_gc_collections_total\{generation="0"\} ', text, re.M)
    assert process.stop() == 0
    events = [line["event"] for line in process.lines()]
    assert "replica.stopped" in events and "leader.resigned" in events
    gc_lines = [line for line in process.lines() if line["event"] == "gc.thresholds"]
    assert [line["thresholds"][0] for line in gc_lines] == [DEFAULT_GC_THRESHOLD]
    frozen = [line for line in process.lines() if line["event"] == "gc.frozen"]
    assert len(frozen) == 1 and frozen[0]["objects"] > 0 and frozen[0]["leases"] == 0
    decisions = [line for line in process.lines() if line["event"] == "decision"]
    assert {d["request_id"]: d["outcome"] for d in decisions} == {
        "r1": "admitted",
        "c1": "ok",
        "r2": "admitted",
        "r3": "rejected",
    }
    assert [d["reason"] for d in decisions if d["request_id"] == "r3"] == ["insufficient-capacity"]


def test_a_run_without_websocket_or_metrics_never_loads_aiohttp(
    nats_url: str, tmp_path: Path
) -> None:
    """nats-py imports aiohttp for its WebSocket transport only; the console script marks
    it absent for a ``run`` that cannot need it (a tenth of a replica's memory), and the
    replica decides as ever."""
    process = RunningProcess(nats_url, tmp_path / "rc.db", tmp_path / "run.log")
    try:

        async def drive(bus: BusClient) -> Any:
            await bus.wait_caught_up(within_s=20)
            await bus.send(
                b.snapshot("h1", cpu=8, memory_mib=16384, disk_gib=200),
                b.pool("web", cpu=4, memory_mib=8192, disk_gib=40),
                b.admit("r1", "web", "vm-1"),
            )
            return await bus.decision("r1")

        assert on_bus(nats_url, drive)["outcome"] == "admitted"
        assert not aiohttp_loaded(process.proc.pid)
        assert process.stop() == 0
    finally:
        if process.proc.poll() is None:
            process.stop(signal.SIGKILL)


def test_replay_audit_and_status_after_a_run(served: tuple[str, Path, RunningProcess]) -> None:
    url, db, process = served
    assert process.stop() == 0
    runner = CliRunner()
    replayed = runner.invoke(cli, ["replay", "--nats-url", url, "--log-level", "error"])
    assert replayed.exit_code == 0, replayed.output
    assert "replayed inputs 1..7: 7 folded (1 dead-lettered)" in replayed.output
    assert "no divergences" in replayed.output

    async def digest() -> str:
        from reconciler.store.digest import state_digest

        async with await Store.open(db) as store:
            return state_digest(await store.load_state())

    assert f"state digest: {anyio.run(digest)}" in replayed.output

    audit = runner.invoke(
        cli, ["audit", "job-1", "--db", str(db), "--nats-url", url, "--log-level", "error"]
    )
    assert audit.exit_code == 0, audit.output
    lines = audit.output.splitlines()
    assert lines[0] == "lease L3: vm-1 on h1 (web, cold) is created job=job-1"
    assert "rc.in.cmd.admit" in lines[1] and '"request_id":"r1"' in lines[1]
    assert "∅ → reserved  (admit)" in audit.output
    assert "reserved → created  (mark-created)" in audit.output
    assert "decision mark-created c1 final ok" in audit.output
    as_json = runner.invoke(cli, ["audit", "r1", "--db", str(db), "--no-inputs", "--json"])
    kinds = [orjson.loads(line)["type"] for line in as_json.output.splitlines()]
    assert kinds == ["lease", "transition", "decision", "transition", "decision"]
    missing = runner.invoke(cli, ["audit", "nobody", "--db", str(db), "--no-inputs"])
    assert missing.exit_code == 1 and "nothing in" in missing.output

    status = runner.invoke(cli, ["status", "--db", str(db)])
    assert status.exit_code == 0, status.output
    assert re.search(r"^h1\s+yes\s+0/8\s+0/16384\s+120/200\s+-\s+1 created, 1 reserved$",
                     status.output, re.M)  # fmt: skip
    rows = [
        orjson.loads(line)
        for line in runner.invoke(cli, ["status", "--db", str(db), "--json"]).output.splitlines()
    ]
    assert [r["type"] for r in rows] == ["host", "pool"] and rows[1]["instances"] == 2


def test_replay_fails_on_a_divergence(served: tuple[str, Path, RunningProcess]) -> None:
    url, _, process = served
    assert process.stop() == 0

    async def forge(bus: BusClient) -> None:
        decided = await bus.last_output("rc.out.decision.r2")
        assert decided is not None
        body = orjson.loads(decided.data)
        body["outcome"] = "rejected"
        await bus.js.publish(
            "rc.out.decision.r9", orjson.dumps(body), headers={"Nats-Msg-Id": "decision:r9:final"}
        )

    on_bus(url, forge)
    result = CliRunner().invoke(
        cli, ["replay", "--nats-url", url, "--json", "--log-level", "error"]
    )
    assert result.exit_code == 1
    report = orjson.loads(result.output)
    assert report["ok"] is False and report["divergences"] == 1
    assert report["details"][0]["kind"] == "unexpected"
    assert report["details"][0]["msg_id"] == "decision:r9:final"


def test_run_refuses_a_store_ahead_of_the_stream(nats_url: str, tmp_path: Path) -> None:
    db = tmp_path / "rc.db"

    async def ahead() -> None:
        from reconciler.core.state import Effects, State

        async with await Store.open(db) as store:
            await commit(store, State(applied_seq=99), Effects(), applied_seq=99)

    anyio.run(ahead)
    result = subprocess.run(
        [*RECONCILER, "run", "--nats-url", nats_url, "--db", str(db), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "has applied up to seq 99, but stream RC_IN ends at seq 0" in result.stderr


def test_options_are_validated_and_documented() -> None:
    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    for command in ("run", "replay", "audit", "status", "demo"):
        assert command in top.output
    run_help = runner.invoke(cli, ["run", "--help"]).output
    for option, env in (
        ("--nats-url", "RC_NATS_URL"),
        ("--nats-creds", "RC_NATS_CREDS"),
        ("--db", "RC_DB"),
        ("--prefix", "RC_PREFIX"),
        ("--workers", "RC_WORKERS"),
        ("--status-debounce", "RC_STATUS_DEBOUNCE"),
        ("--status-progress-interval", "RC_STATUS_PROGRESS_INTERVAL"),
        ("--live-get-timeout", "RC_LIVE_GET_TIMEOUT"),
        ("--leader-ttl", "RC_LEADER_TTL"),
        ("--log-format", "RC_LOG_FORMAT"),
        ("--metrics-addr", "RC_METRICS_ADDR"),
        ("--tls-ca", "RC_TLS_CA"),
        ("--gc-threshold", "RC_GC_THRESHOLD"),
    ):
        assert option in run_help and env in run_help
    bad = runner.invoke(cli, ["run", "--leader-ttl", "0"])
    assert bad.exit_code == 2 and "--leader-ttl" in bad.output
    bad = runner.invoke(cli, ["run", "--replica", "no spaces please"])
    assert bad.exit_code == 2 and "replica name" in bad.output
    bad = runner.invoke(cli, ["run", "--gc-threshold", "-1"])
    assert bad.exit_code == 2 and "--gc-threshold" in bad.output
