"""The GARM provider's protocol, configuration and bootstrap rendering: pure functions,
and the executable's answers that need neither the bus nor Incus (run as GARM runs it)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.garm.attempts import job_of, request_id, runner_of_job
from reconciler.garm.bootstrap import cloud_config, injection, install_script
from reconciler.garm.config import load_config, parse_config
from reconciler.garm.protocol import (
    ExitCode,
    Invocation,
    ProviderError,
    garm_status,
    parse_bootstrap,
    provider_instance,
)
from reconciler.garm.schemas import EXTRA_SPECS_SCHEMA
from reconciler.garm.specs import parse_extra_specs
from tests.support.garm import CA_PEM, TOKEN, Garm, bootstrap, install_template
from tests.support.repo import ROOT

pytestmark = pytest.mark.timeout(60)


def parsed(**changes: Any) -> Any:
    body = bootstrap("garm-abc", "small")
    body.update(changes)
    return parse_bootstrap(orjson.dumps(body))


# ----------------------------------------------------------------------- protocol


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


@given(st.from_regex(r"[a-z][a-z0-9-]{0,61}[a-z0-9]", fullmatch=True), st.integers(1, 64))
def test_attempt_identities_are_tokens_and_give_the_runner_back(name: str, n: int) -> None:
    for step in ("claim", "admit", "created", "injected"):
        rid = request_id(name, n, step)
        assert len(rid) <= 128 and all(c.isalnum() or c in "-_" for c in rid)
    assert runner_of_job(job_of(name, n)) == name
    assert (job_of(name, n) == name) == (n == 1)


# ----------------------------------------------------------------------- config


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


# ----------------------------------------------------------------------- bootstrap


def test_cloud_config_carries_the_script_the_ca_and_the_proxy() -> None:
    b = parsed(proxy_config={"http_proxy": "http://proxy:3128", "no_proxy": "10.0.0.0/8"})
    text = cloud_config(b)
    assert text.startswith("#cloud-config\n")
    config = orjson.loads(text.split("\n", 1)[1])
    (script, proxy) = config["write_files"]
    assert base64.b64decode(script["content"]) == install_script(b)
    assert script["path"] == "/install_runner.sh" and script["permissions"] == "0755"
    assert "http_proxy='http://proxy:3128'" in proxy["content"] or (
        "http_proxy=http://proxy:3128" in proxy["content"]
    )
    assert config["ca_certs"]["trusted"] == [CA_PEM.decode()]
    assert config["runcmd"] == [["su", "-l", "-c", "/install_runner.sh", "runner"]]
    assert config["package_update"] is False  # disable_updates_on_boot


def test_without_a_template_the_script_fetches_garms_install_script() -> None:
    b = parsed(extra_specs=None)
    script = install_script(b).decode()
    assert "https://garm.example:9997/api/v1/metadata/install-script/" in script
    assert TOKEN in script  # GARM's own wrapper embeds it too: it goes to Incus only


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


SPECS = {
    "pre_install_scripts": {"02-second": b64("echo two\n"), "01-first": b64("echo one\n")},
    "extra_packages": ["jq", "curl"],
}


def test_extra_specs_are_read_with_garms_and_the_incus_providers_keys() -> None:
    specs = parse_extra_specs(
        {
            **SPECS,
            "extra_context": {"marker": "m"},
            "disable_updates": True,
            "enable_boot_debug": False,
            "someone_elses": {"kept": "out of the way"},
        }
    )
    assert specs.pre_install_scripts == (("01-first", b"echo one\n"), ("02-second", b"echo two\n"))
    assert specs.extra_packages == ("jq", "curl") and specs.extra_context == {"marker": "m"}
    assert specs.disable_updates is True and specs.enable_boot_debug is False
    assert parse_extra_specs(None) == parse_extra_specs({})


def test_the_extra_specs_schema_takes_what_the_provider_takes() -> None:
    validator = jsonschema_rs.validator_for(EXTRA_SPECS_SCHEMA)
    good = {**SPECS, "extra_context": {"a": "b"}, "disable_updates": True, "other": 1}
    assert validator.is_valid(good)
    for bad in (
        {"pre_install_scripts": {"../x": "eA=="}},
        {"extra_context": {"a": 1}},
        {"extra_packages": [""]},
        {"enable_boot_debug": "yes"},
    ):
        assert not validator.is_valid(bad), bad
        with pytest.raises(ProviderError):
            parse_extra_specs(bad)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"pre_install_scripts": ["x"]}, "map script names to base64"),
        ({"pre_install_scripts": {"../etc/passwd": "eA=="}}, "is not a file name"),
        ({"pre_install_scripts": {".hidden": "eA=="}}, "is not a file name"),
        ({"pre_install_scripts": {"01-x": "not base64!"}}, "01-x is not base64"),
        ({"extra_context": {"a": 1}}, "extra_context must map names to strings"),
        ({"disable_updates": "yes"}, "disable_updates must be true or false"),
        ({"extra_packages": "jq"}, "extra_packages must be a list"),
        ({"runner_install_template": 42}, "must be a base64 string"),
        ([1], "extra specs must be a JSON object"),
    ],
)
def test_bad_extra_specs_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ProviderError, match=message):
        parse_extra_specs(raw)


def test_pre_install_scripts_run_as_root_in_name_order_before_the_install_script() -> None:
    b = parsed(extra_specs=SPECS)
    config = orjson.loads(cloud_config(b).split("\n", 1)[1])
    files = {f["path"]: f for f in config["write_files"]}
    assert base64.b64decode(files["/garm-pre-install/01-first"]["content"]) == b"echo one\n"
    assert files["/garm-pre-install/02-second"]["permissions"] == "0755"
    assert files["/garm-pre-install/02-second"]["owner"] == "root:root"
    assert config["runcmd"] == [
        ["/garm-pre-install/01-first"],
        ["/garm-pre-install/02-second"],
        ["rm", "-rf", "/garm-pre-install"],
        ["su", "-l", "-c", "/install_runner.sh", "runner"],
    ]
    plan = injection(b)
    assert [p for p, _, _ in plan.files][:2] == [
        "/garm-pre-install/01-first",
        "/garm-pre-install/02-second",
    ]
    assert "/garm-pre-install" in plan.prepare
    script = plan.command[2]
    assert (
        script.index("/garm-pre-install/01-first /garm-pre-install/02-second")
        < script.index("rm -rf /garm-pre-install")
        < script.index("su -l -c /install_runner.sh runner")
    )


@pytest.mark.parametrize(
    ("options", "specs", "upgrade", "packages"),
    [
        ({}, {}, True, ["curl", "tar"]),
        ({"disable_updates_on_boot": True}, {}, False, []),
        ({}, {"disable_updates": True, "extra_packages": ["jq"]}, False, ["jq"]),
        ({"disable_updates_on_boot": True}, {"disable_updates": False}, True, ["curl", "tar"]),
        (
            {"extra_packages": ["git"]},
            {"extra_packages": ["jq", "git"]},
            True,
            ["curl", "tar", "git", "jq"],
        ),
    ],
)
def test_packages_and_updates_follow_the_official_incus_provider(
    options: dict[str, Any], specs: dict[str, Any], upgrade: bool, packages: list[str]
) -> None:
    b = parsed(user_data_options=options, extra_specs=specs)
    config = orjson.loads(cloud_config(b).split("\n", 1)[1])
    assert config["package_upgrade"] is upgrade and config["package_update"] is upgrade
    assert config["packages"] == packages


def test_boot_debug_traces_the_fetching_script() -> None:
    assert b"set -x" in install_script(parsed(extra_specs={"enable_boot_debug": True}))
    assert b"set -x" not in install_script(parsed(extra_specs={}))
    options = {"enable_boot_debug": True}
    assert b"set -x" in install_script(parsed(extra_specs={}, user_data_options=options))


def test_a_warm_injection_pushes_files_then_runs_one_command_without_secrets() -> None:
    plan = injection(parsed())
    paths = [path for path, _, _ in plan.files]
    assert paths == ["/install_runner.sh", "/usr/local/share/ca-certificates/garm-ca-bundle.crt"]
    assert plan.prepare[:2] == ("mkdir", "-p") and "/var/log" in plan.prepare
    assert TOKEN not in " ".join(plan.command) and TOKEN not in repr(plan)


# ----------------------------------------------------------------------- the executable


@pytest.fixture
def garm(tmp_path: Path) -> Garm:
    return Garm(tmp_path / "none.toml")


async def test_local_commands_answer_on_stdout_only(garm: Garm) -> None:
    version = await garm.run(garm.env("GetVersion"))
    assert version.code == 0 and version.stdout.decode().strip()
    versions = await garm.run(garm.env("GetSupportedInterfaceVersions"))
    assert versions.json() == ["v0.1.0", "v0.1.1"]
    schema = await garm.run(garm.env("GetConfigJSONSchema"))
    assert "nats_url" in schema.json()["properties"]
    specs = await garm.run(garm.env("GetExtraSpecsJSONSchema"))
    assert "runner_install_template" in specs.json()["properties"]
    ok = await garm.run(
        garm.env("ValidatePoolInfo", GARM_POOL_EXTRASPECS=base64.b64encode(b"{}").decode())
    )
    assert ok.code == 0 and ok.stdout == b""
    assert {"pre_install_scripts", "extra_context", "disable_updates"} <= set(
        specs.json()["properties"]
    )


async def test_validate_pool_info_reads_the_specs_and_parses_the_template(garm: Garm) -> None:
    def validate(specs: dict[str, Any]) -> Any:
        encoded = base64.b64encode(orjson.dumps(specs)).decode()
        return garm.run(garm.env("ValidatePoolInfo", GARM_POOL_EXTRASPECS=encoded))

    good = {"runner_install_template": b64("{{ .RunnerName }}"), **SPECS}
    assert (await validate(good)).code == 0
    broken = await validate({"runner_install_template": b64("x\n{{ if .RunnerName }}")})
    assert broken.code == 1 and "line 2: {{if}} has no {{end}}" in broken.stderr.decode()
    named = await validate({"pre_install_scripts": {"a/b": b64("x")}})
    assert named.code == 1 and "is not a file name" in named.stderr.decode()


async def test_bad_calls_exit_1_with_a_clear_message(garm: Garm) -> None:
    unknown = await garm.run(garm.env("Reboot"))
    assert unknown.code == 1 and unknown.stdout == b""
    assert "unknown GARM_COMMAND 'Reboot'" in unknown.stderr.decode()
    nothing = await garm.run({})
    assert nothing.code == 1 and "GARM_COMMAND is not set" in nothing.stderr.decode()
    malformed = await garm.run(garm.env("CreateInstance", GARM_POOL_ID="p"), b"{not json")
    assert malformed.code == 1 and "stdin is not JSON" in malformed.stderr.decode()
    no_config = await garm.run(garm.env("ListInstances", GARM_POOL_ID="p"))
    assert no_config.code == 1 and "cannot read config file" in no_config.stderr.decode()
    bad_specs = await garm.run(garm.env("ValidatePoolInfo", GARM_POOL_EXTRASPECS="%%%"))
    assert bad_specs.code == 1 and "GARM_POOL_EXTRASPECS" in bad_specs.stderr.decode()


def test_the_example_config_files_are_valid() -> None:
    example = load_config(str(ROOT / "docs" / "garm-provider.example.toml"))
    assert example.pool_of("small") == "ci-small" and "host-01" in example.hosts
    deployed = load_config(str(ROOT / "compose" / "garm-provider.toml"))
    assert deployed.pool_of("small") == "ci-small" and "incus-1" in deployed.hosts
