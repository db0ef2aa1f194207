"""deploy/systemd's units: hardened, secrets only through LoadCredential, and accepted by
``systemd-analyze verify`` where it is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.repo import ROOT

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
HARDENING = (
    "User=reconciler",
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "CapabilityBoundingSet=",
    "UMask=0077",
)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_a_unit_is_hardened_and_takes_secrets_as_credentials(unit: Path) -> None:
    text = unit.read_text()
    lines = set(text.splitlines())
    for directive in HARDENING:
        assert directive in lines, directive
    assert "--nats-password " not in text and "RC_NATS_PASSWORD=" not in text
    assert "LoadCredential=nkey:" in text and "--nats-nkey %d/nkey" in text
    if "StateDirectory=" in text:
        assert "StateDirectoryMode=0700" in lines


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
        if line.strip() and "/usr/bin/reconciler is not executable" not in line
    ]
    assert problems == []
