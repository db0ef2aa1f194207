"""Streams and bucket of CONTRACT.md ("Streams") (reconciler.bus.streams).

Run against the real nats-server of the ``nats_server`` fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable

import nats
import pytest
from nats.aio.client import Client
from nats.js import api
from structlog.testing import capture_logs

from reconciler.bus.streams import StreamNames, ensure_streams
from tests.support.natsserver import NatsServer, expect_reconnect

DAY = 24 * 3600.0

# ---------------------------------------------------------------------------- helpers


@pytest.fixture
async def prefix_for(
    nats_server: NatsServer, nc: Client
) -> AsyncIterator[Callable[[str], StreamNames]]:
    """Names for a prefix; unique (and deleted afterwards) on a shared external server."""
    made: list[StreamNames] = []

    def names(prefix: str) -> StreamNames:
        if nats_server.shared:
            prefix = f"{prefix}{secrets.token_hex(4)}"
        made.append(StreamNames.for_prefix(prefix))
        return made[-1]

    yield names
    if nats_server.shared:
        js = nc.jetstream()
        for n in made:
            for stream in (n.in_stream, n.out_stream, n.leader_stream):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(stream)


# ---------------------------------------------------------------------------- names


def test_names_for_the_default_prefix() -> None:
    names = StreamNames.for_prefix("rc")
    assert (names.in_stream, names.in_subjects) == ("RC_IN", "rc.in.>")
    assert (names.out_stream, names.out_subjects) == ("RC_OUT", "rc.out.>")
    assert (names.leader_bucket, names.leader_stream) == ("rc_leader", "KV_rc_leader")
    assert StreamNames.for_prefix() == names


def test_names_for_another_prefix() -> None:
    names = StreamNames.for_prefix("p")
    assert (names.in_stream, names.out_stream, names.leader_bucket) == ("P_IN", "P_OUT", "p_leader")
    assert (names.in_subjects, names.out_subjects) == ("p.in.>", "p.out.>")


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a>", "*", "x" * 129])
def test_a_prefix_must_be_one_subject_token(bad: str) -> None:
    with pytest.raises(ValueError):
        StreamNames.for_prefix(bad)


async def test_a_duplicate_window_longer_than_max_age_is_refused(nc: Client) -> None:
    with pytest.raises(ValueError):
        await ensure_streams(
            nc.jetstream(), StreamNames.for_prefix("rc"), max_age_s=60, duplicate_window_s=600
        )


# ---------------------------------------------------------------------------- creation


async def test_streams_and_bucket_are_created_as_the_contract_says(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    with capture_logs() as logs:
        await ensure_streams(js, names)
    assert {e["event"] for e in logs} == {"stream.created", "bucket.created"}

    rc_in = (await js.stream_info(names.in_stream)).config
    assert rc_in.subjects == [names.in_subjects]
    assert rc_in.storage == api.StorageType.FILE
    assert rc_in.retention == api.RetentionPolicy.LIMITS
    assert rc_in.max_age == 30 * DAY
    assert rc_in.duplicate_window == 600
    assert rc_in.deny_delete is True

    rc_out = (await js.stream_info(names.out_stream)).config
    assert rc_out.subjects == [names.out_subjects]
    assert rc_out.storage == api.StorageType.FILE
    assert rc_out.duplicate_window == 600

    leader = (await js.stream_info(names.leader_stream)).config
    assert leader.max_age == 10
    assert leader.max_msgs_per_subject == 1
    assert leader.storage == api.StorageType.FILE
    kv = await js.key_value(names.leader_bucket)
    revision = await kv.create("leader", b"replica-1")
    assert (await kv.get("leader")).revision == revision


async def test_ensure_streams_is_idempotent(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await ensure_streams(js, names)
    await js.publish(f"{names.prefix}.in.x", b"{}")
    before = [(await js.stream_info(s)).config for s in (names.in_stream, names.leader_stream)]
    with capture_logs() as logs:
        await ensure_streams(js, names)
        await ensure_streams(js, names)
    assert logs == []
    after = [(await js.stream_info(s)).config for s in (names.in_stream, names.leader_stream)]
    assert after == before
    assert (await js.stream_info(names.in_stream)).state.messages == 1


async def test_concurrent_start_ups_all_succeed(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await asyncio.gather(*(ensure_streams(js, names) for _ in range(4)))
    assert (await js.stream_info(names.in_stream)).config.deny_delete is True


async def test_prefix_variant(
    nats_server: NatsServer, nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("p")
    js = nc.jetstream()
    await ensure_streams(js, names, leader_ttl_s=3)
    ack = await js.publish(f"{names.prefix}.in.host.h1.snapshot", b"{}")
    assert ack.stream == names.in_stream
    ack = await js.publish(f"{names.prefix}.out.decision.r1", b"{}")
    assert ack.stream == names.out_stream
    assert (await js.stream_info(names.leader_stream)).config.max_age == 3
    if not nats_server.shared:
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info("RC_IN")


# ---------------------------------------------------------------------------- reconciling


async def test_changed_settings_are_updated_and_logged_and_others_kept(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await ensure_streams(js, names, max_age_s=DAY, duplicate_window_s=60, leader_ttl_s=5)
    # An operator's own limit, which ensure_streams does not manage:
    current = (await js.stream_info(names.in_stream)).config
    await js.update_stream(current.evolve(max_bytes=1 << 30))

    with capture_logs() as logs:
        await ensure_streams(js, names)
    updated = {e["stream"] for e in logs if e["event"] == "stream.updated"}
    assert updated == {names.in_stream, names.out_stream, names.leader_stream}

    rc_in = (await js.stream_info(names.in_stream)).config
    assert (rc_in.max_age, rc_in.duplicate_window) == (30 * DAY, 600)
    assert rc_in.max_bytes == 1 << 30
    assert (await js.stream_info(names.leader_stream)).config.max_age == 10


async def test_settings_the_server_cannot_change_are_logged_not_fatal(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await js.add_stream(
        name=names.in_stream,
        subjects=[names.in_subjects],
        storage=api.StorageType.MEMORY,
        duplicate_window=120,
    )
    with capture_logs() as logs:
        await ensure_streams(js, names)
    errors = [e for e in logs if e["event"] == "stream.config_not_updatable"]
    assert [(e["field"], e["current"], e["wanted"]) for e in errors] == [
        ("storage", "memory", "file")
    ]
    rc_in = (await js.stream_info(names.in_stream)).config
    assert rc_in.storage == api.StorageType.MEMORY  # left alone
    assert (rc_in.duplicate_window, rc_in.deny_delete) == (600, True)  # the rest updated


# ---------------------------------------------------------------------------- behaviour


async def test_in_deduplicates_by_msg_id(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await ensure_streams(js, names)
    subject = f"{names.prefix}.in.cmd.admit"
    first = await js.publish(subject, b'{"v":1}', headers={"Nats-Msg-Id": "req-1"})
    again = await js.publish(subject, b'{"v":1}', headers={"Nats-Msg-Id": "req-1"})
    other = await js.publish(subject, b'{"v":1}', headers={"Nats-Msg-Id": "req-2"})
    assert not first.duplicate
    assert again.duplicate is True
    assert again.seq == first.seq
    assert other.seq == first.seq + 1
    assert (await js.stream_info(names.in_stream)).state.messages == 2


async def test_in_denies_deleting_messages(
    nc: Client, prefix_for: Callable[[str], StreamNames]
) -> None:
    names = prefix_for("rc")
    js = nc.jetstream()
    await ensure_streams(js, names)
    ack = await js.publish(f"{names.prefix}.in.x", b"{}")
    with pytest.raises(nats.js.errors.APIError):
        await js.delete_msg(names.in_stream, ack.seq)


@pytest.mark.parametrize("graceful", [True, False], ids=["restart", "kill-and-start"])
async def test_streams_survive_a_server_restart(
    nats_server: NatsServer,
    nc: Client,
    prefix_for: Callable[[str], StreamNames],
    graceful: bool,
) -> None:
    if not nats_server.supports_faults:
        pytest.skip(f"cannot restart {nats_server!r}")
    names = prefix_for("rc")
    subject = f"{names.prefix}.in.x"
    js = nc.jetstream()
    await ensure_streams(js, names)
    for i in range(5):
        await js.publish(subject, b"{}", headers={"Nats-Msg-Id": f"m{i}"})
    kv = await js.key_value(names.leader_bucket)
    await kv.put("leader", b"replica-1")

    async with expect_reconnect(nc):
        nats_server.restart(graceful=graceful)

    info = await js.stream_info(names.in_stream)
    assert info.state.messages == 5
    assert (info.config.storage, info.config.deny_delete) == (api.StorageType.FILE, True)
    dup = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "m4"})
    assert dup.duplicate is True  # the duplicate window survives too
    assert (await kv.get("leader")).value == b"replica-1"
    with capture_logs() as logs:
        await ensure_streams(js, names)
    assert logs == []
