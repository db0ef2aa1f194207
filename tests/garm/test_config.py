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
        ({"garm_pools": {"0b9e": "not a pool"}}, "garm_pools"),
        ({"bootstrap_timeout": 0}, "bootstrap_timeout"),
        ({"boot_time": -5}, "boot_time"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ProviderError, match=message) as caught:
        parse_config(raw)
    assert "s3cret" not in caught.value.message


def test_a_runner_waits_bootstrap_timeout_minus_boot_time() -> None:
    """GARM's default runner_bootstrap_timeout is 20 minutes; a boot needs 5 of them by
    default: a create waits up to 15 minutes in the queue. Nothing left: no wait."""
    assert parse_config({}).queue_wait_s == 1200 - 300
    assert parse_config({"bootstrap_timeout": 1800, "boot_time": 240}).queue_wait_s == 1560
    assert parse_config({"bootstrap_timeout": 300, "boot_time": 300}).queue_wait_s == 0
    assert parse_config({"bootstrap_timeout": 60, "boot_time": 300}).queue_wait_s == 0


def test_a_garm_pool_maps_to_a_reconciler_pool_the_config_first() -> None:
    """[garm_pools] by GARM pool id, then the pool's extra specs, then [pools] by
    flavor, then the flavor: the tenant is the one that names the reconciler pool."""
    config = parse_config(
        {"garm_pools": {"pool-a": "team-a-small"}, "pools": {"small": "ci-small"}}
    )
    assert config.pool_source("small", garm_pool="pool-a", named="x") == (
        "team-a-small",
        "garm_pools",
    )
    assert config.pool_source("small", garm_pool="pool-b", named="team-b") == (
        "team-b",
        "extra_specs",
    )
    assert config.pool_source("small", garm_pool="pool-b") == ("ci-small", "pools")
    assert config.pool_source("big", garm_pool="") == ("big", "flavor")
    with pytest.raises(ProviderError, match="names no valid pool"):
        config.pool_of("no such/flavor")


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
