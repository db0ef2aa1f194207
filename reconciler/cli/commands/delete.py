"""``reconciler delete KIND NAME``: delete a pool, class, GPU profile or GPU policy.

The deletion travels as an ``apply-config`` command with nothing but it, and the fold
decides it as it decides every change: a class still named by a pool's claims, or a GPU
profile still named by a host or rendered into an active lease, is refused, with what
uses it; so is what does not exist. A deleted pool admits nothing new; its idle warm VMs
(booting or ready, unclaimed) are drained at once; its other leases run to their end.

Exit status: 0 when deleted; 1 when refused, for an unreachable server, or no decision
within ``--wait``; 2 for a usage error.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import click

from reconciler.cli.commands.apply import publish_change
from reconciler.cli.commands.get import CONFIG_KIND_ARGUMENT
from reconciler.cli.config_file import ConfigChange
from reconciler.cli.oneshot import connect_once
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    decision_wait_option,
    oneshot_log_options,
)
from reconciler.client import ReconcilerClient
from reconciler.core.configs import KIND_OF_PLURAL
from reconciler.core.messages import Origin, is_token

__all__ = ["delete_cmd"]


@click.command("delete", short_help="Delete a pool, class, GPU profile or GPU policy.")
@click.argument("kind", type=CONFIG_KIND_ARGUMENT)
@click.argument("name")
@decision_wait_option
@bus_options
@connect_timeout_option
@oneshot_log_options
def delete_cmd(kind: str, name: str, wait: float, connect_timeout: float, **kwargs: Any) -> None:
    """Delete the item NAME of KIND (pools, classes, gpu-profiles, gpu-policies).

    \b
    Example:
      reconciler delete pools ci-small
    """
    common = common_from(kwargs, name="reconciler-delete")
    if not is_token(name):
        raise click.BadParameter(f"{name!r} is not a config name", param_hint="NAME")
    change = ConfigChange(deletions=((KIND_OF_PLURAL[kind], name),))
    ok = anyio.run(lambda: _delete(common.nats, common.prefix, change, wait, connect_timeout))
    if not ok:
        raise SystemExit(1)


async def _delete(
    nats: Any, prefix: str, change: ConfigChange, wait: float, connect_timeout: float
) -> bool:
    nc = await connect_once(nats, connect_timeout)
    try:
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        return await publish_change(client, change, f"delete-{uuid.uuid4().hex[:16]}", wait, prefix)
    finally:
        await nc.close()
