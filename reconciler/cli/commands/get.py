"""``reconciler get KIND [NAME]``: the config in force, as a file ``apply`` accepts back.

KIND is ``pools``, ``classes``, ``gpu-profiles``, ``gpu-policies`` or ``tenants`` (a new kind of
config is one entry of :data:`reconciler.core.configs.CONFIG_KINDS`). A synced replica
answers (the ``config`` query); the items are printed as YAML, each ``kind`` first, or
with ``--json`` as a JSON array of the same items. ``reconciler get pools > f.yaml``,
an edit, ``reconciler diff f.yaml``, ``reconciler apply f.yaml`` is the round trip.

Exit status: 0; 1 for a NAME that does not exist, an unreachable server or no replica
answering within ``--timeout``.
"""

from __future__ import annotations

from typing import Any

import anyio
import click
import orjson

from reconciler.cli.config_file import items_as_yaml
from reconciler.cli.oneshot import connect_once
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    oneshot_log_options,
    reply_timeout_option,
)
from reconciler.client import NoReplica, QueryFailed, ReconcilerClient
from reconciler.core.configs import KIND_OF_PLURAL
from reconciler.core.messages import Origin

__all__ = ["CONFIG_KIND_ARGUMENT", "get_cmd"]

#: KIND as ``get`` and ``delete`` take it: the plural, as kubectl has it
CONFIG_KIND_ARGUMENT = click.Choice(sorted(KIND_OF_PLURAL))


@click.command("get", short_help="Print the config in force, as `apply` reads it.")
@click.argument("kind", type=CONFIG_KIND_ARGUMENT)
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of YAML.")
@reply_timeout_option(10.0)
@bus_options
@connect_timeout_option
@oneshot_log_options
def get_cmd(
    kind: str, name: str | None, as_json: bool, timeout: float, connect_timeout: float,
    **kwargs: Any,
) -> None:  # fmt: skip
    """Print every item of KIND (pools, classes, gpu-profiles, gpu-policies), or the one
    named NAME, as YAML that `reconciler apply` accepts back.

    \b
    Examples:
      reconciler get pools
      reconciler get classes a100 --json
    """
    common = common_from(kwargs, name="reconciler-get")
    request: dict[str, Any] = {"kind": KIND_OF_PLURAL[kind]}
    if name is not None:
        request["name"] = name
    result = anyio.run(lambda: _ask(common.nats, common.prefix, request, timeout, connect_timeout))
    if result is None:
        raise click.ClickException(f"there is no {KIND_OF_PLURAL[kind]} named {name!r}")
    items = result["items"]
    if as_json:
        shown = [{"kind": i["kind"], **i["payload"]} for i in items]
        click.echo(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(items_as_yaml(items), nl=False)


async def _ask(
    nats: Any, prefix: str, request: dict[str, Any], reply_s: float, connect_timeout: float
) -> Any:
    nc = await connect_once(nats, connect_timeout)
    try:
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        try:
            return await client.query("config", request, within_s=reply_s)
        except (NoReplica, QueryFailed) as exc:
            raise click.ClickException(str(exc)) from None
    finally:
        await nc.close()
