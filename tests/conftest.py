"""Shared pytest configuration and fixtures.

Keep this file generic: NATS server fixtures and test-wide settings only. Fixtures for one
area belong in that area's test module or a helper module beside it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import structlog
from nats.aio.client import Client

from tests.support import realincus
from tests.support.natsserver import NatsServer, start_nats_server


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for this test (or ``RC_TEST_NATS_URL``'s).

    ``kill()``, ``stop()``, ``start()``, ``restart()``, ``pause()``, ``resume()`` inject
    faults; they skip the test when the server cannot be controlled. ``.url`` survives
    restarts.
    """
    workdir = tmp_path / "nats"
    workdir.mkdir()
    with start_nats_server(workdir) as server:
        yield server


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """The client URL of this test's NATS server."""
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A nats-py client connected to this test's server, reconnecting fast, closed after."""
    client = await nats.connect(
        nats_url,
        name="pytest",
        connect_timeout=2,
        reconnect_time_wait=0.1,  # seconds; float works
        max_reconnect_attempts=-1,
        allow_reconnect=True,
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Commands configure logging for the whole process; undo it after each test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


# ------------------------------------------------------------------ real Incus daemon


@pytest.fixture(scope="session")
def real_incus_daemon() -> Iterator[realincus.RealIncus]:
    """One private Incus 6.0 daemon for the session (see :mod:`tests.support.realincus`)."""
    reason = realincus.unavailable()
    if reason is not None:
        if realincus.required():
            pytest.fail(f"{realincus.REQUIRE_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)
    with realincus.start_real_incus() as daemon:
        yield daemon


@pytest.fixture
def real_incus(real_incus_daemon: realincus.RealIncus) -> Iterator[realincus.RealIncus]:
    """The session's real daemon, emptied of instances after the test."""
    yield real_incus_daemon
    real_incus_daemon.clean()


_real_incus_runs: dict[str, bool] = {}  # test id -> ran (True) or was skipped (False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "real_incus" not in report.keywords:
        return
    if report.when == "call":
        _real_incus_runs[report.nodeid] = True
    elif report.when == "setup" and report.skipped:
        _real_incus_runs[report.nodeid] = False


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _real_incus_runs:
        ran = sum(_real_incus_runs.values())
        skipped = len(_real_incus_runs) - ran
        terminalreporter.write_line(
            f"real Incus daemon: {ran} tests ran against it, {skipped} skipped"
        )
