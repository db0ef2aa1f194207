"""The tests' own nats-server (tests/support/natsserver.py): pausing it, and closing it."""

from __future__ import annotations

import os
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from tests.support.natsserver import NatsProcess, NatsServer, start_nats_server


async def test_a_paused_server_answers_nothing_until_resumed(
    nats_server: NatsServer, nc: Client
) -> None:
    # A request, not nc.flush(timeout=…): in nats-py 2.16 a timed-out flush leaves a
    # cancelled future behind, and the late PONG kills the client's read loop.
    js = nc.jetstream(timeout=0.3)
    nats_server.pause()
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await js.account_info()
    finally:
        nats_server.resume()
    await nc.jetstream(timeout=2).account_info()


def test_closing_the_server_leaves_no_process(tmp_path: Path) -> None:
    if os.environ.get("RC_TEST_NATS_URL"):
        pytest.skip("needs a server this test controls")
    with start_nats_server(tmp_path) as server:
        assert isinstance(server, NatsProcess)
        pid = server.pid
        server.pause()  # even a stopped process is terminated
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
