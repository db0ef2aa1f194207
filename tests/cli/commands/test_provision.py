"""``reconciler provision``: streams, bucket and executor consumers, idempotently."""

from __future__ import annotations

import anyio


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
