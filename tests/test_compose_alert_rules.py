"""compose/'s Prometheus configuration, alert rules and Grafana dashboard against the
components that feed them: ``promtool`` accepts the rules and the configuration and runs
the rules' own cases (``alerts_test.yml``), every job an alert names is scraped, and
every metric a rule or a dashboard panel names is exported by a running replica, bridge
or executor (a renamed metric would silently never fire).

``promtool`` comes with the Debian package ``prometheus``, which ``scripts/test``
installs where it can (root on Debian); it then sets ``RC_REQUIRE_PROMTOOL=1`` and a
missing ``promtool`` fails these tests instead of skipping them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from reconciler.bridge.bridge import Bridge, HostBridge, HostSettings
from reconciler.bridge.metrics import bridge_metrics_server
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.executor.executor import Executor, ExecutorConfig
from reconciler.incus.client import IncusHost
from reconciler.replica.replica import Replica, RunConfig
from tests.support.repo import ROOT
from tests.support.simfleet import endpoints as fleet_endpoints
from tests.support.simfleet import sim_fleet

PROMETHEUS = ROOT / "compose" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
DASHBOARDS = ROOT / "compose" / "grafana" / "dashboards"
METRIC = re.compile(r"\b(rc_[a-z0-9_]+)\b")
REQUIRE_ENV = "RC_REQUIRE_PROMTOOL"
PREFIX = "rca"


# ------------------------------------------------------------------ promtool


def promtool() -> str:
    found = shutil.which("promtool")
    if found is not None:
        return found
    reason = "no promtool (Debian package prometheus; scripts/test installs it as root)"
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{reason}, and {REQUIRE_ENV} is set")
    pytest.skip(reason)


def run_promtool(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def test_promtool_accepts_the_alert_rules() -> None:
    output = run_promtool("check", "rules", ALERTS.name, cwd=PROMETHEUS)
    rules = sum(len(group["rules"]) for group in yaml.safe_load(ALERTS.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in output


def test_the_alert_rules_cases_pass() -> None:
    output = run_promtool("test", "rules", "alerts_test.yml", cwd=PROMETHEUS)
    assert "SUCCESS" in output


def test_promtool_accepts_the_scrape_configuration(tmp_path: Path) -> None:
    # compose mounts the directory at /etc/prometheus: the same files, here
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    output = run_promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert "SUCCESS" in output


def scrape_jobs() -> set[str]:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    return {job["job_name"] for job in config["scrape_configs"]}


def test_every_job_an_alert_names_is_scraped() -> None:
    named = set(re.findall(r'job="([^"]+)"', ALERTS.read_text()))
    assert named == {"reconciler", "bridge", "executor"}
    assert named <= scrape_jobs()


# ------------------------------------------------------------------ names


def named_metrics() -> dict[str, set[str]]:
    """Every ``rc_…`` name in the alert rules and the dashboards' panels, by file."""
    found: dict[str, set[str]] = {}
    doc = yaml.safe_load(ALERTS.read_text())
    exprs = [rule["expr"] for group in doc["groups"] for rule in group["rules"]]
    found[ALERTS.name] = {name for expr in exprs for name in METRIC.findall(expr)}
    for path in sorted(DASHBOARDS.glob("*.json")):
        panels = json.loads(path.read_text())["panels"]
        exprs = [t["expr"] for panel in panels for t in panel.get("targets", [])]
        found[path.name] = {name for expr in exprs for name in METRIC.findall(expr)}
    return found


@contextlib.asynccontextmanager
async def running(
    start: Any, stop: anyio.Event, *, started: anyio.Event | None = None
) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(start, stop=stop))
        if started is not None:
            with anyio.fail_after(20):
                await started.wait()
        try:
            yield
        finally:
            stop.set()


async def _scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    return await anyio.to_thread.run_sync(get)


def exported(text: str) -> tuple[set[str], set[str]]:
    """The names a ``/metrics`` page exports (samples, and counters as ``_total`` and
    histograms as ``_bucket``, ``_sum`` and ``_count`` even before their first sample),
    and the names of its counters."""
    names: set[str] = set()
    counters: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            counters.add(family.name)
            names.add(f"{family.name}_total")
        elif family.type == "histogram":  # before its first observation, too
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names, counters


async def test_every_metric_a_rule_or_a_panel_names_is_exported(
    nats_url: str, tmp_path: Path
) -> None:
    names = StreamNames.for_prefix(PREFIX)
    nats = ConnectOptions(urls=(nats_url,), reconnect_wait_s=0.1, connect_timeout_s=1.0)
    pages: dict[str, str] = {}
    async with sim_fleet(2) as fleet:
        endpoints = fleet_endpoints(fleet)
        replica = Replica(
            RunConfig(
                nats=nats,
                db=tmp_path / "rc.db",
                prefix=PREFIX,
                replica="names",
                store_writer="thread",
                metrics_addr="127.0.0.1:0",
                metrics_per_host=True,  # the dashboard's bars per host need them
            )
        )
        executor = Executor(
            ExecutorConfig(
                endpoints=endpoints,
                nats=nats,
                prefix=PREFIX,
                db=tmp_path / "executor.db",
                metrics_addr="127.0.0.1:0",
            )
        )
        nc: Client = await connect(nats)
        incus = [IncusHost(e) for e in endpoints]
        try:
            await ensure_streams(nc.jetstream(), names)
            hosts = [
                HostBridge(incus=h, js=nc.jetstream(), prefix=PREFIX, settings=HostSettings())
                for h in incus
            ]
            bridge = bridge_metrics_server(addr="127.0.0.1:0", hosts=hosts, nc=nc)
            await bridge.start()
            stop = anyio.Event()
            try:
                async with (
                    running(replica.run, stop, started=replica.started),
                    running(executor.run, stop, started=executor.ready),
                    anyio.create_task_group() as tg,
                ):
                    tg.start_soon(Bridge(hosts).run)
                    with anyio.fail_after(20):
                        while not all(h.caught_up for h in hosts):  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    assert replica.metrics is not None and executor.metrics is not None
                    for component, port in (
                        ("replica", replica.metrics.port),
                        ("bridge", bridge.port),
                        ("executor", executor.metrics.port),
                    ):
                        pages[component] = await _scrape(port)
                    tg.cancel_scope.cancel()
            finally:
                await bridge.stop()
        finally:
            for host in incus:
                await host.aclose()
            await nc.close()

    everything: set[str] = set()
    counters: set[str] = set()
    owners: dict[str, str] = {}
    for component, page in pages.items():
        found, counted = exported(page)
        own = {name for name in found if name.startswith("rc_")}
        assert own, component
        # one name, one meaning: a query without a job label never mixes two components
        shared = sorted(name for name in own if owners.setdefault(name, component) != component)
        assert shared == [], f"{component} exports names another component does: {shared}"
        everything |= found
        counters |= counted
    for where, named in named_metrics().items():
        assert named, where
        missing = sorted(named - everything)
        assert missing == [], f"{where} names metrics no component exports: {missing}"
        # prometheus-client exports a counter "x" as "x_total": "x" alone matches nothing
        bare = sorted(named & counters)
        assert bare == [], f"{where} names counters without _total: {bare}"
    # each component's own metrics are named somewhere, so an operator sees them
    every_named = set().union(*named_metrics().values())
    for prefix in ("rc_bridge_", "rc_executor_"):
        assert any(name.startswith(prefix) for name in every_named), prefix
