"""The page's server: aiohttp on one address (see the package's rules).

- :func:`check_exposure` refuses a non-loopback address without TLS and a password;
  :func:`tls_context` loads the certificate and its key (an error names the files,
  never what they hold).
- :class:`Queries` asks any synced replica the ``fleet``, ``decisions`` and ``lease``
  queries (:class:`~reconciler.client.ReconcilerClient`), each bounded by ``wait_s``.
- :class:`WebServer` serves ``/`` (``?after=<host>`` pages the hosts), ``/lease/<id>``,
  ``/lease?id=<id>`` (the search box: a redirect to the former), ``/static/page.css``
  and ``/healthz``; GET and HEAD only. With a password every path but ``/healthz``
  asks for it (HTTP basic auth, user and password compared in constant time). Every
  answer carries a Content-Security-Policy that allows the page's own style sheet and
  nothing else, and ``Cache-Control: no-store``.
- When no replica answers, the page says so (HTTP 503) instead of showing old numbers.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hmac
import importlib.resources
import ipaddress
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.client import Client

from reconciler.client import ClientError, QueryFailed, ReconcilerClient
from reconciler.core.messages import MessageError, Origin
from reconciler.web.page import lease_path, render_lease, render_overview, render_problem

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "DEFAULT_LISTEN",
    "Exposure",
    "Queries",
    "WebConfig",
    "WebServer",
    "check_exposure",
    "is_loopback",
    "tls_context",
]

logger = structlog.get_logger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8480"

_CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
_REALM = 'Basic realm="reconciler", charset="UTF-8"'


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve to anything


class Exposure(ValueError):
    """An address the page may not listen on with the protection given."""


def check_exposure(host: str, *, tls: bool, password: bool) -> None:
    """Refuse (:class:`Exposure`) a non-loopback ``host`` without TLS and a password."""
    if is_loopback(host) or (tls and password):
        return
    missing = [
        what
        for what, given in (
            ("--https-cert and --https-key", tls),
            ("a password (--password-file or RC_WEB_PASSWORD)", password),
        )
        if not given
    ]
    raise Exposure(
        f"{host} is not a loopback address: the page is served beyond this machine only "
        f"with TLS and a password; give {' and '.join(missing)}"
    )


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context for ``cert`` and ``key`` (PEM); :class:`ValueError` naming the
    files when they cannot be loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        why = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__
        raise ValueError(f"cannot load the certificate {cert} with the key {key}: {why}") from None
    return context


@dataclass(frozen=True, slots=True)
class WebConfig:
    host: str
    port: int
    #: HTTP basic auth: ``(user, password)``; ``None`` asks for nothing
    credentials: tuple[str, str] | None = None
    tls: ssl.SSLContext | None = None
    #: seconds between the page's reloads (0: never)
    refresh_s: int = 10
    #: how long a page waits for a replica's answers
    wait_s: float = 5.0


#: waiting requests the page lists (the queue query's ``total`` says how many wait)
QUEUE_SHOWN = 50


class Queries:
    """The page's data: the queries of any synced replica, over ``nc``."""

    def __init__(self, nc: Client, *, prefix: str, wait_s: float) -> None:
        self.client = ReconcilerClient(nc, prefix=prefix, origin=Origin.CLI)
        self.wait_s = wait_s

    async def overview(self, after: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``fleet`` (hosts after ``after``) and ``decisions`` answers."""
        fleet = await self.client.query(
            "fleet", {"after": after} if after else {}, within_s=self.wait_s
        )
        decisions = await self.client.query("decisions", {}, within_s=self.wait_s)
        return fleet, decisions

    async def queue(self) -> dict[str, Any] | None:
        """The first :data:`QUEUE_SHOWN` waiting requests (the ``queue`` answer), or
        ``None`` from a replica of a release without queues (it does not know the
        query): the page then has no queue to show, not a problem."""
        try:
            found = await self.client.query("queue", {"limit": QUEUE_SHOWN}, within_s=self.wait_s)
        except QueryFailed as exc:
            if exc.code == "invalid":
                return None
            raise
        return found if isinstance(found, dict) else None

    async def lease(self, identifier: str) -> dict[str, Any] | None:
        """The lease ``identifier`` names, with its history and decisions; ``None``
        when nothing is known by it."""
        found = await self.client.query(
            "lease", {"identifier": identifier, "decisions": True}, within_s=self.wait_s
        )
        return found if isinstance(found, dict) else None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _problem(exc: Exception) -> str:
    if isinstance(exc, QueryFailed):  # an older replica does not know the query, say
        return f"a replica refused the page's query: {exc}"
    return f"no answer from a synced replica: {exc}"


class WebServer:
    """The page on ``config``'s address, from ``queries``; :meth:`start`, :meth:`stop`."""

    def __init__(self, config: WebConfig, queries: Queries) -> None:
        self.config = config
        self.queries = queries
        self.port = config.port
        self._runner: web.AppRunner | None = None
        self._css = (
            importlib.resources.files("reconciler.web").joinpath("static/page.css").read_bytes()
        )

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls is not None else "http"
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{scheme}://{host}:{self.port}/"

    def app(self) -> web.Application:
        from aiohttp import web

        @web.middleware
        async def protect(request: web.Request, handler: Any) -> web.StreamResponse:
            asks = self.config.credentials is not None and request.path != "/healthz"
            if asks and not self._authorized(request.headers.get("Authorization", "")):
                response: web.StreamResponse = web.Response(
                    status=401, text="a password is needed\n", headers={"WWW-Authenticate": _REALM}
                )
                response.headers.update(_HEADERS)
                return response
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # the router's 404 and 405: headers added too
                response = web.Response(status=exc.status, text=exc.text, headers=exc.headers)
            response.headers.update(_HEADERS)
            if self.config.tls is not None:
                response.headers["Strict-Transport-Security"] = "max-age=31536000"
            return response

        app = web.Application(middlewares=[protect])
        app.router.add_get("/", self._overview)
        app.router.add_get("/lease", self._find)
        app.router.add_get("/lease/{identifier:.+}", self._lease)
        app.router.add_get("/static/page.css", self._style)
        app.router.add_get("/healthz", self._healthz)
        return app

    def _authorized(self, header: str) -> bool:
        assert self.config.credentials is not None
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        want_user, want_password = (s.encode() for s in self.config.credentials)
        # both compared, always, in constant time
        user_ok = hmac.compare_digest(user, want_user)
        password_ok = hmac.compare_digest(password, want_password)
        return bool(sep) and user_ok and password_ok

    async def _overview(self, request: web.Request) -> web.Response:
        from aiohttp import web

        after = request.query.get("after") or None
        try:
            fleet, decisions = await self.queries.overview(after)
            waiting = await self.queries.queue()
        except (ClientError, MessageError) as exc:
            html = render_overview(None, None, now=_now(), refresh_s=self.config.refresh_s,
                                   problem=_problem(exc))  # fmt: skip
            return web.Response(text=html, status=503, content_type="text/html")
        html = render_overview(
            fleet, decisions, now=_now(), refresh_s=self.config.refresh_s, queue=waiting
        )
        return web.Response(text=html, content_type="text/html")

    async def _find(self, request: web.Request) -> web.Response:
        from aiohttp import web

        identifier = request.query.get("id", "").strip()
        where = lease_path(identifier) if identifier else "/"
        return web.Response(status=303, headers={"Location": where})

    async def _lease(self, request: web.Request) -> web.Response:
        from aiohttp import web

        identifier = request.match_info["identifier"]
        if len(identifier) > 256:
            html = render_problem("bad request", "an identifier is at most 256 characters",
                                  now=_now())  # fmt: skip
            return web.Response(text=html, status=400, content_type="text/html")
        try:
            lease = await self.queries.lease(identifier)
        except (ClientError, MessageError) as exc:
            html = render_lease(identifier, None, now=_now(), problem=_problem(exc))
            return web.Response(text=html, status=503, content_type="text/html")
        html = render_lease(identifier, lease, now=_now())
        return web.Response(text=html, status=200 if lease else 404, content_type="text/html")

    async def _style(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(body=self._css, content_type="text/css")

    async def _healthz(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(text="ok\n")

    async def start(self) -> None:
        from aiohttp import web

        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port,
                           ssl_context=self.config.tls)  # fmt: skip
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or ()
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        logger.info("web.listening", url=self.url, password=self.config.credentials is not None)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
