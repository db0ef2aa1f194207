"""A private, local Incus daemon: for the tests and ``reconciler demo --incus-real``.

``start_local_incus()`` starts ``incusd`` (Incus 6.0 LTS, containers only where the
kernel has no ``vhost_vsock``) with its own ``INCUS_DIR`` in a fresh temporary directory:
no systemd, no network, one ``dir`` storage pool named ``default``. It imports a busybox
image built here from ``busybox-static`` plus a tiny static client
(``incus-ready.c`` beside this module, compiled with ``gcc -static``) that the image's
init runs once at boot to send ``PATCH /1.0 {"state":"Ready"}`` on ``/dev/incus/sock``
(trying again until it is answered 200), so Incus emits ``instance-ready``. Nothing is
downloaded.

Rules:

- :func:`unavailable` says why the daemon cannot run here (not root, no ``incusd``, no
  ``busybox-static``, no ``gcc``), so callers can skip or refuse with that reason.
- Tearing down stops every instance of every project, sends SIGTERM to the daemon's own
  PID (never by name), waits for it, unmounts whatever it left under its directory and
  removes the directory.
- :meth:`LocalIncus.clean` deletes every instance (each test starts from an empty daemon).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

INCUSD = Path("/usr/libexec/incus/incusd")
INCUS = "incus"
BUSYBOX = Path("/bin/busybox")
READY_SOURCE = Path(__file__).with_name("incus-ready.c")
IMAGE_ALIAS = "busybox"

PRESEED = {
    "config": {},
    "networks": [],
    "storage_pools": [{"name": "default", "driver": "dir", "config": {}}],
    "profiles": [
        {
            "name": "default",
            "devices": {"root": {"type": "disk", "path": "/", "pool": "default"}},
        }
    ],
}

#: init starts incus-ready once, in a session of its own, its errors on the console (the
#: instance's console log); the respawned sleep keeps init, and the container, running
INITTAB = "::once:/bin/incus-ready\n::respawn:/bin/sleep 2147483647\n"


def unavailable() -> str | None:
    """Why a private Incus daemon cannot run here, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "the real Incus daemon needs root"
    if not INCUSD.exists():
        return f"{INCUSD} is missing (Debian package incus-base)"
    if shutil.which(INCUS) is None:
        return "the incus client is missing (Debian package incus-base)"
    if not BUSYBOX.exists():
        return f"{BUSYBOX} is missing (Debian package busybox-static)"
    if shutil.which("gcc") is None:
        return "gcc is missing (Debian packages gcc and libc6-dev)"
    return None


@dataclass
class LocalIncus:
    """A running private daemon: its directory, socket, PID and test image alias."""

    directory: Path
    process: subprocess.Popen[bytes]
    image: str = IMAGE_ALIAS
    version: str = ""

    @property
    def socket(self) -> Path:
        return self.directory / "unix.socket"

    @property
    def url(self) -> str:
        """The endpoint URL the project's Incus adapter takes for this daemon."""
        return "http+unix://" + quote(str(self.socket), safe="")

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "INCUS_DIR": str(self.directory),
            "INCUS_CONF": str(self.directory / "client"),
            "INCUS_SKIP_INSTANCE_TYPES": "1",
        }

    def incus(self, *args: str, input: bytes | None = None, check: bool = True) -> str:
        """Run the ``incus`` client against this daemon; its stdout."""
        done = subprocess.run(
            [INCUS, *args],
            env=self.env(),
            input=input,
            capture_output=True,
            timeout=60,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"incus {' '.join(args)}: {done.stderr.decode().strip()}")
        return done.stdout.decode()

    def query(self, path: str) -> object:
        """``incus query PATH`` decoded (the metadata of a sync answer)."""
        return json.loads(self.incus("query", path))

    def instances(self) -> list[dict[str, object]]:
        """Every instance, in every project, with its state."""
        found = self.query("/1.0/instances?recursion=1&all-projects=true")
        if not isinstance(found, list):
            raise RuntimeError(f"incus query /1.0/instances: not a list: {found!r}")
        return found

    def launch(
        self, name: str, *, project: str = "default", config: dict[str, str] | None = None
    ) -> None:
        """``incus launch`` the test image as container ``name``."""
        args = ["launch", self.image, name, "--project", project]
        for key, value in (config or {}).items():
            args += ["--config", f"{key}={value}"]
        self.incus(*args)

    def clean(self) -> None:
        """Force-delete every instance in every project (one call per project)."""
        by_project: dict[str, list[str]] = {}
        for inst in self.instances():
            project = str(inst.get("project") or "default")
            by_project.setdefault(project, []).append(str(inst["name"]))
        for project, names in sorted(by_project.items()):
            self.incus("delete", "--force", *names, "--project", project, check=False)

    def restart(self) -> None:
        """Stop the daemon (instances keep running) and start it again on the same dir."""
        _terminate(self.process)
        self.process = _spawn(self.directory)
        _wait_ready(self)


def _spawn(directory: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "INCUS_DIR": str(directory),
        "INCUS_SKIP_INSTANCE_TYPES": "1",
    }
    log = open(directory / "incusd.out", "ab")  # noqa: SIM115 - the daemon owns it
    try:
        return subprocess.Popen(
            [str(INCUSD), "--group", "root", "--logfile", str(directory / "incusd.log")],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def _wait_ready(daemon: LocalIncus) -> None:
    done = subprocess.run(
        [INCUS, "admin", "waitready", "--timeout=60"],
        env=daemon.env(),
        capture_output=True,
        timeout=90,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"incusd did not become ready: {done.stderr.decode().strip()}")


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve())
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


def _unmount_all(directory: Path) -> None:
    for point in sorted(_mounts_under(directory), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def build_image(workdir: Path) -> Path:
    """The unified image tarball: busybox-static, its applets, inittab, incus-ready."""
    ready = workdir / "incus-ready"
    subprocess.run(
        ["gcc", "-static", "-Os", "-o", str(ready), str(READY_SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    applets = (
        subprocess.run([str(BUSYBOX), "--list-full"], check=True, capture_output=True, timeout=30)
        .stdout.decode()
        .split()
    )
    tarball = workdir / "busybox-image.tar.gz"
    now = int(time.time())
    with tarfile.open(tarball, "w:gz") as tar:

        def add_file(name: str, data: bytes, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, now
            tar.addfile(info, io.BytesIO(data))

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, now
            tar.addfile(info)

        metadata = (
            "architecture: x86_64\n"
            f"creation_date: {now}\n"
            "properties:\n"
            "  os: busybox\n"
            "  release: static\n"
            "  description: busybox test image with the incus-ready client\n"
        )
        add_file("metadata.yaml", metadata.encode(), 0o644)
        for d in (
            "rootfs",
            "rootfs/bin",
            "rootfs/sbin",
            "rootfs/usr",
            "rootfs/usr/bin",
            "rootfs/usr/sbin",
            "rootfs/etc",
            "rootfs/dev",
            "rootfs/proc",
            "rootfs/sys",
            "rootfs/run",
            "rootfs/root",
            "rootfs/var",
        ):
            add_dir(d)
        add_dir("rootfs/tmp", 0o1777)
        add_file("rootfs/bin/busybox", BUSYBOX.read_bytes(), 0o755)
        add_file("rootfs/bin/incus-ready", ready.read_bytes(), 0o755)
        for applet in sorted(set(applets)):
            path = "rootfs/" + applet.lstrip("/")
            if path == "rootfs/bin/busybox" or path.count("/") < 2:
                continue
            link = tarfile.TarInfo(path)
            link.type, link.linkname, link.mtime = tarfile.SYMTYPE, "/bin/busybox", now
            tar.addfile(link)
        add_file("rootfs/etc/inittab", INITTAB.encode(), 0o644)
        add_file("rootfs/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
        add_file("rootfs/etc/group", b"root:x:0:\n", 0o644)
    return tarball


@contextlib.contextmanager
def start_local_incus(*, test_image: bool = True) -> Iterator[LocalIncus]:
    """A private daemon (with the test image imported unless ``test_image`` is false);
    stopped and cleaned up after, with every instance and image it holds."""
    directory = Path(tempfile.mkdtemp(prefix="rc-incus-"))
    directory.chmod(0o711)  # unprivileged containers' root must traverse it
    process = _spawn(directory)
    daemon = LocalIncus(directory=directory, process=process)
    try:
        _wait_ready(daemon)
        daemon.incus("admin", "init", "--preseed", input=json.dumps(PRESEED).encode())
        if test_image:
            build = directory / "build"
            build.mkdir()
            tarball = build_image(build)
            daemon.incus("image", "import", str(tarball), "--alias", IMAGE_ALIAS)
        server = daemon.query("/1.0")
        assert isinstance(server, dict)
        daemon.version = str(server.get("environment", {}).get("server_version", ""))
        yield daemon
    finally:
        try:
            if daemon.process.poll() is None:
                for project in _projects(daemon):
                    daemon.incus("stop", "--all", "--force", "--project", project, check=False)
                daemon.clean()
        finally:
            _terminate(daemon.process)
            _unmount_all(directory)
            shutil.rmtree(directory, ignore_errors=True)


def _projects(daemon: LocalIncus) -> list[str]:
    try:
        found = daemon.query("/1.0/projects?recursion=1")
    except (RuntimeError, ValueError):
        return ["default"]
    assert isinstance(found, list)
    return [str(p["name"]) for p in found]
