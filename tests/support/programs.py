"""A reconciler program run as the real command (``python -m reconciler.cli``): a child
process logging JSON lines to a file, its ``/healthz``, ``/readyz`` and Prometheus
``/metrics`` on the port it chose."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import orjson
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Program:
    """``reconciler <args>`` as a child process logging JSON lines to a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "reconciler.cli", *args, "--log-format", "json"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.base = ""

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [orjson.loads(line) for line in lines if line.startswith("{")]

    def serving(self) -> str:
        """The base URL of its metrics server, once it listens (port 0 was asked)."""

        def port() -> int | None:
            for event in self.events():
                if event.get("event") == "metrics.listening":
                    return int(event["port"])
            assert self.process.poll() is None, self.log.read_text()
            return None

        found = wait_for(port, 20, "the metrics server to listen")
        self.base = f"http://127.0.0.1:{found}"
        return self.base

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def ready(self, within_s: float) -> dict[str, Any]:
        """``/readyz``'s document once it answers 200 (the NATS connection is up)."""
        wait_for(lambda: self.get("/readyz")[0] == 200, within_s, "/readyz to answer 200")
        document: dict[str, Any] = orjson.loads(self.get("/readyz")[1])
        assert document["nats_connected"] is True
        return document

    def metrics(self) -> Samples:
        status, body = self.get("/metrics")
        assert status == 200
        return parse(body.decode())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for(check: Callable[[], Any], within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"waited {within_s} s for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def program(args: list[str], log: Path) -> Iterator[Program]:
    running = Program(args, log)
    try:
        yield running
    finally:
        running.stop()


def two_free_ports() -> int:
    """A port P with P and P + 1 free now (the simulated hosts listen there later)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


async def _with_bus(url: str, work: Callable[[Any], Any]) -> Any:
    nc = await nats.connect(url, connect_timeout=2)
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def on_bus(url: str, work: Callable[[Any], Any]) -> Any:
    return anyio.run(_with_bus, url, work)
