"""Connecting to NATS: one place for credentials, TLS, reconnection and connection logs.

Rules:

- A connection reconnects forever (``max_reconnect_attempts=-1``), waiting
  ``reconnect_wait_s`` between attempts to the same server. The *initial* connect retries
  the same way, so a daemon started before its NATS server waits for it; pass
  ``initial_timeout_s`` to give up instead (``TimeoutError``). A first connection that
  can never succeed (the server's certificate not trusted or not for that host name,
  our client certificate refused, our credentials refused) raises
  :class:`ConnectRefused` at once, saying which; later reconnections keep trying
  (credentials may be rotated meanwhile). A refused client certificate is named even
  when the server's alert was lost to a reset (TLS 1.3 lets nats-py write ``CONNECT``
  before the server has judged the certificate): after such a hang-up each server is
  asked once more by :func:`~reconciler.bus.tls_probe.hangup_cause`, which writes
  nothing after its handshake and so reads the alert. A one-shot connection (with
  ``initial_timeout_s``) logs its connect and close at debug only.
- Disconnects, reconnects, errors and the final close are logged through structlog; the
  client never prints.
- ``tls_ca_file`` makes a TLS context that verifies the server against that CA; without
  it, a ``tls://`` URL uses the system's trust store. ``tls_cert_file`` and
  ``tls_key_file`` add a client certificate (a server with ``verify: true`` asks for one).
- TLS never falls back to plaintext. A ``tls://`` URL or any TLS option means TLS or no
  connection: nats-py itself upgrades to TLS only when the server's ``INFO`` asks for it,
  so the client checks every server's ``INFO`` (first connection, reconnection,
  discovered cluster members alike) before anything of ours is sent. A server that offers
  TLS without requiring it (``allow_non_tls``) is spoken to in TLS; one that does not
  offer it is refused (:class:`TlsNotOffered`), and the first connection fails at once
  with :class:`ConnectRefused`: no ``CONNECT``, hence no credential, ever reaches it.
  The check goes through a nats-py internal
  (:class:`~reconciler.bus.nats_internals.TlsOnlyClient`); on a nats-py without it, a
  connection that asks for TLS is refused
  (:class:`~reconciler.bus.nats_internals.UnsupportedNatsPy`) rather than risked in
  plaintext.
- ``nkey_seed_file`` authenticates with an NKey seed file (the seed is read by nats-py,
  never held by us); ``inbox_prefix`` scopes every reply subject (requests, publish acks,
  pull deliveries) so that a least-privilege user subscribes to ``<prefix>.>`` only.
- A permissions violation the server reports is logged as an error naming the subject,
  and fed to the connection's :class:`~reconciler.bus.violations.ViolationWatch`, so a
  call it refused fails at once instead of timing out.
- Secrets (password, seed, key) are never logged nor put into an error message.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import re
import ssl
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import anyio
import structlog
from nats.aio.client import Client

from reconciler.bus import nats_internals
from reconciler.bus.nats_internals import (
    TidyClient,
    TlsNotOffered,
    TlsOnlyClient,
    UnsupportedNatsPy,
)
from reconciler.bus.tls_probe import hangup_cause
from reconciler.bus.violations import watch_of

__all__ = [
    "DEFAULT_NATS_URL",
    "ConnectOptions",
    "ConnectRefused",
    "TlsNotOffered",
    "check_url",
    "connect",
    "parse_urls",
    "shown_urls",
    "tls_context",
]

logger = structlog.get_logger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def parse_urls(value: str) -> tuple[str, ...]:
    """Split a ``--nats-url`` value: one URL, or several separated by commas or spaces,
    each checked by :func:`check_url` (a bad one is refused before any connection)."""
    urls = tuple(part for part in re.split(r"[,\s]+", value) if part)
    if not urls:
        raise ValueError("no NATS URL given")
    for url in urls:
        check_url(url)
    bare = [u for u in urls if "://" not in u]
    if bare and len(bare) < len(urls):  # "nats://host name": a space split one value
        raise ValueError(
            f"{bare[0].rpartition('@')[2]!r} has no scheme where the other URLs have one: "
            "commas and spaces separate URLs, so give each its nats:// (or tls://, ws://, "
            "wss://)"
        )
    return urls


#: the schemes nats-py connects with; a URL without one is ``nats://``
NATS_SCHEMES = ("nats", "tls", "ws", "wss")

_HOST = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?"
)


def check_url(url: str) -> None:
    """Raise :class:`ValueError` unless ``url`` is one NATS server's URL:
    ``[nats|tls|ws|wss://][user[:password]@]host[:port]``, with a host name or an IP
    address and a port number. The error never shows credentials."""
    full = url if "://" in url else f"nats://{url}"
    parts = urlsplit(full)
    shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
    schemes = ", ".join(f"{s}://" for s in NATS_SCHEMES)
    if parts.scheme.lower() not in NATS_SCHEMES:
        raise ValueError(
            f"NATS URL {shown!r}: {parts.scheme}:// is not a NATS scheme (one of {schemes})"
        )
    try:
        port = parts.port
    except ValueError:
        port = -1
    host = parts.hostname or ""
    if port == -1 or parts.netloc.endswith(":"):
        raise ValueError(f"NATS URL {shown!r}: the port is not a number from 0 to 65535")
    if not _is_address(host):
        raise ValueError(
            f"NATS URL {shown!r}: {host or 'an empty host'!s} is not a host name or an IP "
            "address (separate several URLs with commas)"
        )
    if parts.path not in ("", "/") and parts.scheme.lower() not in ("ws", "wss"):
        raise ValueError(f"NATS URL {shown!r}: a nats:// or tls:// URL has no path")


def shown_urls(urls: tuple[str, ...]) -> str:
    """``urls`` as errors and logs may show them: without the user and password a URL
    may carry."""
    shown = []
    for url in urls:
        scheme, sep, rest = url.rpartition("://")
        authority, slash, path = rest.partition("/")
        shown.append(f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}")
    return ", ".join(shown)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST.fullmatch(host)) and not host.replace(".", "").isdigit()
    return True


@dataclass(frozen=True, kw_only=True)
class ConnectOptions:
    """How to reach NATS; mirrors the common command-line options (docs/cli.md). The
    password is left out of ``repr``, so logging these options cannot leak it."""

    urls: tuple[str, ...] = (DEFAULT_NATS_URL,)
    creds_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    nkey_seed_file: str | None = None
    inbox_prefix: str = "_INBOX"
    name: str | None = None
    reconnect_wait_s: float = 2.0
    connect_timeout_s: float = 2.0
    ping_interval_s: float = 20.0
    initial_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):  # a forgiving constructor: urls="nats://a,nats://b"
            object.__setattr__(self, "urls", parse_urls(self.urls))
        if not self.urls:
            raise ValueError("ConnectOptions.urls is empty")
        if self.password is not None and self.user is None:
            raise ValueError("a NATS password needs a user")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a TLS client certificate and its key go together")
        if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", self.inbox_prefix):
            raise ValueError(f"inbox prefix {self.inbox_prefix!r} is not a subject of plain tokens")
        if self.requires_tls:
            plain_ws = [url for url in self.urls if url.lower().startswith("ws://")]
            if plain_ws:
                raise ValueError(
                    f"{plain_ws[0]} is a plain WebSocket URL, but TLS was asked for "
                    "(a tls:// URL or a TLS option): use wss:// for TLS over WebSocket"
                )

    @property
    def uses_tls(self) -> bool:
        """Whether the options ask for TLS beyond what a ``tls://`` URL implies."""
        return any((self.tls_ca_file, self.tls_cert_file, self.tls_key_file))

    @property
    def requires_tls(self) -> bool:
        """Whether every connection must be TLS: a ``tls://`` (or ``wss://``) URL, or any
        TLS option. Such options never fall back to plaintext."""
        return self.uses_tls or any(
            url.lower().startswith(("tls://", "wss://")) for url in self.urls
        )

    @classmethod
    def from_url(cls, url: str, **options: object) -> ConnectOptions:
        """Options for ``url`` (commas allowed), other fields as keywords."""
        return cls(urls=parse_urls(url), **options)  # type: ignore[arg-type]


def tls_context(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca_file`` (the system's trust
    store without it) and presents ``cert_file``/``key_file`` when given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            # the key file's content never reaches the message: only the paths and the cause
            raise ValueError(
                f"cannot load the TLS client certificate {cert_file} with key {key_file}: "
                f"{exc.strerror or type(exc).__name__}"
            ) from None
    return context


async def connect(opts: ConnectOptions) -> Client:
    """Connect to NATS with ``opts``; the returned client reconnects forever."""
    if opts.requires_tls and not nats_internals.guards_tls():
        # no way to look at a server's INFO before CONNECT: TLS could fall back unseen
        raise UnsupportedNatsPy(
            "Client._process_info(info, initial_connection), which keeps TLS from ever "
            "falling back to plaintext"
        )
    needs_nkeys = opts.creds_file is not None or opts.nkey_seed_file is not None
    if needs_nkeys and importlib.util.find_spec("nkeys") is None:
        raise RuntimeError(
            "--nats-creds and --nats-nkey need the nkeys package (pip install 'nats-py[nkeys]')"
        )
    log = logger.bind(connection=opts.name)
    nc = TlsOnlyClient() if opts.requires_tls else TidyClient()
    #: the TLS context of every attempt (the system's trust store for a ``tls://`` URL
    #: without TLS options, as nats-py would make it)
    context = (
        tls_context(opts.tls_ca_file, opts.tls_cert_file, opts.tls_key_file)
        if opts.requires_tls
        else None
    )
    watch = watch_of(nc)
    #: why the first connection can never succeed (TLS or credentials refused)
    refusals: list[str] = []
    first_done = anyio.Event()  # later errors are a reconnection's: logged, retried
    refused = anyio.Event()
    hung_up = anyio.Event()  # a first attempt's TLS connection was reset or cut

    async def on_disconnected() -> None:
        if nc.is_closed:  # our own close(): on_closed says so
            return
        log.warning("nats.disconnected")

    async def on_reconnected() -> None:
        log.info("nats.reconnected", server=_server(nc))

    async def on_error(exc: Exception) -> None:
        if not first_done.is_set() and not refused.is_set():
            why = _refusal(exc)
            if why is not None:
                refusals.append(why)
                refused.set()
                return
            if context is not None and isinstance(exc, _HANGUPS):
                hung_up.set()  # perhaps a refused client certificate: diagnose() asks
        violation = watch.record(exc)
        if violation is not None:
            log.error("nats.permission_violation", error=str(violation))
            return
        log.warning("nats.error", error=str(exc) or type(exc).__name__, type=type(exc).__name__)

    # a one-shot connection (an operator's command) says nothing about its own open and
    # close unless asked (debug); a daemon's connection logs them at info
    routine = log.debug if opts.initial_timeout_s is not None else log.info

    async def on_closed() -> None:
        routine("nats.closed")

    # nats-py annotates these durations as int; it uses them as float seconds.
    reconnect_wait = cast(int, opts.reconnect_wait_s)
    connect_timeout = cast(int, opts.connect_timeout_s)
    ping_interval = cast(int, opts.ping_interval_s)
    attempt = nc.connect(
        servers=list(opts.urls),
        name=opts.name,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=reconnect_wait,
        connect_timeout=connect_timeout,
        ping_interval=ping_interval,
        user=opts.user,
        password=opts.password,
        user_credentials=opts.creds_file,
        nkeys_seed=opts.nkey_seed_file,
        inbox_prefix=opts.inbox_prefix,
        tls=context,
    )
    failed: list[Exception] = []
    try:
        with anyio.fail_after(opts.initial_timeout_s or math.inf):
            async with anyio.create_task_group() as tg:

                async def first_connect() -> None:
                    try:
                        await attempt
                    except Exception as exc:  # raised below as itself, not in a group
                        failed.append(exc)
                    tg.cancel_scope.cancel()

                async def until_refused() -> None:
                    await refused.wait()
                    tg.cancel_scope.cancel()

                async def diagnose() -> None:
                    # a hang-up right after the TLS handshake may hide the server's
                    # refusal of our certificate (see reconciler.bus.tls_probe): ask
                    # each server once, with nothing written after the handshake
                    await hung_up.wait()
                    assert context is not None
                    for url in opts.urls:
                        cause = await hangup_cause(url, context, opts.connect_timeout_s)
                        why = None if cause is None else _refusal(cause)
                        log.debug("nats.tls_probe", server=shown_urls((url,)), refusal=why)
                        if why is not None and not refused.is_set():
                            refusals.append(why)
                            refused.set()
                            return

                tg.start_soon(first_connect)
                tg.start_soon(until_refused)
                tg.start_soon(diagnose)
    except TimeoutError:
        await _abandon(nc)
        raise TimeoutError(
            f"no NATS server reachable at {shown_urls(opts.urls)} within {opts.initial_timeout_s} s"
        ) from None
    if failed:
        raise failed[0]
    if refusals:
        await _abandon(nc)
        raise ConnectRefused(f"cannot connect to NATS at {shown_urls(opts.urls)}: {refusals[0]}")
    first_done.set()
    routine("nats.connected", server=_server(nc))
    return nc


#: how long closing a client whose first connection failed may take (it takes
#: milliseconds, but for the case :func:`_abandon` describes)
_ABANDON_WITHIN_S = 2.0


async def _abandon(nc: Client) -> None:
    """Close a client whose first connection failed, even while its caller is cancelled.

    The wait is bounded: nats-py's ``close`` waits until the socket's close is confirmed
    to the stream nats-py opened it with, and for an attempt cancelled during its TLS
    upgrade that confirmation never comes (asyncio closes the socket, but reports it to
    the TLS layer that nats-py had not taken over yet). The socket is closed either way."""
    deadline = anyio.current_time() + _ABANDON_WITHIN_S
    with anyio.CancelScope(shield=True, deadline=deadline) as scope:
        await nc.close()
    if scope.cancelled_caught:
        logger.debug("nats.close_abandoned", within_s=_ABANDON_WITHIN_S)


#: how a first TLS attempt ends when the server refused our client certificate but its
#: alert was lost to the reset of the ``CONNECT`` nats-py had already written
_HANGUPS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError)


class ConnectRefused(ConnectionError):
    """The first connection was refused for a reason that retrying cannot cure: the
    server's certificate, our client certificate, our credentials, or a server that
    does not offer the TLS we asked for."""


def _refusal(exc: BaseException) -> str | None:
    """What an error of a first connection attempt means, when it is final."""
    if isinstance(exc, TlsNotOffered):
        return str(exc)
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the server's TLS certificate is not trusted ({exc.verify_message}): check "
            "--tls-ca, and that the URL's host name is one the certificate names"
        )
    if isinstance(exc, ssl.SSLError) and (
        "BAD_CERTIFICATE" in text or "CERTIFICATE_REQUIRED" in text or "UNKNOWN_CA" in text
    ):
        return (
            "the server refused our TLS client certificate (none given, or not signed by "
            "a CA it trusts): check --tls-cert and --tls-key"
        )
    if "authorization violation" in text.lower():
        return (
            "the server refused our credentials (Authorization Violation): check "
            "--nats-user/--nats-password(-file), --nats-nkey or --nats-creds"
        )
    return None


def _server(nc: Client) -> str | None:
    url = nc.connected_url
    return None if url is None else f"{url.scheme}://{url.hostname}:{url.port}"
