"""The outbox publisher (reconciler.bus.publisher) against a real nats-server: outputs
confirmed, deduplicated by ``Nats-Msg-Id``, and refusals reported."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from reconciler.bus.publisher import PublishError, publish_outputs
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.core.messages import Output

pytestmark = pytest.mark.timeout(30)

NAMES = StreamNames.for_prefix("rc")


async def test_outputs_are_confirmed_and_deduplicated_by_msg_id(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, NAMES)
    outs = [
        Output(f"out.decision.r{i}", f"decision:r{i}:final", b'{"i": %d}' % i) for i in range(5)
    ]
    acks = await publish_outputs(nc, outs, prefix="rc")
    assert [a.seq for a in acks] == [1, 2, 3, 4, 5] and not any(a.duplicate for a in acks)
    again = await publish_outputs(
        nc, [*outs, Output("out.status.host.h1", None, b"{}")], prefix="rc"
    )
    assert [a.duplicate for a in again] == [True] * 5 + [False]
    assert (await js.stream_info("RC_OUT")).state.messages == 6


async def test_an_unconfirmed_publish_is_an_error_to_retry(nc: Client) -> None:
    # no stream captures these subjects: the server answers "no responders"
    with pytest.raises(PublishError, match="no stream answered"):
        await publish_outputs(nc, [Output("out.decision.r", "d", b"{}")], prefix="nostream")


async def test_a_refused_publish_is_an_error_and_the_others_still_count(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, NAMES)
    await js.update_stream(
        (await js.stream_info("RC_OUT")).config.evolve(max_msg_size=64)
    )  # a payload over 64 bytes is refused by the stream
    outs = [
        Output("out.decision.small", "decision:small:final", b"{}"),
        Output("out.decision.big", "decision:big:final", b"x" * 100),
    ]
    with pytest.raises(PublishError, match="the stream refused"):
        await publish_outputs(nc, outs, prefix="rc", timeout_s=5)
    assert (await js.stream_info("RC_OUT")).state.messages == 1
