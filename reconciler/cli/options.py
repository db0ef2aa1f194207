"""The common command-line options of CONTRACT.md ("Command line"), shared by every command.

Each option is also an environment variable ``RC_<NAME>`` (``--nats-url`` is
``RC_NATS_URL``); a flag given on the command line wins. Commands take the options they
need through the decorators below and turn them into :class:`Common`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from reconciler.bus.connection import DEFAULT_NATS_URL, ConnectOptions, parse_urls
from reconciler.cli.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from reconciler.incus.client import IncusEndpoint, endpoints_from_fleet_file

__all__ = [
    "Common",
    "bus_options",
    "common_from",
    "db_option",
    "incus_endpoints",
    "incus_options",
    "log_options",
    "run_options",
]

F = TypeVar("F", bound=Callable[..., Any])


def _env(name: str) -> str:
    return "RC_" + name.upper().replace("-", "_")


def _option(name: str, **kwargs: Any) -> Callable[[F], F]:
    kwargs.setdefault("envvar", _env(name))
    kwargs.setdefault("show_envvar", True)
    return click.option(f"--{name}", **kwargs)


def _apply(f: F, decorators: list[Callable[[F], F]]) -> F:
    for decorate in reversed(decorators):
        f = decorate(f)
    return f


def log_options(f: F) -> F:
    """``--log-format`` and ``--log-level``; logging is configured before the command runs."""
    return _apply(
        f,
        [
            _option(
                "log-format",
                type=click.Choice(LOG_FORMATS),
                default="text",
                show_default=True,
                help="Log lines as JSON objects or as readable text.",
            ),
            _option(
                "log-level",
                type=click.Choice(LOG_LEVELS, case_sensitive=False),
                default="info",
                show_default=True,
                help="Least severe level logged.",
            ),
        ],
    )


def bus_options(f: F) -> F:
    """How to reach NATS, and the subject prefix."""
    return _apply(
        f,
        [
            _option(
                "nats-url",
                default=DEFAULT_NATS_URL,
                show_default=True,
                help="NATS server URL(s), comma-separated.",
            ),
            _option(
                "nats-creds",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="NATS credentials file (JWT + NKey).",
            ),
            _option("nats-user", help="NATS user name."),
            _option("nats-password", help="NATS password (needs --nats-user)."),
            _option(
                "tls-ca",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="CA file to verify the NATS server's certificate.",
            ),
            _option(
                "prefix",
                default="rc",
                show_default=True,
                help="Subject prefix: streams <PREFIX>_IN, <PREFIX>_OUT, bucket <prefix>_leader.",
            ),
        ],
    )


def db_option(f: F) -> F:
    """``--db``: the SQLite file."""
    return _option(
        "db",
        type=click.Path(dir_okay=False, path_type=Path),
        default=Path("reconciler.db"),
        show_default=True,
        help="SQLite file of the folded state.",
    )(f)


def run_options(f: F) -> F:
    """The options of the long-running reconciler."""
    return _apply(
        f,
        [
            _option(
                "workers",
                type=click.IntRange(min=1),
                default=2,
                show_default=True,
                help="Workers per keyed reconciler queue.",
            ),
            _option(
                "status-debounce",
                type=click.FloatRange(min=0, min_open=True),
                default=1.0,
                show_default=True,
                help="Seconds a host or pool status waits for more changes before publishing.",
            ),
            _option(
                "status-progress-interval",
                type=click.FloatRange(min=0, min_open=True),
                default=10.0,
                show_default=True,
                help="Seconds between full rounds of status, changed or not.",
            ),
            _option(
                "live-get-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=5.0,
                show_default=True,
                help="Seconds a live Incus GET of a suspect instance may take.",
            ),
            _option(
                "leader-ttl",
                type=click.FloatRange(min=0, min_open=True),
                default=10.0,
                show_default=True,
                help="Seconds the leader key lives without renewal (the bucket's TTL).",
            ),
            _option(
                "metrics-addr",
                help="HOST:PORT for Prometheus /metrics, /healthz and /readyz (off when unset).",
            ),
        ],
    )


@dataclass(frozen=True, kw_only=True)
class Common:
    """The common options, parsed."""

    nats: ConnectOptions
    prefix: str


def common_from(kwargs: dict[str, Any], *, name: str) -> Common:
    """Pop the bus and log options out of a command's keyword arguments."""
    configure_logging(fmt=kwargs.pop("log_format"), level=kwargs.pop("log_level"))
    creds, tls_ca = kwargs.pop("nats_creds"), kwargs.pop("tls_ca")
    try:
        nats = ConnectOptions(
            urls=parse_urls(kwargs.pop("nats_url")),
            creds_file=str(creds) if creds else None,
            user=kwargs.pop("nats_user"),
            password=kwargs.pop("nats_password"),
            tls_ca_file=str(tls_ca) if tls_ca else None,
            name=name,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    return Common(nats=nats, prefix=kwargs.pop("prefix"))


def incus_options(f: F) -> F:
    """Which Incus hosts to reach, and how (``--incus-fleet``, ``--incus``, TLS)."""
    return _apply(
        f,
        [
            _option(
                "incus-fleet",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help='Fleet file: {"hosts": {"<host>": {"url": "<pylxd URL>"}}} (the '
                "simulator writes one).",
            ),
            _option(
                "incus",
                multiple=True,
                metavar="HOST=URL",
                envvar="RC_INCUS",
                help="An Incus host and its URL (https://…:8443 or http+unix://…); repeatable.",
            ),
            _option(
                "incus-cert",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="Client certificate for Incus over TLS (with --incus-key).",
            ),
            _option(
                "incus-key",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="Client key for Incus over TLS.",
            ),
            _option(
                "incus-verify",
                default="true",
                show_default=True,
                help="Verify Incus's certificate: true, false, or a CA/server certificate path.",
            ),
        ],
    )


def incus_endpoints(kwargs: dict[str, Any]) -> tuple[IncusEndpoint, ...]:
    """Pop the Incus options out of a command's keyword arguments; the endpoints, by host."""
    fleet, pairs = kwargs.pop("incus_fleet"), kwargs.pop("incus")
    cert_path, key_path = kwargs.pop("incus_cert"), kwargs.pop("incus_key")
    verify_text = str(kwargs.pop("incus_verify"))
    if (cert_path is None) != (key_path is None):
        raise click.BadParameter("--incus-cert and --incus-key go together")
    cert = (str(cert_path), str(key_path)) if cert_path is not None else None
    verify: bool | str = {"true": True, "false": False}.get(verify_text.lower(), verify_text)
    found: dict[str, IncusEndpoint] = {}
    if fleet is not None:
        try:
            for ep in endpoints_from_fleet_file(fleet):
                found[ep.host] = IncusEndpoint(host=ep.host, url=ep.url, cert=cert, verify=verify)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"cannot read fleet file {fleet}: {exc!r}") from exc
    for pair in pairs:
        host, sep, url = pair.partition("=")
        if not sep or not host or not url:
            raise click.BadParameter(f"--incus takes HOST=URL, not {pair!r}")
        found[host] = IncusEndpoint(host=host, url=url, cert=cert, verify=verify)
    return tuple(found[name] for name in sorted(found))
