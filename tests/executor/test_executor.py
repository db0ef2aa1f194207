"""``reconciler executor``: exec commands from a real nats-server, carried out by real pylxd
on the simulated Incus fleet.

Covers: what a create makes (tags, limits, root size, GPUs, started, on the right host);
deletes of running, stopped and missing VMs; one instance's commands in order and
instances in parallel; a command id acted on once (re-published, redelivered after a
crash); retries of transient failures (a failing create, an unreachable host) and of a
NATS restart; definite refusals terminated; bad commands refused without Incus;
heartbeats; graceful shutdown. Parsing is in ``test_commands.py``, the command as a
process in ``tests/cli/commands/test_executor.py``.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.streams import ensure_streams
from reconciler.core.model import TAG_KIND, TAG_LEASE_ID, TAG_POOL
from reconciler.executor.executor import ExecutorConfig, consumer_name
from reconciler.executor.records import ExecutorStore, FinishedCommand
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.simulator import Fleet, Listen, default_fleet
from tests.incus.conftest import FAST, make_fleet
from tests.support.bus import BusClient
from tests.support.executor import (
    GPU_PCI,
    NAMES,
    PREFIX,
    ActionLog,
    consumer_info,
    create_cmd,
    delete_cmd,
    endpoints_of,
    fast_config,
    publish,
    running_executor,
    settled,
    until,
)

pytestmark = pytest.mark.timeout(60)

CPU, OTHER, GPU = "host-01", "host-02", "host-04"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ex-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def fleet(socket_dir: Path) -> AsyncIterator[Fleet]:
    async with make_fleet(socket_dir) as running:
        yield running


@pytest.fixture
async def bus(nc: Client) -> Client:
    """The test's NATS client, with the streams created as ``reconciler run`` does."""
    await ensure_streams(nc.jetstream(), NAMES)
    return nc


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "executor.db"


def instance(fleet: Fleet, host: str, name: str, project: str = "ci") -> Any:
    return fleet.host(host).instances.get((project, name))


# ------------------------------------------------------------------------ configuration


def test_config_is_validated() -> None:
    endpoint = IncusEndpoint(host="h1", url="http://127.0.0.1:1")
    ExecutorConfig(endpoints=(endpoint,))
    with pytest.raises(ValueError, match="at least one"):
        ExecutorConfig(endpoints=())
    with pytest.raises(ValueError, match="twice"):
        ExecutorConfig(endpoints=(endpoint, endpoint))
    with pytest.raises(ValueError, match="host name"):
        ExecutorConfig(endpoints=(IncusEndpoint(host="-x", url="http://a"),))
    with pytest.raises(ValueError, match="heartbeat"):
        ExecutorConfig(endpoints=(endpoint,), ack_wait_s=10, heartbeat_s=10)
    assert ExecutorConfig(endpoints=(endpoint,), ack_wait_s=8).heartbeat_interval_s == 2


# ------------------------------------------------------------------------ creating


async def test_create_makes_a_tagged_started_vm_on_its_host(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    command = create_cmd(
        GPU,
        "w-gpu-1",
        "L30",
        pool="gpu_train",
        cpu=8,
        memory_mib=32768,
        disk_gib=100,
        gpus=((1, GPU_PCI[1]), (0, GPU_PCI[0])),
    )
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, command)
        record = await running.record("create:L30")
        assert (record.outcome, record.attempts, record.host) == ("created", 1, GPU)
        await settled(bus, GPU)

    made = instance(fleet, GPU, "w-gpu-1")
    assert made is not None
    assert all(instance(fleet, h, "w-gpu-1") is None for h in fleet.hosts if h != GPU)
    assert made.type == "virtual-machine"
    assert made.profiles == ["default"]
    assert made.config["limits.cpu"] == "8"
    assert made.config["limits.memory"] == "32768MiB"
    assert made.config[TAG_LEASE_ID] == "L30"
    assert made.config[TAG_POOL] == "gpu_train"
    assert made.config[TAG_KIND] == "warm"
    assert made.devices["root"] == {
        "type": "disk",
        "path": "/",
        "pool": "default",
        "size": "100GiB",
    }
    gpus = {d["pci"] for d in made.devices.values() if d.get("type") == "gpu"}
    assert gpus == {GPU_PCI[0], GPU_PCI[1]}
    assert made.is_running

    host = IncusHost(IncusEndpoint(host=GPU, url=fleet.endpoints[GPU]))
    try:
        view = await host.get_instance("w-gpu-1", project="ci")
    finally:
        await host.aclose()
    assert view is not None
    assert view.lease_id == "L30"
    assert (view.resources.cpu, view.resources.memory_mib, view.resources.disk_gib) == (
        8,
        32768,
        100,
    )
    assert view.gpus == (GPU_PCI[0], GPU_PCI[1])


def bus_url(nc: Client) -> str:
    url = nc.connected_url
    assert url is not None
    return f"nats://{url.hostname}:{url.port}"


# ------------------------------------------------------------------------ deleting


async def test_create_honours_the_pools_instance_type(fleet: Fleet, bus: Client, db: Path) -> None:
    command = create_cmd(CPU, "w-ct-1", "L40", instance_type="container")
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, command)
        record = await running.record("create:L40")
        assert record.outcome == "created"
        await settled(bus, CPU)

    made = instance(fleet, CPU, "w-ct-1")
    assert made is not None
    assert made.type == "container"
    assert made.is_running


async def test_delete_stops_and_deletes_a_running_vm(fleet: Fleet, bus: Client, db: Path) -> None:
    fleet.host(CPU).add_instance("w-1", project="ci", status="Running", config={TAG_LEASE_ID: "L1"})
    log = ActionLog(fleet)
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, delete_cmd(CPU, "w-1", "L1", reason="preempted"))
        record = await running.record("delete:L1:preempted")
        await settled(bus, CPU)
    assert (record.outcome, record.detail) == ("deleted", "was Running")
    assert instance(fleet, CPU, "w-1") is None
    assert log.of("w-1") == ["instance-stopped", "instance-deleted"]


async def test_delete_of_a_stopped_or_missing_vm_is_done(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    fleet.host(CPU).add_instance("w-2", project="ci", status="Stopped")
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, delete_cmd(CPU, "w-2", "L2"))
        await publish(bus, delete_cmd(CPU, "w-3", "L3", reason="orphan"))
        await publish(bus, delete_cmd(CPU, "w-4", "L4", project="gone"))
        stopped = await running.record("delete:L2:drained")
        missing = await running.record("delete:L3:orphan")
        no_project = await running.record("delete:L4:drained")
        await settled(bus, CPU)
        assert running.executor.stats["retry"] == 0
    assert (stopped.outcome, stopped.detail) == ("deleted", "was Stopped")
    assert (missing.outcome, missing.detail) == ("absent", "no such instance")
    assert (no_project.outcome, no_project.detail) == ("absent", "Project not found")
    assert instance(fleet, CPU, "w-2") is None


# ------------------------------------------------------------------------ ordering


async def test_one_instance_runs_in_order_and_instances_in_parallel(
    socket_dir: Path, bus: Client, db: Path
) -> None:
    slow = dataclasses.replace(FAST, action_delay_s=0.25)
    async with make_fleet(socket_dir, options=slow) as fleet:
        log = ActionLog(fleet)
        config = fast_config(bus_url(bus), db, endpoints_of(fleet), workers=4)
        async with running_executor(config) as running:
            began = time.monotonic()
            await publish(bus, create_cmd(CPU, "w-x", "L10"))
            await publish(bus, delete_cmd(CPU, "w-x", "L10"))
            for i in range(3):
                await publish(bus, create_cmd(OTHER, f"p-{i}", f"L2{i}"))
            created = await running.record("create:L10")
            deleted = await running.record("delete:L10:drained")
            for i in range(3):
                await running.record(f"create:L2{i}")
            elapsed = time.monotonic() - began
            await settled(bus, CPU)
            await settled(bus, OTHER)
        assert created.outcome == "created"
        assert (deleted.outcome, deleted.stream_seq > created.stream_seq) == ("deleted", True)
        assert deleted.detail.startswith("was R")  # it deleted the VM the create made
        lifecycle = ("instance-created", "instance-started", "instance-stopped", "instance-deleted")
        assert [a for a in log.of("w-x") if a in lifecycle] == [
            "instance-created",
            "instance-started",
            "instance-stopped",
            "instance-deleted",
        ]
        assert instance(fleet, CPU, "w-x") is None
        # Each command is two 0.25 s actions: 5 in a row would take 2.5 s.
        assert elapsed < 2.0, elapsed


async def test_a_slow_host_does_not_hold_up_the_others(fleet: Fleet, bus: Client, db: Path) -> None:
    fleet.host(CPU).timing.action_delay_s = 0.6  # create + start: 1.2 s
    config = fast_config(bus_url(bus), db, endpoints_of(fleet), workers=1)
    async with running_executor(config) as running:
        await publish(bus, create_cmd(CPU, "slow-1", "L40"))
        await until(lambda: instance(fleet, CPU, "slow-1") is not None)
        began = time.monotonic()
        await publish(bus, create_cmd(OTHER, "quick-1", "L41"))
        await running.record("create:L41")
        assert time.monotonic() - began < 0.6
        assert await running.executor.store.finished("create:L40") is None
        await running.record("create:L40")


# ------------------------------------------------------------------------ once


async def test_a_republished_command_id_acts_once(fleet: Fleet, bus: Client, db: Path) -> None:
    log = ActionLog(fleet)
    command = create_cmd(CPU, "w-5", "L5")
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        first = await publish(bus, command, msg_id=False)
        second = await publish(bus, command, msg_id=False)
        assert second == first + 1  # no deduplication by the stream
        await running.record("create:L5")
        await until(lambda: running.executor.stats["duplicate"] == 1)
        # Past the stream's duplicate window, on another day: still once.
        await publish(bus, command, msg_id="create:L5:again")
        await until(lambda: running.executor.stats["duplicate"] == 2)
        await settled(bus, CPU)
        assert running.executor.stats["created"] == 1
    assert log.count("instance-created", "w-5") == 1
    assert log.count("instance-started", "w-5") == 1


class CrashingStore(ExecutorStore):
    """Dies (hangs until killed) right after, or right before, writing a record."""

    crash_after_write = True
    crashed: anyio.Event

    async def record(self, done: FinishedCommand) -> FinishedCommand:
        if self.crash_after_write:
            await super().record(done)
        self.crashed.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("after_write", [True, False], ids=["after-record", "before-record"])
async def test_redelivery_after_a_crash_between_incus_and_ack(
    fleet: Fleet, bus: Client, db: Path, after_write: bool
) -> None:
    """Killed after the VM was made but before the ack: the redelivered command finds its
    record and is acked without acting; killed before the record was written, it is done
    again, and the idempotent create leaves the same VM."""
    log = ActionLog(fleet)
    config = fast_config(bus_url(bus), db, endpoints_of(fleet))
    crashing = await CrashingStore.open(db)
    crashing.crashed = anyio.Event()
    crashing.crash_after_write = after_write
    try:
        async with running_executor(config, store=crashing) as doomed:
            await publish(bus, create_cmd(CPU, "w-6", "L6"))
            with anyio.fail_after(10):
                await crashing.crashed.wait()
            doomed.kill()
    finally:
        await crashing.close()
    made = instance(fleet, CPU, "w-6")
    assert made is not None
    uuid = made.config["volatile.uuid"]
    assert (await consumer_info(bus, CPU)).num_ack_pending == 1

    async with running_executor(config) as restarted:
        record = await restarted.record("create:L6")
        await until(lambda: restarted.executor.held() == 0)
        info = await settled(bus, CPU)
        stats = restarted.executor.stats
    assert info.ack_floor is not None and info.delivered is not None
    assert info.ack_floor.stream_seq == info.delivered.stream_seq
    assert record.outcome == "created"
    if after_write:
        assert (stats["duplicate"], stats["created"]) == (1, 0)
    else:
        assert (stats["duplicate"], stats["created"]) == (0, 1)
    assert instance(fleet, CPU, "w-6").config["volatile.uuid"] == uuid
    assert log.count("instance-created", "w-6") == 1


async def test_a_create_after_its_lease_was_deleted_is_superseded(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, delete_cmd(CPU, "w-7", "L7", reason="preempted"))
        await running.record("delete:L7:preempted")
        await publish(bus, create_cmd(CPU, "w-7", "L7"))
        record = await running.record("create:L7")
        await settled(bus, CPU)
    assert record.outcome == "superseded"
    assert "delete:L7:preempted" in record.detail
    assert instance(fleet, CPU, "w-7") is None


# ------------------------------------------------------------------------ failures


async def test_a_transient_create_failure_is_retried_with_backoff(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    fleet.host(CPU).fail_next("create", count=2)
    fleet.host(CPU).fail_next("start", name="w-8")
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, create_cmd(CPU, "w-8", "L8"))
        record = await running.record("create:L8")
        await settled(bus, CPU)
        assert running.executor.stats["retry"] == 3
    assert (record.outcome, record.attempts) == ("created", 4)
    assert instance(fleet, CPU, "w-8").is_running


async def test_an_unreachable_host_is_retried_until_it_answers(bus: Client, db: Path) -> None:
    # Over TCP: pylxd's unix-socket connection leaks its socket when connect() fails.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    endpoints = (IncusEndpoint(host=CPU, url=f"http://127.0.0.1:{port}"),)
    async with running_executor(fast_config(bus_url(bus), db, endpoints)) as running:
        await publish(bus, create_cmd(CPU, "w-9", "L9"))
        await until(lambda: running.executor.stats["retry"] >= 3)
        assert await running.executor.store.finished("create:L9") is None
        listen = Listen(kind="tcp", address="127.0.0.1", base_port=port)
        async with Fleet(default_fleet(1, projects=("ci",)), listen=listen, options=FAST) as fleet:
            record = await running.record("create:L9")
            await settled(bus, CPU)
            assert instance(fleet, CPU, "w-9").is_running
    assert record.outcome == "created"
    assert record.attempts >= 4


@pytest.mark.parametrize(
    ("setup", "command", "why"),
    [
        (None, create_cmd(CPU, "w-10", "L10", profiles=("default", "gpu-nope")), "doesn't exist"),
        ("Image not found", create_cmd(CPU, "w-10", "L10", image="nope/1"), "Image not found"),
        (None, create_cmd(CPU, "w-10", "L10", project="nope"), "Project not found"),
    ],
    ids=["unknown-profile", "bad-image", "unknown-project"],
)
async def test_a_definite_refusal_is_terminated(
    fleet: Fleet, bus: Client, db: Path, setup: str | None, command: dict[str, Any], why: str
) -> None:
    if setup is not None:
        fleet.host(CPU).fail_next("create", message=setup)
    config = fast_config(bus_url(bus), db, endpoints_of(fleet), ack_wait_s=0.5)
    async with running_executor(config) as running:
        await publish(bus, command)
        record = await running.record("create:L10")
        info = await settled(bus, CPU)
        if why == "doesn't exist":  # once is enough
            await anyio.sleep(0.8)  # past ack_wait: a terminated message is never redelivered
            later = await consumer_info(bus, CPU)
            assert later.delivered is not None and info.delivered is not None
            assert later.delivered.consumer_seq == info.delivered.consumer_seq == 1
        assert running.executor.stats["retry"] == 0
    assert (record.outcome, record.attempts) == ("rejected", 1)
    assert why in record.detail
    assert all(name != "w-10" for (_, name) in fleet.host(CPU).instances)
    # what failed for good comes back as the host's failure input, once
    (report,) = await BusClient(bus, prefix=PREFIX).inputs(f"{PREFIX}.in.host.{CPU}.failure")
    assert report.msg_id == "failure:L10:create"
    body = report.json()
    assert (body["lease_id"], body["instance"], body["action"]) == ("L10", "w-10", "create")
    assert why in body["error"] and body["command_id"] == "create:L10"


async def test_a_failure_that_does_not_pass_gives_up_after_max_attempts(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    fleet.host(CPU).fail_next("create", count=10)
    config = fast_config(bus_url(bus), db, endpoints_of(fleet), max_attempts=3)
    async with running_executor(config) as running:
        await publish(bus, create_cmd(CPU, "w-11", "L11"))
        record = await running.record("create:L11")
        await settled(bus, CPU)
    assert (record.outcome, record.attempts) == ("gave-up", 3)
    assert "simulated failure" in record.detail
    (report,) = await BusClient(bus, prefix=PREFIX).inputs(f"{PREFIX}.in.host.{CPU}.failure")
    assert report.json()["action"] == "create"
    assert report.json()["error"].endswith("(after 3 attempts)")


async def test_a_start_that_keeps_failing_is_reported_as_a_start_failure(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    fleet.host(CPU).fail_next("start", count=10)
    config = fast_config(bus_url(bus), db, endpoints_of(fleet), max_attempts=2)
    async with running_executor(config) as running:
        await publish(bus, create_cmd(CPU, "w-12", "L12"))
        record = await running.record("create:L12")
        await settled(bus, CPU)
    assert record.outcome == "gave-up"
    (report,) = await BusClient(bus, prefix=PREFIX).inputs(f"{PREFIX}.in.host.{CPU}.failure")
    assert (report.msg_id, report.json()["action"]) == ("failure:L12:start", "start")


async def test_bad_commands_are_refused_without_touching_incus(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    log = ActionLog(fleet)
    good = create_cmd(CPU, "w-12", "L12")
    config = fast_config(bus_url(bus), db, endpoints_of(fleet), ack_wait_s=0.5)
    async with running_executor(config) as running:
        await publish(bus, {**good, "instance": "bad_name", "command_id": "c1"})
        await publish(bus, {**good, "instance": "1234", "command_id": "c2"})
        await publish(
            bus,
            {**good, "host": OTHER, "command_id": "c3"},
            subject=f"{PREFIX}.out.exec.{CPU}.create",
        )
        await publish(bus, {**good, "command_id": "c4", "demand": {"cpu": -1}})
        await publish(bus, b"not json", subject=f"{PREFIX}.out.exec.{CPU}.delete", msg_id="c5")
        await publish(bus, {**good, "command_id": "c6"}, subject=f"{PREFIX}.out.exec.{CPU}.reboot")
        await publish(bus, good)  # the line goes on
        await running.record("create:L12")
        info = await settled(bus, CPU)
        assert running.executor.stats["refused"] == 6
        for command_id in ("c1", "c2", "c3", "c4", "c5", "c6"):
            assert await running.executor.store.finished(command_id) is None
        await anyio.sleep(0.8)  # past ack_wait: terminated, never redelivered
        later = await consumer_info(bus, CPU)
        assert later.delivered is not None and info.delivered is not None
        assert later.delivered.consumer_seq == info.delivered.consumer_seq == 7
    assert {name for (_, _, name, _) in log.actions} == {"w-12"}
    assert list(fleet.host(OTHER).instances) == []


# ------------------------------------------------------------------- time and faults


async def test_heartbeats_keep_a_long_command_from_being_redelivered(
    socket_dir: Path, bus: Client, db: Path
) -> None:
    slow = dataclasses.replace(FAST, action_delay_s=0.8)
    async with make_fleet(socket_dir, options=slow) as fleet:
        config = fast_config(bus_url(bus), db, endpoints_of(fleet), ack_wait_s=0.6)
        async with running_executor(config) as running:
            await publish(bus, create_cmd(CPU, "w-13", "L13"))  # 1.6 s of work
            await publish(bus, create_cmd(CPU, "w-13b", "L13b"), msg_id=True)
            await running.record("create:L13")
            await running.record("create:L13b")
            info = await settled(bus, CPU)
        assert info.num_redelivered == 0
        assert running.executor.stats["created"] == 2


async def test_a_nats_restart_is_waited_out(
    fleet: Fleet, bus: Client, db: Path, nats_server: Any
) -> None:
    async with running_executor(fast_config(bus_url(bus), db, endpoints_of(fleet))) as running:
        await publish(bus, create_cmd(CPU, "w-14", "L14"))
        await running.record("create:L14")
        await anyio.to_thread.run_sync(nats_server.restart)
        with anyio.fail_after(15):
            while True:  # the test's own client reconnects too
                try:
                    await publish(bus, delete_cmd(CPU, "w-14", "L14"))
                    break
                except Exception:
                    await anyio.sleep(0.1)
        record = await running.record("delete:L14:drained", within_s=15)
        await settled(bus, CPU)
    assert record.outcome == "deleted"
    assert instance(fleet, CPU, "w-14") is None


async def test_the_consumer_follows_the_configuration(fleet: Fleet, bus: Client, db: Path) -> None:
    config = fast_config(bus_url(bus), db, endpoints_of(fleet))
    async with running_executor(config):
        created = await consumer_info(bus, CPU)
    assert created.config.filter_subject == f"{PREFIX}.out.exec.{CPU}.>"
    assert created.config.ack_policy == api.AckPolicy.EXPLICIT
    assert created.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
    assert (created.config.ack_wait, created.config.max_ack_pending) == (1.5, 64)
    changed = dataclasses.replace(config, ack_wait_s=3.0, max_in_hand=8)
    async with running_executor(changed):
        updated = await consumer_info(bus, CPU)
    assert (updated.config.ack_wait, updated.config.max_ack_pending) == (3.0, 8)
    assert updated.config.opt_start_seq == created.config.opt_start_seq


async def test_a_new_consumer_catches_up_on_recent_commands_only(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    await publish(bus, create_cmd(CPU, "old-1", "L50"))
    await anyio.sleep(1.2)
    await publish(bus, create_cmd(OTHER, "old-2", "L51"))  # another host's consumer
    await publish(bus, create_cmd(CPU, "recent-1", "L52"))
    two = tuple(e for e in endpoints_of(fleet) if e.host in (CPU, OTHER))
    config = fast_config(bus_url(bus), db, two, catch_up_s=1.0)
    async with running_executor(config) as running:
        await running.record("create:L52")
        await running.record("create:L51")
        await settled(bus, CPU)
        assert await running.executor.store.finished("create:L50") is None
    assert instance(fleet, CPU, "old-1") is None
    # Without catch-up, a new consumer starts with the next command.
    await publish(bus, create_cmd(GPU, "old-3", "L53"))
    fresh = fast_config(bus_url(bus), db, endpoints_of(fleet), catch_up_s=0)
    async with running_executor(fresh) as running:
        await publish(bus, create_cmd(GPU, "new-3", "L54"))
        await running.record("create:L54")
        assert await running.executor.store.finished("create:L53") is None


async def test_a_consumer_filtering_other_commands_is_not_used(
    fleet: Fleet, bus: Client, db: Path
) -> None:
    js = bus.jetstream()
    await js.add_consumer(
        NAMES.out_stream,
        config=api.ConsumerConfig(
            durable_name=consumer_name(CPU),
            filter_subject=f"{PREFIX}.out.exec.{OTHER}.>",
            ack_policy=api.AckPolicy.EXPLICIT,
        ),
    )
    endpoints = tuple(e for e in endpoints_of(fleet) if e.host == CPU)
    async with running_executor(fast_config(bus_url(bus), db, endpoints), ready=False) as running:
        await publish(bus, create_cmd(OTHER, "w-18", "L18"))
        await anyio.sleep(0.5)
        assert not running.executor.ready.is_set()
        assert running.executor.stats["refused"] == 0
    assert (await consumer_info(bus, CPU)).num_pending == 1  # left for whoever owns it


# ------------------------------------------------------------------------ shutdown


async def test_stop_finishes_running_commands_and_hands_back_the_rest(
    socket_dir: Path, bus: Client, db: Path
) -> None:
    slow = dataclasses.replace(FAST, action_delay_s=0.4)
    async with make_fleet(socket_dir, options=slow) as fleet:
        # One worker and a long ack wait: the queued command can only come back by nak.
        config = fast_config(bus_url(bus), db, endpoints_of(fleet), workers=1, ack_wait_s=60)
        async with running_executor(config) as first:
            await publish(bus, create_cmd(CPU, "w-15", "L15"))
            await publish(bus, create_cmd(CPU, "w-16", "L16"))
            await until(lambda: instance(fleet, CPU, "w-15") is not None)
            await until(lambda: first.executor.held() == 2)
            await first.shutdown()
        assert first.executor.stats["created"] == 1
        assert instance(fleet, CPU, "w-15").is_running
        assert instance(fleet, CPU, "w-16") is None
        async with running_executor(config) as second:
            record = await second.record("create:L16", within_s=5)
            await settled(bus, CPU)
        assert record.outcome == "created"
        async with await ExecutorStore.open(db) as store:
            assert (await store.finished("create:L15")) is not None


# ------------------------------------------------------------------------ soak


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_soak_flaky_hosts_a_killed_executor_and_a_nats_restart(
    socket_dir: Path, bus: Client, db: Path, nats_server: Any
) -> None:
    """120 instances on four flaky hosts, each created, half of them deleted, every
    command published twice; the executor is killed mid-way and NATS restarted. In the
    end every VM that should exist does, every other is gone, none was created twice."""
    flaky = dataclasses.replace(FAST, action_delay_s=0.01, seed=7)
    async with make_fleet(socket_dir, options=flaky) as fleet:
        log = ActionLog(fleet)
        for sim_host in fleet.hosts.values():
            sim_host.set_failure_rate("create", 0.2)
            sim_host.set_failure_rate("start", 0.1)
        config = fast_config(bus_url(bus), db, endpoints_of(fleet), max_attempts=50, workers=8)
        hosts = sorted(fleet.hosts)
        names = [(hosts[i % len(hosts)], f"s-{i}", f"S{i}") for i in range(120)]
        doomed = names[::2]

        async def publish_all() -> None:
            for host, name, lease in names:
                await publish(bus, create_cmd(host, name, lease), msg_id=False)
            for host, name, lease in doomed:
                await publish(bus, delete_cmd(host, name, lease), msg_id=False)
            for host, name, lease in names:  # everything again, past any dedup window
                await publish(bus, create_cmd(host, name, lease), msg_id=False)
            for host, name, lease in doomed:
                await publish(bus, delete_cmd(host, name, lease), msg_id=False)

        async with running_executor(config) as first:
            await publish_all()
            await until(lambda: first.executor.stats["created"] >= 30, within_s=60)
            first.kill()
        await anyio.to_thread.run_sync(nats_server.restart)
        async with running_executor(config) as second:
            for _, _, lease in names:
                await second.record(f"create:{lease}", within_s=60)
            for _, _, lease in doomed:
                await second.record(f"delete:{lease}:drained", within_s=60)
            for host in hosts:
                await settled(bus, host, within_s=60)
        for index, (host, name, _) in enumerate(names):
            assert (instance(fleet, host, name) is not None) == (index % 2 == 1), name
            assert log.count("instance-created", name) == 1, name
        async with await ExecutorStore.open(db) as store:
            assert await store.count() == len(names) + len(doomed)
