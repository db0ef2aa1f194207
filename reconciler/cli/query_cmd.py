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
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reconciler.bus.schemas import SchemaLoadError, load
from reconciler.cli.oneshot import connect_once, connect_timeout_option, oneshot_log_options
from reconciler.cli.options import bus_options, common_from
from reconciler.core.queries import QUERIES as CORE_QUERIES

__all__ = ["QUERIES", "query_cmd"]

#: every query the replicas answer: the core's, and ``health`` (answered by the adapter)
QUERIES = tuple(sorted([*CORE_QUERIES, "health"]))


@click.command("query", short_help="Ask the replicas a query and print the reply.")
@click.argument("name", type=click.Choice(QUERIES))
@click.argument("request", required=False, default="{}", metavar="[JSON]")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds to wait for a replica's reply.",
)
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
        lambda: _ask(common.nats, f"{common.prefix}.query.{name}", body, timeout, connect_timeout)
    )
    if reply.get("ok") is True:
        click.echo(orjson.dumps(reply.get("result"), option=orjson.OPT_INDENT_2).decode())
        return
    error = reply.get("error") or {}
    raise click.ClickException(f"{error.get('code', 'error')}: {error.get('message', reply)}")


async def _ask(
    nats: Any, subject: str, body: Any, reply_s: float, connect_timeout: float
) -> dict[str, Any]:
    nc = await connect_once(nats, connect_timeout)
    try:
        try:
            msg = await nc.request(subject, orjson.dumps(body), timeout=reply_s)
        except NoRespondersError:
            raise click.ClickException(
                f"no replica answers {subject}: is `reconciler run` running with this --prefix?"
            ) from None
        except NatsTimeoutError:
            raise click.ClickException(
                f"no reply on {subject} within {reply_s:g} s (--timeout)"
            ) from None
        try:
            reply = orjson.loads(msg.data)
        except orjson.JSONDecodeError as exc:
            raise click.ClickException(f"the reply is not JSON: {exc}") from None
        if not isinstance(reply, dict):
            raise click.ClickException(f"the reply is not a JSON object: {reply!r}")
        return reply
    finally:
        await nc.close()
