"""The simulator against Incus's own ``rest-api.yaml`` and ``FACTS.md``, so it cannot drift.

- Every route the simulator serves (but ``/_sim/``) is a path and method of the spec, and
  every status it answers in a scripted session is one the spec declares for it.
- Every object it renders has the shape of the spec's definition: no field the spec
  lacks, no field missing except Go's ``omitempty`` ones (``tests/incus/simulator/spec.py`` lists
  them with the reason), and scalar types and RFC 3339 times as declared.
- The envelopes, status codes, operation fields, event shape and texts of FACTS.md hold.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from aiohttp import web

from reconciler.incus.simulator import Fleet
from reconciler.incus.simulator.api import add_incus_routes
from reconciler.incus.simulator.control import CONTROL_PREFIX, add_control_routes
from reconciler.incus.simulator.wire import StatusCode, error_body, sync_body
from tests.incus.conftest import GPU_HOST, unix_http, until_booted
from tests.incus.simulator.spec import facts, normalize, rest_api, shape_problems, spec_operations

#: FACTS.md and rest-api.yaml were read from Incus 7.3: hold the simulator's 7.x there
#: (its 6.0 LTS is held to a real 6.0 daemon by test_differential.py)
pytestmark = pytest.mark.incus_version("7")

IMAGE = {"type": "image", "alias": "debian/13"}


class Recorder:
    """An HTTP client on one host that remembers (method, route, status) of each answer."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.seen: set[tuple[str, str, int]] = set()

    async def __call__(
        self, method: str, path: str, body: Any = None, **params: Any
    ) -> tuple[int, Any]:
        async with self.http.request(method, path, json=body, params=params or None) as response:
            answer = await response.json(content_type=None)
        route = re.sub(
            r"/1\.0/(instances|operations|storage-pools|projects|profiles)/[^/?]+",
            r"/1.0/\1/{}",
            path.split("?", 1)[0],
        )
        self.seen.add((method, route, response.status))
        return response.status, answer

    async def done(self, answer: dict[str, Any]) -> dict[str, Any]:
        status, waited = await self("GET", f"{answer['operation']}/wait", timeout=5)
        assert status == 200
        return dict(waited["metadata"])


@pytest.fixture
async def api(fleet: Fleet) -> AsyncIterator[Recorder]:
    async with unix_http(fleet, GPU_HOST) as http:
        yield Recorder(http)


def served_routes() -> set[tuple[str, str]]:
    app = web.Application()
    add_incus_routes(app)
    add_control_routes(app)
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }


# ---------------------------------------------------------------------- paths and statuses


def test_every_served_incus_route_is_in_the_spec() -> None:
    declared = spec_operations()
    incus = {(m, p) for m, p in served_routes() if not p.startswith(f"{CONTROL_PREFIX}/")}
    missing = sorted((m, p) for m, p in incus if (m, normalize(p)) not in declared)
    assert missing == []
    # with DELETE /1.0/projects/{name} (the differential test's cleanup), and files and
    # exec (the GARM provider injects through them)
    assert len(incus) == 26
    control = {p for _, p in served_routes() if p.startswith(f"{CONTROL_PREFIX}/")}
    assert control and not {normalize(p) for p in control} & {p for _, p in declared}


async def test_every_status_answered_is_declared(api: Recorder) -> None:
    _, created = await api(
        "POST", "/1.0/instances", {"name": "s1", "type": "virtual-machine", "source": IMAGE}
    )
    await api.done(created)
    await api("POST", "/1.0/instances", {"name": "s1", "type": "virtual-machine", "source": IMAGE})
    await api("POST", "/1.0/instances", {"name": "-bad", "source": IMAGE})
    await api("POST", "/1.0/instances", {"name": "p1", "source": IMAGE, "profiles": ["nope"]})
    await api("POST", "/1.0/instances", {"name": "p1", "source": IMAGE}, project="nope")
    for path in (
        "/1.0",
        "/1.0/resources",
        "/1.0/instances",
        "/1.0/instances/s1",
        "/1.0/instances/s1/state",
        "/1.0/instances/nope",
        "/1.0/instances/nope/state",
        "/1.0/storage-pools",
        "/1.0/storage-pools/default",
        "/1.0/storage-pools/default/resources",
        "/1.0/storage-pools/nope",
        "/1.0/projects",
        "/1.0/projects/ci",
        "/1.0/projects/nope",
        "/1.0/profiles",
        "/1.0/profiles/default",
        "/1.0/profiles/nope",
        "/1.0/operations",
        "/1.0/operations/nope",
        "/1.0/operations/nope/wait",
    ):
        await api("GET", path)
    await api("GET", "/1.0/instances", project="nope")
    await api("GET", "/1.0/instances", project="ci", **{"all-projects": "true"})
    await api("PATCH", "/1.0/instances/s1", {"description": "x"})
    await api.done((await api("PUT", "/1.0/instances/s1", {"description": "y"}))[1])
    await api.done((await api("PUT", "/1.0/instances/s1/state", {"action": "start"}))[1])
    await api("PUT", "/1.0/instances/s1/state", {"action": "jump"})
    await api("DELETE", "/1.0/instances/s1")
    await api("DELETE", "/1.0/operations/nope")
    await api("POST", "/1.0/projects", {"name": "extra"})
    await api("POST", "/1.0/projects", {"name": "extra"})
    assert {s for _, _, s in api.seen} == {200, 201, 202, 400, 404, 409, 500}
    declared = spec_operations()
    undeclared = sorted((m, p, s) for m, p, s in api.seen if str(s) not in declared[(m, p)])
    assert undeclared == []


# ---------------------------------------------------------------------- shapes


async def test_server_and_resources_have_the_spec_shapes(api: Recorder) -> None:
    _, server = await api("GET", "/1.0")
    assert shape_problems(server["metadata"], "Server") == []
    _, resources = await api("GET", "/1.0/resources")
    assert resources["metadata"]["gpu"]["total"] == 4
    assert shape_problems(resources["metadata"], "Resources") == []
    _, pools = await api("GET", "/1.0/storage-pools", recursion=1)
    assert [shape_problems(p, "StoragePool") for p in pools["metadata"]] == [[]]
    _, pool = await api("GET", "/1.0/storage-pools/default/resources")
    assert shape_problems(pool["metadata"], "ResourcesStoragePool") == []
    _, projects = await api("GET", "/1.0/projects", recursion=1)
    assert [shape_problems(p, "Project") for p in projects["metadata"]] == [[], []]
    _, profile = await api("GET", "/1.0/profiles/default", project="ci")
    assert shape_problems(profile["metadata"], "Profile") == []


async def test_instances_state_and_operations_have_the_spec_shapes(
    fleet: Fleet, api: Recorder
) -> None:
    _, created = await api(
        "POST",
        "/1.0/instances",
        {
            "name": "v1",
            "type": "virtual-machine",
            "source": IMAGE,
            "config": {"user.rc.lease-id": "L1"},
            "devices": {"gpu0": {"type": "gpu", "pci": "0000:41:00.0"}},
        },
        project="ci",
    )
    assert shape_problems(created["metadata"], "Operation") == []
    waited = await api.done(created)
    assert shape_problems(waited, "Operation") == []
    _, fetched = await api("GET", created["operation"])
    assert shape_problems(fetched["metadata"], "Operation") == []
    fleet.host(GPU_HOST).add_instance("stopped-one", status="Stopped")
    await api.done(
        (await api("PUT", "/1.0/instances/v1/state", {"action": "start"}, project="ci"))[1]
    )
    await until_booted(fleet, GPU_HOST, "v1", project="ci")  # state has network, os_info
    for recursion, definition in ((1, "Instance"), (2, "InstanceFull")):
        _, listed = await api(
            "GET", "/1.0/instances", recursion=recursion, **{"all-projects": "true"}
        )
        assert len(listed["metadata"]) == 2
        assert [shape_problems(i, definition) for i in listed["metadata"]] == [[], []]
    for name, project in (("v1", "ci"), ("stopped-one", "default")):
        _, state = await api("GET", f"/1.0/instances/{name}/state", project=project)
        assert shape_problems(state["metadata"], "InstanceState") == []
    _, ops = await api("GET", "/1.0/operations", recursion=1)
    assert all(shape_problems(o, "Operation") == [] for v in ops["metadata"].values() for o in v)


async def test_envelopes_have_the_spec_response_shapes(api: Recorder) -> None:
    responses = rest_api()["responses"]
    _, created = await api(
        "POST", "/1.0/instances", {"name": "e1", "type": "virtual-machine", "source": IMAGE}
    )
    assert set(responses["Operation"]["schema"]["properties"]) <= set(created)
    _, missing = await api("GET", "/1.0/instances/nope")
    for name in ("NotFound", "BadRequest", "Conflict", "InternalServerError", "Forbidden"):
        assert set(responses[name]["schema"]["properties"]) <= set(missing)
    _, patched = await api("PATCH", "/1.0/instances/e1", {})
    assert set(responses["EmptySyncResponse"]["schema"]["properties"]) <= set(patched)


async def test_event_frames_have_the_spec_and_facts_shape(fleet: Fleet, api: Recorder) -> None:
    async with api.http.ws_connect("/1.0/events?all-projects=true&type=lifecycle") as ws:
        fleet.host(GPU_HOST).add_instance("ev", project="ci", status="Stopped", silent=False)
        with anyio.fail_after(2):
            message = await ws.receive()
    event = orjson.loads(message.data)
    assert shape_problems(event, "Event") == []
    top, meta = _facts_event_keys()
    assert set(event) == top
    required = {k for k, optional in meta.items() if not optional}
    assert required <= set(event["metadata"]) <= set(meta)
    assert event["metadata"]["source"] == "/1.0/instances/ev?project=ci"


# ---------------------------------------------------------------------- FACTS.md


def _section(title: str) -> str:
    text = facts()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _bullets(title: str) -> list[str]:
    """The section's bullets, each joined over its continuation lines."""
    return ["- " + " ".join(b.split()) for b in _section(title).split("\n- ")[1:]]


def _example(prefix: str, placeholder: str) -> dict[str, Any]:
    line = next(b for b in _bullets("Envelopes") if b.startswith(prefix))
    raw = re.search(r"`(\{.*\})`", line)
    assert raw is not None, line
    loaded: dict[str, Any] = json.loads(raw.group(1).replace(placeholder, "null"))
    return loaded


def _facts_event_keys() -> tuple[set[str], dict[str, bool]]:
    line = next(b for b in _bullets("Events") if b.startswith("- Event:"))
    metadata = re.search(r'"metadata":\{([^}]*)\}', line)
    assert metadata is not None
    fields = {
        m.group(1): bool(m.group(2)) for m in re.finditer(r'"([a-z_]+)"(\?)?', metadata.group(1))
    }
    top = set(re.findall(r'"([a-z_]+)":', line.replace(metadata.group(0), '"metadata":')))
    return top, fields


def test_facts_envelopes_are_the_simulators() -> None:
    sync = _example("- Sync:", "…")
    assert sync == sync_body(None)
    error = _example("- Error:", "__never__")
    assert error == error_body(404, "Instance not found")
    asynchronous = _example("- Async:", "<Operation>")
    assert asynchronous["status"] == StatusCode.OPERATION_CREATED.label
    assert asynchronous["status_code"] == StatusCode.OPERATION_CREATED


def test_facts_status_codes_are_the_simulators() -> None:
    listed = dict(re.findall(r"(\d{3}) ([A-Z][a-z]+(?: created)?)", _section("Status codes")))
    assert {int(code): label for code, label in listed.items()} == {
        int(s): s.label for s in StatusCode
    }
    vm = re.search(r"VM statuses: (.*)\.", _section("Instances"))
    assert vm is not None
    for label, code in re.findall(r"([A-Z][a-z]+) (\d{3})", vm.group(1)):
        assert StatusCode(int(code)).label == label


async def test_facts_operation_fields_and_texts_hold(api: Recorder) -> None:
    line = next(b for b in _bullets("Operations") if "Fields:" in b)
    fields = re.sub(r"\([^)]*\)", "", line.split("Fields:", 1)[1].strip(" `."))
    names = {f.strip(" `") for f in fields.split(",")}
    _, created = await api(
        "POST", "/1.0/instances", {"name": "f1", "type": "virtual-machine", "source": IMAGE}
    )
    assert names == set(created["metadata"])
    await api.done(created)
    _, stop = await api("PUT", "/1.0/instances/f1/state", {"action": "stop"})
    failed = await api.done(stop)
    assert (failed["status_code"], failed["err"]) == (400, "The instance is already stopped")
    await api.done((await api("PUT", "/1.0/instances/f1/state", {"action": "start"}))[1])
    status, refused = await api("DELETE", "/1.0/instances/f1")
    assert (status, refused["error"]) == (400, "Instance is running")
    status, missing = await api("GET", "/1.0/instances/none")
    assert (status, missing["error"]) == (404, "Instance not found")
    status, gone = await api("GET", "/1.0/operations/none")
    assert (status, gone["error"]) == (404, "Operation not found")
    for text in (
        "The instance is already stopped",
        "Instance is running",
        "Operation not found",
        "Instance not found",
    ):
        assert text in facts()


def test_facts_lifecycle_actions_cover_the_simulators() -> None:
    listed = _section("Events")
    emitted = {
        "instance-created",
        "instance-started",
        "instance-ready",
        "instance-agent-started",
        "instance-shutdown",
        "instance-stopped",
        "instance-restarted",
        "instance-deleted",
        "instance-updated",
        "instance-paused",
        "instance-resumed",
    }
    for action in emitted:
        assert f"-{action.removeprefix('instance-')}" in listed or action in listed, action


@pytest.mark.parametrize("name", ["rest-api.yaml", "FACTS.md"])
def test_vendored_spec_is_the_shared_one(name: str) -> None:
    """The copies under tests/incus/simulator/data must follow ../shared/incus when it changes."""
    from tests.incus.simulator.spec import SHARED_DIR, VENDORED_DIR

    shared = SHARED_DIR / name
    if not shared.exists():
        pytest.skip(f"{shared} is not on this machine; the vendored copy is used")
    assert (VENDORED_DIR / name).read_bytes() == shared.read_bytes(), (
        f"copy {shared} to {VENDORED_DIR / name}"
    )
