"""``reconciler credentials``: one command makes a deployment's credentials, NATS
accounts and Incus fleet file for named replicas and Incus hosts, adds one later without
touching what exists, rotates a user's NKey with an overlap, keeps private files private,
and refuses what it cannot use. The accounts it writes are what a real nats-server
loads: a replica added later runs after a reload, with its own least privilege."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import orjson
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.violations import PermissionViolation, guarded
from reconciler.cli.main import cli
from reconciler.deploy.accounts import permissions
from reconciler.deploy.credentials import public_key
from reconciler.deploy.fleet import Fleet
from reconciler.replica.replica import Replica, RunConfig, StartupError
from tests.support.bus import running_replica
from tests.support.cluster import BINARY, _free_ports

pytestmark = pytest.mark.timeout(90)

FLEET = ["--replica", "replica-1", "--replica", "replica-2", "--incus-host", "incus-1"]


def credentials(out: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["credentials", "--out", str(out), *args])
    return result.exit_code, result.output


def contents(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_one_command_makes_every_credential_of_a_named_fleet(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    code, text = credentials(out, *FLEET, "--san", "nats.example.net", "--san", "10.1.2.3")
    assert code == 0, text
    users = ("admin", "replica-1", "replica-2", "bridge", "executor", "producer")
    expected = {"ca.pem", "ca-key.pem", "accounts.conf", "fleet.json", "deployment.json"}
    for node in ("nats-1", "nats-2", "nats-3"):
        expected |= {f"{node}.pem", f"{node}-key.pem"}
    for user in users:
        expected |= {f"{user}.nk", f"{user}.pem", f"{user}-key.pem"}
    for user in ("replica-1", "replica-2", "bridge", "executor", "producer"):
        expected |= {f"{user}-incus.pem", f"{user}-incus-key.pem"}
    assert set(os.listdir(out)) == expected
    # private: the directory and every key and seed, from the start
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for path in out.iterdir():
        if path.name.endswith(("-key.pem", ".nk")):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # nothing secret is printed
    for user in users:
        assert (out / f"{user}.nk").read_text().strip() not in text
    assert "incus config trust add-certificate" in text and "bridge-incus.pem" in text
    # certificates: one CA; nodes serve and route; the rest are clients
    ca = cert(out / "ca.pem")
    node_cert = cert(out / "nats-1.pem")
    assert node_cert.issuer == ca.subject
    sans = node_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"nats-1", "localhost", "nats.example.net"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
    usage = node_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    for name in ("bridge", "bridge-incus", "replica-2-incus"):
        client = cert(out / f"{name}.pem")
        assert client.issuer == ca.subject
        usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # the Incus fleet file the bridge, the executor and the replicas read
    fleet = orjson.loads((out / "fleet.json").read_bytes())
    assert fleet == {
        "hosts": {
            "incus-1": {
                "url": "https://incus-1:8443",
                "verify": "/etc/reconciler/incus/incus-1.crt",
            }
        }
    }


def test_running_it_again_adds_a_replica_and_a_host_and_keeps_everything(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    assert credentials(out, *FLEET)[0] == 0
    before = contents(out)
    code, text = credentials(out)  # nothing named: the recorded fleet, complete
    assert code == 0 and "created: nothing (complete)" in text, text
    assert contents(out) == before
    code, text = credentials(
        out, "--replica", "replica-3", "--incus-host", "incus-2=https://10.0.0.2:8443"
    )
    assert code == 0, text
    after = contents(out)
    added = set(after) - set(before)
    assert added == {
        "replica-3.nk", "replica-3.pem", "replica-3-key.pem",
        "replica-3-incus.pem", "replica-3-incus-key.pem",
    }  # fmt: skip
    for name, data in before.items():
        if name not in ("accounts.conf", "fleet.json", "deployment.json"):
            assert after[name] == data, f"{name} changed"
    recorded = Fleet.recorded_in(out)
    assert recorded.replicas == ("replica-1", "replica-2", "replica-3")
    assert dict(recorded.incus_hosts) == {
        "incus-1": "https://incus-1:8443",
        "incus-2": "https://10.0.0.2:8443",
    }
    accounts = (out / "accounts.conf").read_text()
    for replica in ("replica-1", "replica-2", "replica-3"):
        assert public_key(out / f"{replica}.nk") in accounts
    assert "$JS.ACK.RC_OUT.executor-incus-2.>" in accounts
    assert "incus-2" in orjson.loads((out / "fleet.json").read_bytes())["hosts"]


def test_each_user_may_use_only_its_own_consumers() -> None:
    fleet = Fleet().merged(replicas=["r1", "r2"], incus_hosts={"h1": "", "h2": ""})
    perms = permissions(fleet)
    assert list(perms) == ["admin", "r1", "r2", "bridge", "executor", "producer"]
    r1 = " ".join(perms["r1"].publish)
    assert "RC_IN-r1" in r1 and "RC_IN-r2" not in r1
    # the leader's own commands: top-ups, expiries, and the queue's timeouts
    assert {"rc.in.cmd.admit", "rc.in.cmd.release", "rc.in.cmd.queue-timeout"} <= set(
        perms["r1"].publish
    )
    assert perms["r1"].subscribe == ("_INBOX.r1.>", "rc.query.* rc-query")
    assert perms["r1"].allow_responses and not perms["producer"].allow_responses
    executor = perms["executor"].publish
    assert "$JS.API.CONSUMER.MSG.NEXT.RC_OUT.executor-h2" in executor
    assert not any("CREATE" in s for s in executor)
    # the executor reports its hosts' failures, and publishes nothing else on the bus
    assert [s for s in executor if s.startswith(("rc.in.", "rc.out."))] == [
        f"rc.in.host.{host}.failure" for host in sorted(fleet.incus_hosts)
    ]
    # a producer sends commands, but not the operators' (config, host lifecycle)
    producer = perms["producer"].publish
    assert "rc.in.cmd.admit" in producer and "rc.in.host.*.failure" in producer
    assert not any(s in producer for s in ("rc.in.cmd.>", "rc.in.cmd.apply-config"))
    assert "rc.in.cmd.drain" not in producer
    # another prefix renames every subject, stream and consumer
    other = permissions(dataclasses.replace(fleet, prefix="ci"))
    assert "$JS.ACK.CI_IN.CI_IN-r1.>" in other["r1"].publish
    assert "ci.in.cmd.claim-warm" in other["producer"].publish


def test_a_rotation_keeps_the_previous_nkey_accepted_until_it_is_retired(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    assert credentials(out, *FLEET)[0] == 0
    old_key = public_key(out / "bridge.nk")
    old_cert = (out / "bridge.pem").read_bytes()
    untouched = (out / "producer.nk").read_bytes()
    code, text = credentials(out, "--rotate", "bridge")
    assert code == 0 and "rotated bridge" in text, text
    new_key = public_key(out / "bridge.nk")
    assert new_key != old_key and (out / "bridge.pem").read_bytes() != old_cert
    assert stat.S_IMODE((out / "bridge.nk").stat().st_mode) == 0o600
    accounts = (out / "accounts.conf").read_text()
    assert old_key in accounts and new_key in accounts
    assert (out / "producer.nk").read_bytes() == untouched
    code, text = credentials(out, "--rotate", "bridge")
    assert code == 1 and "--retire bridge" in text
    code, text = credentials(out, "--retire", "bridge")
    assert code == 0, text
    accounts = (out / "accounts.conf").read_text()
    assert old_key not in accounts and new_key in accounts
    assert not (out / "bridge.nk.previous").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--replica", "bad.name", "--incus-host", "h"], "replica name 'bad.name' must be"),
        (["--replica", "bridge", "--incus-host", "h"], "'bridge' is already a component name"),
        (["--replica", "r", "--incus-host", "h=http://h:8443"], "is not an https:// endpoint"),
        (["--replica", "r"], "name at least one Incus host"),
        (["--incus-host", "h"], "name at least one replica"),
        (["--replica", "r", "--incus-host", "h", "--prefix", "a.b"], "prefix must be"),
    ],
)
def test_a_name_it_cannot_use_is_refused_and_nothing_is_written(
    tmp_path: Path, args: list[str], says: str
) -> None:
    out = tmp_path / "secrets"
    code, text = credentials(out, *args)
    assert code == 1, text
    assert says in text and text.startswith("Error: ") and len(text.splitlines()) == 1
    assert not out.exists()


def test_a_directory_serves_one_prefix(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    assert credentials(out, *FLEET)[0] == 0
    code, text = credentials(out, "--prefix", "ci")
    assert code == 1 and "prefix is 'rc'" in text


# ------------------------------------------------------------- a real nats-server


@dataclasses.dataclass
class Served:
    out: Path
    url: str
    process: subprocess.Popen[bytes]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """One nats-server with TLS, JetStream and the accounts of a fresh credentials
    directory (``secrets/`` beside its configuration, which includes them relatively)."""
    if not Path(BINARY).exists():
        pytest.skip("no nats-server binary")
    out = tmp_path / "secrets"
    assert credentials(out, *FLEET)[0] == 0
    port = _free_ports(1)[0]
    conf = tmp_path / "server.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "store"}" }}\n'
        f'tls {{ cert_file: "{out / "nats-1.pem"}", key_file: "{out / "nats-1-key.pem"}",'
        f' ca_file: "{out / "ca.pem"}", verify: true }}\n'
        'include "secrets/accounts.conf"\n'
    )
    checked = subprocess.run([BINARY, "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    log = tmp_path / "nats.log"
    process = subprocess.Popen([BINARY, "-c", str(conf), "-l", str(log)])
    try:
        deadline = time.monotonic() + 10
        while "Server is ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else ""
            time.sleep(0.05)
        yield Served(out=out, url=f"tls://localhost:{port}", process=process)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(10)


def _options(served: Served, user: str) -> ConnectOptions:
    out = served.out
    return ConnectOptions(
        urls=(served.url,),
        nkey_seed_file=str(out / f"{user}.nk"),
        tls_ca_file=str(out / "ca.pem"),
        tls_cert_file=str(out / f"{user}.pem"),
        tls_key_file=str(out / f"{user}-key.pem"),
        inbox_prefix=f"_INBOX.{user}",
        name=user,
        connect_timeout_s=2.0,
        initial_timeout_s=10.0,
    )


async def test_a_replica_added_later_runs_after_a_reload_with_its_own_permissions(
    served: Served, tmp_path: Path
) -> None:
    out = served.out
    done = await anyio.to_thread.run_sync(
        CliRunner().invoke,
        cli,
        ["provision", "--nats-url", served.url, "--nats-nkey", str(out / "admin.nk"),
         "--tls-ca", str(out / "ca.pem"), "--tls-cert", str(out / "admin.pem"),
         "--tls-key", str(out / "admin-key.pem"), "--inbox-prefix", "_INBOX.admin"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output

    def config(user: str, *, as_user: str | None = None) -> RunConfig:
        nats = _options(served, as_user or user)
        return RunConfig(nats=nats, db=tmp_path / f"{user}.db", replica=user)

    # before it is named, replica-3 has no user: with replica-1's it may not use its consumer
    with anyio.fail_after(20), pytest.raises(StartupError, match="RC_IN-replica-3"):
        await Replica(config("replica-3", as_user="replica-1")).run(stop=anyio.Event())
    assert (await anyio.to_thread.run_sync(credentials, out, "--replica", "replica-3"))[0] == 0
    served.process.send_signal(signal.SIGHUP)  # nats-server reloads its configuration
    await anyio.sleep(1.0)
    async with running_replica(config("replica-3")) as replica:
        assert replica.leader_ready
        # its own least privilege: not replica-1's consumer
        nc = await connect(_options(served, "replica-3"))
        try:
            js = nc.jetstream()
            with anyio.fail_after(5), pytest.raises(PermissionViolation):
                await guarded(nc, lambda: js.consumer_info("RC_IN", "RC_IN-replica-1"))
        finally:
            await nc.close()
