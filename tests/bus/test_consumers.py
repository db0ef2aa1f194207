"""Every consumer the project reads (reconciler/bus/consumers.py), against a real
nats-server: the replica's input consumer as documented, and the executor's made the same
way by the executor and by ``reconciler provision``, with the catch-up window."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest
from click.testing import CliRunner
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.consumers import (
    Ensured,
    ensure_executor_consumer,
    executor_consumer_name,
    first_seq_since,
    input_consumer,
)
from reconciler.bus.streams import StreamNames
from tests.support.bus import BusClient, stream_with_inputs

pytestmark = pytest.mark.timeout(30)

NAMES = StreamNames.for_prefix("rc")


async def test_the_input_consumer_is_configured_as_documented(nc: Client) -> None:
    bus = await stream_with_inputs(nc, 5)
    info = await bus.js.add_consumer(
        "RC_IN", config=input_consumer("RC_IN-a", from_seq=3, batch=500, ack_wait_s=60)
    )
    config = info.config
    assert config.durable_name == "RC_IN-a" and config.opt_start_seq == 3
    assert config.ack_policy == api.AckPolicy.ALL and config.max_ack_pending == 4000
    assert config.mem_storage and config.num_replicas in (0, 1)
    assert info.num_pending == 3


async def test_executor_consumers_catch_up_on_the_last_hour_however_they_are_made(
    nc: Client, nats_url: str
) -> None:
    """The executor and ``reconciler provision`` make the same consumer: a command decided
    before it existed is delivered (the last hour's), an older one is not."""
    from reconciler.cli.main import cli

    bus = BusClient(nc)
    await bus.ensure_streams()
    for host in ("h1", "h2"):
        await bus.js.publish(f"rc.out.exec.{host}.c1", b"{}")

    async def ensure(ack_wait_s: float, max_in_hand: int) -> Ensured:
        return await ensure_executor_consumer(
            nc,
            bus.js,
            stream=NAMES.out_stream,
            prefix="rc",
            host="h1",
            ack_wait_s=ack_wait_s,
            max_in_hand=max_in_hand,
            catch_up_s=3600.0,
        )

    assert await ensure(120.0, 64) is Ensured.CREATED
    args = ["provision", "--nats-url", nats_url, "--executor-host", "h2"]
    done = await anyio.to_thread.run_sync(lambda: CliRunner().invoke(cli, args))
    assert done.exit_code == 0, done.output
    by_executor = await bus.js.consumer_info("RC_OUT", executor_consumer_name("h1"))
    by_provision = await bus.js.consumer_info("RC_OUT", executor_consumer_name("h2"))
    assert by_executor.num_pending == by_provision.num_pending == 1
    mine, theirs = by_executor.config, by_provision.config
    for field in ("ack_policy", "ack_wait", "max_ack_pending", "max_deliver", "deliver_policy"):
        assert getattr(mine, field) == getattr(theirs, field), field
    assert mine.opt_start_seq == 1 and theirs.opt_start_seq == 2
    # ensured again: as it is, or updated to the executor's settings
    assert await ensure(120.0, 64) is Ensured.UNCHANGED
    assert await ensure(30.0, 8) is Ensured.UPDATED
    updated = (await bus.js.consumer_info("RC_OUT", executor_consumer_name("h1"))).config
    assert updated.ack_wait == 30.0 and updated.max_ack_pending == 8


async def test_the_catch_up_probe_finds_the_first_command_of_the_window(nc: Client) -> None:
    bus = BusClient(nc)
    await bus.ensure_streams()
    await bus.js.publish("rc.out.exec.h1.c0", b"{}")  # 1
    await bus.js.publish("rc.out.decision.r", b"{}")  # 2: not a command of h1
    await anyio.sleep(1.2)
    await bus.js.publish("rc.out.exec.h2.c1", b"{}")  # 3: another host's
    await bus.js.publish("rc.out.exec.h1.c2", b"{}")  # 4
    probe = {"stream": "RC_OUT", "filter_subject": "rc.out.exec.h1.>"}
    assert await first_seq_since(nc, bus.js, **probe, seconds=3600) == 1
    assert await first_seq_since(nc, bus.js, **probe, seconds=1.0) == 4
    nothing = {"stream": "RC_OUT", "filter_subject": "rc.out.exec.h9.>"}
    assert await first_seq_since(nc, bus.js, **nothing, seconds=3600) == 5
    assert [c.name for c in await bus.js.consumers_info("RC_OUT")] == []  # probes deleted
