"""``GET /1.0/events``: the WebSocket, its filters, its pings and gorilla's handshake checks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from pylxd import Client
from pylxd.client import EventType, _WebsocketClient
from ws4py.client import WebSocketBaseClient
from ws4py.exc import HandshakeError

from reconciler.incus.simulator import Fleet, FleetOptions, Listen, SimulatorThread, default_fleet
from tests.incus.conftest import CPU_HOST

IMAGE = {"type": "image", "alias": "debian/13"}


async def frames(
    ws: aiohttp.ClientWebSocketResponse, count: int, timeout_s: float = 2.0
) -> list[Any]:
    got: list[Any] = []
    with anyio.fail_after(timeout_s):
        while len(got) < count:
            message = await ws.receive()
            assert message.type == aiohttp.WSMsgType.TEXT, message
            got.append(orjson.loads(message.data))
    return got


async def silent(ws: aiohttp.ClientWebSocketResponse, seconds: float = 0.3) -> bool:
    try:
        with anyio.fail_after(seconds):
            message = await ws.receive()
    except TimeoutError:
        return True
    return message.type != aiohttp.WSMsgType.TEXT


async def drive(
    http: aiohttp.ClientSession, method: str, path: str, body: Any = None, project: str = "default"
) -> None:
    async with http.request(method, path, json=body, params={"project": project}) as response:
        answer = await response.json()
    assert response.status == 202, answer
    async with http.get(f"{answer['operation']}/wait") as response:
        op = (await response.json())["metadata"]
    assert op["status"] == "Success", op


async def create_vm(http: aiohttp.ClientSession, name: str) -> None:
    await drive(
        http, "POST", "/1.0/instances", {"name": name, "type": "virtual-machine", "source": IMAGE}
    )


@pytest.mark.incus_version("7")  # 6.0 has no instance-agent-started: test_simulator_lts.py
async def test_one_frame_per_event_in_incus_lifecycle_shape(http: aiohttp.ClientSession) -> None:
    async with http.ws_connect("/1.0/events?type=lifecycle") as ws:
        await create_vm(http, "e1")
        await drive(http, "PUT", "/1.0/instances/e1/state", {"action": "start"})
        events = await frames(ws, 4)
        await drive(http, "PUT", "/1.0/instances/e1/state", {"action": "stop", "force": False})
        events += await frames(ws, 1)
        await drive(http, "PUT", "/1.0/instances/e1/state", {"action": "start"})
        events += await frames(ws, 3)
        await drive(http, "PUT", "/1.0/instances/e1/state", {"action": "stop", "force": True})
        await drive(http, "DELETE", "/1.0/instances/e1")
        events += await frames(ws, 2)
    actions = [e["metadata"]["action"] for e in events]
    assert actions == [
        "instance-created",
        "instance-started",
        "instance-agent-started",
        "instance-ready",
        "instance-shutdown",  # graceful stop
        "instance-started",
        "instance-agent-started",
        "instance-ready",
        "instance-stopped",  # forced stop
        "instance-deleted",
    ]
    created = events[0]
    assert list(created) == ["type", "timestamp", "metadata", "location", "project"]
    assert created["type"] == "lifecycle" and created["location"] == "none"
    assert created["project"] == "default"
    assert list(created["metadata"]) == [
        "action",
        "source",
        "requestor",
        "context",
        "name",
        "project",
    ]
    assert created["metadata"]["source"] == "/1.0/instances/e1"
    assert created["metadata"]["requestor"] == {
        "username": "root",
        "protocol": "unix",
        "address": "@",
    }
    assert created["metadata"]["context"]["type"] == "virtual-machine"
    agent = events[2]["metadata"]
    assert "requestor" not in agent  # the guest, not an API request, did it
    assert created["timestamp"].endswith("Z") and "T" in created["timestamp"]


async def test_events_of_other_projects_are_not_delivered(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    host = fleet.host(CPU_HOST)
    async with (
        http.ws_connect("/1.0/events?type=lifecycle") as default_ws,
        http.ws_connect("/1.0/events?type=lifecycle&project=ci") as ci_ws,
        http.ws_connect("/1.0/events?type=lifecycle&all-projects=true") as all_ws,
    ):
        host.add_instance("in-ci", project="ci", status="Stopped", silent=False)
        host.add_instance("in-default", status="Stopped", silent=False)
        every = await frames(all_ws, 2)
        only_ci = await frames(ci_ws, 1)
        only_default = await frames(default_ws, 1)
        assert await silent(ci_ws) and await silent(default_ws)
    assert [e["metadata"]["name"] for e in every] == ["in-ci", "in-default"]
    assert only_ci[0]["metadata"]["source"] == "/1.0/instances/in-ci?project=ci"
    assert only_ci[0]["project"] == "ci"
    assert only_default[0]["metadata"]["name"] == "in-default"


async def test_type_filter_and_operation_events(http: aiohttp.ClientSession) -> None:
    async with http.ws_connect("/1.0/events?type=operation") as ws:
        await create_vm(http, "o1")
        events = await frames(ws, 3)
    assert {e["type"] for e in events} == {"operation"}
    assert [e["metadata"]["status"] for e in events] == ["Pending", "Running", "Success"]


async def test_pings_arrive_at_the_configured_interval(http: aiohttp.ClientSession) -> None:
    async with http.ws_connect("/1.0/events", autoping=False) as ws:
        with anyio.fail_after(1.0):
            message = await ws.receive()
    assert message.type == aiohttp.WSMsgType.PING  # every 0.2 s in tests, 10 s by default


@pytest.mark.parametrize(
    ("query", "status", "error"),
    [
        ("type=lifecycle,nonsense", 400, '"nonsense" isn\'t a supported event type'),
        (
            "project=ci&all-projects=true",
            400,
            "Cannot specify a project when requesting all projects",
        ),
        ("project=nope", 404, "Project not found"),
    ],
)
async def test_bad_event_requests(
    http: aiohttp.ClientSession, query: str, status: int, error: str
) -> None:
    async with http.get(f"/1.0/events?{query}") as response:
        body = await response.json()
    assert (response.status, body["error"]) == (status, error)


async def test_a_plain_request_is_not_a_websocket(http: aiohttp.ClientSession) -> None:
    async with http.get("/1.0/events") as response:
        assert response.status == 400


async def test_dropping_streams_gracefully_sends_a_close(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    async with http.ws_connect("/1.0/events") as ws:
        await asyncio.sleep(0.05)
        assert await fleet.host(CPU_HOST).drop_event_streams(graceful=True) == 1
        with anyio.fail_after(2):
            message = await ws.receive()
    assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)


# ---------------------------------------------------------------------- Origin (ws4py)


class _OriginClient(WebSocketBaseClient):  # type: ignore[misc]
    """ws4py as pylxd < 2.4.1 used it: it sends ``Origin`` built from the URL."""


def _handshake(client: Client, ws_class: type[WebSocketBaseClient]) -> None:
    ws = client.events(websocket_client=ws_class, event_types={EventType.Lifecycle})
    try:
        ws.connect()
    finally:
        ws.close_connection()


def test_origin_over_a_unix_socket_is_refused_403(sim_thread: SimulatorThread) -> None:
    client = Client(endpoint=sim_thread.endpoints[CPU_HOST])
    try:
        with pytest.raises(HandshakeError, match="403"):
            _handshake(client, _OriginClient)  # Origin: ws+unix://localhost, Host: localhost:None
        _handshake(client, _WebsocketClient)  # pylxd's default client excludes Origin
    finally:
        client.api.session.close()


def test_origin_matching_the_host_over_tcp_is_accepted(socket_dir: Path) -> None:
    fleet = Fleet(
        default_fleet(1), listen=Listen(kind="tcp"), options=FleetOptions(boot_delay_s=0.05)
    )
    with SimulatorThread(fleet) as sim:
        client = Client(endpoint=sim.endpoints["host-01"])
        try:
            _handshake(client, _OriginClient)  # Origin ws://127.0.0.1:PORT == Host
        finally:
            client.api.session.close()
