"""``reconciler diff FILE``: what ``reconciler apply FILE`` would change, and nothing else.

The file is read and checked as ``apply`` reads it (:mod:`reconciler.cli.config_file`),
then a synced replica is asked what the fold would decide (the ``config-check`` query,
the fold's own checks against its current state). Each item that would change is
printed: ``+`` created, ``~`` updated (with every field that changes, current value
first), and, with ``--all``, ``=`` unchanged. ``apply`` never deletes what the file
leaves out: ``reconciler delete`` does.

Exit status (as ``diff`` has it): 0 when nothing would change, 1 when something would,
2 when the file cannot be applied (a problem in it, an item the fold would refuse), the
server cannot be reached or no replica answers.
"""

from __future__ import annotations

from typing import Any

import anyio
import click

from reconciler.cli.commands.apply import check
from reconciler.cli.config_file import ConfigChange, problems_message, read_items
from reconciler.cli.oneshot import connect_once
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    oneshot_log_options,
    reply_timeout_option,
)
from reconciler.client import ReconcilerClient
from reconciler.core.messages import Origin

__all__ = ["diff_cmd", "diff_lines"]

_MARK = {"created": "+", "updated": "~", "unchanged": "="}


class DiffTrouble(click.ClickException):
    """The file cannot be compared: exit status 2, as ``diff`` has it."""

    exit_code = 2


@click.command("diff", short_help="Show what `apply FILE` would change.")
@click.argument("file", type=click.File("rb"))
@click.option("--all", "show_all", is_flag=True, help="List unchanged items too.")
@reply_timeout_option(10.0)
@bus_options
@connect_timeout_option
@oneshot_log_options
def diff_cmd(
    file: Any, show_all: bool, timeout: float, connect_timeout: float, **kwargs: Any
) -> None:
    """Compare FILE (YAML or JSON, as `apply` reads it) with the config in force.

    \b
    Example:
      reconciler get pools > pools.yaml      # edit it, then:
      reconciler diff pools.yaml && echo "nothing to apply"
    """
    common = common_from(kwargs, name="reconciler-diff")
    source = getattr(file, "name", "FILE")
    items, problems = read_items(file.read(), source=source)
    if problems:
        raise DiffTrouble(problems_message(source, problems, nothing="compared"))
    change = ConfigChange(items=tuple(items))
    try:
        result = anyio.run(
            lambda: _check(common.nats, common.prefix, change, timeout, connect_timeout, source)
        )
    except click.ClickException as exc:
        raise DiffTrouble(exc.message) from None
    refused = [i for i in result["items"] if i.get("error")]
    if refused:
        lines = [f"{i['kind']} {i['name']}: {i['error']}" for i in refused]
        raise DiffTrouble(
            f"{source}: the fold would refuse {len(refused)} item(s), so `apply` would change "
            "nothing:\n  " + "\n  ".join(lines)
        )
    lines = diff_lines(result["items"], show_all=show_all)
    for line in lines:
        click.echo(line)
    changed = sum(1 for i in result["items"] if i.get("change") != "unchanged")
    if changed:
        click.echo(f"{changed} of {len(result['items'])} item(s) would change", err=True)
        raise SystemExit(1)
    click.echo(f"no changes: the {len(result['items'])} item(s) are in force as written", err=True)


async def _check(
    nats: Any, prefix: str, change: ConfigChange, reply_s: float, connect_timeout: float,
    source: str,
) -> Any:  # fmt: skip
    nc = await connect_once(nats, connect_timeout)
    try:
        sizes = change.size_problems(max_payload=nc.max_payload, request_id="config-check")
        if sizes:
            raise click.ClickException(f"{source}: " + "\n  ".join(sizes))
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        return await check(client, change, within_s=reply_s)
    finally:
        await nc.close()


def diff_lines(items: list[dict[str, Any]], *, show_all: bool = False) -> list[str]:
    """A ``config-check`` answer's items as ``diff`` prints them."""
    lines: list[str] = []
    for item in items:
        change = str(item.get("change"))
        if change == "unchanged" and not show_all:
            continue
        lines.append(f"{_MARK.get(change, '?')} {item['kind']} {item['name']}")
        for path, old, new in item.get("fields") or ():
            lines.append(f"    {path}: {_shown(old)} -> {_shown(new)}")
    return lines


def _shown(value: Any) -> str:
    return "(none)" if value is None else str(value)
