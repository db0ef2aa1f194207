"""cloud-init's part, played from the host for the busybox test image (which has none).

A cold runner's whole setup travels in its ``cloud-init.user-data``; on a real image
cloud-init carries it out at first boot. The test image cannot, so :func:`play` does,
through the Incus API, what cloud-init's modules do with the keys the provider writes,
in cloud-init's order: ``users`` (a passwd entry and a home, busybox having no
``adduser``), ``write_files`` (``b64`` or plain content, ``permissions``, owned by root),
then ``runcmd`` as one shell script run as root (list entries quoted, strings as they
are), its output in ``/var/log/cloud-init-output.log``. Packages, ``ca_certs`` and
``package_*`` are left out: the test image has no package manager.

The user data is parsed as YAML, as cloud-init parses it, so this also checks that the
provider's user data is valid cloud-config."""

from __future__ import annotations

import base64
import shlex
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.support.realincus import RealIncus

RUNCMD_PATH = "/var/lib/cloud/instance/scripts/runcmd"
OUTPUT_LOG = "/var/log/cloud-init-output.log"


def user_data(daemon: RealIncus, instance: str) -> dict[str, Any]:
    found = daemon.query(f"/1.0/instances/{instance}")
    assert isinstance(found, dict)
    text = str(found["config"]["cloud-init.user-data"])
    assert text.startswith("#cloud-config\n"), text[:40]
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


def _push(daemon: RealIncus, instance: str, path: str, content: bytes, mode: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "content"
        source.write_bytes(content)
        daemon.incus(
            "file",
            "push",
            str(source),
            f"{instance}{path}",
            "--create-dirs",
            "--uid",
            "0",
            "--gid",
            "0",
            "--mode",
            mode,
        )


def _sh(daemon: RealIncus, instance: str, script: str, *, check: bool = True) -> str:
    return daemon.incus("exec", instance, "--", "sh", "-c", script, check=check)


def play(daemon: RealIncus, instance: str) -> str:
    """Carry out ``instance``'s user data as cloud-init would; the runcmd's output."""
    data = user_data(daemon, instance)
    for uid, user in enumerate((u for u in data.get("users", []) if isinstance(u, dict)), 1000):
        name = shlex.quote(str(user["name"]))
        _sh(
            daemon,
            instance,
            f"echo {name}:x:{uid}:{uid}::/home/{name}:/bin/sh >>/etc/passwd && "
            f"echo {name}:x:{uid}: >>/etc/group && "
            f"mkdir -p /home/{name} && chown {uid}:{uid} /home/{name}",
        )
    for item in data.get("write_files", []):
        content = str(item["content"])
        raw = base64.b64decode(content) if item.get("encoding") == "b64" else content.encode()
        _push(daemon, instance, str(item["path"]), raw, str(item.get("permissions", "0644")))
    lines = ["#!/bin/sh"]
    for command in data.get("runcmd", []):
        lines.append(shlex.join(command) if isinstance(command, list) else str(command))
    _push(daemon, instance, RUNCMD_PATH, ("\n".join(lines) + "\n").encode(), "0700")
    _sh(daemon, instance, f"mkdir -p /var/log && {RUNCMD_PATH} >{OUTPUT_LOG} 2>&1", check=False)
    return daemon.incus("exec", instance, "--", "cat", OUTPUT_LOG)
