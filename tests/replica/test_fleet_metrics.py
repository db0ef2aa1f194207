"""The fleet's metrics (:mod:`reconciler.replica.fleet_metrics`): a real replica on a real
nats-server folds hosts, pools, admissions, claims and lifecycle events, and its
``/metrics`` page says what the fleet holds, how claims went and how long things took;
a second replica that is not the leader says the same about the fleet."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections import Counter
from pathlib import Path

import anyio
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from reconciler.core.model import HostName
from reconciler.replica.fleet_metrics import (
    RESOURCES,
    Histogram,
    _fleet_totals,
    _host_condition,
    _host_figures,
    fleet_families,
    stream_seconds,
)
from reconciler.replica.replica import Replica
from reconciler.store.sqlite import Store
from tests.store.test_sqlite import MESSAGES, folded
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica

pytestmark = pytest.mark.timeout(90)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(replica: Replica) -> Samples:
    assert replica.metrics is not None
    port = replica.metrics.port

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    text = await anyio.to_thread.run_sync(get)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_stream_times_are_read_to_the_nanosecond() -> None:
    assert stream_seconds("1970-01-01T00:00:10.5Z") == 10.5
    assert stream_seconds("1970-01-01T00:00:10.000000001Z") == pytest.approx(10.000000001)
    assert stream_seconds("1970-01-01T00:01:00Z") == 60.0
    assert stream_seconds("yesterday") is None


def test_a_histogram_counts_cumulatively() -> None:
    hist = Histogram((1.0, 5.0))
    for seconds in (0.5, 1.0, 3.0, 9.0, -1.0):
        hist.observe(seconds)
    assert hist.buckets() == [("1.0", 3.0), ("5.0", 4.0), ("+Inf", 5.0)]
    assert hist.total == 13.5


def test_the_fleets_totals_are_the_sums_of_its_hosts() -> None:
    """The one-pass totals agree with each host's figures (foreign VMs, GPUs held and
    foreign, adoptions, cordons: the store tests' scenario), and with their sum."""
    state = folded(MESSAGES)[0]
    state.put_host(dataclasses.replace(state.hosts[HostName("h1")], cordon="cordoned"))
    capacity, booked, conditions = _fleet_totals(state)
    rows = [_host_figures(state, name) for name in state.host_order]
    assert capacity == [sum(alloc[i] for alloc, _ in rows) for i in range(4)]
    assert booked == [sum(used[i] for _, used in rows) for i in range(4)]
    assert conditions == Counter(_host_condition(state, name) for name in state.host_order)
    assert conditions["cordoned"] == 1 and sum(booked) > 0 and booked[3] > 0
    families = {
        f.name: {tuple(s.labels.values()): s.value for s in f.samples}
        for f in fleet_families(state, per_host=True)
    }
    for i, resource in enumerate(RESOURCES):
        per_host = [v for k, v in families["rc_host_booked"].items() if k[1] == resource]
        assert families["rc_fleet_booked"][(resource,)] == sum(per_host) == booked[i]


async def test_the_fleet_as_metrics(nc: Client, nats_url: str, tmp_path: Path) -> None:
    bus = BusClient(nc)
    config = fast_config(
        nats_url, tmp_path / "rc.db", metrics_addr="127.0.0.1:0", metrics_per_host=True
    )
    async with running_replica(config) as replica:
        await bus.send(
            b.snapshot("h1", cpu=16, memory_mib=65536, disk_gib=500),
            b.snapshot("h2", cpu=8, memory_mib=32768, disk_gib=200, schedulable=False),
            b.pool("web", cpu=4, memory_mib=8192, disk_gib=40, min_ready=0, max_ready=3),
            b.admit("w1", "web", "warm-1", kind="warm", host="h1"),
            b.admit("w2", "web", "warm-2", kind="warm", host="h1"),
            b.admit("c1", "web", "cold-1", host="h1"),
        )
        await bus.decision("c1")
        await anyio.sleep(0.3)  # stream times apart: the waits are not zero
        await bus.send(
            b.lifecycle("h1", "instance-created", "warm-1"),
            b.lifecycle("h1", "instance-ready", "warm-1"),
            b.cmd("mark-created", "mc1", instance="cold-1"),
            b.cmd("claim-warm", "k1", pool="web", job="job-1"),
            b.cmd("claim-warm", "k2", pool="web", job="job-2"),  # warm-2 still boots
        )
        await bus.decision("mc1")
        await bus.decision("k2")
        await anyio.sleep(0.2)
        await bus.send(b.cmd("mark-warm-injected", "i1", instance="warm-1", job="job-1"))
        await bus.decision("i1")
        # the same request again (past the stream's duplicate window, as a producer's
        # retry would be): its decision is re-sent, neither counted nor timed again
        await bus.send(b.cmd("claim-warm", "k2", pool="web", job="job-2"), msg_ids=False)
        await bus.send(b.cmd("claim-warm", "k3", pool="nope", job="job-3"))  # unknown pool
        await bus.decision("k3")
        with anyio.fail_after(10):
            while True:
                samples = await scrape(replica)
                if (
                    value(samples, "rc_warm_inject_seconds_count", pool="web")
                    and value(samples, "rc_decision_latency_seconds_count", verb="claim-warm") >= 3
                ):
                    break
                await anyio.sleep(0.05)

        # capacity and booking, the fleet's and each host's; h2 is not schedulable
        assert value(samples, "rc_fleet_capacity", resource="cpu") == 24
        assert value(samples, "rc_fleet_booked", resource="cpu") == 12
        assert value(samples, "rc_fleet_booked", resource="memory_mib") == 3 * 8192
        assert value(samples, "rc_fleet_hosts", condition="schedulable") == 1
        assert value(samples, "rc_fleet_hosts", condition="unschedulable") == 1
        assert value(samples, "rc_host_booked", host="h1", resource="disk_gib") == 120
        assert value(samples, "rc_host_capacity", host="h2", resource="cpu") == 8
        assert value(samples, "rc_host_schedulable", host="h2") == 0
        # the pool: one claimed (injected), one booting; its warm targets
        assert value(samples, "rc_pool_leases", pool="web", state="claimed") == 1
        assert value(samples, "rc_pool_leases", pool="web", state="booting") == 1
        assert value(samples, "rc_pool_leases", pool="web", state="ready") == 0
        assert value(samples, "rc_pool_instances", pool="web") == 3
        assert value(samples, "rc_pool_warm_target", pool="web", bound="max_ready") == 3
        # claims: one hit, one miss; none on an unknown pool (its name is no label)
        assert not any(k[0] == "rc_warm_claims_total" and ("pool", "nope") in k[1] for k in samples)
        assert (
            value(
                samples,
                "rc_decision_outcomes_total",
                verb="claim-warm",
                outcome="no-warm",
                reason="unknown-pool",
            )
            == 1
        )
        assert value(samples, "rc_warm_claims_total", pool="web", outcome="claimed") == 1
        assert value(samples, "rc_warm_claims_total", pool="web", outcome="no-warm") == 1
        assert (
            value(
                samples,
                "rc_decision_outcomes_total",
                verb="claim-warm",
                outcome="no-warm",
                reason="not-ready",
            )
            == 1
        )
        assert (
            value(
                samples,
                "rc_decision_outcomes_total",
                verb="admit",
                outcome="admitted",
                reason="none",
            )
            == 3
        )
        # the waits: each observed once, from stream times, at least the pauses above
        for name in ("rc_warm_boot_seconds", "rc_cold_start_seconds", "rc_warm_inject_seconds"):
            assert value(samples, f"{name}_count", pool="web") == 1, name
            assert value(samples, f"{name}_sum", pool="web") >= 0.15, name
            assert value(samples, f"{name}_bucket", pool="web", le="+Inf") == 1, name
        # the leader's decision latency, by verb
        assert value(samples, "rc_decision_latency_seconds_count", verb="admit") == 3
        # k1, k2 and k3: not k2 re-sent
        assert value(samples, "rc_decision_latency_seconds_count", verb="claim-warm") == 3
        assert value(samples, "rc_decision_latency_seconds_count", verb="mark-warm-injected") == 1
        assert 0 < value(samples, "rc_decision_latency_seconds_sum", verb="admit") < 10

        # a follower that folds the same stream says the same about the fleet, and the
        # claims it counted; it publishes nothing, so it has no decision latency
        follower_config = fast_config(nats_url, tmp_path / "f.db", metrics_addr="127.0.0.1:0")
        async with running_replica(follower_config, ready=False) as follower:
            with anyio.fail_after(10):
                while follower.pipeline is None or not follower.pipeline.synced.is_set():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            theirs = await scrape(follower)
        for name in (
            "rc_fleet_capacity", "rc_fleet_booked", "rc_pool_leases", "rc_warm_claims_total",
            "rc_warm_boot_seconds_count", "rc_warm_inject_seconds_sum", "rc_cold_start_seconds_sum",
        ):  # fmt: skip
            mine = {k: v for k, v in samples.items() if k[0] == name}
            assert mine and {k: v for k, v in theirs.items() if k[0] == name} == mine, name
        assert not any(k[0] == "rc_host_capacity" for k in theirs)  # not asked for per host
        assert not any(k[0] == "rc_decision_latency_seconds_count" for k in theirs)

    # the leader's store (written by its writer process) kept the claims' counts, which
    # reconciler status reads and a restarted replica's rc_warm_claims_total starts from
    async with await Store.open_readonly(config.db) as store:
        assert await store.warm_claims() == {"web": (1, 1)}
    async with running_replica(config) as again:
        samples = await scrape(again)
    assert value(samples, "rc_warm_claims_total", pool="web", outcome="claimed") == 1
    assert value(samples, "rc_warm_claims_total", pool="web", outcome="no-warm") == 1
