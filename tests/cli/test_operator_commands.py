"""``reconciler cmd``, ``query`` and ``apply`` as an operator types them, against a real
``reconciler run`` process and nats-server; and the bounded, clear failures of every
command that talks to NATS once (``replay``, ``audit``, ``cmd``, ``query``, ``apply``)."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from reconciler.cli.commands.query import QUERIES
from reconciler.cli.main import cli
from tests.cli.test_main import RunningProcess, on_bus
from tests.support import builders as b
from tests.support.bus import BusClient
from tests.support.folding import commit
from tests.support.repo import ROOT

pytestmark = pytest.mark.timeout(90)

POOLS_YAML = """\
# two pools and a GPU class, as an operator writes them
- kind: pool
  pool: web
  flavor: {cpu: 4, memory_mib: 8192, disk_gib: 40}
  claims: []
  warm: {min_ready: 0, max_ready: 0, protect_min_ready: false}
  max_instances: 10
  priority: 0
  host_selector: {}
  placement: pack
  image: ubuntu/24.04
  profiles: [default]
  project: default
- pool: batch
  flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}
  claims: []
  warm: {min_ready: 0, max_ready: 0, protect_min_ready: false}
  max_instances: 10
  priority: 0
  host_selector: {}
  placement: spread
  image: ubuntu/24.04
  profiles: [default]
  project: default
- class: a100
  parameters: {gpu: {count: 1, model: A100}}
"""


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [*args, "--log-level", "error"])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def served(nats_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A ``reconciler run`` process that knows one host and nothing else."""
    process = RunningProcess(nats_url, tmp_path / "rc.db", tmp_path / "run.log")

    async def drive(bus: BusClient) -> None:
        await bus.wait_caught_up(within_s=20)
        await bus.send(b.snapshot("h1", cpu=8, memory_mib=16384, disk_gib=200))
        await bus.wait_caught_up()

    try:
        on_bus(nats_url, drive)
        yield nats_url, tmp_path
    finally:
        if process.proc.poll() is None:
            process.stop(signal.SIGKILL)


def test_apply_then_cmd_then_query(served: tuple[str, Path]) -> None:
    url, tmp = served
    pools = tmp / "pools.yaml"
    pools.write_text(POOLS_YAML)
    code, out, err = invoke("apply", str(pools), "--nats-url", url)
    assert code == 0, out + err
    assert err.startswith("published rc.in.cmd.apply-config request_id=apply-")
    assert "(3 item(s))" in err
    assert out.splitlines() == [
        "created          pool web",
        "created          pool batch",
        "created          class a100",
        out.splitlines()[-1],
    ]
    assert out.splitlines()[-1].startswith("applied: 3 item(s): 3 created  [input ")
    code, reapplied, _ = invoke("apply", str(pools), "--nats-url", url)
    assert code == 0 and reapplied.count("unchanged        ") == 3
    assert "3 unchanged" in reapplied

    code, out, err = invoke(
        "cmd", "admit", "pool=web", "instance=vm-1", "kind=cold", "job=job-1",
        "request_id=r1", "--nats-url", url,
    )  # fmt: skip
    assert code == 0, out + err
    assert "published rc.in.cmd.admit request_id=r1" in err
    assert out.startswith("final   admitted  lease ")
    assert "vm-1 on h1 (web, cold, reserved, job job-1)" in out
    # the same request again: deduplicated by the stream, its decision shown again
    again = invoke(
        "cmd", "admit", "pool=web", "instance=vm-1", "kind=cold", "job=job-1",
        "request_id=r1", "--nats-url", url,
    )  # fmt: skip
    assert again[0] == 0 and "(a duplicate: already on the stream)" in again[2]
    assert again[1] == out

    # a generated request id, a refusal: exit 1 with the reason
    code, out, err = invoke(
        "cmd", "admit", "--json", '{"pool": "web", "instance": "vm-2", "kind": "cold"}',
        "--nats-url", url,
    )  # fmt: skip
    assert code == 0, out + err
    assert "request_id=cli-" in err
    code, out, _ = invoke(
        "cmd", "admit", "pool=web", "instance=vm-3", "kind=cold", "--nats-url", url
    )
    assert code == 1 and "final   rejected (insufficient-capacity)" in out
    code, out, _ = invoke("cmd", "release", "instance=vm-2", "--raw", "--nats-url", url)
    assert code == 0 and orjson.loads(out)["outcome"] == "ok"

    code, out, err = invoke("query", "lease", '{"identifier": "job-1"}', "--nats-url", url)
    assert code == 0, out + err
    lease = orjson.loads(out)
    assert lease["instance"] == "vm-1" and lease["history"]
    code, out, err = invoke("query", "health", "--nats-url", url)
    assert code == 0 and orjson.loads(out)["caches_synced"] is True
    code, out, err = invoke("query", "pool", '{"pool": "web"}', "--nats-url", url)
    assert code == 0, out + err
    pool = orjson.loads(out)
    assert pool["pool"]["pool"] == "web" and "vm-1" in [le["instance"] for le in pool["leases"]]
    code, out, err = invoke("query", "lease", '{"identifier": "nobody"}', "--nats-url", url)
    assert code == 1 and "not-found" in err
    code, out, err = invoke("query", "lease", '{"identifier": 3}', "--nats-url", url)
    assert code == 1 and "nothing sent" in err


def test_query_offers_every_query_the_replicas_answer() -> None:
    schemas = ROOT / "reconciler" / "schemas" / "query"
    named = sorted(p.name.removesuffix(".request.json") for p in schemas.glob("*.request.json"))
    assert list(QUERIES) == named


def test_apply_refuses_the_whole_file_for_one_bad_item(nats_url: str, tmp_path: Path) -> None:
    async def streams(bus: BusClient) -> int:
        await bus.ensure_streams()
        return len(await bus.inputs())

    assert on_bus(nats_url, streams) == 0
    bad = tmp_path / "pools.json"
    items = [
        {"kind": "pool", **b.pool("ok")[1]},
        {**b.pool("bad", cpu=-1)[1]},
        {"name": "mystery"},
        {**b.pool("ok")[1]},
    ]
    bad.write_text(orjson.dumps(items).decode())
    code, _, err = invoke("apply", str(bad), "--nats-url", nats_url)
    assert code == 1
    assert "3 problems, nothing published" in err
    assert "item 2 (pool 'bad'): flavor/cpu" in err
    assert "item 3: unknown kind" in err
    assert "item 4 (pool 'ok'): the same pool as item 1" in err
    assert on_bus(nats_url, streams) == 0
    code, _, _ = invoke("apply", str(bad), "--dry-run", "--nats-url", nats_url)
    assert code == 1
    not_yaml = tmp_path / "x.yaml"
    not_yaml.write_text("- [unclosed")
    assert invoke("apply", str(not_yaml), "--nats-url", nats_url)[0] == 1


def test_cmd_refuses_bad_input_before_publishing(nats_url: str) -> None:
    code, _, err = invoke("cmd", "admit", "pool=web", "kind=cold", "--nats-url", nats_url)
    assert code == 1 and "not a valid admit command, nothing published" in err
    assert "instance" in err
    code, _, err = invoke("cmd", "admit", "claims:=[oops", "--nats-url", nats_url)
    assert code == 2 and "not JSON" in err
    code, _, err = invoke("cmd", "teleport", "--nats-url", nats_url)
    assert code == 2


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    "args",
    [
        ("replay",),
        ("cmd", "release", "instance=vm-1"),
        ("query", "health"),
        ("apply", "POOLS"),
        ("audit", "job-1", "--db", "DB"),
    ],
    ids=lambda a: a[0],
)
def test_an_unreachable_server_is_a_bounded_clear_error(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(POOLS_YAML)
    db = tmp_path / "rc.db"
    if "DB" in args:
        import anyio

        from reconciler.core.state import Effects, State
        from reconciler.store.sqlite import Store

        async def a_store() -> None:
            async with await Store.open(db) as store:
                await commit(store, State(applied_seq=0), Effects(), applied_seq=0)

        anyio.run(a_store)
    argv = [{"POOLS": str(pools), "DB": str(db)}.get(a, a) for a in args]
    code, _, err = invoke(*argv, "--nats-url", _closed_port(), "--connect-timeout", "0.5")
    if args[0] == "audit":
        assert code == 1 and "nothing in" in err  # the store answers first: nothing to fetch
        return
    assert code == 1, err
    assert "no NATS server reachable at nats://127.0.0.1:" in err
    assert "within 0.5 s" in err


def test_a_missing_stream_is_an_error(nats_url: str) -> None:
    code, _, err = invoke("cmd", "release", "instance=vm-1", "--nats-url", nats_url)
    assert code == 1 and "stream RC_IN does not exist" in err
    code, _, err = invoke("replay", "--nats-url", nats_url)
    assert code == 1 and "RC_IN" in err


def test_audit_and_status_after_the_demo(nats_url: str, tmp_path: Path) -> None:
    """The demo's story on a server that outlives it: audit shows every decision phase, the
    executor commands and the preemptor; status tells taken GPUs from none."""
    db = tmp_path / "demo.db"
    demo = CliRunner().invoke(cli, ["demo", "--db", str(db), "--nats-url", nats_url, "--quiet"])
    assert demo.exit_code == 0, demo.output

    code, out, err = invoke("audit", "urgent-1", "--db", str(db), "--nats-url", nats_url)
    assert code == 0, err
    assert "decision admit-preemptible urgent-1 pending pending" in out
    assert "decision admit-preemptible urgent-1 final admitted" in out
    assert out.index("pending pending") < out.index("final admitted")

    as_json = invoke("audit", "urgent-1", "--db", str(db), "--nats-url", nats_url, "--json")
    pending = [
        line
        for line in map(orjson.loads, as_json[1].splitlines())
        if line["type"] == "decision" and line["phase"] == "pending"
    ]
    [victim] = pending[0]["victims"]
    code, out, err = invoke("audit", victim["instance"], "--db", str(db), "--nats-url", nats_url)
    assert code == 0, err
    assert "ready → victim  (preempted, by request urgent-1)" in out
    assert f"executor create {victim['instance']} on {victim['host']}" in out
    assert f"executor delete (preempted) {victim['instance']} on {victim['host']}  command" in out
    assert out.index("→ victim") < out.index("executor delete") < out.index("victim → released")
    as_json = invoke("audit", victim["instance"], "--db", str(db), "--nats-url", nats_url, "--json")
    types = [orjson.loads(line)["type"] for line in as_json[1].splitlines()]
    assert types.count("command") == 2 and "input" in types

    code, out, err = invoke(
        "audit", "urgent-1", "--db", str(db), "--nats-url", nats_url, "--prefix", "other"
    )
    assert code == 1 and "stream OTHER_IN does not exist" in err

    code, out, _ = invoke("status", "--db", str(db))
    assert code == 0
    gpu_row = next(line for line in out.splitlines() if line.startswith("gpu-a "))
    cpu_row = next(line for line in out.splitlines() if line.startswith("cpu-b "))
    assert " none free " in gpu_row and " - " in cpu_row


def test_status_and_audit_refuse_a_file_that_is_not_a_replicas_store(tmp_path: Path) -> None:
    import sqlite3

    other = tmp_path / "executor.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE finished (command_id TEXT PRIMARY KEY)")
    conn.close()
    before = other.read_bytes()
    code, _, err = invoke("status", "--db", str(other))
    assert code == 1 and "is not a reconciler replica's store" in err
    code, _, err = invoke("audit", "x", "--db", str(other), "--no-inputs")
    assert code == 1 and "is not a reconciler replica's store" in err
    assert other.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["executor.db"]
    code, _, err = invoke("status", "--db", str(tmp_path / "absent.db"))
    assert code == 1 and "no store at" in err
    assert not (tmp_path / "absent.db").exists()


def test_a_follower_catching_up_logs_old_decisions_at_debug_only(
    served: tuple[str, Path],
) -> None:
    url, tmp = served

    async def old_news(bus: BusClient) -> None:
        await bus.send(b.pool("web", cpu=64), b.admit("r-big", "web", "vm-big"))
        await bus.send_raw("rc.in.cmd.admit", b"not json")
        await bus.decision("r-big")
        await bus.wait_caught_up()

    on_bus(url, old_news)
    follower = RunningProcess(
        url, tmp / "follower.db", tmp / "follower.log", "--replica", "follower",
        "--log-level", "info",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not any(e.get("event") == "caches.synced" for e in follower.lines()):
            assert time.monotonic() < deadline, "the follower never synced"
            time.sleep(0.1)
    finally:
        assert follower.stop() == 0
    events = [line.get("event") for line in follower.lines()]
    assert "caches.synced" in events
    assert "decision" not in events and "dead_letter" not in events


def test_apply_reports_a_configuration_the_reconciler_rejects(served: tuple[str, Path]) -> None:
    url, tmp = served
    unusable = tmp / "unusable.json"
    unusable.write_text(orjson.dumps(b.pool("odd", min_ready=3, max_ready=2)[1]).decode())
    code, out, err = invoke("apply", str(unusable), "--dry-run", "--nats-url", url)
    assert code == 1, out + err
    assert out.splitlines() == [
        "refused          pool odd: pool 'odd': warm.min_ready 3 > max_ready 2",
        "1 of 1 item(s) refused: the fold would apply none",
    ]
    assert "dry run, nothing published" in err
    code, out, err = invoke("apply", str(unusable), "--nats-url", url)
    assert code == 1, out + err
    assert "published rc.in.cmd.apply-config" in err
    assert "refused          pool odd: pool 'odd': warm.min_ready 3 > max_ready 2" in out
    assert "rejected (invalid-config): 1 of 1 item(s) refused, nothing applied" in err
