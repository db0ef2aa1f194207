"""``reconciler web`` on the command line: what it refuses before listening, and a real
process serving the page behind a password that never shows on its command line or in
its logs."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from reconciler.cli.main import cli
from tests.support.programs import program, wait_for

pytestmark = pytest.mark.timeout(60)


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["web", *args, "--log-level", "error"], env=env)
    return result.exit_code, result.output + result.stderr


@pytest.mark.parametrize("listen", ["0.0.0.0:8480", "[::]:8480", "10.1.2.3:8480", "web:8480"])
def test_a_non_loopback_address_is_refused_without_tls_and_a_password(listen: str) -> None:
    code, out = invoke("--listen", listen)
    assert code == 2
    assert "is not a loopback address" in out and "--https-cert and --https-key" in out


def test_tls_without_a_password_is_refused_too(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    code, out = invoke(
        "--listen", "0.0.0.0:8480", "--https-cert", str(cert), "--https-key", str(key)
    )
    assert code == 2 and "give a password (--password-file or RC_WEB_PASSWORD)" in out


def test_half_a_tls_pair_two_passwords_and_a_bad_address_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw\n")
    assert "together" in invoke("--https-cert", str(secret))[1]
    code, out = invoke("--password-file", str(secret), env={"RC_WEB_PASSWORD": "other"})
    assert code == 2 and "not both" in out
    code, out = invoke("--listen", "nowhere")
    assert code == 2 and "HOST:PORT" in out


def test_there_is_no_password_option_on_the_command_line() -> None:
    code, out = invoke("--password", "x")
    assert code == 2 and "No such option" in out


def get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_command_serves_the_page_behind_a_password(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RC_WEB_PASSWORD", "hunter2-web")
    args = ["web", "--listen", "127.0.0.1:0", "--nats-url", nats_url, "--timeout", "0.3"]
    with program(args, tmp_path / "web.log") as web:

        def url() -> str | None:
            for event in web.events():
                if event.get("event") == "web.listening":
                    return str(event["url"])
            assert web.process.poll() is None, web.log.read_text()
            return None

        base = wait_for(url, 20, "the page to listen")
        assert get(base) == 401
        right = "Basic " + base64.b64encode(b"reconciler:hunter2-web").decode()
        assert get(base, right) == 503  # no replica runs: the page says so
        assert get(base + "healthz") == 200
        assert "hunter2" not in " ".join(web.process.args)  # type: ignore[arg-type]
    assert "hunter2" not in web.log.read_text()
