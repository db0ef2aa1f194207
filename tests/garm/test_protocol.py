"""The GARM provider's protocol (reconciler.garm.protocol): GARM's BootstrapInstance and
environment read, statuses and faults written as GARM expects them."""

from __future__ import annotations

import base64

import orjson
import pytest

from reconciler.garm.protocol import (
    ExitCode,
    Invocation,
    ProviderError,
    garm_status,
    parse_bootstrap,
    provider_instance,
)
from tests.support.garm import CA_PEM, TOKEN, install_template, parsed

pytestmark = pytest.mark.timeout(60)


def test_a_bootstrap_with_garms_key_spellings_is_read() -> None:
    b = parsed()
    assert (b.name, b.flavor, b.os_type, b.arch) == ("garm-abc", "small", "linux", "amd64")
    assert b.callback_url.endswith("/callbacks") and b.metadata_url.endswith("/metadata")
    assert b.instance_token == TOKEN and b.ca_bundle == CA_PEM
    assert b.specs.install_template == base64.b64decode(install_template("garm-abc"))
    assert [(t.os, t.architecture) for t in b.tools] == [("linux", "x64")]
    assert TOKEN not in repr(b) and "CERTIFICATE" not in repr(b)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"flavor": "x"}', "'name' is missing"),
        (orjson.dumps({"name": "-bad", "flavor": "x"}), "not a valid Incus instance name"),
        (orjson.dumps({"name": "ok-1"}), "'flavor' is missing"),
        (orjson.dumps({"name": "ok-1", "flavor": "x", "ca-cert-bundle": "%%"}), "not base64"),
        (orjson.dumps({"name": "ok-1", "flavor": "x", "extra_specs": [1]}), "JSON object"),
        (orjson.dumps({"name": "ok-1", "flavor": "x", "os_type": "windows"}), "Linux pool"),
        (orjson.dumps({"name": "ok-1", "flavor": "x", "os_type": "unknown"}), "only 'linux'"),
        (orjson.dumps({"name": "ok-1", "flavor": "x", "tools": {}}), "'tools' must be"),
    ],
)
def test_a_malformed_bootstrap_is_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(ProviderError, match=message) as caught:
        parse_bootstrap(data)
    assert caught.value.code is ExitCode.FAILED


def test_a_template_that_is_not_base64_is_refused() -> None:
    with pytest.raises(ProviderError, match="runner_install_template is not base64"):
        parsed(extra_specs={"runner_install_template": "not base64!"})


def test_the_environment_of_a_v011_call_is_read() -> None:
    specs = base64.b64encode(b'{"runner_install_template": "eA=="}').decode()
    inv = Invocation.from_environ(
        {
            "GARM_COMMAND": "ListInstances",
            "GARM_CONTROLLER_ID": "c",
            "GARM_PROVIDER_CONFIG_FILE": "/etc/x.toml",
            "GARM_POOL_ID": "p",
            "GARM_POOL_EXTRASPECS": specs,
            "GARM_INTERFACE_VERSION": "v0.1.1",
        }
    )
    assert inv.extra_specs == {"runner_install_template": "eA=="} and inv.pool_id == "p"
    scale_set = Invocation.from_environ({"GARM_COMMAND": "x", "GARM_POOL_EXTRASPECS": "bnVsbA=="})
    assert scale_set.extra_specs is None
    with pytest.raises(ProviderError, match="GARM_COMMAND"):
        Invocation.from_environ({})


def test_statuses_and_faults_are_garms() -> None:
    assert [garm_status(s) for s in ("Running", "Ready", "Stopped", "Error", "Frozen")] == [
        "running",
        "running",
        "stopped",
        "error",
        "unknown",
    ]
    out = provider_instance(name="n", provider_id="p", status="error", fault="disk on fire")
    assert base64.b64decode(out["provider_fault"]) == b"disk on fire"
    with pytest.raises(ValueError):
        provider_instance(name="n", provider_id="p", status="pending_create")
