"""``reconciler web``: the read-only page of the fleet (:mod:`reconciler.web`).

It listens on ``--listen`` (default ``127.0.0.1:8480``) and reads through the queries of
any synced replica. A non-loopback address is refused unless ``--https-cert`` and
``--https-key`` and a password are given; the password comes from ``--password-file``
or the environment variable ``RC_WEB_PASSWORD``, never from the command line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click

from reconciler.bus.connection import ConnectOptions, connect
from reconciler.cli.options import bus_options, common_from, log_options, read_secret
from reconciler.cli.signals import run_until_signalled
from reconciler.observe.endpoints import parse_addr
from reconciler.web.server import (
    DEFAULT_LISTEN,
    Exposure,
    Queries,
    WebConfig,
    WebServer,
    check_exposure,
    tls_context,
)

__all__ = ["web"]

#: the environment variable that may hold the password (a file is the other way)
PASSWORD_ENV = "RC_WEB_PASSWORD"


F = TypeVar("F", bound=Callable[..., Any])


def _file(name: str, envvar: str, text: str) -> Callable[[F], F]:
    return click.option(
        name,
        envvar=envvar,
        show_envvar=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help=text,
    )


@click.command("web")
@click.option(
    "--listen",
    envvar="RC_WEB_LISTEN",
    show_envvar=True,
    default=DEFAULT_LISTEN,
    show_default=True,
    help="HOST:PORT to serve the page on. Anything but a loopback address needs "
    "--https-cert, --https-key and a password.",
)
@_file("--https-cert", "RC_WEB_HTTPS_CERT", "The page's TLS certificate (PEM, with its chain).")
@_file("--https-key", "RC_WEB_HTTPS_KEY", "The TLS certificate's private key (PEM).")
@_file(
    "--password-file",
    "RC_WEB_PASSWORD_FILE",
    f"File holding the page's password (its first line); or set {PASSWORD_ENV}. With a "
    "password, every request needs it (HTTP basic auth).",
)
@click.option(
    "--user",
    envvar="RC_WEB_USER",
    show_envvar=True,
    default="reconciler",
    show_default=True,
    help="The user name HTTP basic auth asks for with the password.",
)
@click.option(
    "--refresh",
    envvar="RC_WEB_REFRESH",
    show_envvar=True,
    type=click.IntRange(min=0, max=3600),
    default=10,
    show_default=True,
    help="Seconds between the page's reloads in the browser (0: never).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds a page waits for a synced replica's answers.",
)
@bus_options
@log_options
def web(
    listen: str,
    https_cert: Path | None,
    https_key: Path | None,
    password_file: Path | None,
    user: str,
    refresh: int,
    timeout: float,
    **kwargs: Any,
) -> None:
    """Serve a read-only page of the fleet: hosts with their capacity, pools with their
    warm VMs, the most recent decisions, and a lease's trail (/lease/<lease_id>).

    It reads through the queries of any synced replica and changes nothing.
    """
    common = common_from(kwargs, name="reconciler-web")
    try:
        host, port = parse_addr(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc).replace("metrics address", "address"),
                                 param_hint="--listen") from None  # fmt: skip
    if (https_cert is None) != (https_key is None):
        raise click.UsageError("give --https-cert and --https-key together")
    password = _password(password_file)
    try:
        check_exposure(host, tls=https_cert is not None, password=password is not None)
    except Exposure as exc:
        raise click.UsageError(str(exc)) from None
    tls = None
    if https_cert is not None and https_key is not None:
        try:
            tls = tls_context(str(https_cert), str(https_key))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--https-cert") from None
    config = WebConfig(
        host=host,
        port=port,
        credentials=(user, password) if password is not None else None,
        tls=tls,
        refresh_s=refresh,
        wait_s=timeout,
    )
    anyio.run(lambda: _serve(common.nats, common.prefix, config))


def _password(path: Path | None) -> str | None:
    """The password from ``--password-file`` or ``RC_WEB_PASSWORD``; ``None`` if neither."""
    from_env = os.environ.get(PASSWORD_ENV) or None
    if path is not None:
        if from_env is not None:
            raise click.UsageError(f"give --password-file or {PASSWORD_ENV}, not both")
        return read_secret(path, option="--password-file")
    return from_env


async def _serve(nats: ConnectOptions, prefix: str, config: WebConfig) -> None:
    nc = await connect(nats)
    server = WebServer(config, Queries(nc, prefix=prefix, wait_s=config.wait_s))
    try:
        try:
            await server.start()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {config.host}:{config.port}: "
                                       f"{exc.strerror or exc}") from None  # fmt: skip
        click.echo(f"serving the page on {server.url}", err=True)
        await run_until_signalled(lambda stop: stop.wait(), stopping="stopping")
    finally:
        with anyio.CancelScope(shield=True):
            await server.stop()
            await nc.close()
