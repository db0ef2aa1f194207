"""docs/tour.md cannot drift: its commands run, in order, as a newcomer pastes them
(the start block at once), against the demo fleet (``sim-incus``) and a private
nats-server, and what each printed is what the tour shows.

How the page is read: every ```console block is a list of ``$ command`` lines, each
followed by what it printed; a ```yaml block whose first line is ``# NAME: …`` is the
file NAME the commands use. The install (clone, venv, pip) is what this test runs in;
``/tmp/tour`` becomes a directory of the test's and port 14222 a free one. What cannot
print the same twice is compared as a shape: request ids, hashes, timestamps and
numbers (input sequences depend on when the bridge's inventories arrive), and runs of
spaces. Commands that only read (``status``, ``audit``, ``replay``, ``query``) are asked
again for a while until they print what the tour shows (the top-up's VM booting), as a
reader who waits a moment would; a command that changes something runs once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.cluster import _free_ports
from tests.support.natsserver import find_binary
from tests.support.repo import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOUR = ROOT / "docs" / "tour.md"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
_READS = ("reconciler status", "reconciler audit", "reconciler replay", "reconciler query")
_SKIPPED = ("git clone", "python3 -m venv", "export PATH=")
#: how long a read is asked again until it prints what the tour shows
_SETTLE_S = 30.0


@dataclass
class Step:
    command: str
    expected: list[str] = field(default_factory=list)


def steps(text: str) -> tuple[list[Step], dict[str, str]]:
    """The tour's commands with what each printed, and the files it writes."""
    found: list[Step] = []
    files: dict[str, str] = {}
    for kind, body in _BLOCK.findall(text):
        if kind == "yaml":
            named = re.match(r"#\s*([\w.-]+):", body)
            if named:
                files[named.group(1)] = body
        if kind != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                found.append(Step(re.sub(r"\s+#.*$", "", line[2:]).strip()))
            elif found:
                found[-1].expected.append(line)
    return found, files


def test_the_tour_is_read_as_commands_and_outputs() -> None:
    found, files = steps(TOUR.read_text(encoding="utf-8"))
    commands = [s.command for s in found]
    assert "reconciler apply pools.yaml" in commands and "pools.yaml" in files
    assert any(c.endswith("&") for c in commands)


_HEX = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{6,}\b")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z?")


def shape(line: str, *, tour: str, port: int) -> str:
    line = line.replace(tour, "/tmp/tour").replace(str(port), "14222")
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    line = _TIME.sub("T", line)
    line = _HEX.sub("H", line)
    line = re.sub(r"\d+", "N", line)
    return " ".join(line.split())


def same(expected: list[str], printed: list[str], *, tour: str, port: int) -> bool:
    want = [shape(e, tour=tour, port=port) for e in expected]
    got = [shape(p, tour=tour, port=port) for p in printed]
    if len(want) != len(got):
        return False
    for w, g in zip(want, got, strict=True):
        if w.endswith("…"):  # cut at a width: numbers of other lengths move the cut
            if not g.endswith("…") or w[:60] != g[:60]:
                return False
        elif w != g:
            return False
    return True


@pytest.fixture
def tour_dir() -> Iterator[Path]:
    # short: the simulated hosts listen on unix sockets in it (107 bytes at most)
    directory = Path(tempfile.mkdtemp(prefix="tour-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _wait_for(condition: str, check: object, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"the tour's system: {condition}"
        time.sleep(0.1)


def test_the_tour_runs_as_written(tour_dir: Path) -> None:
    binary = find_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    found, files = steps(TOUR.read_text(encoding="utf-8"))
    port = _free_ports(1)[0]
    tour = str(tour_dir)
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("RC_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(binary).parent}{os.pathsep}{env['PATH']}"
    cwd = ROOT
    jobs: list[subprocess.Popen[bytes]] = []
    last_status = 0
    try:
        for step in found:
            command = step.command.replace("/tmp/tour", tour).replace("14222", str(port))
            if command.startswith(_SKIPPED):
                continue
            if command.startswith("mkdir -p ") and " && cd " in command:
                cwd = Path(command.split(" && cd ", 1)[1])
                cwd.mkdir(parents=True, exist_ok=True)
                for name, body in files.items():
                    (cwd / name).write_text(body)
                continue
            if command.startswith("export "):
                name, value = command.removeprefix("export ").split("=", 1)
                env[name] = value
                continue
            if command.startswith("kill %"):
                for number in (int(n) for n in re.findall(r"%(\d+)", command)):
                    job = jobs[number - 1]
                    os.killpg(job.pid, signal.SIGTERM)  # the shell's job: its command too
                    status = job.wait(30)
                    assert status in (0, -signal.SIGTERM, 128 + signal.SIGTERM), job.args
                continue
            if command == "echo $?":
                assert [str(last_status)] == step.expected, step
                continue
            if command.endswith("&"):
                jobs.append(
                    subprocess.Popen(
                        command[:-1], shell=True, cwd=cwd, env=env, start_new_session=True
                    )
                )
                continue
            if jobs and not _ready(cwd):
                _wait_for("a leader and both hosts", functools.partial(_ready, cwd))
            if jobs and not command.startswith(_READS):
                # a reader reads the prose between two commands: the warm VMs the tour
                # says were booting have booted by the time the next command changes
                # anything (a claim typed 0.1 s after `apply` finds none ready)
                _wait_for("warm VMs booted", functools.partial(_booted, cwd, env))
            last_status = _run(step, command, cwd, env, tour=tour, port=port)
    finally:
        for job in jobs:  # a job's group: the shell and the command it runs
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)


def _ready(cwd: Path) -> bool:
    """What the tour says happened within a second of the start block."""

    def log(name: str) -> str:
        path = cwd / name
        return path.read_text(errors="replace") if path.exists() else ""

    return "leader.ready" in log("run.log") and log("bridge.log").count("bridge.inventory") >= 2


def _booted(cwd: Path, env: dict[str, str]) -> bool:
    """No pool has a warm VM booting (or no store yet: nothing to boot)."""
    if not (cwd / "rc.db").exists():
        return True
    result = subprocess.run(
        ["reconciler", "status", "--db", "rc.db", "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        return False
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return all(row.get("booting", 0) == 0 for row in rows if row.get("type") == "pool")


def _run(step: Step, command: str, cwd: Path, env: dict[str, str], *, tour: str, port: int) -> int:
    reads = command.startswith(_READS)
    deadline = time.monotonic() + (_SETTLE_S if reads else 0)
    while True:
        result = subprocess.run(
            command,
            shell=True,
            cwd=cwd,
            env={**env, "PYTHONUNBUFFERED": "1"},  # both streams in the order printed
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )
        printed = result.stdout.splitlines()
        if same(step.expected, printed, tour=tour, port=port):
            return result.returncode
        if time.monotonic() >= deadline:
            shown = "\n".join(printed)
            raise AssertionError(
                f"docs/tour.md: `{step.command}` printed (status {result.returncode}):\n"
                f"{shown}\n--- the tour shows:\n" + "\n".join(step.expected)
            )
        time.sleep(0.5)
