"""The page's server against a real replica over a real nats-server: what it serves, the
headers that keep the page to itself, HTTP basic auth, TLS, what it may listen on, and a
page that says so when no replica answers."""

from __future__ import annotations

import base64
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest
from nats.aio.client import Client

from reconciler.deploy.pki import Authority
from reconciler.web.page import lease_path
from reconciler.web.server import (
    Exposure,
    Queries,
    WebConfig,
    WebServer,
    check_exposure,
    is_loopback,
    tls_context,
)
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def serving(nc: Client, **config: object) -> AsyncIterator[WebServer]:
    settings: dict[str, object] = {"host": "127.0.0.1", "port": 0, "refresh_s": 0}
    settings.update(config)
    wait_s = float(str(settings.pop("wait_s", 5.0)))
    server = WebServer(WebConfig(**settings), Queries(nc, prefix="rc", wait_s=wait_s))  # type: ignore[arg-type]
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def basic(user: str, password: str) -> str:
    """An ``Authorization`` header's value for HTTP basic auth."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def fetch(
    url: str, *, auth: str | None = None, ssl_: ssl.SSLContext | None = None
) -> tuple[int, dict[str, str], str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            url,
            headers={"Authorization": auth} if auth else {},
            ssl=ssl_ if ssl_ is not None else True,
            allow_redirects=False,
        ) as r,
    ):
        return r.status, dict(r.headers), await r.text()


async def test_the_page_lists_the_requests_waiting_in_the_queue(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")), serving(nc) as web:
        await bus.send(b.snapshot("h1", cpu=4), b.pool("ci", cpu=4), b.admit("a1", "ci", "vm-1"))
        await bus.decision("a1")
        await bus.send(b.admit("q1", "ci", "vm-2", wait_s=600))
        queued = await bus.decision("q1", phase="pending")
        assert queued["outcome"] == "queued"

        status, _, page = await fetch(web.url)
        assert status == 200
        assert 'id="queue"' in page and 'data-request="q1"' in page
        assert "1 request(s) in the admission queue" in page and "insufficient-capacity" in page


async def test_the_page_is_served_from_a_replicas_queries_with_headers_that_keep_it_to_itself(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")), serving(nc) as web:
        await bus.send(b.snapshot("h1"), b.pool("ci"), b.admit("a1", "ci", "vm-1", job="job-1"))
        lease = (await bus.decision("a1"))["lease"]

        status, headers, page = await fetch(web.url)
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert 'data-host="h1"' in page and 'data-pool="ci"' in page
        assert 'data-request="a1"' in page
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "style-src 'self'" in csp and "script" not in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store"

        status, headers, css = await fetch(web.url + "static/page.css")
        assert status == 200 and headers["Content-Type"].startswith("text/css") and "rect" in css

        status, _, trail = await fetch(web.url + f"lease/{lease['lease_id']}")
        assert status == 200 and "vm-1" in trail and "admitted" in trail
        status, headers, _ = await fetch(web.url + "lease?id=job-1")
        assert status == 303 and headers["Location"] == "/lease/job-1"
        job = "octo/repo run 7 / job build"
        await bus.send(b.admit("a2", "ci", "vm-2", job=job))
        await bus.decision("a2")
        status, headers, _ = await fetch(web.url + "lease?id=" + quote(job))
        assert status == 303 and headers["Location"] == lease_path(job)
        status, _, trail = await fetch(web.url + lease_path(job).lstrip("/"))
        assert status == 200 and "vm-2" in trail and job in trail
        status, _, page = await fetch(web.url + "lease/nobody")
        assert status == 404 and "nothing is known as nobody" in page
        status, _, _ = await fetch(web.url + "nowhere")
        assert status == 404


async def test_nothing_is_written(nc: Client, nats_url: str, tmp_path: Path) -> None:
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")), serving(nc) as web:
        bus = BusClient(nc)
        await bus.send(b.snapshot("h1"))
        before = len(await bus.inputs())
        async with aiohttp.ClientSession() as session:
            for method in ("POST", "PUT", "DELETE"):
                async with session.request(method, web.url) as r:
                    assert r.status == 405
        await fetch(web.url)
        await fetch(web.url + "lease/h1")
        assert len(await bus.inputs()) == before


async def test_a_password_is_asked_for_on_every_page_but_the_health_probe(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    async with (
        running_replica(fast_config(nats_url, tmp_path / "rc.db")),
        serving(nc, credentials=("ops", "s3cret")) as web,
    ):
        for path in ("", "static/page.css", "lease/L1"):
            status, headers, body = await fetch(web.url + path)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
            assert "s3cret" not in body
        for wrong in (basic("ops", "nope"), basic("root", "s3cret")):
            assert (await fetch(web.url, auth=wrong))[0] == 401
        assert (await fetch(web.url, auth=basic("ops", "s3cret")))[0] == 200
        assert (await fetch(web.url + "healthz"))[0] == 200


async def test_tls_serves_the_page_over_https(nc: Client, nats_url: str, tmp_path: Path) -> None:
    ca = Authority.create()
    issued = ca.issue("web", sans=["127.0.0.1"], server=True)
    (tmp_path / "web.pem").write_bytes(issued.cert_pem)
    (tmp_path / "web-key.pem").write_bytes(issued.key_pem)
    context = tls_context(str(tmp_path / "web.pem"), str(tmp_path / "web-key.pem"))
    trust = ssl.create_default_context(cadata=ca.cert_pem.decode())
    async with (
        running_replica(fast_config(nats_url, tmp_path / "rc.db")),
        serving(nc, tls=context, credentials=("ops", "pw")) as web,
    ):
        assert web.url.startswith("https://")
        status, headers, _ = await fetch(web.url, auth=basic("ops", "pw"), ssl_=trust)
        assert status == 200 and "Strict-Transport-Security" in headers


def test_a_certificate_that_cannot_be_loaded_is_named_not_shown(tmp_path: Path) -> None:
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nsecretstuff\n")
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot load the certificate") as err:
        tls_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    assert "secretstuff" not in str(err.value)


async def test_the_page_says_so_when_no_replica_answers(nc: Client) -> None:
    async with serving(nc, wait_s=0.3) as web:
        status, _, page = await fetch(web.url)
        assert status == 503 and "no answer from a synced replica" in page
        status, _, page = await fetch(web.url + "lease/L1")
        assert status == 503 and "no answer from a synced replica" in page


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("web.example.org", False),
    ],
)
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_non_loopback_address_needs_tls_and_a_password() -> None:
    check_exposure("127.0.0.1", tls=False, password=False)
    check_exposure("0.0.0.0", tls=True, password=True)
    with pytest.raises(Exposure, match="--https-cert and --https-key and a password"):
        check_exposure("0.0.0.0", tls=False, password=False)
    with pytest.raises(Exposure, match="give a password"):
        check_exposure("10.0.0.5", tls=True, password=False)
    with pytest.raises(Exposure, match=r"give --https-cert and --https-key$"):
        check_exposure("10.0.0.5", tls=False, password=True)
