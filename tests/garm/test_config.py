"""The GARM provider's configuration file (reconciler.garm.config): read, checked, and
the examples the docs and compose/ ship valid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reconciler.garm.config import load_config, parse_config
from reconciler.garm.protocol import ProviderError
from tests.support.repo import ROOT

pytestmark = pytest.mark.timeout(60)


def test_the_config_file_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        'nats_url = "nats://a:4222, nats://b:4222"\nnats_user = "garm"\nnats_password = "s3cret"\n'
        'prefix = "rc"\ndecision_timeout = 30\nincus_verify = false\n'
        'incus_cert = "/c.crt"\nincus_key = "/c.key"\n'
        '[incus.hosts]\nhost-01 = "/var/lib/incus/unix.socket"\nhost-02 = "https://h2:8443"\n'
        '[pools]\nsmall = "ci-small"\n'
    )
    config = load_config(str(path))
    assert config.nats.urls == ("nats://a:4222", "nats://b:4222")
    assert config.decision_timeout_s == 30 and config.pool_of("small") == "ci-small"
    assert config.pool_of("other") == "other"
    assert config.hosts["host-01"].url == "http+unix://%2Fvar%2Flib%2Fincus%2Funix.socket"
    assert config.hosts["host-01"].cert is None
    assert config.hosts["host-02"].cert == ("/c.crt", "/c.key")
    assert config.hosts["host-02"].verify is False


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"nats_urll": "x"}, "unknown key"),
        ({"decision_timeout": -1}, "decision_timeout"),
        ({"admission": "yolo"}, "admission"),
        ({"incus": {"hosts": {"h": 1}}}, "endpoint"),
        ({"incus": {"hosts": {"h": "relative/path"}}}, "neither a URL"),
        ({"incus_cert": "/c"}, "go together"),
        ({"nats_password": "s3cret"}, "needs a user"),
        ({"pools": {"a": 1}}, "pool names"),
        ({"nats_url": "tls://a:4222,wss://b:443"}, "not over WebSocket"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ProviderError, match=message) as caught:
        parse_config(raw)
    assert "s3cret" not in caught.value.message


def test_a_missing_or_broken_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ProviderError, match="GARM_PROVIDER_CONFIG_FILE is empty"):
        load_config("")
    with pytest.raises(ProviderError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("= nope")
    with pytest.raises(ProviderError, match="not valid TOML"):
        load_config(str(tmp_path / "bad.toml"))


def test_the_example_config_files_are_valid() -> None:
    example = load_config(str(ROOT / "docs" / "garm-provider.example.toml"))
    assert example.pool_of("small") == "ci-small" and "host-01" in example.hosts
    deployed = load_config(str(ROOT / "compose" / "garm-provider.toml"))
    assert deployed.pool_of("small") == "ci-small" and "incus-1" in deployed.hosts
