"""The command-line options of docs/cli.md that more than one command takes, in one
place: the bus and logging options, the store, the replica's tuning and retention, the
Incus hosts, and the one-shot commands' connect timeout (an option of one command only
is declared with its command).

Each option is also an environment variable ``RC_<NAME>`` (``--nats-url`` is
``RC_NATS_URL``); a flag given on the command line wins. Commands take the options they
need through the decorators below and turn them into :class:`Common`. An option that
sets a field of a program's configuration (``RunConfig``, ``ExecutorConfig``,
``ConnectOptions``) takes its default from that field (:func:`config_default`): one
source of each default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import click
import orjson

from reconciler.bus.connection import DEFAULT_NATS_URL, ConnectOptions, parse_urls
from reconciler.bus.streams import DEFAULT_LEADER_TTL_S
from reconciler.cli.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from reconciler.core.messages import DEFAULT_PREFIX
from reconciler.core.retention import DEFAULT_DECISION_RETENTION_S
from reconciler.incus.client import DEFAULT_OPERATION_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S
from reconciler.incus.endpoints import IncusEndpoint, endpoints_from_fleet_file
from reconciler.replica.collector import DEFAULT_GC_THRESHOLD
from reconciler.replica.replica import RunConfig
from reconciler.replica.reservation_reaper import (
    DEFAULT_JOURNAL_RETENTION_S,
    DEFAULT_RESERVATION_TIMEOUT_S,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "Common",
    "IncusOptions",
    "bus_options",
    "common_from",
    "config_default",
    "connect_timeout_option",
    "db_option",
    "decision_retention_option",
    "decision_wait_option",
    "incus_from",
    "incus_options",
    "load_endpoints",
    "log_options",
    "oneshot_log_options",
    "parse_verify",
    "read_secret",
    "reply_timeout_option",
    "retention_options",
    "run_options",
    "stream_replicas_option",
]

F = TypeVar("F", bound=Callable[..., Any])


def config_default(config: type[Any], name: str) -> Any:
    """The default of field ``name`` of the configuration dataclass ``config``."""
    for found in dataclasses.fields(config):
        if found.name == name:
            if found.default is not dataclasses.MISSING:
                return found.default
            if found.default_factory is not dataclasses.MISSING:
                return found.default_factory()
            break
    raise LookupError(f"{config.__name__}.{name} has no default")


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
            _option(
                "nats-password",
                help="NATS password (needs --nats-user). Visible in ps on the command line: "
                "prefer RC_NATS_PASSWORD or --nats-password-file.",
            ),
            _option(
                "nats-password-file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="File holding the NATS password (one line; e.g. a systemd credential).",
            ),
            _option(
                "tls-ca",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="CA file to verify the NATS server's certificate.",
            ),
            _option(
                "tls-cert",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="Client certificate (PEM) for NATS servers that verify clients; "
                "needs --tls-key.",
            ),
            _option(
                "tls-key",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="The client certificate's private key (PEM).",
            ),
            _option(
                "nats-nkey",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="NKey seed file to authenticate with (the seed stays in the file).",
            ),
            _option(
                "inbox-prefix",
                default=config_default(ConnectOptions, "inbox_prefix"),
                show_default=True,
                help="Prefix of every reply subject (a least-privilege user may subscribe to "
                "<prefix>.> only), e.g. _INBOX.bridge.",
            ),
            _option(
                "prefix",
                default=DEFAULT_PREFIX,
                show_default=True,
                help="Subject prefix: streams <PREFIX>_IN, <PREFIX>_OUT, bucket <prefix>_leader.",
            ),
        ],
    )


def stream_replicas_option(help_text: str) -> Callable[[F], F]:
    """``--stream-replicas`` (``RC_STREAM_REPLICAS``): replicas of the streams and the
    leader bucket, for the commands that may create them (``run``, ``provision``)."""
    return _option(
        "stream-replicas",
        type=click.IntRange(min=1, max=5),
        default=config_default(RunConfig, "stream_replicas"),
        show_default=True,
        help=help_text,
    )


def db_option(f: F) -> F:
    """``--db``: the SQLite file."""
    return _option(
        "db",
        type=click.Path(dir_okay=False, path_type=Path),
        default=config_default(RunConfig, "db"),
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
                default=config_default(RunConfig, "workers"),
                show_default=True,
                help="Workers per keyed reconciler queue.",
            ),
            _option(
                "status-debounce",
                type=click.FloatRange(min=0, min_open=True),
                default=config_default(RunConfig, "status_debounce_s"),
                show_default=True,
                help="Seconds a host or pool status waits for more changes before publishing.",
            ),
            _option(
                "status-progress-interval",
                type=click.FloatRange(min=0, min_open=True),
                default=config_default(RunConfig, "status_progress_interval_s"),
                show_default=True,
                help="Seconds between full rounds of status, changed or not.",
            ),
            _option(
                "live-get-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=config_default(RunConfig, "live_get_timeout_s"),
                show_default=True,
                help="Seconds a live Incus GET of a suspect instance may take.",
            ),
            _option(
                "warm-boot-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=config_default(RunConfig, "warm_boot_timeout_s"),
                show_default=True,
                help="Seconds a warm VM may take from admission to ready before its lease is "
                "released and the pool asks for another.",
            ),
            _option(
                "leader-ttl",
                type=click.FloatRange(min=0, min_open=True),
                default=DEFAULT_LEADER_TTL_S,
                show_default=True,
                help="Seconds the leader key lives without renewal (the bucket's TTL).",
            ),
            _option(
                "snapshot-interval",
                type=click.FloatRange(min=0),
                default=config_default(RunConfig, "snapshot_interval_s"),
                show_default=True,
                help="Seconds between the leader's snapshots of the state to the object store "
                "<prefix>_snapshots (0: none). A replica with an empty store starts from the "
                "newest one; replay starts from one when the stream's oldest inputs aged out.",
            ),
            _option(
                "metrics-addr",
                help="HOST:PORT for Prometheus /metrics, /healthz and /readyz (off when unset).",
            ),
            _option(
                "metrics-per-host",
                is_flag=True,
                default=False,
                help="Also export one series per host (rc_host_capacity, rc_host_booked, "
                "rc_host_schedulable): 9 series a host. The fleet's totals are always there.",
            ),
            _option(
                "gc-threshold",
                type=click.IntRange(min=0),
                default=DEFAULT_GC_THRESHOLD,
                show_default=True,
                help="Allocations between two collections of the garbage collector's youngest "
                "generation; CPython's 700 costs the fold about 7 % of its CPU and 100 ms "
                "pauses once the state is large. The folded state is also frozen out of every "
                "collection (once loaded, then at most once a second) and collected in full "
                "once an hour. 0 keeps the interpreter's behaviour.",
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

    def path(key: str) -> str | None:
        value = kwargs.pop(key)
        return str(value) if value else None

    password = kwargs.pop("nats_password")
    password_file = kwargs.pop("nats_password_file")
    if password_file is not None:
        if password is not None:
            raise click.UsageError("give --nats-password or --nats-password-file, not both")
        password = read_secret(password_file, option="--nats-password-file")
    try:
        nats = ConnectOptions(
            urls=parse_urls(kwargs.pop("nats_url")),
            creds_file=path("nats_creds"),
            user=kwargs.pop("nats_user"),
            password=password,
            tls_ca_file=path("tls_ca"),
            tls_cert_file=path("tls_cert"),
            tls_key_file=path("tls_key"),
            nkey_seed_file=path("nats_nkey"),
            inbox_prefix=kwargs.pop("inbox_prefix"),
            name=name,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    return Common(nats=nats, prefix=kwargs.pop("prefix"))


def read_secret(path: Path, *, option: str) -> str:
    """A secret from a file: its first line, without the line end. Errors name the file,
    never its content."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or type(exc).__name__}",
            param_hint=option,
        ) from None
    secret = text.splitlines()[0] if text else ""
    if not secret:
        raise click.BadParameter(f"{path} is empty", param_hint=option)
    return secret


def parse_verify(value: str) -> bool | str:
    """``--incus-verify``: ``true``/``false``, or a CA bundle or server certificate path."""
    lowered = value.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    if not Path(value).is_file():
        raise click.BadParameter(f"{value!r} is neither true, false nor a certificate file")
    return value


def _url(value: str) -> str:
    """A pylxd endpoint URL; a socket path (``/…`` or ``unix:/…``) becomes ``http+unix``."""
    path = value.removeprefix("unix:") if value.startswith("unix:") else value
    if path.startswith("/"):
        return "http+unix://" + quote(path, safe="")
    return value


def _tls(
    endpoint: IncusEndpoint, entry: dict[str, Any], cert: tuple[str, str] | None, verify: bool | str
) -> IncusEndpoint:
    own_cert = entry.get("client_cert"), entry.get("client_key")
    chosen_cert = (str(own_cert[0]), str(own_cert[1])) if all(own_cert) else cert
    chosen_verify: bool | str = verify
    if "verify" in entry:
        raw = entry["verify"]
        chosen_verify = raw if isinstance(raw, bool) else str(raw)
    if not endpoint.url.startswith("https://"):
        return endpoint
    return dataclasses.replace(endpoint, cert=chosen_cert, verify=chosen_verify)


def load_endpoints(
    *,
    fleet_file: Path | None,
    pairs: Iterable[str] = (),
    only: Iterable[str] = (),
    cert: tuple[str, str] | None = None,
    verify: bool | str = True,
) -> tuple[IncusEndpoint, ...]:
    """The Incus hosts of a fleet file and of ``HOST=URL`` pairs (which win), narrowed to
    ``only`` when given; TLS settings apply to ``https://`` hosts without their own."""
    found: dict[str, IncusEndpoint] = {}
    entries: dict[str, dict[str, Any]] = {}
    if fleet_file is not None:
        try:
            raw = orjson.loads(fleet_file.read_bytes())
            entries = {str(k): dict(v) for k, v in raw["hosts"].items()}
            for endpoint in endpoints_from_fleet_file(fleet_file):
                found[endpoint.host] = endpoint
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise click.BadParameter(
                f"cannot read fleet file {fleet_file}: {exc!r}", param_hint="--incus-fleet"
            ) from exc
    for pair in pairs:
        host, sep, url = pair.partition("=")
        if not sep or not host or not url:
            raise click.BadParameter(f"{pair!r} is not HOST=URL", param_hint="--incus")
        found[host] = IncusEndpoint(host=host, url=_url(url))
        entries.pop(host, None)
    wanted = set(only)
    if wanted:
        unknown = wanted - set(found)
        if unknown:
            raise click.BadParameter(f"not in the fleet: {sorted(unknown)}", param_hint="--host")
        found = {h: e for h, e in found.items() if h in wanted}
    return tuple(_tls(found[h], entries.get(h, {}), cert, verify) for h in sorted(found))


@dataclass(frozen=True, kw_only=True)
class IncusOptions:
    """The Incus options, parsed: the hosts and how long a call may take."""

    endpoints: tuple[IncusEndpoint, ...]
    request_timeout_s: float
    operation_timeout_s: float


def incus_options(f: F) -> F:
    """Which Incus hosts to reach, and how: ``--incus-fleet``, ``--incus HOST=URL``, TLS
    and timeouts. Each is also ``RC_INCUS_…`` (``--incus`` is ``RC_INCUS``)."""
    return _apply(
        f,
        [
            _option(
                "incus-fleet",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help='Fleet file: {"hosts": {"<host>": {"url": "https://10.0.0.5:8443"}, ...}} '
                "(what sim-incus --fleet-file writes; see README).",
            ),
            click.option(
                "--incus",
                "incus_pairs",
                multiple=True,
                metavar="HOST=URL",
                envvar="RC_INCUS",
                show_envvar=True,
                help="A host and its endpoint (https://…:8443, or a unix socket path); repeatable.",
            ),
            _option(
                "incus-cert",
                type=click.Path(exists=True, dir_okay=False),
                help="Client certificate (PEM) for https endpoints; needs --incus-key.",
            ),
            _option(
                "incus-key",
                type=click.Path(exists=True, dir_okay=False),
                help="Client certificate's private key (PEM).",
            ),
            _option(
                "incus-verify",
                default="true",
                show_default=True,
                help="Verify https endpoints: true, false, or a CA bundle / server certificate.",
            ),
            _option(
                "incus-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=DEFAULT_REQUEST_TIMEOUT_S,
                show_default=True,
                help="Seconds one HTTP request to Incus may take.",
            ),
            _option(
                "incus-operation-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=DEFAULT_OPERATION_TIMEOUT_S,
                show_default=True,
                help="Seconds an Incus operation (create, start, stop, delete) may take.",
            ),
        ],
    )


def incus_from(kwargs: dict[str, Any], *, only: Iterable[str] = ()) -> IncusOptions:
    """Pop the Incus options out of a command's keyword arguments."""
    cert_file, key_file = kwargs.pop("incus_cert"), kwargs.pop("incus_key")
    if bool(cert_file) != bool(key_file):
        raise click.UsageError("--incus-cert and --incus-key go together")
    endpoints = load_endpoints(
        fleet_file=kwargs.pop("incus_fleet"),
        pairs=kwargs.pop("incus_pairs"),
        only=only,
        cert=(str(cert_file), str(key_file)) if cert_file else None,
        verify=parse_verify(kwargs.pop("incus_verify")),
    )
    return IncusOptions(
        endpoints=endpoints,
        request_timeout_s=kwargs.pop("incus_timeout"),
        operation_timeout_s=kwargs.pop("incus_operation_timeout"),
    )


# ------------------------------------------------------------------ one-shot commands

DEFAULT_CONNECT_TIMEOUT_S = 10.0


def oneshot_log_options(f: F) -> F:
    """``--log-format`` and ``--log-level`` for a command that runs once: it logs warnings
    and errors unless asked for more (its result is what it prints, not its logs)."""
    f = click.option(
        "--log-level",
        envvar="RC_LOG_LEVEL",
        show_envvar=True,
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="warning",
        show_default=True,
        help="Least severe level logged.",
    )(f)
    return click.option(
        "--log-format",
        envvar="RC_LOG_FORMAT",
        show_envvar=True,
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        help="Log lines as JSON objects or as readable text.",
    )(f)


def connect_timeout_option(f: F) -> F:
    """``--connect-timeout``: seconds to reach a NATS server before giving up."""
    return click.option(
        "--connect-timeout",
        envvar="RC_CONNECT_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0, min_open=True),
        default=DEFAULT_CONNECT_TIMEOUT_S,
        show_default=True,
        help="Seconds to reach a NATS server before giving up with an error.",
    )(f)


# ------------------------------------------------------------------ retention


def decision_wait_option(f: F) -> F:
    """``--wait``: seconds to wait for the fold's final decision (0: publish only). A
    command that waits and gets none exits 1: no replica answered."""
    return click.option(
        "--wait",
        type=click.FloatRange(min=0),
        default=30.0,
        show_default=True,
        help="Seconds to wait for the fold's final decision (0: publish only, do not wait).",
    )(f)


def reply_timeout_option(default: float) -> Callable[[F], F]:
    """``--timeout``: seconds to wait for a (synced) replica's reply to a query."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=default,
        show_default=True,
        help="Seconds to wait for a replica's reply.",
    )


def decision_retention_option(f: F) -> F:
    """``--decision-retention`` (``RC_DECISION_RETENTION``), in seconds of stream time."""
    return click.option(
        "--decision-retention",
        envvar="RC_DECISION_RETENTION",
        show_envvar=True,
        type=click.IntRange(min=1),
        default=DEFAULT_DECISION_RETENTION_S,
        show_default=True,
        help="Seconds of stream time a decided request id is remembered (its decision "
        "re-sent unchanged) after its final decision, and a released lease kept after its "
        "release. Evicted inside the fold: replicas and replays must use the same value.",
    )(f)


def retention_options(f: F) -> F:
    """``--decision-retention``, ``--journal-retention`` and ``--reservation-timeout``."""
    f = click.option(
        "--reservation-timeout",
        envvar="RC_RESERVATION_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0, min_open=True),
        default=DEFAULT_RESERVATION_TIMEOUT_S,
        show_default=True,
        help="Seconds a cold lease may stay reserved after its admission (its creator "
        "never created the VM) before the leader releases it.",
    )(f)
    f = click.option(
        "--journal-retention",
        envvar="RC_JOURNAL_RETENTION",
        show_envvar=True,
        type=click.IntRange(min=1),
        default=DEFAULT_JOURNAL_RETENTION_S,
        show_default=True,
        help="Seconds of stream time the store keeps lease history (the journal that "
        "`reconciler audit` shows); older rows are pruned as batches are written.",
    )(f)
    return decision_retention_option(f)
