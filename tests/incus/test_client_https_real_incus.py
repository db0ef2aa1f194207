"""Incus over HTTPS, as a deployment reaches it (docs/operations.md, "Incus hosts"): the
real Incus 6.0 daemon serves its API on a loopback port and trusts a client certificate
``reconciler credentials`` made; the endpoint pins the daemon's own server certificate
(``fleet.json``'s ``verify``). REST calls and the lifecycle event stream both work; both
refuse a server whose certificate is not the pinned one, and the pin holds when
``REQUESTS_CA_BUNDLE`` is set (requests would otherwise put that bundle in its place)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import orjson
import pytest
from click.testing import CliRunner
from pylxd import Client

from reconciler.cli.main import cli
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import EventStreamRefused, IncusUnavailable
from reconciler.incus.events import open_lifecycle_stream
from tests.support.cluster import _free_ports
from tests.support.realincus import RealIncus

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(90)]


@pytest.fixture
def served(real_incus: RealIncus, tmp_path: Path) -> Iterator[tuple[IncusEndpoint, Path]]:
    """The daemon on HTTPS, trusting the bridge's client certificate; the endpoint that
    pins its server certificate, and the credentials directory."""
    secrets = tmp_path / "secrets"
    done = CliRunner().invoke(
        cli, ["credentials", "--out", str(secrets), "--replica", "r1", "--incus-host", "h1"]
    )
    assert done.exit_code == 0, done.output
    port = _free_ports(1)[0]
    real_incus.incus("config", "set", "core.https_address", f"127.0.0.1:{port}")
    real_incus.incus(
        "config",
        "trust",
        "add-certificate",
        str(secrets / "bridge-incus.pem"),
        "--name",
        "t-bridge",
    )
    try:
        yield (
            IncusEndpoint(
                host="h1",
                url=f"https://127.0.0.1:{port}",
                cert=(str(secrets / "bridge-incus.pem"), str(secrets / "bridge-incus-key.pem")),
                verify=str(real_incus.directory / "server.crt"),
            ),
            secrets,
        )
    finally:
        for entry in orjson.loads(real_incus.incus("config", "trust", "list", "--format", "json")):
            if entry.get("name") == "t-bridge":
                real_incus.incus("config", "trust", "remove", entry["fingerprint"], check=False)
        real_incus.incus("config", "unset", "core.https_address", check=False)


async def test_a_pinned_host_answers_and_streams_its_events(
    served: tuple[IncusEndpoint, Path], real_incus: RealIncus, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, secrets = served
    # another bundle in the environment must not replace the pinned certificate
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(secrets / "ca.pem"))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(secrets / "ca.pem"))
    host = IncusHost(endpoint)
    try:
        info = await host.server_info()
        assert info.server_version.startswith("6.0")
        async with host.lifecycle_events(idle_timeout_s=30) as events:
            await anyio.to_thread.run_sync(lambda: real_incus.launch("https-1"))
            with anyio.fail_after(30):
                async for event in events:
                    if event["metadata"]["action"] == "instance-created":
                        assert event["metadata"]["source"].endswith("/https-1")
                        break
    finally:
        await host.aclose()


async def test_a_server_that_is_not_the_pinned_one_is_refused(
    served: tuple[IncusEndpoint, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, secrets = served
    # pin another certificate: the deployment's CA's, which this server does not present
    other = IncusEndpoint(
        host=endpoint.host, url=endpoint.url, cert=endpoint.cert, verify=str(secrets / "ca.pem")
    )
    host = IncusHost(other)
    try:
        with pytest.raises(IncusUnavailable, match=r"[Ff]ingerprints did not match"):
            await host.server_info()
    finally:
        await host.aclose()
    # the event stream checks the server as the REST calls do (ws4py alone would not):
    # a client whose REST calls pin the right certificate (a plain pylxd client, which
    # honours the pin without a CA bundle in the environment), the stream another
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    client = Client(endpoint=endpoint.url, cert=endpoint.cert, verify=endpoint.verify)
    try:
        with pytest.raises(EventStreamRefused, match="not the pinned one"):
            async with open_lifecycle_stream(
                client, host="h1", connect_timeout_s=5, idle_timeout_s=30, buffer=8,
                verify=str(secrets / "ca.pem"),
            ):  # fmt: skip
                pass
    finally:
        client.api.session.close()
