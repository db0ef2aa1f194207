"""The secured deployment of ``compose/``, from the very files compose uses: three NATS
nodes (``compose/nats/server.conf``), and the least-privilege accounts, certificates and
NKeys that ``reconciler credentials`` makes, as local processes (see
:mod:`tests.support.cluster`).

- ``reconciler provision`` (admin) creates R3 streams, the bucket and the executor's
  consumer; a replica without stream-create permission then runs, and before that fails
  at once naming the missing permission;
- each component works with exactly its permission set, and what it may not do is
  refused by the server and reported at once as a :class:`PermissionViolation`;
- TLS with client verification: a wrong CA, a wrong host name, a missing client
  certificate (and a wrong NKey) fail at once with a clear error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.connection import ConnectOptions, ConnectRefused, connect
from reconciler.bus.sending import publish
from reconciler.bus.violations import PermissionViolation, guarded, watch_of
from reconciler.replica.replica import Replica, RunConfig, StartupError
from tests.support import builders as b
from tests.support.bus import running_replica
from tests.support.cluster import Deployment, deployment, make_credentials

#: the tests share one deployment and run in order (a replica refused before
#: `provision`, then provisioned streams): one worker runs them all (scripts/test
#: distributes with --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.xdist_group("deployment")]

#: component x forbidden action x what happened, filled by the tests (printed at the end)
TABLE: list[tuple[str, str, str]] = []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deployment(tmp_path_factory.mktemp("deployment")) as dep:
        yield dep
    if TABLE:
        width = max(len(a) for _, a, _ in TABLE)
        print("\ncomponent | forbidden action | what happened")
        for component, action, outcome in TABLE:
            print(f"{component:9} | {action:{width}} | {outcome}")


def cli_options(dep: Deployment, component: str) -> list[str]:
    return [
        "--nats-url", ",".join(dep.urls),
        "--nats-nkey", str(dep.secrets / f"{component}.nk"),
        "--tls-ca", str(dep.secrets / "ca.pem"),
        "--tls-cert", str(dep.secrets / f"{component}.pem"),
        "--tls-key", str(dep.secrets / f"{component}-key.pem"),
        "--inbox-prefix", f"_INBOX.{component}",
    ]  # fmt: skip


def reconciler(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reconciler.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def replica_config(
    dep: Deployment, db: Path, name: str = "replica-1", *, user: str | None = None
) -> RunConfig:
    """Replica ``name``, connected as NATS user ``user`` (its own by default)."""
    return RunConfig(
        nats=dep.options(user or name),
        db=db,
        replica=name,
        leader_ttl_s=2.0,
        status_debounce_s=0.05,
        status_progress_interval_s=0.5,
        stream_replicas=3,
    )


async def refused_at_once(
    component: str, action: str, call: Callable[[], Awaitable[Any]]
) -> PermissionViolation:
    started = time.monotonic()
    with anyio.fail_after(5), pytest.raises(PermissionViolation) as info:
        await call()
    took = time.monotonic() - started
    TABLE.append((component, action, f"refused in {took:.2f} s: {info.value}"))
    assert took < 2.0
    return info.value


# ------------------------------------------------------------------ provisioning


async def test_a_replica_without_the_streams_fails_at_once_naming_the_permission(
    cluster: Deployment, tmp_path: Path
) -> None:
    started = time.monotonic()
    with anyio.fail_after(20), pytest.raises(StartupError) as info:
        await Replica(replica_config(cluster, tmp_path / "rc.db")).run(stop=anyio.Event())
    message = str(info.value)
    assert "stream RC_IN does not exist" in message
    assert "$JS.API.STREAM.CREATE.RC_IN" in message and "reconciler provision" in message
    TABLE.append(
        ("replica", "create stream RC_IN", f"StartupError in {time.monotonic() - started:.2f} s")
    )


async def test_provision_waits_for_a_cluster_that_cannot_place_its_replicas_yet(
    cluster: Deployment,
) -> None:
    """Right after the nodes start, R3 streams may not be placeable yet (as with a node
    down): `provision` tries again until they are, or says why after --wait."""
    args = ["provision", *cli_options(cluster, "admin"), "--stream-replicas", "3"]
    node = cluster.nodes["nats-3"]
    node.stop()
    try:
        short = await anyio.to_thread.run_sync(lambda: reconciler(*args, "--wait", "2"))
        assert short.returncode == 1, short.stderr
        lines = [line for line in short.stderr.splitlines() if line.startswith("Error:")]
        assert len(lines) == 1, short.stderr
        assert re.fullmatch(
            r"Error: the JetStream cluster could not place 3 replica\(s\) within 2 s \(no "
            r"suitable peers for placement[^)]*\): check that 3 NATS node\(s\) with JetStream "
            r"are up and clustered, or give --stream-replicas the number there are",
            lines[0],
        ), lines[0]
        assert "Traceback" not in short.stderr

        async def start_the_node_later() -> None:
            await anyio.sleep(3)
            node.start()

        async with anyio.create_task_group() as tg:
            tg.start_soon(start_the_node_later)
            waited = await anyio.to_thread.run_sync(lambda: reconciler(*args, "--wait", "45"))
        assert waited.returncode == 0, waited.stderr
        assert "provision.waiting" in waited.stderr
        assert "3 replica(s)" in waited.stdout
    finally:
        if node.proc is None or node.proc.poll() is not None:
            node.start()
        await anyio.to_thread.run_sync(cluster.wait_ready)


async def test_provision_creates_r3_streams_the_bucket_and_the_executor_consumer(
    cluster: Deployment,
) -> None:
    args = ["provision", *cli_options(cluster, "admin"), "--stream-replicas", "3"]
    done = await anyio.to_thread.run_sync(lambda: reconciler(*args, "--executor-host", "incus-1"))
    assert done.returncode == 0, done.stderr
    assert "executor-incus-1: created" in done.stdout
    # idempotent; the hosts of the fleet file `reconciler credentials` wrote are the same
    fleet = str(cluster.secrets / "fleet.json")
    again = await anyio.to_thread.run_sync(lambda: reconciler(*args, "--incus-fleet", fleet))
    assert again.returncode == 0, again.stderr
    assert "executor-incus-1: exists" in again.stdout
    nc = await connect(cluster.options("admin"))
    try:
        js = nc.jetstream()
        for stream in ("RC_IN", "RC_OUT", "KV_rc_leader"):
            assert (await js.stream_info(stream)).config.num_replicas == 3
        info = await js.consumer_info("RC_OUT", "executor-incus-1")
        assert info.config.filter_subject == "rc.out.exec.incus-1.>"
    finally:
        await nc.close()


async def test_a_replica_not_in_the_accounts_fails_at_once_naming_its_consumer(
    cluster: Deployment, tmp_path: Path
) -> None:
    started = time.monotonic()
    # replica-9 is not in the accounts: with replica-1's credentials it may not use its
    # consumer (nor, as any replica, another replica's)
    config = replica_config(cluster, tmp_path / "rc.db", name="replica-9", user="replica-1")
    with anyio.fail_after(20), pytest.raises(StartupError) as info:
        await Replica(config).run(stop=anyio.Event())
    assert "$JS.API.CONSUMER.DELETE.RC_IN.RC_IN-replica-9" in str(info.value)
    TABLE.append(
        (
            "replica",
            "use consumer RC_IN-replica-9 (not its own)",
            f"StartupError in {time.monotonic() - started:.2f} s",
        )
    )


# ------------------------------------------------------------------- permissions


async def test_each_component_works_with_its_own_permissions(
    cluster: Deployment, tmp_path: Path
) -> None:
    async with running_replica(replica_config(cluster, tmp_path / "rc.db")):
        bridge = await connect(cluster.options("bridge"))
        admin = await connect(cluster.options("admin"))
        producer = await connect(cluster.options("producer"))
        executor = await connect(cluster.options("executor"))
        try:
            # the bridge: a host's resources in; it reads back its last snapshot
            snapshot = b.snapshot("incus-1", cpu=16, memory_mib=65536, disk_gib=500)
            await publish(
                bridge.jetstream(),
                b.subject_of(snapshot),
                orjson.dumps(snapshot[1]),
                msg_id="snap-1",
            )
            last = await bridge.jetstream().get_last_msg("RC_IN", "rc.in.host.incus-1.snapshot")
            assert orjson.loads(last.data or b"{}")["host"] == "incus-1"
            # an operator (admin) configures pools: one warm, so the leader tops it up
            for item in (b.pool("cold"), b.pool("warm", min_ready=1, max_ready=1)):
                await publish(admin.jetstream(), b.subject_of(item), orjson.dumps(item[1]))
            # a producer: a command in, its decision out, a query answered
            decisions = await producer.subscribe("rc.out.decision.>")
            admit = b.admit("perm-1", "cold", "vm-perm-1")
            await publish(
                producer.jetstream(), b.subject_of(admit), orjson.dumps(admit[1]), msg_id="in:p1"
            )
            with anyio.fail_after(20):
                while True:
                    msg = await decisions.next_msg(timeout=20)
                    decision = orjson.loads(msg.data)
                    if decision["request_id"] == "perm-1" and decision["phase"] == "final":
                        break
            assert decision["outcome"] == "admitted"
            health = orjson.loads((await producer.request("rc.query.health", b"{}", 5)).data)
            assert health["ok"] and health["result"]["caches_synced"]
            # the executor: the warm top-up's create command, from its pre-made consumer
            sub = await executor.jetstream().pull_subscribe_bind(
                durable="executor-incus-1", stream="RC_OUT", inbox_prefix=b"_INBOX.executor."
            )
            with anyio.fail_after(30):
                msgs = await sub.fetch(1, timeout=25)
            assert msgs[0].subject == "rc.out.exec.incus-1.create"
            await msgs[0].ack_sync()
            for nc in (bridge, admin, producer, executor):
                assert watch_of(nc).count == 0, watch_of(nc).last
        finally:
            for nc in (bridge, admin, producer, executor):
                await nc.close()


async def test_what_a_component_may_not_do_is_refused_and_reported(cluster: Deployment) -> None:
    names = ("bridge", "executor", "producer", "replica-1")
    conns: dict[str, Client] = {n: await connect(cluster.options(n)) for n in names}
    try:

        def put(component: str, subject: str) -> Callable[[], Awaitable[Any]]:
            js = conns[component].jetstream()
            return lambda: publish(js, subject, b'{"v":1}', msg_id=f"x:{component}:{subject}")

        await refused_at_once("bridge", "publish rc.in.cmd.admit", put("bridge", "rc.in.cmd.admit"))
        await refused_at_once(
            "bridge", "publish rc.out.decision.r1", put("bridge", "rc.out.decision.r1")
        )
        await refused_at_once(
            "executor", "publish rc.in.host.incus-1.snapshot",
            put("executor", "rc.in.host.incus-1.snapshot"),
        )  # fmt: skip
        await refused_at_once(
            "executor", "publish rc.in.cmd.release", put("executor", "rc.in.cmd.release")
        )
        js = conns["executor"].jetstream()
        push = api.ConsumerConfig(
            durable_name="sneaky", deliver_subject="leak.here", ack_policy=api.AckPolicy.NONE
        )
        await refused_at_once(
            "executor", "create a consumer on RC_OUT",
            lambda: guarded(conns["executor"], lambda: js.add_consumer("RC_OUT", config=push)),
        )  # fmt: skip
        await refused_at_once(
            "producer", "publish rc.out.decision.r1", put("producer", "rc.out.decision.r1")
        )
        await refused_at_once(
            "producer", "publish rc.out.exec.incus-1.delete",
            put("producer", "rc.out.exec.incus-1.delete"),
        )  # fmt: skip
        await refused_at_once(
            "producer", "publish rc.in.host.incus-1.inventory",
            put("producer", "rc.in.host.incus-1.inventory"),
        )  # fmt: skip
        await refused_at_once(
            "replica", "publish rc.in.config.pool.p", put("replica-1", "rc.in.config.pool.p")
        )

        async def subscribe_exec() -> None:
            nc = conns["producer"]

            async def subscribe() -> None:
                await nc.subscribe("rc.out.exec.>")
                await nc.flush()
                await anyio.sleep(3)  # the refusal comes asynchronously

            await guarded(nc, subscribe, subjects=("rc.out.exec.>",))

        await refused_at_once("producer", "subscribe rc.out.exec.>", subscribe_exec)
    finally:
        for nc in conns.values():
            await nc.close()


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def strangers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Credentials of another deployment: another CA, other NKeys."""
    out = tmp_path_factory.mktemp("strangers")
    make_credentials(out)
    return out


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("good", None),
        ("wrong CA", "certificate is not trusted"),
        ("wrong host name", "IP address mismatch"),
        ("no client certificate", "refused our TLS client certificate"),
        ("client certificate of another CA", "refused our TLS client certificate"),
        ("wrong NKey", "refused our credentials"),
    ],
)
async def test_tls_and_credentials_fail_at_once_with_a_clear_error(
    cluster: Deployment, strangers: Path, case: str, expected: str | None
) -> None:
    port = cluster.nodes["nats-1"].client_port
    cases: dict[str, dict[str, Any]] = {
        "good": {},
        "wrong CA": {"tls_ca_file": str(strangers / "ca.pem")},
        "wrong host name": {"urls": (f"tls://127.0.0.2:{port}",)},
        "no client certificate": {"tls_cert_file": None, "tls_key_file": None},
        "client certificate of another CA": {
            "tls_cert_file": str(strangers / "producer.pem"),
            "tls_key_file": str(strangers / "producer-key.pem"),
        },
        "wrong NKey": {"nkey_seed_file": str(strangers / "producer.nk")},
    }
    opts: ConnectOptions = dataclasses.replace(cluster.options("producer"), **cases[case])
    started = time.monotonic()
    if expected is None:
        nc = await connect(opts)
        assert nc.is_connected
        await nc.close()
        return
    with pytest.raises(ConnectRefused, match=expected) as info:
        await connect(opts)
    took = time.monotonic() - started
    assert took < 3.0, took
    seed = (strangers / "producer.nk").read_text().strip()
    assert seed not in str(info.value)
