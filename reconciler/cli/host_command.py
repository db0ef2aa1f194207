"""What ``reconciler cordon``, ``uncordon`` and ``drain`` share: one host, one command on
the bus (``<prefix>.in.cmd.<verb>``, folded like any other input), its decision printed.

Exit status: 0 when the fold says ``ok``; 1 for ``rejected`` (``unknown-host``: no
snapshot ever named the host), an unreachable server or no decision within ``--wait``;
2 for a usage error.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import click

from reconciler.cli.commands.cmd import SUCCESS, send_and_print
from reconciler.cli.oneshot import input_problems
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    decision_wait_option,
    oneshot_log_options,
)

__all__ = ["host_command"]


def host_command(verb: str, *, short_help: str, help_text: str) -> click.Command:
    """The ``reconciler <verb> HOST`` command."""

    @click.command(verb, short_help=short_help, help=help_text)
    @click.argument("host")
    @decision_wait_option
    @bus_options
    @connect_timeout_option
    @oneshot_log_options
    def command(host: str, wait: float, connect_timeout: float, **kwargs: Any) -> None:
        common = common_from(kwargs, name=f"reconciler-{verb}")
        body = {"v": 1, "request_id": f"{verb}-{uuid.uuid4().hex[:16]}", "host": host}
        problems = input_problems(f"cmd.{verb}", body)
        if problems:
            raise click.BadParameter("; ".join(problems), param_hint="HOST")
        final = anyio.run(
            lambda: send_and_print(
                common.nats, common.prefix, verb, body, wait, False, connect_timeout
            )
        )
        if final is not None and final.outcome not in SUCCESS:
            raise SystemExit(1)

    return command
