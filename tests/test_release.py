"""A release installs anywhere: ``python -m build`` makes a wheel and an sdist from the
checkout; the wheel, installed with its dependencies from local wheels (no index) into a
fresh virtual environment and with ``pip install --user`` under a throwaway home, runs
from outside the checkout: ``reconciler --version`` prints the one version, ``reconciler
demo`` decides and replays, and the schemas it reads are the package's own."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support import release as rel
from tests.support.repo import ROOT

#: one release built for all three tests: one worker runs them (see scripts/test)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("release")]

SCHEMAS = sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "reconciler" / "schemas").rglob("*.json")
)


@pytest.fixture(scope="module")
def release() -> rel.Release:
    return rel.release()


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    return rel.wheelhouse()


def outside_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing points at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.pop("RC_SCHEMAS_DIR", None)
    return {**env, **extra}


def pip_install(python: Path, *args: str | Path, cwd: Path, env: dict[str, str]) -> None:
    """``pip install`` into ``python``'s environment, from the wheelhouse only (this
    environment's pip drives it: the new one is made without pip, which saves seconds)."""
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile",
         "--no-index", *args],
        cwd=cwd, env=env,
    )  # fmt: skip


def run(args: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_release_is_a_wheel_and_an_sdist_with_one_version(release: rel.Release) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert release.version == version
    assert release.wheel.name == f"reconciler-{version}-py3-none-any.whl"
    with zipfile.ZipFile(release.wheel) as wheel:
        names = wheel.namelist()
    assert (
        sorted(n for n in names if n.startswith("reconciler/schemas/") and n.endswith(".json"))
        == SCHEMAS
    )
    assert "reconciler/schemas/README.md" in names and "reconciler/py.typed" in names
    web = ROOT / "reconciler" / "web"
    for asset in [*web.glob("templates/*.html"), *web.glob("static/*")]:  # reconciler web's
        assert asset.relative_to(ROOT).as_posix() in names, asset
    assert not [n for n in names if ".data/" in n], "no data-files outside the package"
    with tarfile.open(release.sdist) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    for needed in (
        "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in",
        "docs/operations.md", "deploy/systemd/reconciler@.service",
        "compose/docker-compose.yml", "compose/nats/server.conf", *SCHEMAS,
    ):  # fmt: skip
        assert needed in members, needed
    assert not [m for m in members if m.startswith("compose/secrets")]


def test_the_wheel_runs_the_demo_from_a_fresh_virtual_environment(
    release: rel.Release, wheelhouse: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    env = outside_env()
    # run from this test environment, venv makes a new one of its base interpreter
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=env)
    pip_install(
        venv / "bin" / "python", "--find-links", wheelhouse, release.wheel, cwd=tmp_path, env=env
    )
    assert run([venv / "bin" / "reconciler", "--version"], cwd=tmp_path, env=env) == (
        f"reconciler, version {release.version}\n"
    )
    where = run(
        [venv / "bin" / "python", "-c",
         "import reconciler.bus.schemas as s; print(s.schemas_dir())"],
        cwd=tmp_path, env=env,
    ).strip()  # fmt: skip
    assert Path(where).is_relative_to(venv) and not Path(where).is_relative_to(ROOT)
    demo = run([venv / "bin" / "reconciler", "demo"], cwd=tmp_path, env=env, timeout=120)
    assert "replay of the input stream: no divergences, same digest" in demo, demo[-2000:]


def test_a_user_install_finds_its_schemas(
    release: rel.Release, wheelhouse: Path, tmp_path: Path
) -> None:
    # an interpreter whose user site is on (a virtual environment sees it only when it
    # includes the system's packages), and a home of its own for ~/.local
    base = tmp_path / "base"
    home = tmp_path / "home"
    home.mkdir()
    env = outside_env(HOME=str(home))
    env.pop("PYTHONUSERBASE", None)
    run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", base],
        cwd=tmp_path,
        env=env,
    )
    pip_install(
        base / "bin" / "python", "--user", "--ignore-installed", "--find-links", wheelhouse,
        release.wheel, cwd=tmp_path, env=env,
    )  # fmt: skip
    script = home / ".local" / "bin" / "reconciler"
    assert run([script, "--version"], cwd=tmp_path, env=env) == (
        f"reconciler, version {release.version}\n"
    )
    where = run(
        [base / "bin" / "python", "-c", "import reconciler; print(reconciler.__file__)"],
        cwd=tmp_path, env=env,
    ).strip()  # fmt: skip
    assert Path(where).is_relative_to(home / ".local"), where
    # every schema is there: the AsyncAPI document it generates is the repository's
    document = run(
        [base / "bin" / "python", "-m", "reconciler.bus.asyncapi"], cwd=tmp_path, env=env
    )
    assert document == (ROOT / "docs" / "asyncapi.json").read_text()
