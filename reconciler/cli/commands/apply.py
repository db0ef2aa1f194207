"""``reconciler apply FILE``: publish pools, classes, GPU profiles and GPU policies.

The file (YAML or JSON; ``-`` is stdin) holds a list of items, or one item. An item is
the payload of ``<prefix>.in.config.<kind>.<name>``; its kind is its ``kind`` field
(``pool``, ``class``, ``gpu-profile``, ``gpu-policy``; removed before publishing) or, without
one, the field that names it: ``pool`` or ``class``, else ``defaults`` for a GPU profile
and ``overrides`` for a GPU policy. ``v`` defaults to 1.

Every item is checked (its schema, the fold's domain checks, one item per kind and name)
before the first is published: one bad item and nothing is sent. Then each is published
with a ``Nats-Msg-Id`` derived from its content, and, unless ``--wait 0``, the command
waits until a replica has folded them and reports any rejection the leader published on
``<prefix>.out.config.rejected.<kind>.<name>``. Exit status 1 on bad input, a rejection,
or an unreachable server.
"""

from __future__ import annotations

from typing import Any

import anyio
import click
import yaml

from reconciler.cli.oneshot import connect_once, input_problems, missing_stream
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    oneshot_log_options,
)
from reconciler.client import NoStream, ReconcilerClient
from reconciler.core.messages import CONFIG_KINDS, Origin, Subjects

__all__ = ["ConfigItem", "apply_cmd", "read_items"]

KINDS = CONFIG_KINDS
_NAME_FIELD = {"pool": "pool", "class": "class", "gpu-profile": "name", "gpu-policy": "name"}


class ConfigItem:
    """One validated item: its kind, name and payload."""

    def __init__(self, kind: str, name: str, payload: dict[str, Any]) -> None:
        self.kind, self.name, self.payload = kind, name, payload

    def subject(self, prefix: str) -> str:
        return Subjects(prefix).config_input(self.kind, self.name)


def _kind_of(item: dict[str, Any]) -> str | None:
    kind = item.get("kind")
    if kind is not None:
        return kind if kind in KINDS else None
    for field, guessed in (("pool", "pool"), ("class", "class")):
        if field in item:
            return guessed
    if "defaults" in item:
        return "gpu-profile"
    if "overrides" in item:
        return "gpu-policy"
    return None


def read_items(text: str, *, source: str) -> tuple[list[ConfigItem], list[str]]:
    """The items of a file's text, and every problem found (items are only valid when
    there is no problem at all)."""
    try:
        document = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as exc:
        return [], [f"{source}: neither YAML nor JSON: {exc}"]
    if isinstance(document, dict):
        document = [document]
    if not isinstance(document, list) or not document:
        return [], [f"{source}: expected a list of pools, classes, GPU profiles and policies"]
    items: list[ConfigItem] = []
    problems: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for index, raw in enumerate(document, start=1):
        where = f"item {index}"
        if not isinstance(raw, dict):
            problems.append(f"{where}: not a mapping")
            continue
        kind = _kind_of(raw)
        if kind is None:
            problems.append(
                f"{where}: unknown kind; give kind: {' | '.join(KINDS)} "
                "(or a pool/class field, GPU profile defaults, GPU policy overrides)"
            )
            continue
        payload = {k: v for k, v in raw.items() if k != "kind"}
        payload.setdefault("v", 1)
        name = payload.get(_NAME_FIELD[kind])
        where = f"item {index} ({kind} {name!r})"
        found = input_problems(
            f"config.{kind}", payload, subject_token=name if isinstance(name, str) else None
        )
        problems.extend(f"{where}: {p}" for p in found)
        if found or not isinstance(name, str):
            continue
        if (kind, name) in seen:
            problems.append(f"{where}: the same {kind} as item {seen[(kind, name)]}")
            continue
        seen[(kind, name)] = index
        items.append(ConfigItem(kind, name, payload))
    return items, problems


@click.command("apply", short_help="Publish pools, classes, GPU settings from a file.")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds to wait for a replica to fold the items and report rejections (0: publish only).",
)
@click.option("--dry-run", is_flag=True, help="Validate only; publish nothing.")
@bus_options
@connect_timeout_option
@oneshot_log_options
def apply_cmd(file: Any, wait: float, dry_run: bool, connect_timeout: float, **kwargs: Any) -> None:
    """Validate every pool, class, GPU profile and GPU policy in FILE (YAML or JSON), then
    publish them all, or nothing if any is invalid.

    \b
    Example file:
      - kind: pool
        pool: small
        flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}
        claims: []
        warm: {min_ready: 1, max_ready: 2, protect_min_ready: false}
        max_instances: 10
        priority: 0
        host_selector: {}
        placement: pack
        image: ci-runner
        profiles: [default]
        project: default
    """
    common = common_from(kwargs, name="reconciler-apply")
    source = getattr(file, "name", "FILE")
    items, problems = read_items(file.read(), source=source)
    if problems:
        raise click.ClickException(
            f"{source}: {len(problems)} problem(s), nothing published:\n  " + "\n  ".join(problems)
        )
    if dry_run:
        for item in items:
            click.echo(f"valid  {item.subject(common.prefix)}")
        return
    rejected = anyio.run(lambda: _publish(common.nats, common.prefix, items, wait, connect_timeout))
    if rejected:
        raise SystemExit(1)


async def _publish(
    nats: Any, prefix: str, items: list[ConfigItem], wait: float, connect_timeout: float
) -> int:
    nc = await connect_once(nats, connect_timeout)
    try:
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        async with client.config_rejections() as rejections:
            last_seq = 0
            ours: set[int] = set()
            for item in items:
                try:
                    ack = await client.publish_config(item.kind, item.name, item.payload)
                except NoStream as exc:
                    raise missing_stream(exc.stream, prefix) from None
                same = "  (unchanged: already on the stream)" if ack.duplicate else ""
                click.echo(f"published {ack.subject} as input {ack.seq}{same}")
                last_seq = max(last_seq, ack.seq)
                ours.add(ack.seq)
            if wait == 0:
                return 0
            folded = await client.wait_applied(last_seq, within_s=wait)
            if not folded:
                click.echo(
                    f"not yet folded by a replica within {wait:g} s (--wait): rejections, if "
                    f"any, will be on {client.subjects.config_rejections}",
                    err=True,
                )
            # the leader publishes after it commits: give its rejections a moment to arrive
            found = await rejections.of(ours, within_s=0.5 if folded else 0)
        for rejected in found:
            click.secho(
                f"rejected {rejected.kind} {rejected.name}: {rejected.error}", fg="red", err=True
            )
        return len(found)
    finally:
        await nc.close()
