"""The console script (reconciler.cli.entry) leaves aiohttp out only of a ``run`` that
cannot need it."""

from __future__ import annotations

import pytest

from reconciler.cli.entry import run_without_aiohttp

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("args", "env", "without"),
    [
        (["run", "--nats-url", "nats://a:4222"], {}, True),
        (["run"], {"RC_NATS_URL": "tls://a:4222"}, True),
        (["run", "--nats-url", "nats://a:4222,WSS://b:443"], {}, False),
        (["run"], {"RC_NATS_URL": "ws://a:8080"}, False),
        (["run", "--metrics-addr", "127.0.0.1:9100"], {}, False),
        (["run", "--metrics-addr=127.0.0.1:9100"], {}, False),
        (["run"], {"RC_METRICS_ADDR": "127.0.0.1:9100"}, False),
        (["bridge", "--nats-url", "nats://a:4222"], {}, False),
        ([], {}, False),
    ],
)
def test_the_console_script_leaves_aiohttp_out_only_of_a_run_that_cannot_need_it(
    args: list[str], env: dict[str, str], without: bool
) -> None:
    assert run_without_aiohttp(args, env) is without
