"""The tests' private, real Incus daemon (:mod:`reconciler.demo.local_incus`, which the
demo runs on too), and what only the tests do with it.

One daemon per test session (``real_incus_daemon`` in ``conftest.py``); tests that use it
are marked ``@pytest.mark.real_incus`` and counted in the session's summary. Where it
cannot run they skip with the reason, unless ``RC_REQUIRE_REAL_INCUS=1`` (set by
``scripts/test`` where it installed the packages, so in CI), where that is a failure.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from reconciler.demo.local_incus import (
    IMAGE_ALIAS,
    LocalIncus,
    build_image,
    start_local_incus,
    unavailable,
)

__all__ = [
    "IMAGE_ALIAS",
    "REQUIRE_ENV",
    "SLOW_IMAGE_ALIAS",
    "RealIncus",
    "launch_ready",
    "required",
    "slow_image",
    "start_real_incus",
    "unavailable",
    "wait_status",
]

#: the test image with a file of zeros that makes Incus unpack it for seconds
SLOW_IMAGE_ALIAS = "busybox-slow"
SLOW_IMAGE_ZEROS = 1 << 30

REQUIRE_ENV = "RC_REQUIRE_REAL_INCUS"

RealIncus = LocalIncus
start_real_incus = start_local_incus


def launch_ready(daemon: RealIncus, name: str, *, within_s: float = 15.0, **kw: Any) -> None:
    """Launch ``name`` and wait until its guest said it is ready (status ``Ready``)."""
    daemon.launch(name, **kw)
    wait_status(daemon, name, "Ready", within_s=within_s)


def wait_status(
    daemon: RealIncus, name: str, status: str, *, project: str = "default", within_s: float = 15.0
) -> None:
    """Wait until instance ``name`` has ``status``; fail after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        found = daemon.query(f"/1.0/instances/{name}?project={project}")
        assert isinstance(found, dict)
        if found["status"] == status:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} is {found['status']}, not {status}, after {within_s} s")
        time.sleep(0.05)


def required() -> bool:
    """Whether a missing daemon is a failure rather than a skip (CI)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def slow_image(daemon: RealIncus) -> str:
    """An image whose create keeps Incus busy for seconds (its rootfs holds a GiB of
    zeros, a few MiB compressed): a test can act while the create operation runs.
    Imported once per daemon; its alias."""
    aliases = daemon.query("/1.0/images/aliases")
    assert isinstance(aliases, list)
    if f"/1.0/images/aliases/{SLOW_IMAGE_ALIAS}" in aliases:
        return SLOW_IMAGE_ALIAS
    work = Path(daemon.directory) / "build-slow"
    work.mkdir(exist_ok=True)
    base = build_image(work)
    slow = work / "busybox-slow.tar.gz"
    with tarfile.open(base, "r:gz") as source, tarfile.open(slow, "w:gz", compresslevel=1) as out:
        for member in source.getmembers():
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        zeros = tarfile.TarInfo("rootfs/var/zeros")
        zeros.size, zeros.mode = SLOW_IMAGE_ZEROS, 0o644
        out.addfile(zeros, io.BufferedReader(_Zeros(zeros.size), 1 << 20))
    daemon.incus("image", "import", str(slow), "--alias", SLOW_IMAGE_ALIAS)
    slow.unlink()
    return SLOW_IMAGE_ALIAS
