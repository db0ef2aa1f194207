"""The simulator's two Incus releases: 6.0 LTS (the default) and 7.x, where they differ.

Each test runs against the simulator only (fast); what 6.0 does is what a real Incus 6.0.4
daemon answered (``tests/incus/simulator/test_differential.py`` keeps checking it), what 7.x does is
``FACTS.md``. The adapter (``IncusHost``) must give one answer for both.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import pytest
from click.testing import CliRunner

from reconciler.cli.main import cli
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import InstanceExists, OperationFailed
from reconciler.incus.simulator import DEFAULT_VERSION, Fleet, parse_version
from reconciler.incus.simulator.host import SimHost
from reconciler.incus.simulator.shapes import HostShape
from reconciler.incus.views import InstanceSpec
from tests.incus.conftest import CPU_HOST, until_booted

IMAGE = {"type": "image", "alias": "busybox"}
BOTH = pytest.mark.parametrize("incus_version", ["6.0", "7"])
LTS = pytest.mark.incus_version("6.0")
V7 = pytest.mark.incus_version("7")


async def call(
    http: aiohttp.ClientSession, method: str, path: str, body: Any = None, **params: Any
) -> tuple[int, dict[str, Any]]:
    async with http.request(method, path, json=body, params=params or None) as response:
        return response.status, await response.json()


async def waited(http: aiohttp.ClientSession, answer: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return await call(http, "GET", f"{answer['operation']}/wait", timeout=5)


async def post(http: aiohttp.ClientSession, name: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"name": name, "type": "container", "source": IMAGE, **extra}
    return await call(http, "POST", "/1.0/instances", body)


async def created(http: aiohttp.ClientSession, name: str, **extra: Any) -> dict[str, Any]:
    status, answer = await post(http, name, **extra)
    assert status == 202, answer
    status, body = await waited(http, answer)
    assert (status, body["type"]) == (200, "sync"), body
    return dict(body["metadata"])


async def lifecycle(ws: aiohttp.ClientWebSocketResponse, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with anyio.fail_after(5):
        while len(found) < count:
            event = await ws.receive_json()
            if event["type"] == "lifecycle":
                found.append(event)
    return found


def refusing_host(http_fleet: Fleet) -> SimHost:
    """The CPU host, with one container image and no VM support (as the real test daemon)."""
    host = http_fleet.host(CPU_HOST)
    host.images = {"busybox": "container"}
    host.vm_unsupported = "vhost_vsock kernel module not loaded"
    return host


# ---------------------------------------------------------------------- choosing a release


def test_the_lts_is_the_default_and_7_is_on_request() -> None:
    assert parse_version(DEFAULT_VERSION).server_version == "6.0.4"
    assert SimHost(HostShape(name="h")).version.lts
    assert parse_version("6.0").server_version == "6.0.4"
    assert parse_version("7").server_version == parse_version("7.3").server_version == "7.3"
    with pytest.raises(ValueError, match=r"6\.0 \(LTS\) or 7\.x"):
        parse_version("5.21")


def test_sim_incus_offers_the_version_option() -> None:
    result = CliRunner().invoke(cli, ["sim-incus", "--help"])
    assert result.exit_code == 0 and "--incus-version [6.0|7]" in result.output
    result = CliRunner().invoke(cli, ["sim-incus", "--incus-version", "5"])
    assert result.exit_code == 2 and "Invalid value for '--incus-version'" in result.output


@BOTH
async def test_server_version(http: aiohttp.ClientSession, incus_version: str) -> None:
    _, body = await call(http, "GET", "/1.0")
    expected = "6.0.4" if incus_version == "6.0" else "7.3"
    assert body["metadata"]["environment"]["server_version"] == expected


@BOTH
async def test_serial_section_in_resources_only_on_7(
    http: aiohttp.ClientSession, incus_version: str
) -> None:
    _, body = await call(http, "GET", "/1.0/resources")
    assert ("serial" in body["metadata"]) is (incus_version == "7")


# ---------------------------------------------------------------------- operations


@BOTH
async def test_operation_metadata_null_on_6_and_empty_on_7(
    http: aiohttp.ClientSession, incus_version: str
) -> None:
    status, answer = await post(http, "m1")
    assert status == 202
    assert answer["metadata"]["metadata"] == (None if incus_version == "6.0" else {})
    _, started = await call(http, "PUT", "/1.0/instances/m1/state", {"action": "start"})
    await waited(http, answer)
    _, body = await waited(http, started)
    assert body["metadata"]["metadata"] == (None if incus_version == "6.0" else {})


@BOTH
async def test_a_create_from_an_image_reports_its_unpack_progress(
    http: aiohttp.ClientSession, incus_version: str
) -> None:
    op = await created(http, "p1")
    assert set(op["metadata"]) == {"create_instance_from_image_unpack_progress", "progress"}
    assert op["metadata"]["progress"]["stage"] == "create_instance_from_image_unpack"


@LTS
async def test_a_failed_operations_wait_is_an_error_envelope_on_6(
    http: aiohttp.ClientSession,
) -> None:
    await created(http, "w1")
    _, answer = await call(http, "PUT", "/1.0/instances/w1/state", {"action": "stop"})
    status, body = await waited(http, answer)
    assert status == 200
    assert body == {
        "type": "error",
        "status": "",
        "status_code": 0,
        "operation": "",
        "error_code": 400,  # Incus's error value is a 400 (api.StatusErrorf)
        "error": "The instance is already stopped",
        "metadata": None,
    }
    _, body = await call(http, "GET", answer["operation"])
    op = body["metadata"]
    assert (op["status"], op["status_code"], op["err"]) == (
        "Failure",
        400,
        "The instance is already stopped",
    )
    for _ in range(2):  # the second start fails with a plain error: 500
        _, answer = await call(http, "PUT", "/1.0/instances/w1/state", {"action": "start"})
        status, body = await waited(http, answer)
    assert (status, body["error_code"], body["error"]) == (
        200,
        500,
        "The instance is already running",
    )


@V7
async def test_a_failed_operations_wait_is_a_sync_envelope_on_7(
    http: aiohttp.ClientSession,
) -> None:
    await created(http, "w1")
    _, answer = await call(http, "PUT", "/1.0/instances/w1/state", {"action": "stop"})
    status, body = await waited(http, answer)
    assert (status, body["type"], body["metadata"]["status_code"]) == (200, "sync", 400)


# ---------------------------------------------------------------------- refusals


@LTS
async def test_a_duplicate_name_is_accepted_then_fails_in_the_operation_on_6(
    http: aiohttp.ClientSession, fleet: Fleet
) -> None:
    await created(http, "d1", config={"user.a": "1"})
    async with http.ws_connect("/1.0/events?type=lifecycle,operation") as ws:
        status, answer = await post(http, "d1")
        assert status == 202 and answer["metadata"]["status"] == "Running"
        status, body = await waited(http, answer)
        assert (status, body["error_code"]) == (200, 500)
        assert body["error"].endswith(
            "UNIQUE constraint failed: instances.project_id, instances.name"
        )
        with anyio.fail_after(5):
            while (event := await ws.receive_json())["metadata"].get("status") != "Failure":
                assert event["type"] == "operation"  # a failed create: no lifecycle event
    _, body = await call(http, "GET", "/1.0/instances/d1")
    assert body["metadata"]["config"]["user.a"] == "1"  # the first one is untouched


@V7
async def test_a_duplicate_name_is_a_sync_409_on_7(http: aiohttp.ClientSession) -> None:
    await created(http, "d1")
    status, body = await post(http, "d1")
    assert (status, body["error"]) == (409, 'Instance "d1" already exists')


@BOTH
async def test_missing_image_type_mismatch_and_no_vms_fail_in_the_operation(
    http: aiohttp.ClientSession, fleet: Fleet, incus_version: str
) -> None:
    refusing_host(fleet)
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"source": {"type": "image", "alias": "nosuch"}},
            "Image not provided for instance creation",
        ),
        (
            {"type": "virtual-machine"},
            'Requested image\'s type "container" doesn\'t match instance type "virtual-machine"',
        ),
        (
            {"type": "virtual-machine", "source": {"type": "none"}},
            'Failed creating instance record: Instance type "virtual-machine" is not supported '
            "on this server: vhost_vsock kernel module not loaded",
        ),
    ]
    for extra, err in cases:
        status, answer = await post(http, "r1", **extra)
        assert status == 202, answer
        await call(http, "GET", f"{answer['operation']}/wait", timeout=5)
        _, op = await call(http, "GET", answer["operation"])
        assert (op["metadata"]["status"], op["metadata"]["err"]) == ("Failure", err)
        status, _ = await call(http, "GET", "/1.0/instances/r1")
        assert status == 404


@BOTH
async def test_missing_instance_text(http: aiohttp.ClientSession, incus_version: str) -> None:
    expected = (
        'Failed to fetch instance "nosuch" in project "default": Instance not found'
        if incus_version == "6.0"
        else "Instance not found"
    )
    for method, path, body in (
        ("GET", "/1.0/instances/nosuch", None),
        ("PUT", "/1.0/instances/nosuch/state", {"action": "start"}),
    ):
        status, answer = await call(http, method, path, body)
        assert (status, answer["error_code"], answer["error"]) == (404, 404, expected)


@BOTH
async def test_already_frozen_text(http: aiohttp.ClientSession, incus_version: str) -> None:
    await created(http, "f1")
    for action in ("start", "freeze"):
        _, answer = await call(http, "PUT", "/1.0/instances/f1/state", {"action": action})
        await waited(http, answer)
    _, answer = await call(http, "PUT", "/1.0/instances/f1/state", {"action": "freeze"})
    await waited(http, answer)
    _, op = await call(http, "GET", answer["operation"])
    expected = "container" if incus_version == "6.0" else "instance"
    assert op["metadata"]["err"] == f"The {expected} is already frozen"


# ---------------------------------------------------------------------- events


@BOTH
async def test_boot_events_and_the_guests_ready(
    http: aiohttp.ClientSession, fleet: Fleet, incus_version: str
) -> None:
    await created(http, "b1")
    async with http.ws_connect("/1.0/events?type=lifecycle") as ws:
        _, answer = await call(http, "PUT", "/1.0/instances/b1/state", {"action": "start"})
        await waited(http, answer)
        count = 3 if incus_version == "7" else 2
        events = await lifecycle(ws, count)
    actions = [e["metadata"]["action"] for e in events]
    agent = ["instance-agent-started"] if incus_version == "7" else []
    assert actions == ["instance-started", *agent, "instance-ready"]
    assert "requestor" not in events[-1]["metadata"]  # the guest said it, not an API client
    await until_booted(fleet, CPU_HOST, "b1")
    _, body = await call(http, "GET", "/1.0/instances/b1")
    assert (body["metadata"]["status"], body["metadata"]["status_code"]) == ("Ready", 113)


@BOTH
async def test_stops_deletes_and_the_created_context(
    http: aiohttp.ClientSession, fleet: Fleet, incus_version: str
) -> None:
    fleet.host(CPU_HOST).set_boot_delay(60)  # no instance-ready in between
    async with http.ws_connect("/1.0/events?type=lifecycle") as ws:
        await created(http, "s1")
        for action, force in (("start", False), ("stop", False), ("start", False), ("stop", True)):
            _, answer = await call(
                http, "PUT", "/1.0/instances/s1/state", {"action": action, "force": force}
            )
            await waited(http, answer)
        _, answer = await call(http, "DELETE", "/1.0/instances/s1")
        await waited(http, answer)
        events = await lifecycle(ws, 6)
    assert [e["metadata"]["action"] for e in events] == [
        "instance-created",
        "instance-started",
        "instance-shutdown",  # graceful
        "instance-started",
        "instance-stopped",  # forced
        "instance-deleted",
    ]
    context = events[0]["metadata"]["context"]
    assert list(context) == ["location", "storage-pool", "type"]  # a Go map: sorted keys
    assert context == {"location": "none", "storage-pool": "default", "type": "container"}


@BOTH
async def test_patch_update_requestor(http: aiohttp.ClientSession, incus_version: str) -> None:
    await created(http, "u1")
    async with http.ws_connect("/1.0/events?type=lifecycle") as ws:
        status, _ = await call(http, "PATCH", "/1.0/instances/u1", {"config": {"user.b": "2"}})
        assert status == 200
        (event,) = await lifecycle(ws, 1)
    assert event["metadata"]["action"] == "instance-updated"
    assert ("requestor" in event["metadata"]) is (incus_version == "7")


# ---------------------------------------------------------------------- the adapter, both


def lease(name: str, lease_id: str) -> InstanceSpec:
    return InstanceSpec.for_lease(
        name=name,
        image="busybox",
        lease_id=lease_id,
        pool="p",
        kind="warm",
        instance_type="container",
    )


@BOTH
async def test_the_adapter_gives_one_answer_for_both(fleet: Fleet, incus_version: str) -> None:
    host = IncusHost(
        IncusEndpoint(host=CPU_HOST, url=fleet.endpoints[CPU_HOST]),
        request_timeout_s=5.0,
        operation_timeout_s=5.0,
    )
    try:
        first = await host.create_instance(lease("a1", "L1"))
        again = await host.create_instance(lease("a1", "L1"))  # idempotent for its lease
        assert again.name == first.name == "a1"
        with pytest.raises(InstanceExists):
            await host.create_instance(lease("a1", "L2"))
        assert await host.get_instance("nosuch") is None
        await host.stop_instance("nosuch")  # missing is success
        await host.delete_instance("nosuch")
        await host.start_instance("a1")
        await host.start_instance("a1")  # already running is success
        refusing_host(fleet)
        with pytest.raises(OperationFailed, match="Image not provided"):
            await host.create_instance(InstanceSpec(name="a2", image="nosuch"))
    finally:
        await host.aclose()


@LTS
async def test_an_image_that_signals_late_becomes_ready_when_the_guest_says_so(
    http: aiohttp.ClientSession, fleet: Fleet
) -> None:
    host = fleet.host(CPU_HOST)
    host.timing.report_ready = False
    await created(http, "g1")
    assert not host.guest_ready("g1")  # stopped: nothing to report
    async with http.ws_connect("/1.0/events?type=lifecycle") as ws:
        _, answer = await call(http, "PUT", "/1.0/instances/g1/state", {"action": "start"})
        await waited(http, answer)
        await until_booted(fleet, CPU_HOST, "g1")
        _, body = await call(http, "GET", "/1.0/instances/g1")
        assert body["metadata"]["status_code"] == 103  # booted, but the guest said nothing
        async with http.post("/_sim/instances/g1/ready", json={}) as response:
            assert (await response.json())["result"] is True
        events = await lifecycle(ws, 2)
    assert [e["metadata"]["action"] for e in events] == ["instance-started", "instance-ready"]
    _, body = await call(http, "GET", "/1.0/instances/g1")
    assert body["metadata"]["status_code"] == 113


@BOTH
async def test_projects_created_and_deleted_with_their_events(
    http: aiohttp.ClientSession, incus_version: str
) -> None:
    body = {"name": "p2", "config": {"features.profiles": "false"}}
    async with http.ws_connect("/1.0/events?type=lifecycle&all-projects=true") as ws:
        status, _ = await call(http, "POST", "/1.0/projects", body)
        assert status == 201
        status, again = await call(http, "POST", "/1.0/projects", body)
        expected = 500 if incus_version == "6.0" else 409
        assert (status, again["error_code"]) == (expected, expected)
        status, answer = await call(
            http, "POST", "/1.0/instances?project=p2", {"name": "c", "source": IMAGE}
        )
        assert answer["metadata"]["resources"] == {"instances": ["/1.0/instances/c?project=p2"]}
        await waited(http, answer)
        status, refused = await call(http, "DELETE", "/1.0/projects/p2")
        assert (status, refused["error"]) == (400, "Only empty projects can be removed")
        _, answer = await call(http, "DELETE", "/1.0/instances/c?project=p2")
        await waited(http, answer)
        status, _ = await call(http, "DELETE", "/1.0/projects/p2")
        assert status == 200
        events = await lifecycle(ws, 4)
    assert [e["metadata"]["action"] for e in events] == [
        "project-created",
        "instance-created",
        "instance-deleted",
        "project-deleted",
    ]
    assert events[0]["metadata"] == {
        "action": "project-created",
        "source": "/1.0/projects/p2",
        "requestor": {"username": "root", "protocol": "unix", "address": "@"},
    }
    assert events[0]["project"] == "p2"
