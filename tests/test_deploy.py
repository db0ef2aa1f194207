"""deploy/systemd's units: hardened, secrets only through LoadCredential, the one install
path the docs give, and accepted by ``systemd-analyze verify`` where it is installed.
(tests/system/test_deployment_systemd.py runs them under systemd.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.repo import ROOT

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
#: the units of the reconciler's own components (the others run nats-server)
COMPONENTS = [u for u in UNITS if u.name != "reconciler-nats.service"]
#: where docs/operations.md ("Install"), the container image and GARM's docs put it
INSTALLED = "/opt/reconciler/bin/reconciler"
HARDENING = (
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "CapabilityBoundingSet=",
    "UMask=0077",
)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_a_unit_is_hardened_and_runs_as_its_own_user(unit: Path) -> None:
    lines = set(unit.read_text().splitlines())
    for directive in HARDENING:
        assert directive in lines, directive
    user = "User=nats" if unit.name == "reconciler-nats.service" else "User=reconciler"
    assert user in lines
    if any(line.startswith("StateDirectory=") for line in lines):
        assert "StateDirectoryMode=0700" in lines


@pytest.mark.parametrize("unit", COMPONENTS, ids=lambda p: p.name)
def test_a_component_takes_secrets_as_credentials_and_runs_the_installed_command(
    unit: Path,
) -> None:
    text = unit.read_text()
    assert "--nats-password " not in text and "RC_NATS_PASSWORD=" not in text
    assert "LoadCredential=nkey:" in text and "--nats-nkey %d/nkey" in text
    (start,) = re.findall(r"^ExecStart=(\S+)", text, re.M)
    assert start == INSTALLED
    # every credential it loads is a file `reconciler credentials` makes
    made = re.compile(r"ca\.pem|(admin|bridge|executor|%i)(-incus)?(\.nk|\.pem|-key\.pem)")
    pattern = r"^LoadCredential=[^:]+:/etc/reconciler/credentials/(\S+)$"
    for name in re.findall(pattern, text, re.M):
        assert made.fullmatch(name), name


def test_the_container_image_installs_where_the_units_look() -> None:
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert "python -m venv /opt/reconciler" in dockerfile
    assert '"/opt/reconciler/bin/reconciler"' in dockerfile  # the entry point


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_accepts_the_unit(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze")
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text())
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and f"{INSTALLED} is not executable" not in line
    ]
    assert problems == []
