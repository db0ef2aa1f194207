"""``reconciler executor`` (reconciler.cli.commands.executor): its endpoints from a fleet file
and flags, and the command as a process finishing its command on SIGTERM."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
import pytest
from nats.aio.client import Client

from reconciler.bus.streams import ensure_streams
from reconciler.cli.commands.executor import load_endpoints, parse_verify
from reconciler.core.model import TAG_LEASE_ID
from reconciler.incus.simulator import SimulatorThread
from tests.incus.conftest import FAST, make_fleet
from tests.support.executor import (
    NAMES,
    consumer_info,
    create_cmd,
    publish,
)

pytestmark = pytest.mark.timeout(60)

CPU = "host-01"


def test_endpoints_from_fleet_file_and_flags(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_bytes(
        orjson.dumps(
            {
                "hosts": {
                    "h1": {"url": "https://10.0.0.1:8443"},
                    "h2": {"url": "https://10.0.0.2:8443", "verify": str(ca)},
                    "h3": {"url": "http+unix://%2Fvar%2Flib%2Fincus%2Funix.socket"},
                }
            }
        )
    )
    found = load_endpoints(
        fleet_file=fleet_file,
        pairs=["h4=/run/incus.socket", "h1=https://10.0.0.9:8443"],
        cert=("c.pem", "k.pem"),
        verify=False,
    )
    by_host = {e.host: e for e in found}
    assert [e.host for e in found] == ["h1", "h2", "h3", "h4"]
    assert by_host["h1"].url == "https://10.0.0.9:8443"  # the flag wins over the file
    assert (by_host["h1"].cert, by_host["h1"].verify) == (("c.pem", "k.pem"), False)
    assert by_host["h2"].verify == str(ca)  # the file's own verify
    assert by_host["h3"].cert is None  # no TLS over a unix socket
    assert by_host["h4"].url == "http+unix://%2Frun%2Fincus.socket"
    only = load_endpoints(fleet_file=fleet_file, only=["h2"])
    assert [e.host for e in only] == ["h2"]
    with pytest.raises(click.BadParameter):
        load_endpoints(fleet_file=fleet_file, only=["nope"])
    with pytest.raises(click.BadParameter):
        load_endpoints(fleet_file=None, pairs=["no-url"])
    assert parse_verify("false") is False
    assert parse_verify("TRUE") is True
    assert parse_verify(str(ca)) == str(ca)
    with pytest.raises(click.BadParameter):
        parse_verify(str(tmp_path / "missing.pem"))


def test_sigterm_lets_the_command_process_finish_its_command(tmp_path: Path, nats_url: str) -> None:
    directory = Path(tempfile.mkdtemp(prefix="ex-"))
    slow = dataclasses.replace(FAST, action_delay_s=1.0)
    fleet_file = directory / "fleet.json"
    db = tmp_path / "executor.db"
    log_file = tmp_path / "executor.log"
    try:
        with SimulatorThread(make_fleet(directory, options=slow, hosts=2)) as sim:
            anyio.run(_ensure_streams, nats_url)
            with log_file.open("ab") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "reconciler.cli.commands.executor",
                     "--incus-fleet", str(fleet_file), "--nats-url", nats_url,
                     "--db", str(db), "--log-format", "json", "--retry-base", "0.1"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )  # fmt: skip
            try:
                _wait(lambda: _log_events(log_file).count("consumer.bound") == 2, 15)
                anyio.run(_publish_one, nats_url, create_cmd(CPU, "w-17", "L17"))
                _wait(lambda: ("ci", "w-17") in sim.host(CPU).instances, 10)
                process.send_signal(signal.SIGTERM)
                assert process.wait(20) == 0
            finally:
                if process.poll() is None:
                    process.kill()
            made = sim.call(lambda: sim.host(CPU).instances.get(("ci", "w-17")))
            assert made is not None
            assert made.is_running
            assert made.config[TAG_LEASE_ID] == "L17"
        events = _log_events(log_file)
        assert "command.done" in events
        assert events[-1] == "executor.stopped"
        info = anyio.run(_consumer_info, nats_url, CPU)
        assert info.num_ack_pending == 0
        assert info.ack_floor.stream_seq == info.delivered.stream_seq
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _log_events(path: Path) -> list[str]:
    found = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            found.append(str(orjson.loads(line).get("event")))
    return found


def _wait(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


async def _with_client(url: str) -> Client:
    import nats

    return await nats.connect(url, connect_timeout=2)


async def _ensure_streams(url: str) -> None:
    nc = await _with_client(url)
    try:
        await ensure_streams(nc.jetstream(), NAMES)
    finally:
        await nc.close()


async def _publish_one(url: str, payload: dict[str, Any]) -> None:
    nc = await _with_client(url)
    try:
        await publish(nc, payload)
    finally:
        await nc.close()


async def _consumer_info(url: str, host: str) -> Any:
    nc = await _with_client(url)
    try:
        return await consumer_info(nc, host)
    finally:
        await nc.close()
