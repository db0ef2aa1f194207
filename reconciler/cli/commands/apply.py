"""``reconciler apply FILE``: pools, classes, GPU profiles and GPU policies, applied whole
or not at all.

The file is read and every item checked first (:mod:`reconciler.cli.config_file`: a
field its schema does not name, its schema, the fold's checks after the schema, an item
twice, the sizes): one problem and nothing is sent. Then the whole file is published as
one ``apply-config`` command (``<prefix>.in.cmd.apply-config``), which the fold applies
entirely or not at all, and its decision is waited for: each item ``created``,
``updated`` or ``unchanged``, or every item the fold refused, with why.

``--dry-run`` publishes nothing: it asks a synced replica (the ``config-check`` query)
what the fold would decide with its current state, by the fold's own checks, and prints
that verdict.

Exit status: 0 when applied (or, with ``--dry-run``, when it would be); 1 when an item is
refused, for bad input, an unreachable server, or no decision within ``--wait`` (no
replica answered: nothing is known to be applied); 2 for a usage error.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import click

from reconciler.cli.config_file import ConfigChange, problems_message, read_items
from reconciler.cli.oneshot import connect_once, missing_stream
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    decision_wait_option,
    oneshot_log_options,
)
from reconciler.client import NoDecision, NoReplica, NoStream, QueryFailed, ReconcilerClient
from reconciler.core.messages import Decision, Origin

__all__ = ["apply_cmd", "check", "describe_check", "item_lines", "print_check", "publish_change"]


@click.command("apply", short_help="Apply pools, classes, GPU settings from a file, whole.")
@click.argument("file", type=click.File("rb"))
@decision_wait_option
@click.option(
    "--dry-run",
    is_flag=True,
    help="Publish nothing: print what the fold would decide, asked of a synced replica.",
)
@bus_options
@connect_timeout_option
@oneshot_log_options
def apply_cmd(file: Any, wait: float, dry_run: bool, connect_timeout: float, **kwargs: Any) -> None:
    """Apply every pool, class, GPU profile and GPU policy in FILE (YAML or JSON, ``-``
    for stdin) as one change: all of them, or none if the fold refuses any.

    \b
    Example file:
      - kind: pool
        pool: small
        flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}
        warm: {min_ready: 1, max_ready: 2}
        max_instances: 10
        image: ci-runner
        profiles: [default]
      - kind: class
        class: a100
        parameters: {gpu: {count: 1, model: A100}}
    """
    common = common_from(kwargs, name="reconciler-apply")
    source = getattr(file, "name", "FILE")
    items, problems = read_items(file.read(), source=source)
    if problems:
        raise click.ClickException(problems_message(source, problems, nothing="published"))
    change = ConfigChange(items=tuple(items))
    ok = anyio.run(
        lambda: _apply(common.nats, common.prefix, change, wait, dry_run, connect_timeout, source)
    )
    if not ok:
        raise SystemExit(1)


async def _apply(
    nats: Any, prefix: str, change: ConfigChange, wait: float, dry_run: bool,
    connect_timeout: float, source: str,
) -> bool:  # fmt: skip
    request_id = f"apply-{uuid.uuid4().hex[:16]}"
    nc = await connect_once(nats, connect_timeout)
    try:
        sizes = change.size_problems(max_payload=nc.max_payload, request_id=request_id)
        if sizes:
            raise click.ClickException(problems_message(source, sizes, nothing="published"))
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        if dry_run:
            result = await check(client, change, within_s=max(wait, 5.0))
            print_check(result)
            verdict = "would be applied" if result["ok"] else "would be rejected: nothing changes"
            click.echo(f"dry run, nothing published: the change {verdict}", err=True)
            return bool(result["ok"])
        return await publish_change(client, change, request_id, wait, prefix)
    finally:
        await nc.close()


async def check(client: ReconcilerClient, change: ConfigChange, *, within_s: float) -> Any:
    """The ``config-check`` answer for ``change``: what the fold would decide."""
    try:
        return await client.query("config-check", change.body(), within_s=within_s)
    except NoReplica as exc:
        raise click.ClickException(
            f"{exc} (the fold's checks need a synced replica; nothing was published)"
        ) from None
    except QueryFailed as exc:
        raise click.ClickException(str(exc)) from None


async def publish_change(
    client: ReconcilerClient, change: ConfigChange, request_id: str, wait: float, prefix: str
) -> bool:
    async with client.watch(request_id) as decisions:
        try:
            ack = await client.send("apply-config", change.command(request_id))
        except NoStream as exc:
            raise missing_stream(exc.stream, prefix) from None
        click.echo(
            f"published {ack.subject} request_id={request_id} as input {ack.seq} "
            f"({change.describe()})",
            err=True,
        )
        if wait == 0:
            click.echo("not waited for (--wait 0): the fold's decision is not known", err=True)
            return True
        try:
            decision = await decisions.final(within_s=wait)
        except NoDecision:
            raise click.ClickException(
                f"no decision for {request_id} within {wait:g} s (--wait): is a "
                f"`reconciler run` leader running with --prefix {prefix}? The change may "
                "still be applied: `reconciler diff` shows what is in force"
            ) from None
    print_decision(decision)
    return decision.outcome == "applied"


def print_decision(decision: Decision) -> None:
    """An ``apply-config`` decision: a line per item, then the verdict."""
    for line in item_lines(decision.as_dict().get("items") or []):
        click.echo(line)
    tail = f"  [input {decision.input_seq}]"
    if decision.outcome == "applied":
        click.echo(f"applied: {decision.detail}{tail}")
    else:
        click.secho(f"rejected ({decision.reason}): {decision.detail}{tail}", fg="red", err=True)


def item_lines(items: list[dict[str, Any]], *, would: bool = False) -> list[str]:
    """One line per item of a decision or a check: what became (or would become) of it."""
    lines = []
    for item in items:
        what = f"{item['kind']} {item['name']}"
        if item.get("error"):
            lines.append(f"{'refused':<16} {what}: {item['error']}")
            continue
        change = str(item.get("change"))
        verb = f"would be {change}" if would and change != "unchanged" else change
        lines.append(f"{verb:<16} {what}")
        for path, old, new in item.get("fields") or ():
            lines.append(f"{'':<16}   {path}: {_value(old)} -> {_value(new)}")
    return lines


def print_check(result: dict[str, Any]) -> None:
    """A ``config-check`` answer, as ``apply --dry-run`` prints it."""
    for line in item_lines(result.get("items") or [], would=True):
        click.echo(line)
    click.echo(describe_check(result))


def describe_check(result: dict[str, Any]) -> str:
    items = result.get("items") or []
    refused = [i for i in items if i.get("error")]
    if refused:
        return f"{len(refused)} of {len(items)} item(s) refused: the fold would apply none"
    changes = [i for i in items if i.get("change") != "unchanged"]
    return f"{len(items)} item(s), {len(changes)} to change: the fold would apply them all"


def _value(value: Any) -> str:
    return "(none)" if value is None else str(value)
