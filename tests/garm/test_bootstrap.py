"""The bootstrap rendering (reconciler.garm.bootstrap): cloud-config for a cold runner,
an injection for a warm one, pre-install scripts and packages as the official Incus
provider runs them, never a secret in a command line."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from reconciler.garm.bootstrap import cloud_config, injection, install_script
from tests.support.garm import CA_PEM, SPECS, TOKEN, parsed

pytestmark = pytest.mark.timeout(60)


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
    assert config["runcmd"] == [
        ["su", "-l", "-c", "/install_runner.sh", "runner"],
        ["rm", "-f", "/install_runner.sh"],  # it may hold the token: gone once it ran
    ]
    assert config["package_update"] is False  # disable_updates_on_boot


def test_without_a_template_the_script_fetches_garms_install_script() -> None:
    b = parsed(extra_specs=None)
    script = install_script(b).decode()
    assert "https://garm.example:9997/api/v1/metadata/install-script/" in script
    assert TOKEN in script  # GARM's own wrapper embeds it too: it goes to Incus only


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
        ["rm", "-f", "/install_runner.sh"],
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
        < script.index("rm -f /install_runner.sh")
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
