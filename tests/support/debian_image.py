"""A Debian 12 system-container image with systemd, for the private Incus daemon of the
tests (:mod:`tests.support.realincus`): built from Debian packages with ``debootstrap``, no image
server needed, and cached between runs.

- :data:`PACKAGES` is what the deployment test needs besides ``minbase``: systemd as PID
  1, Python 3 with ``venv`` (``/opt/reconciler``), ``procps`` to look around.
- The image is a unified Incus image tarball (``metadata.yaml`` and ``rootfs/``), trimmed
  of documentation, locales and apt's caches, with ``localhost`` in ``/etc/hosts``, no
  fixed host name (Incus names each container) and an empty ``machine-id`` (systemd makes
  one per container at first boot).
- It is kept in :func:`tests.support.release.cache_dir` under a name keyed by the suite, the
  package list and :data:`RECIPE` (bump it when the recipe changes), built at most once
  at a time (a lock), and written atomically. Building needs root, ``debootstrap`` and
  the Debian mirror the machine uses (``/etc/apt/sources.list.d/debian.sources``); with
  the image cached, nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.release import cache_dir, locked

SUITE = "bookworm"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps")
#: the recipe's version: a change to what :func:`_build` does must change the key
RECIPE = 2
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
#: what a system container does not need (documentation, translations, apt's caches)
TRIM = (
    "usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
    "var/cache/apt", "var/lib/apt/lists", "var/cache/debconf/templates.dat-old",
)  # fmt: skip


@dataclass(frozen=True)
class Image:
    tarball: Path
    #: seconds spent building it in this run (0 when it came from the cache)
    built_in_s: float


def unavailable() -> str | None:
    """Why the image cannot be built or used here, or ``None``."""
    if os.geteuid() != 0:
        return "building a system-container image needs root"
    if shutil.which("debootstrap") is None:
        return "debootstrap is missing (Debian package debootstrap)"
    return None


def mirror() -> str:
    """The Debian mirror this machine's apt uses (its first ``URIs:`` of the main suite)."""
    if SOURCES.exists():
        for stanza in SOURCES.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1)
                for line in stanza.splitlines()
                if ":" in line and not line.startswith("#")
            )
            suites = fields.get("Suites", "").split()
            if SUITE in suites and fields.get("URIs"):
                return fields["URIs"].split()[0].strip()
    return DEFAULT_MIRROR


def key() -> str:
    text = "\n".join([SUITE, *sorted(PACKAGES), f"recipe {RECIPE}"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def image() -> Image:
    """The cached image, built first if it is not there yet."""
    # uncompressed: every container unpacks the image, and seven unpacking gzip at once
    # keep two cores busy for longer than reading 150 MB more from the disk takes
    target = cache_dir() / f"debian-{SUITE}-systemd-{key()}.tar"
    with locked(target.name):
        if target.exists():
            return Image(tarball=target, built_in_s=0.0)
        started = time.monotonic()
        _build(target)
        return Image(tarball=target, built_in_s=time.monotonic() - started)


def _build(target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="rc-debootstrap-", dir=cache_dir()))
    try:
        rootfs = work / "rootfs"
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
             SUITE, str(rootfs), mirror()],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
        for rel in TRIM:
            path = rootfs / rel
            if path.is_dir():
                shutil.rmtree(path)
                path.mkdir()
            else:
                path.unlink(missing_ok=True)
        (rootfs / "etc" / "hosts").write_text(
            "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        )
        (rootfs / "etc" / "hostname").unlink(missing_ok=True)
        (rootfs / "etc" / "machine-id").write_text("")
        (work / "metadata.yaml").write_text(
            "architecture: x86_64\n"
            f"creation_date: {int(time.time())}\n"
            "properties:\n"
            "  os: debian\n"
            f"  release: {SUITE}\n"
            "  description: Debian with systemd, for the reconciler's deployment test\n"
        )
        partial = target.with_name(f".{target.name}.partial")
        subprocess.run(
            ["tar", "--numeric-owner", "-cf", str(partial), "-C", str(work),
             "metadata.yaml", "rootfs"],
            check=True,
            capture_output=True,
            timeout=600,
        )  # fmt: skip
        partial.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
