"""The project as a user gets it: a release built from the checkout, and its dependencies
as local wheels, for tests that install it somewhere else (a fresh virtual environment,
``pip install --user``, the system containers of :mod:`tests.support.systemd_deployment`).

- :func:`release` builds the sdist and, from it, the wheel (``python -m build
  --no-isolation``: offline, with the build backend the test extras install), once per
  test process, from a copy of the checkout (so nothing is written into it).
- :func:`wheelhouse` holds a wheel of every runtime dependency, pinned to the versions
  this test environment runs, so that an install needs no index (``pip install
  --no-index --find-links``). It is made once per set of pins with ``pip wheel`` (the
  only step that reaches the package index) and kept in :func:`cache_dir`, outside the
  checkout, between runs and test sessions; a lock keeps two sessions from making it
  at once.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.repo import ROOT

CACHE_ENV = "RC_TEST_CACHE"
#: what is not part of the source a release is built from
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "*.py[co]", ".*_cache",
    ".hypothesis", "secrets", "*.db", "*.db-*",
)  # fmt: skip


def cache_dir() -> Path:
    """Where tests keep what is costly to make between runs: ``$RC_TEST_CACHE``, else
    ``/var/cache/reconciler-tests`` (root), else ``~/.cache/reconciler-tests``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        found = Path(explicit)
    elif os.geteuid() == 0:
        found = Path("/var/cache/reconciler-tests")
    else:
        found = Path.home() / ".cache" / "reconciler-tests"
    found.mkdir(parents=True, exist_ok=True)
    return found


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """An exclusive lock on ``<cache>/<name>.lock`` (other test sessions wait)."""
    with (cache_dir() / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Release:
    wheel: Path
    sdist: Path
    version: str


def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rc-release-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def release() -> Release:
    """The sdist and the wheel built from it, from a copy of this checkout."""
    work = _scratch()
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    out = work / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (wheel,) = out.glob("reconciler-*.whl")
    (sdist,) = out.glob("reconciler-*.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        version = HeaderParser().parsestr(zf.read(name).decode())["Version"]
    return Release(wheel=wheel, sdist=sdist, version=version)


def dependency_pins() -> list[str]:
    """``name==version`` of every runtime dependency of reconciler (transitively), as
    installed here (markers evaluated for this interpreter, extras followed)."""
    seen: dict[str, tuple[str, frozenset[str]]] = {}
    todo: list[tuple[str, frozenset[str]]] = [("reconciler", frozenset())]
    while todo:
        name, extras = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise RuntimeError(f"{name} is a dependency but is not installed here") from None
        key = dist.metadata["Name"].lower().replace("_", "-")
        known = seen.get(key)
        if known is not None and extras <= known[1]:
            continue
        seen[key] = (dist.version, extras | (known[1] if known else frozenset()))
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
                todo.append((req.name, frozenset(req.extras)))
    seen.pop("reconciler")
    return sorted(f"{name}=={version}" for name, (version, _) in seen.items())


def wheelhouse() -> Path:
    """A directory with a wheel of every pinned dependency, made once per pin set."""
    pins = dependency_pins()
    tag = f"{sys.implementation.cache_tag}-{platform.machine()}"
    key = hashlib.sha256("\n".join([tag, *pins]).encode()).hexdigest()[:16]
    house = cache_dir() / f"wheelhouse-{tag}-{key}"
    with locked("wheelhouse"):
        if house.is_dir():
            return house
        partial = Path(tempfile.mkdtemp(prefix=f"{house.name}.", dir=cache_dir()))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                 "--wheel-dir", str(partial), *pins],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(
                    f"pip wheel of the dependencies failed (the package index must be "
                    f"reachable the first time):\n{done.stderr[-3000:]}"
                )
            partial.rename(house)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return house
