"""The documented deployment, run for real under systemd (docs/operations.md, "systemd on
bare hosts"; :mod:`tests.support.systemd_deployment`): three NATS nodes with TLS and a user per
component, two replicas, the bridge and the executor from the project's own units in
Debian 12 system containers, installed from the release built from this checkout, the
bridge and the executor reaching the host's Incus over HTTPS with the client
certificates ``reconciler credentials`` made, and the GARM provider called from its own
container as GARM calls it.

Then a command is decided end to end (GARM's ``CreateInstance`` claims the warm container
that the leader asked for and the executor created), and under a steady command load
the node that leads the streams is stopped, then the leading replica's container, then
both are started again: every input on the stream exactly once, every command decided,
no output twice, and, once the bridge is stopped (nothing else writes to the input
stream) and the replicas have caught up and stopped, both replicas' stores equal to a
replay (where they differ is printed if not). Each step's time and the failover figures
are printed."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import orjson
import pytest
from click.testing import CliRunner
from nats.aio.client import Client

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.sending import publish
from reconciler.cli.main import cli
from reconciler.core.state import State
from reconciler.demo.local_incus import start_local_incus
from reconciler.replay.replay import ReplayReport, replay_into
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support import debian_image, realincus
from tests.support import release as rel
from tests.support import systemd_deployment as sd
from tests.support.bus import BusClient, leader_holder, stream_messages
from tests.support.cluster import BINARY
from tests.support.garm import CONTROLLER, GARM_POOL, bootstrap
from tests.support.state_diff import differences
from tests.support.workload import mixed, publish_steadily

#: one site for both tests, built once: one worker runs them (see scripts/test)
pytestmark = [
    pytest.mark.real_incus,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.xdist_group("deployment-systemd"),
]

#: the figures of the module's tests, printed by the last one
REPORT: list[str] = []


def _unavailable() -> str | None:
    return realincus.unavailable() or debian_image.unavailable()


@pytest.fixture(scope="module")
def site(
    real_incus_daemon: realincus.RealIncus, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sd.Site]:
    reason = _unavailable()
    if reason is not None:
        if realincus.required():
            pytest.fail(f"{realincus.REQUIRE_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("systemd")
    managed = real_incus_daemon
    ports = sd.Ports.allocate()
    timings: dict[str, float] = {}
    started = time.monotonic()
    image = debian_image.image()
    timings["image (debootstrap; cached between runs)"] = time.monotonic() - started
    if image.built_in_s:
        REPORT.append(f"the image was built in this run: {image.built_in_s:.1f} s")
    started = time.monotonic()
    release, wheelhouse = rel.release(), rel.wheelhouse()
    timings["release and its dependencies' wheels"] = time.monotonic() - started
    secrets = work / "secrets"
    done = CliRunner().invoke(
        cli,
        ["credentials", "--out", str(secrets), "--replica", sd.REPLICAS[0],
         "--replica", sd.REPLICAS[1],
         "--incus-host", f"{sd.INCUS_HOST}=https://127.0.0.1:{sd.INCUS_PORT}"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    inputs = sd.Inputs(
        secrets=secrets,
        wheel=release.wheel,
        sdist=release.sdist,
        wheelhouse=wheelhouse,
        nats_server=Path(BINARY),
        incus_server_cert=managed.directory / "server.crt",
    )
    with contextlib.ExitStack() as stack:
        # the managed Incus host, as the docs' "Incus hosts" say (on a loopback port)
        managed.incus("config", "set", "core.https_address", f"127.0.0.1:{ports.incus}")
        stack.callback(managed.incus, "config", "unset", "core.https_address", check=False)
        trusted: list[str] = []
        stack.callback(_untrust, managed, trusted)
        for user in (*sd.REPLICAS, "bridge", "executor", "producer"):
            managed.incus(
                "config", "trust", "add-certificate", str(secrets / f"{user}-incus.pem"),
                "--name", f"reconciler-{user}",
            )  # fmt: skip
            trusted.append(f"reconciler-{user}")
        stack.callback(managed.clean)
        started = time.monotonic()
        daemon = stack.enter_context(start_local_incus(test_image=False))
        timings["a private Incus for the machines"] = time.monotonic() - started
        site = sd.Site(daemon=daemon, ports=ports, work=work, timings=timings)
        stack.callback(site.destroy)
        site.timed(
            "import the image",
            lambda: site.incus("image", "import", str(image.tarball), "--alias", sd.IMAGE_ALIAS),
        )
        sd.deploy(site, inputs)
        yield site


def _untrust(managed: realincus.RealIncus, names: list[str]) -> None:
    found = orjson.loads(managed.incus("config", "trust", "list", "--format", "json"))
    for entry in found:
        if entry.get("name") in names:
            managed.incus("config", "trust", "remove", entry["fingerprint"], check=False)


def admin_options(site: sd.Site) -> ConnectOptions:
    secrets = site.work / "secrets"
    return ConnectOptions(
        urls=tuple(site.ports.nats_urls.split(",")),
        nkey_seed_file=str(secrets / "admin.nk"),
        tls_ca_file=str(secrets / "ca.pem"),
        tls_cert_file=str(secrets / "admin.pem"),
        tls_key_file=str(secrets / "admin-key.pem"),
        inbox_prefix="_INBOX.admin",
        name="test-admin",
        reconnect_wait_s=0.2,
        connect_timeout_s=2.0,
        initial_timeout_s=30.0,
    )


def metric(site: sd.Site, replica: str, name: str) -> float | None:
    """A replica's gauge from its /metrics (through its forwarded port), or None."""
    import urllib.request

    url = f"http://127.0.0.1:{site.ports.metrics[replica]}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def until(what: str, check, within_s: float, diagnose=lambda: "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s\n{diagnose()}")
        await anyio.sleep(0.3)


def journals(site: sd.Site) -> str:
    parts = [site.journal(r, f"reconciler@{r}", 25) for r in sd.REPLICAS]
    parts += [site.journal(sd.EDGE, u, 25) for u in ("reconciler-bridge", "reconciler-executor")]
    return "\n".join(parts)


def provider(site: sd.Site, command: str, stdin: bytes = b"", **env: str) -> tuple[int, str]:
    """``reconciler-garm-provider`` on GARM's host, as GARM runs it: an environment of
    the ``GARM_*`` variables only, the bootstrap on stdin."""
    variables = {
        "GARM_COMMAND": command,
        "GARM_CONTROLLER_ID": CONTROLLER,
        "GARM_PROVIDER_CONFIG_FILE": sd.GARM_CONFIG,
        "GARM_INTERFACE_VERSION": "v0.1.0",
        **env,
    }
    args = " ".join(f"{k}={v}" for k, v in variables.items())
    try:
        out = site.sh(
            sd.GARM, f"exec env -i {args} /opt/reconciler/bin/reconciler-garm-provider",
            input=stdin, timeout=180,
        )  # fmt: skip
        return 0, out
    except RuntimeError as exc:
        return 1, str(exc)


async def test_a_command_is_decided_end_to_end(
    site: sd.Site, real_incus_daemon: realincus.RealIncus
) -> None:
    """The leader asks for a warm container, the executor creates it on the Incus host
    over HTTPS, the bridge reports it ready, and GARM's CreateInstance claims it."""
    managed = real_incus_daemon
    nc = await connect(admin_options(site))
    bus = BusClient(nc)
    started = time.monotonic()
    try:
        for stream in ("RC_IN", "RC_OUT"):  # provisioned by reconciler-provision
            assert (await nc.jetstream().stream_info(stream)).config.num_replicas == 3
        kind, pool = b.pool(
            "ci-small", cpu=1, memory_mib=128, disk_gib=1, min_ready=1, max_ready=1,
            instance_type="container",
        )  # fmt: skip
        pool["image"] = managed.image
        await publish(nc.jetstream(), b.subject_of((kind, pool)), orjson.dumps(pool))

        async def warm_ready() -> bool:
            result = await bus.result("pool", {"pool": "ci-small"})
            return any(lease["state"] == "ready" for lease in result["leases"])

        await until("a warm container is ready", warm_ready, 120, lambda: journals(site))
        ready_at = time.monotonic()
        (warm,) = [str(i["name"]) for i in managed.instances()]
        # the bridge forwarded its lifecycle events from the event stream (wss, pinned)
        last = await nc.jetstream().get_last_msg("RC_IN", f"rc.in.host.{sd.INCUS_HOST}.lifecycle")
        assert warm in (last.data or b"").decode(), last.data
        body = orjson.dumps(bootstrap("garm-systemd-1", "small", pool_id=GARM_POOL))
        code, out = await anyio.to_thread.run_sync(
            lambda: provider(site, "CreateInstance", body, GARM_POOL_ID=GARM_POOL)
        )
        assert code == 0, out
        created = orjson.loads(out)
        assert created["provider_id"] == warm and created["name"] == "garm-systemd-1", created
        decided_at = time.monotonic()
        code, out = await anyio.to_thread.run_sync(
            lambda: provider(site, "DeleteInstance", GARM_INSTANCE_ID="garm-systemd-1")
        )
        assert code == 0, out
        await until(
            "the claimed container is deleted",
            lambda: anyio.to_thread.run_sync(
                lambda: warm not in {str(i["name"]) for i in managed.instances()}
            ),
            60,
        )
    finally:
        await nc.close()
    REPORT.append(
        f"end to end: pool applied -> warm container created by the executor and ready "
        f"{ready_at - started:.1f} s; GARM CreateInstance claimed it in "
        f"{decided_at - ready_at:.1f} s; DeleteInstance removed it"
    )


async def explain_digests(
    nc: Client, site: sd.Site, *, head: int, report: ReplayReport, states: dict[str, State]
) -> list[str]:
    """Why the stores' digests are not the replay's: the replay's range against the
    stores' positions, the inputs after ``head`` if any, and where each store differs
    from a second replay's, folded into a store of its own and loaded (the first folds in
    memory)."""
    lines = [
        f"replayed up to seq {report.last_seq} (RC_IN's end when the replicas stopped: "
        f"{head}); stores at "
        + ", ".join(f"{r} {state.applied_seq}" for r, state in states.items())
    ]
    if report.last_seq > head:
        for seq in range(head + 1, min(report.last_seq, head + 10) + 1):
            msg = await nc.jetstream().get_msg("RC_IN", seq=seq)
            lines.append(f"  input {seq} after the stores' end: {msg.subject} at {msg.time}")
    again = site.work / f"replay-{time.monotonic_ns()}.db"
    second = await replay_into(nc, prefix="rc", db=again)
    async with await Store.open(again) as store:
        replayed = await store.load_state()
    lines.append(
        f"a second replay (into {again.name}): up to seq {second.last_seq}, digest "
        f"{'equal to' if second.digest == report.digest else 'NOT'} the first's"
    )
    for r, state in states.items():
        differ = differences(replayed, state, names=("replay", r))
        lines.append(f"{r} against that replay: " + ("differs" if differ else "equal"))
        lines.extend(differ)
    return lines


COMMANDS = 900
RATE = 40  # inputs a second (commands and the lifecycle events between them)
CALM_S = 1.5


async def test_stopping_the_stream_leader_node_and_the_leading_replica_loses_nothing(
    site: sd.Site,
) -> None:
    nc = await connect(admin_options(site))
    js = nc.jetstream()
    bus = BusClient(nc)
    load = mixed(COMMANDS, seed=23)
    for i, (kind, payload) in enumerate(load.setup):
        await publish(js, b.subject_of((kind, payload)), orjson.dumps(payload), msg_id=f"s{i}")
    sent_ids: list[str] = []
    events: list[tuple[str, float]] = []

    async def produce() -> None:
        await publish_steadily(js, load.items, per_second=RATE, sent=sent_ids, retry_for_s=90)

    async def stop(machine: str, why: str) -> None:
        await anyio.to_thread.run_sync(lambda: site.incus("stop", "--force", machine))
        events.append((f"stopped {machine} ({why}) at {len(sent_ids)} inputs sent", time.time()))

    async def start(machine: str) -> None:
        await anyio.to_thread.run_sync(lambda: site.incus("start", machine))
        events.append((f"started {machine}", time.time()))

    async def sent_at_least(n: int) -> None:
        with anyio.fail_after(120):
            while len(sent_ids) < n:  # noqa: ASYNC110 - a counter
                await anyio.sleep(0.1)

    started = time.monotonic()
    load_began = time.time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        await sent_at_least(len(load.items) // 5)
        info = await js.stream_info("RC_IN")
        assert info.cluster is not None and info.cluster.leader in sd.NODES, info.cluster
        node: str = info.cluster.leader
        await stop(node, "the RC_IN stream leader")
        await sent_at_least(len(load.items) * 9 // 20)
        replica = await leader_holder(js)
        assert replica in sd.REPLICAS, replica
        await stop(replica, "the leading replica")
        await sent_at_least(len(load.items) * 7 // 10)
        await start(node)
        await start(replica)
    load_s = time.monotonic() - started

    # back: the node in the cluster, the replica ready and caught up
    await anyio.to_thread.run_sync(
        lambda: site.wait_http(
            # a node stopped hard rejoins once it is current with the meta leader again:
            # seconds when the machine is quiet, over 90 s seen under load (one of
            # ten runs); whether anything was lost is what the test asserts below
            f"http://127.0.0.1:{site.ports.monitor[node]}/healthz", what=node, within_s=240,
            diagnose=lambda: site.journal(node, "reconciler-nats"),
        )
    )  # fmt: skip
    await anyio.to_thread.run_sync(
        lambda: site.wait_http(
            f"http://127.0.0.1:{site.ports.metrics[replica]}/readyz", what=replica,
            within_s=120, diagnose=lambda: site.journal(replica, f"reconciler@{replica}"),
        )
    )  # fmt: skip
    # the bridge is stopped first: it publishes an inventory of the Incus host every
    # --resync-interval (30 s) whatever happens, and one stored after the replicas'
    # stores were taken would be folded by the replay alone (a later position and host
    # revision, so another digest, with no decision differing)
    await anyio.to_thread.run_sync(lambda: site.sh(sd.EDGE, "systemctl stop reconciler-bridge"))
    settle_started = time.monotonic()
    head = 0
    with anyio.fail_after(240):
        while True:
            head = (await js.stream_info("RC_IN")).state.last_seq
            applied = [metric(site, r, "rc_applied_seq") or 0 for r in sd.REPLICAS]
            if min(applied) >= head:
                await bus.wait_caught_up(within_s=60)
                await anyio.sleep(CALM_S)
                if (await js.stream_info("RC_IN")).state.last_seq == head:
                    break
            await anyio.sleep(0.3)
    settle_s = time.monotonic() - settle_started
    # stop the replicas as systemd does (SIGTERM: the batch in hand committed), and
    # take their stores out of the containers
    stores: dict[str, Path] = {}

    def take_store(r: str) -> Path:
        site.sh(r, f"systemctl stop reconciler@{r}")
        local = site.work / f"{r}.db"
        site.incus("file", "pull", f"{r}/var/lib/reconciler/{r}/reconciler.db", str(local))
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(RuntimeError):
                site.incus(
                    "file", "pull", f"{r}/var/lib/reconciler/{r}/reconciler.db{suffix}",
                    str(local) + suffix,
                )  # fmt: skip
        return local

    stores = await anyio.to_thread.run_sync(lambda: site.parallel(take_store, sd.REPLICAS))
    end = (await js.stream_info("RC_IN")).state.last_seq
    assert end == head, f"RC_IN went from {head} to {end} while the replicas stopped"

    # every input the load sent is on RC_IN exactly once
    inputs = Counter(m.msg_id for m in await stream_messages(js, "RC_IN", "rc.in.>") if m.msg_id)
    lost = [i for i in sent_ids if inputs[i] == 0]
    doubled_in = [i for i in sent_ids if inputs[i] > 1]
    out = await stream_messages(js, "RC_OUT", "rc.out.>")
    ids = [m.msg_id for m in out if m.msg_id]
    doubles = [i for i, n in Counter(ids).items() if n > 1]
    decided = {m.subject.rsplit(".", 1)[1] for m in out if ".decision." in m.subject}
    undecided = set(load.commands) - decided
    # how long decisions stopped around each stop: from the last decision before it to
    # the first after it (RC_OUT's own timestamps), within the load
    stamps = sorted(m.at for m in out if ".decision." in m.subject and m.at >= load_began)
    stopped_for = []
    for what, at in events:
        if what.startswith("stopped"):
            before = max((t for t in stamps if t <= at), default=at)
            after = min((t for t in stamps if t > at), default=at)
            stopped_for.append(f"{what.split(' at ')[0]}: {after - before:.1f} s")
    longest = max((b2 - a for a, b2 in itertools.pairwise(stamps)), default=0.0)
    report = await replay_into(nc, prefix="rc")
    states: dict[str, State] = {}
    for r, db in stores.items():
        async with await Store.open(db) as store:
            states[r] = await store.load_state()
    digests = {r: state_digest(state) for r, state in states.items()}
    # on a difference, the rows that differ, printed and in the assertions' messages
    explained: list[str] = []
    if report.last_seq != head or set(digests.values()) != {report.digest}:
        explained = await explain_digests(nc, site, head=head, report=report, states=states)
    await nc.close()
    REPORT.extend([
        f"failover: {len(load.commands)} commands ({len(sent_ids)} inputs) at ~{RATE} "
        f"inputs/s over {load_s:.1f} s; " + "; ".join(what for what, _ in events),
        f"decisions stopped for: {'; '.join(stopped_for)} (longest stretch without a "
        f"decision during the load: {longest:.1f} s)",
        f"inputs lost {len(lost)}, doubled {len(doubled_in)}; outputs {len(out)}, doubled "
        f"{len(doubles)}; commands undecided {len(undecided)}",
        f"settled {settle_s:.1f} s after both were back; replay divergences "
        f"{len(report.divergences)}; stores equal to the replay: "
        + ", ".join(f"{r} {digests[r] == report.digest}" for r in sd.REPLICAS),
    ])  # fmt: skip
    print("\n" + "\n".join(f"{k}: {v:.1f} s" for k, v in site.timings.items()))
    print("\n".join(REPORT))
    if explained:
        print("\n".join(explained))
    crashes = {
        r: site.journal(r, f"reconciler@{r}", 100000).count("Traceback") for r in sd.REPLICAS
    }
    assert crashes == dict.fromkeys(sd.REPLICAS, 0), journals(site)
    assert lost == [] and doubled_in == []
    assert doubles == []
    assert undecided == set()
    assert report.divergences == []
    assert report.last_seq == head, "\n".join(explained)
    assert set(digests.values()) == {report.digest}, "\n".join(explained)
