"""The simulator's Incus API over real HTTP: envelopes, operations, instances, events."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from reconciler.incus.simulator import Fleet
from tests.incus.conftest import CPU_HOST, until_booted

#: these hold the simulator's 7.x to FACTS.md (read from Incus 7.3); its 6.0 LTS
#: answers are in test_simulator_lts.py and test_differential.py
pytestmark = pytest.mark.incus_version("7")

ENVELOPE_FIELDS = {"type", "status", "status_code", "operation", "error_code", "error", "metadata"}
IMAGE = {"type": "image", "alias": "debian/13"}


async def call(
    http: aiohttp.ClientSession, method: str, path: str, body: Any = None, **params: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.request(method, path, json=body, params=params or None) as response:
        return response.status, await response.json(), dict(response.headers)


async def wait(http: aiohttp.ClientSession, answer: dict[str, Any]) -> dict[str, Any]:
    status, body, _ = await call(http, "GET", f"{answer['operation']}/wait", timeout=5)
    assert status == 200 and body["type"] == "sync"
    metadata: dict[str, Any] = body["metadata"]
    return metadata


async def create(
    http: aiohttp.ClientSession, name: str, project: str = "default", **extra: Any
) -> dict[str, Any]:
    status, body, _ = await call(
        http,
        "POST",
        "/1.0/instances",
        {"name": name, "type": "virtual-machine", "source": IMAGE, **extra},
        project=project,
    )
    assert status == 202, body
    return await wait(http, body)


async def state(
    http: aiohttp.ClientSession, name: str, action: str, project: str = "default", **extra: Any
) -> dict[str, Any]:
    status, body, _ = await call(
        http, "PUT", f"/1.0/instances/{name}/state", {"action": action, **extra}, project=project
    )
    assert status == 202, body
    return await wait(http, body)


# ---------------------------------------------------------------------- envelopes


async def test_sync_envelope_has_all_seven_fields(http: aiohttp.ClientSession) -> None:
    status, body, headers = await call(http, "GET", "/1.0")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert set(body) == ENVELOPE_FIELDS
    assert {k: body[k] for k in ENVELOPE_FIELDS - {"metadata"}} == {
        "type": "sync",
        "status": "Success",
        "status_code": 200,
        "operation": "",
        "error_code": 0,
        "error": "",
    }
    assert body["metadata"]["auth"] == "trusted"
    assert body["metadata"]["environment"]["server_name"] == CPU_HOST


async def test_async_envelope_holds_a_running_operation(http: aiohttp.ClientSession) -> None:
    status, body, headers = await call(
        http, "POST", "/1.0/instances", {"name": "a1", "type": "virtual-machine", "source": IMAGE}
    )
    assert status == 202 and set(body) == ENVELOPE_FIELDS
    op = body["metadata"]
    assert body["type"] == "async" and body["status"] == "Operation created"
    assert body["status_code"] == 100 and body["error_code"] == 0 and body["error"] == ""
    assert headers["Location"] == body["operation"] == f"/1.0/operations/{op['id']}"
    assert (op["status"], op["status_code"], op["class"]) == ("Running", 103, "task")
    assert op["resources"] == {"instances": ["/1.0/instances/a1"]}
    assert (
        op["description"] == "Creating instance" and op["err"] == "" and op["may_cancel"] is False
    )


async def test_error_envelope_status_is_the_error_code(http: aiohttp.ClientSession) -> None:
    status, body, _ = await call(http, "GET", "/1.0/instances/missing")
    assert status == 404 and set(body) == ENVELOPE_FIELDS
    assert body == {
        "type": "error",
        "status": "",
        "status_code": 0,
        "operation": "",
        "error_code": 404,
        "error": "Instance not found",
        "metadata": None,
    }
    status, body, _ = await call(http, "GET", "/1.0/nothing-here")
    assert (status, body["error"]) == (404, "not found")
    status, body, _ = await call(http, "POST", "/1.0/resources")
    assert (status, body["error_code"]) == (405, 405)


# ---------------------------------------------------------------------- operations


async def test_wait_reports_failure_only_in_the_operation(http: aiohttp.ClientSession) -> None:
    await create(http, "s1")
    status, body, _ = await call(http, "PUT", "/1.0/instances/s1/state", {"action": "stop"})
    assert status == 202
    status, waited, _ = await call(http, "GET", f"{body['operation']}/wait", timeout=5)
    assert status == 200 and waited["type"] == "sync" and waited["error_code"] == 0
    op = waited["metadata"]
    assert (op["status"], op["status_code"]) == ("Failure", 400)
    assert op["err"] == "The instance is already stopped"


async def test_wait_with_a_timeout_returns_the_running_operation(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    fleet.host(CPU_HOST).timing.action_delay_s = 0.5
    status, body, _ = await call(
        http, "POST", "/1.0/instances", {"name": "slow", "type": "virtual-machine", "source": IMAGE}
    )
    status, waited, _ = await call(http, "GET", f"{body['operation']}/wait", timeout=0)
    assert status == 200 and waited["metadata"]["status_code"] == 103
    status, listed, _ = await call(http, "GET", "/1.0/operations")
    assert listed["metadata"] == {"running": [body["operation"]]}
    status, listed, _ = await call(http, "GET", "/1.0/operations", recursion=1)
    assert listed["metadata"]["running"][0]["id"] == body["metadata"]["id"]
    assert (await wait(http, body))["status"] == "Success"


async def test_finished_operations_expire(http: aiohttp.ClientSession) -> None:
    status, body, _ = await call(
        http, "POST", "/1.0/instances", {"name": "e1", "type": "virtual-machine", "source": IMAGE}
    )
    assert (await wait(http, body))["status_code"] == 200
    status, got, _ = await call(http, "GET", body["operation"])
    assert status == 200 and got["metadata"]["status"] == "Success"
    await asyncio.sleep(0.45)  # retention is 0.3 s in tests (5 s by default, as Incus)
    for path in (body["operation"], f"{body['operation']}/wait"):
        status, got, _ = await call(http, "GET", path)
        assert (status, got["error"]) == (404, "Operation not found")
    status, got, _ = await call(http, "DELETE", "/1.0/operations/nope")
    assert status == 404


# ---------------------------------------------------------------------- instances


async def test_recursion_levels_and_projects(http: aiohttp.ClientSession) -> None:
    await create(http, "d1")
    await create(http, "c1", project="ci")
    _, body, _ = await call(http, "GET", "/1.0/instances")
    assert body["metadata"] == ["/1.0/instances/d1"]
    _, body, _ = await call(http, "GET", "/1.0/instances", project="ci")
    assert body["metadata"] == ["/1.0/instances/c1?project=ci"]
    _, body, _ = await call(http, "GET", "/1.0/instances", **{"all-projects": "true"})
    assert body["metadata"] == ["/1.0/instances/c1?project=ci", "/1.0/instances/d1"]
    _, body, _ = await call(http, "GET", "/1.0/instances", recursion=1, **{"all-projects": "true"})
    assert [(i["project"], i["name"], i["status_code"]) for i in body["metadata"]] == [
        ("ci", "c1", 102),
        ("default", "d1", 102),
    ]
    assert "state" not in body["metadata"][0]
    _, body, _ = await call(http, "GET", "/1.0/instances", recursion=2, project="ci")
    assert body["metadata"][0]["state"]["status"] == "Stopped"
    status, body, _ = await call(
        http, "GET", "/1.0/instances", project="ci", **{"all-projects": "true"}
    )
    assert (status, body["error"]) == (400, "Cannot specify a project when requesting all projects")
    status, body, _ = await call(http, "GET", "/1.0/instances", project="nope")
    assert (status, body["error"]) == (404, "Project not found")


async def test_filter_by_status_and_config(http: aiohttp.ClientSession) -> None:
    await create(http, "f1", config={"user.rc.pool": "gpu"})
    await create(http, "f2")
    await state(http, "f2", "start")
    _, body, _ = await call(http, "GET", "/1.0/instances", filter="status eq Stopped")
    assert body["metadata"] == ["/1.0/instances/f1"]
    _, body, _ = await call(http, "GET", "/1.0/instances", filter="config.user.rc.pool eq gpu")
    assert body["metadata"] == ["/1.0/instances/f1"]


async def test_instance_object_has_expanded_config_and_devices(http: aiohttp.ClientSession) -> None:
    await create(
        http,
        "x1",
        config={"limits.cpu": "2", "user.rc.lease-id": "L9"},
        devices={"root": {"type": "disk", "path": "/", "pool": "default", "size": "20GiB"}},
    )
    _, body, _ = await call(http, "GET", "/1.0/instances/x1")
    inst = body["metadata"]
    assert inst["profiles"] == ["default"] and inst["location"] == "none"
    assert inst["config"]["user.rc.lease-id"] == "L9"
    assert inst["expanded_config"]["limits.cpu"] == "2"
    assert inst["expanded_devices"]["root"]["size"] == "20GiB"
    assert inst["expanded_devices"]["eth0"]["type"] == "nic"  # from the default profile
    assert inst["devices"] == {
        "root": {"type": "disk", "path": "/", "pool": "default", "size": "20GiB"}
    }


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("", "Name must be 1-63 characters long"),
        ("a" * 64, "Name must be 1-63 characters long"),
        ("-vm", 'Name must not start with "-" character'),
        ("vm-", 'Name must not end with "-" character'),
        ("1234", "Name cannot be a number"),
        ("vm_1", "Name can only contain alphanumeric and hyphen characters"),
    ],
)
async def test_invalid_names_are_refused(
    http: aiohttp.ClientSession, name: str, error: str
) -> None:
    status, body, _ = await call(
        http, "POST", "/1.0/instances", {"name": name, "type": "virtual-machine", "source": IMAGE}
    )
    assert (status, body["error"]) == (400, f"Invalid instance name: {error}")


async def test_create_refusals(http: aiohttp.ClientSession) -> None:
    await create(http, "dup")
    status, body, _ = await call(
        http, "POST", "/1.0/instances", {"name": "dup", "type": "virtual-machine", "source": IMAGE}
    )
    assert (status, body["error"]) == (409, 'Instance "dup" already exists')
    status, body, _ = await call(
        http,
        "POST",
        "/1.0/instances",
        {"name": "p1", "type": "virtual-machine", "source": IMAGE, "profiles": ["default", "gpu"]},
    )
    assert (status, body["error"]) == (500, 'Requested profile "gpu" doesn\'t exist')
    status, body, _ = await call(
        http, "POST", "/1.0/instances", {"name": "s1", "source": {"type": "copy"}}
    )
    assert (status, body["error"]) == (400, "Unknown source type copy")
    status, body, _ = await call(http, "POST", "/1.0/instances", {"name": "s1"}, project="nope")
    assert (status, body["error"]) == (404, "Project not found")


async def test_state_transitions_and_their_errors(http: aiohttp.ClientSession) -> None:
    await create(http, "t1")
    steps: list[tuple[str, dict[str, Any], str, str]] = [
        ("start", {}, "Success", ""),
        ("start", {}, "Failure", "The instance is already running"),
        ("freeze", {}, "Success", ""),
        ("freeze", {}, "Failure", "The instance is already frozen"),
        ("unfreeze", {}, "Success", ""),
        ("unfreeze", {}, "Failure", "The instance isn't frozen"),
        ("restart", {"force": True}, "Success", ""),
        ("stop", {"force": True}, "Success", ""),
        ("stop", {"force": True}, "Failure", "The instance is already stopped"),
        ("restart", {}, "Failure", "The instance isn't running"),
        ("freeze", {}, "Failure", "The instance isn't running"),
    ]
    for action, extra, outcome, err in steps:
        op = await state(http, "t1", action, **extra)
        assert (action, op["status"], op["err"]) == (action, outcome, err)
    status, body, _ = await call(http, "PUT", "/1.0/instances/t1/state", {"action": "jump"})
    assert (status, body["error"]) == (400, "Unknown action: 'jump'")
    status, body, _ = await call(http, "PUT", "/1.0/instances/none/state", {"action": "start"})
    assert (status, body["error"]) == (404, "Instance not found")


async def test_statuses_and_delete_rule(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    await create(http, "v1")
    await state(http, "v1", "start")
    _, body, _ = await call(http, "GET", "/1.0/instances/v1/state")
    assert (body["metadata"]["status"], body["metadata"]["status_code"]) == ("Running", 103)
    await until_booted(fleet, CPU_HOST, "v1")  # the guest reported ready
    _, body, _ = await call(http, "GET", "/1.0/instances/v1")
    assert (body["metadata"]["status"], body["metadata"]["status_code"]) == ("Ready", 113)
    for status_name, code in (("Ready", 113), ("Running", 103), ("Frozen", 110)):
        fleet.host(CPU_HOST).set_status("v1", status_name)
        status, body, _ = await call(http, "DELETE", "/1.0/instances/v1")
        assert (status, body["error"]) == (400, "Instance is running"), code
    fleet.host(CPU_HOST).set_status("v1", "Error")
    _, body, _ = await call(http, "GET", "/1.0/instances/v1")
    assert body["metadata"]["status_code"] == 112
    status, body, _ = await call(http, "DELETE", "/1.0/instances/v1")
    assert status == 202 and (await wait(http, body))["status"] == "Success"
    status, body, _ = await call(http, "DELETE", "/1.0/instances/v1")
    assert (status, body["error"]) == (404, "Instance not found")


async def test_update_with_put_and_patch(http: aiohttp.ClientSession) -> None:
    await create(http, "u1", config={"user.a": "1"})
    status, body, _ = await call(http, "PATCH", "/1.0/instances/u1", {"config": {"user.b": "2"}})
    assert status == 200 and body["metadata"] == {}
    status, body, _ = await call(
        http,
        "PUT",
        "/1.0/instances/u1",
        {"config": {"user.c": "3"}, "devices": {}, "profiles": ["default"]},
    )
    assert status == 202 and (await wait(http, body))["status"] == "Success"
    _, body, _ = await call(http, "GET", "/1.0/instances/u1")
    user = {k: v for k, v in body["metadata"]["config"].items() if k.startswith("user.")}
    assert user == {"user.c": "3"}
    assert "volatile.uuid" in body["metadata"]["config"]


async def test_busy_instance_refuses_a_second_action(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    await create(http, "b1")
    fleet.host(CPU_HOST).timing.action_delay_s = 0.3
    _, first, _ = await call(http, "PUT", "/1.0/instances/b1/state", {"action": "start"})
    _, second, _ = await call(http, "PUT", "/1.0/instances/b1/state", {"action": "start"})
    assert (await wait(http, second))["err"] == 'Instance is busy running a "start" operation'
    assert (await wait(http, first))["status"] == "Success"


async def test_server_resources_pools_projects_profiles(http: aiohttp.ClientSession) -> None:
    _, body, _ = await call(http, "GET", "/1.0", project="ci")
    assert body["metadata"]["environment"]["project"] == "ci"
    _, body, _ = await call(http, "GET", "/1.0/resources")
    res = body["metadata"]
    assert res["cpu"]["total"] == 32 and res["gpu"] == {"cards": [], "total": 0}
    assert res["memory"]["total"] == 131072 * 1024**2
    _, body, _ = await call(http, "GET", "/1.0/storage-pools")
    assert body["metadata"] == ["/1.0/storage-pools/default"]
    await create(
        http,
        "disk1",
        devices={"root": {"type": "disk", "path": "/", "pool": "default", "size": "40GiB"}},
    )
    _, body, _ = await call(http, "GET", "/1.0/storage-pools/default/resources")
    assert body["metadata"]["space"] == {"used": 40 * 1024**3, "total": 1024 * 1024**3}
    status, body, _ = await call(http, "GET", "/1.0/storage-pools/other")
    assert (status, body["error"]) == (404, "Storage pool not found")
    _, body, _ = await call(http, "GET", "/1.0/projects")
    assert body["metadata"] == ["/1.0/projects/ci", "/1.0/projects/default"]
    status, body, headers = await call(http, "POST", "/1.0/projects", {"name": "garm-project"})
    assert status == 201 and headers["Location"] == "/1.0/projects/garm-project"
    status, body, _ = await call(http, "POST", "/1.0/projects", {"name": "garm-project"})
    assert status == 409
    _, body, _ = await call(http, "GET", "/1.0/profiles/default", project="garm-project")
    assert body["metadata"]["devices"]["root"]["pool"] == "default"
    status, body, _ = await call(http, "GET", "/1.0/profiles/gpu")
    assert (status, body["error"]) == (404, "Profile not found")
