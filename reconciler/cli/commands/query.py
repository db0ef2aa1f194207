"""``reconciler query <name> [JSON]``: ask the replicas a query and print the reply.

The request (``{}`` when omitted) is checked against ``schemas/query/<name>.request.json``
before it is sent to ``<prefix>.query.<name>``; any replica with synced caches answers.
A result is printed as indented JSON on stdout; an error reply's code and message go to
stderr with exit status 1, as do bad input, no answering replica and an unreachable
server.
"""

from __future__ import annotations

from typing import Any

import anyio
import click
import orjson

from reconciler.bus.schemas import SchemaLoadError, load
from reconciler.cli.oneshot import connect_once
from reconciler.cli.options import (
    bus_options,
    common_from,
    connect_timeout_option,
    oneshot_log_options,
    reply_timeout_option,
)
from reconciler.client import NoReplica, ReconcilerClient
from reconciler.core.messages import MessageError, Origin, QueryReply
from reconciler.core.queries import ADAPTER_QUERIES
from reconciler.core.queries import QUERIES as CORE_QUERIES

__all__ = ["QUERIES", "query_cmd"]

#: every query the replicas answer: the core's, and those the replica answers itself
QUERIES = tuple(sorted([*CORE_QUERIES, *ADAPTER_QUERIES]))


@click.command("query", short_help="Ask the replicas a query and print the reply.")
@click.argument("name", type=click.Choice(QUERIES))
@click.argument("request", required=False, default="{}", metavar="[JSON]")
@reply_timeout_option(5.0)
@bus_options
@connect_timeout_option
@oneshot_log_options
def query_cmd(
    name: str, request: str, timeout: float, connect_timeout: float, **kwargs: Any
) -> None:
    """Ask the running replicas query NAME with the JSON REQUEST and print the result.

    \b
    Examples:
      reconciler query health
      reconciler query lease '{"identifier": "job-42"}'
      reconciler query pool '{"pool": "ci-small"}'
      reconciler query unsuitable-hosts '{"pool": "small", "potential_hosts": ["h1", "h2"]}'
    """
    common = common_from(kwargs, name="reconciler-query")
    try:
        body = orjson.loads(request)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="JSON") from None
    try:
        validator = load().validator(f"query/{name}.request.json")
    except SchemaLoadError as exc:
        raise click.ClickException(str(exc)) from None
    problems = [
        f"{'/'.join(str(p) for p in e.instance_path) or '(request)'}: {e.message}"
        for e in validator.iter_errors(body)
    ]
    if problems:
        raise click.ClickException(
            f"not a valid {name} request, nothing sent:\n  " + "\n  ".join(problems)
        )
    reply = anyio.run(
        lambda: _ask(common.nats, common.prefix, name, body, timeout, connect_timeout)
    )
    if reply.ok:
        click.echo(orjson.dumps(reply.result, option=orjson.OPT_INDENT_2).decode())
        return
    raise click.ClickException(f"{reply.code or 'error'}: {reply.message or reply.body}")


async def _ask(
    nats: Any, prefix: str, name: str, body: Any, reply_s: float, connect_timeout: float
) -> QueryReply:
    nc = await connect_once(nats, connect_timeout)
    try:
        client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        try:
            return await client.ask(name, body, timeout_s=reply_s)
        except NoReplica as exc:
            if not exc.responders:
                raise click.ClickException(
                    f"{exc}: is `reconciler run` running with this --prefix?"
                ) from None
            raise click.ClickException(f"{exc} (--timeout)") from None
        except MessageError as exc:
            raise click.ClickException(str(exc)) from None
    finally:
        await nc.close()
