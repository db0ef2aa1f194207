"""Options a secured deployment needs (CONTRACT.md, "Security and deployment options"):
private database files, secrets from files, messages sized before sending, publishes
retried through a missing stream with the same Nats-Msg-Id, and permission violations
reported as typed errors."""

from __future__ import annotations

import stat
from pathlib import Path

import anyio
import click
import pytest
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError

from reconciler.bus.sending import PayloadTooLarge, encoded_size, publish
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.bus.violations import PermissionViolation, ViolationWatch, parse_violation
from reconciler.cli.options import read_secret
from reconciler.executor.store import ExecutorStore
from reconciler.store.sqlite import Store


@pytest.mark.parametrize("writer_process", [False, True])
async def test_a_new_store_is_private_to_its_owner(tmp_path: Path, writer_process: bool) -> None:
    db = tmp_path / "rc.db"
    async with await Store.open(db, writer_process=writer_process) as store:
        await store.mark_published_through(0)
    files = list(tmp_path.iterdir())  # noqa: ASYNC240 - a test's own directory
    assert files  # the database (and its WAL, shared memory and writer lock)
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


async def test_a_new_executor_database_is_private(tmp_path: Path) -> None:
    db = tmp_path / "exec.db"
    store = await ExecutorStore.open(db)
    await store.close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o600


def test_a_secret_file_gives_its_first_line_and_errors_never_show_it(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret-Value\n")
    assert read_secret(secret, option="--nats-password-file") == "s3cret-Value"
    secret.write_text("")
    with pytest.raises(click.BadParameter, match="is empty"):
        read_secret(secret, option="--nats-password-file")
    secret.write_bytes(b"\xff\xfes3cret")
    with pytest.raises(click.BadParameter) as info:
        read_secret(secret, option="--nats-password-file")
    assert "s3cret" not in str(info.value)


def test_violations_are_recognised_in_nats_py_errors() -> None:
    found = parse_violation('nats: permissions violation for publish to "rc.in.cmd.admit"')
    assert found is not None
    assert (found.operation, found.subject) == ("publish", "rc.in.cmd.admit")
    assert "rc.in.cmd.admit" in str(found) and "publish permission" in str(found)
    sub = parse_violation("nats: Permissions Violation for Subscription to _INBOX.x.>")
    assert sub is not None and (sub.operation, sub.subject) == ("subscribe", "_INBOX.x.>")
    assert parse_violation("nats: stale connection") is None
    watch = ViolationWatch()
    assert watch.record("nats: slow consumer") is None and watch.count == 0
    recorded = watch.record('nats: permissions violation for publish to "rc.out.x"')
    assert isinstance(recorded, PermissionViolation) and watch.count == 1


def test_headers_count_against_max_payload() -> None:
    assert encoded_size(b"x" * 10, None) == 10
    # NATS/1.0\r\n + "Nats-Msg-Id: a\r\n" + \r\n + payload
    assert encoded_size(b"x" * 10, {"Nats-Msg-Id": "a"}) == 10 + 16 + 12


async def test_a_message_over_max_payload_is_refused_before_sending(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, StreamNames.for_prefix("rc"))
    limit = nc.max_payload
    headers_size = encoded_size(b"", {"Nats-Msg-Id": "big"})
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        # the payload alone fits (nats-py would send it); with the header it does not
        await publish(js, "rc.in.cmd.admit", b"x" * (limit - headers_size + 1), msg_id="big")
    assert nc.is_connected
    ack = await publish(js, "rc.in.cmd.admit", b"x" * (limit - headers_size), msg_id="big")
    assert ack.seq == 1 and not ack.duplicate


async def test_a_publish_waits_for_its_stream_and_keeps_its_msg_id(nc: Client) -> None:
    js = nc.jetstream()
    names = StreamNames.for_prefix("late")
    with pytest.raises(NoStreamResponseError):
        await publish(js, "late.in.cmd.admit", b"{}", msg_id="once", retry_for_s=0.2)
    async with anyio.create_task_group() as tg:
        first: list[int] = []

        async def send() -> None:
            first.append((await publish(js, "late.in.cmd.admit", b"{}", msg_id="once")).seq)

        tg.start_soon(send)
        await anyio.sleep(0.5)  # retrying: no stream yet
        assert not first
        await ensure_streams(js, names)
    again = await publish(js, "late.in.cmd.admit", b"{}", msg_id="once")
    assert again.duplicate and again.seq == first[0]
    assert (await js.stream_info(names.in_stream)).state.messages == 1


def test_make_credentials_keeps_keys_private_and_is_idempotent(tmp_path: Path) -> None:
    from cryptography import x509

    from tests.support.cluster import make_credentials

    out = tmp_path / "secrets"
    make_credentials(out)
    ca = (out / "ca.pem").read_bytes()
    seed = (out / "replica.nk").read_bytes()
    for path in out.iterdir():
        private = path.name.endswith(("-key.pem", ".nk"))
        assert (stat.S_IMODE(path.stat().st_mode) & 0o077 == 0) or not private, path
    node = x509.load_pem_x509_certificate((out / "nats-1.pem").read_bytes())
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"nats-1", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    make_credentials(out)  # again: what exists is kept
    assert (out / "ca.pem").read_bytes() == ca and (out / "replica.nk").read_bytes() == seed
    public = seed.decode().strip()
    assert public not in (out / "nkeys.conf").read_text()  # public keys only
    assert "REPLICA_NKEY" in (out / "nkeys.conf").read_text()


def test_provision_creates_streams_bucket_and_executor_consumers(nats_url: str) -> None:
    from click.testing import CliRunner

    from reconciler.cli.main import cli

    args = ["provision", "--nats-url", nats_url, "--executor-host", "h1", "--leader-ttl", "5"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert "executor-h1: created" in first.output
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0 and "executor-h1: exists" in again.output

    async def check() -> None:
        from reconciler.bus.connection import ConnectOptions, connect

        nc = await connect(ConnectOptions(urls=(nats_url,)))
        try:
            js = nc.jetstream()
            info = await js.consumer_info("RC_OUT", "executor-h1")
            assert info.config.filter_subject == "rc.out.exec.h1.>"
            assert info.config.deliver_policy is not None
            assert (await js.stream_info("KV_rc_leader")).config.max_age == 5.0
        finally:
            await nc.close()

    anyio.run(check)


def test_connect_options_never_show_the_password_in_their_repr() -> None:
    from reconciler.bus.connection import ConnectOptions

    opts = ConnectOptions(user="bridge", password="s3cret-hunter2")
    assert "s3cret-hunter2" not in repr(opts) and "bridge" in repr(opts)
