"""``reconciler cmd <verb>``: publish one command and print its decisions as they come.

The body is ``--json BODY`` or ``key=value`` pairs (a string value) and ``key:=JSON``
pairs (any JSON value: numbers, lists, objects); ``v`` is 1 and a ``request_id`` is
generated when the body has none. The command is checked against its schema and the
fold's domain checks before it is published (through the producer's client,
:mod:`reconciler.client`); nothing is sent when it is bad. Then the decisions on
``<prefix>.out.decision.<request_id>`` are printed until the final one.

A field the command's schema does not name (``cpu=4`` on ``admit``, a typo) is refused
before anything is published, with the field it is closest to: the bus would carry it
and the fold ignore it.

Exit status: 0 for ``admitted``, ``claimed``, ``authorized``, ``applied`` and ``ok``; 1
for a refusal (``rejected``, ``no-warm``, ``refused``, ``error``), bad input, an
unreachable server or no final decision within ``--wait`` (no replica answered); 2 for
a usage error.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import click
import orjson

from reconciler.cli.oneshot import connect_once, input_problems, missing_stream
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    decision_wait_option,
    oneshot_log_options,
)
from reconciler.client import NoDecision, NoStream, ReconcilerClient
from reconciler.core.messages import COMMAND_VERBS, Decision, Origin

__all__ = ["SUCCESS", "VERBS", "describe_decision", "parse_body", "send_and_print", "send_cmd"]

VERBS = tuple(sorted(COMMAND_VERBS))
SUCCESS = frozenset({"admitted", "claimed", "authorized", "applied", "ok"})


def parse_body(body_json: str | None, pairs: tuple[str, ...]) -> dict[str, Any]:
    """The command's payload from ``--json`` and ``key=value`` / ``key:=JSON`` pairs."""
    body: dict[str, Any] = {}
    if body_json is not None:
        try:
            parsed = orjson.loads(body_json)
        except orjson.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--json") from None
        if not isinstance(parsed, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--json")
        body.update(parsed)
    for pair in pairs:
        key, sep, value = pair.partition(":=")
        if sep and "=" not in key:
            try:
                body[key] = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise click.BadParameter(f"{pair!r}: the value is not JSON ({exc})") from None
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is neither key=value nor key:=JSON")
        body[key] = value
    body.setdefault("v", 1)
    if "request_id" not in body:
        body["request_id"] = f"cli-{uuid.uuid4().hex[:16]}"
    return body


def describe_decision(d: dict[str, Any]) -> str:
    """One readable line for a decision."""
    text = f"{d.get('phase', '?'):<7} {d.get('outcome', '?')}"
    if "reason" in d:
        text += f" ({d['reason']})"
    if "position" in d:
        text += f" #{d['position']} in line"
    if "detail" in d:
        text += f": {d['detail']}"
    lease = d.get("lease")
    if isinstance(lease, dict):
        gpus = f", gpus {lease['gpus']}" if lease.get("gpus") else ""
        job = f", job {lease['job']}" if lease.get("job") else ""
        text += (
            f"  lease {lease.get('lease_id')}: {lease.get('instance')} on {lease.get('host')} "
            f"({lease.get('pool')}, {lease.get('kind')}, {lease.get('state')}{job}{gpus})"
        )
    victims = d.get("victims")
    if victims:
        names = ", ".join(f"{v.get('instance')} on {v.get('host')}" for v in victims)
        text += f"  victims: {names}"
    return text + f"  [input {d.get('input_seq')}]"


@click.command("cmd", short_help="Publish one command and print its decisions.")
@click.argument("verb", type=click.Choice(VERBS))
@click.argument("pairs", nargs=-1, metavar="[key=value | key:=JSON]...")
@click.option("--json", "body_json", metavar="BODY", help="The command as one JSON object.")
@decision_wait_option
@click.option("--raw", is_flag=True, help="Print each decision as the JSON that travelled.")
@bus_options
@connect_timeout_option
@oneshot_log_options
def send_cmd(
    verb: str, pairs: tuple[str, ...], body_json: str | None, wait: float, raw: bool,
    connect_timeout: float, **kwargs: Any,
) -> None:  # fmt: skip
    """Publish one command (VERB: admit, release, claim-warm…) and print its decisions.

    \b
    Examples:
      reconciler cmd admit pool=small instance=vm-1 kind=warm
      reconciler cmd admit --json '{"pool":"gpu","instance":"vm-2","kind":"cold",
                                    "claims":[{"name":"g","class":"a100"}]}'
      reconciler cmd release instance=vm-1 request_id=rel-vm-1
    """
    common = common_from(kwargs, name="reconciler-cmd")
    body = parse_body(body_json, pairs)
    problems = input_problems(f"cmd.{verb}", body)
    if problems:
        raise click.ClickException(
            f"not a valid {verb} command, nothing published:\n  " + "\n  ".join(problems)
        )
    final = anyio.run(
        lambda: send_and_print(common.nats, common.prefix, verb, body, wait, raw, connect_timeout)
    )
    if final is None:
        return
    if final.outcome not in SUCCESS:
        raise SystemExit(1)


async def send_and_print(
    nats: Any, prefix: str, verb: str, body: dict[str, Any], wait: float, raw: bool,
    connect_timeout: float,
) -> Decision | None:  # fmt: skip
    """Publish the command ``body`` as ``verb`` and print its decisions until the final
    one (``None`` with ``wait`` 0: not waited for); a :class:`click.ClickException` when
    no final decision comes within ``wait``."""
    request_id = str(body["request_id"])
    nc = await connect_once(nats, connect_timeout)
    try:
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        async with client.watch(request_id) as decisions:
            try:
                ack = await client.send(verb, body)
            except NoStream as exc:
                raise missing_stream(exc.stream, prefix) from None
            again = " (a duplicate: already on the stream)" if ack.duplicate else ""
            click.echo(
                f"published {ack.subject} request_id={request_id} as input {ack.seq}{again}",
                err=True,
            )
            if wait == 0:
                return None
            stored = await client.last_decision(request_id) if ack.duplicate else None
            try:
                return await decisions.final(
                    within_s=wait, stored=stored, on_decision=lambda d: _print(d, raw)
                )
            except NoDecision:
                raise click.ClickException(
                    f"no final decision for {request_id} within {wait:g} s (--wait): is a "
                    f"`reconciler run` leader running with --prefix {prefix}?"
                ) from None
    finally:
        await nc.close()


def _print(decision: Decision, raw: bool) -> None:
    click.echo(decision.encode().decode() if raw else describe_decision(decision.as_dict()))
