"""The provider's executable (reconciler.garm.program) run as GARM runs it: the answers
that need neither the bus nor Incus."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.garm import SPECS, Garm, b64, write_config
from tests.support.simfleet import sim_fleet

pytestmark = pytest.mark.timeout(60)


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


async def test_list_instances_with_an_unreachable_host_fails_in_one_line(
    nats_url: str, tmp_path: Path
) -> None:
    async with sim_fleet(1) as fleet:
        hosts = {**fleet.endpoints, "gone": "https://127.0.0.1:1"}
        config = write_config(
            tmp_path / "garm.toml", nats_url=nats_url, hosts=hosts, pools={"small": "ci"}
        )
        listed = await Garm(config).list()
    stderr = listed.stderr.decode()
    assert listed.code == 1 and listed.stdout == b"", listed.text
    assert "ExceptionGroup" not in stderr and "Traceback" not in stderr
    message = stderr.strip().splitlines()[-1]
    print(message)
    assert message.startswith("listing instances on gone: "), stderr
