"""The differential scenario: one sequence of Incus requests, sent to any Incus endpoint.

:func:`run_scenario` sends every :data:`STEPS` request over raw HTTP on the endpoint's
unix socket, then the :data:`PYLXD_STEPS` through pylxd, while a WebSocket watches
``/1.0/events?type=lifecycle,operation``; it returns a :class:`Transcript`: per step what
came back (status code, envelope type and fields, the operation and its ``/wait``, error
texts) and the events, all with ids, timestamps and fingerprints masked. Comparing the
simulator's transcript with a real daemon's is ``tests/incus/simulator/test_differential.py``; the
list of steps is the table in ``docs/incus-simulator.md``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from pylxd import Client
from pylxd import exceptions as pylxd_errors

from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import IncusError
from reconciler.incus.views import InstanceSpec

__all__ = ["ADAPTER_STEPS", "PYLXD_STEPS", "STEPS", "Step", "Transcript", "mask", "run_scenario"]

IMAGE = {"type": "image", "alias": "busybox"}
NAME = "diff-c1"
MISSING_OPERATION = "00000000-0000-4000-8000-000000000000"
PROJECT = "diffp"
#: a project that shares the default project's images and profiles
PROJECT_BODY = {
    "name": PROJECT,
    "config": {"features.images": "false", "features.profiles": "false"},
}

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def mask(value: Any) -> Any:
    """``value`` with UUIDs, RFC 3339 timestamps and SHA-256 fingerprints replaced."""
    if isinstance(value, str):
        text = _UUID.sub("<uuid>", value)
        text = _TIME.sub("<time>", text)
        return _HEX64.sub("<fingerprint>", text)
    if isinstance(value, dict):
        return {k: mask(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(v) for v in value]
    return value


Pick = Callable[[Any], Any]


def _keys(metadata: Any) -> Any:
    return sorted(metadata) if isinstance(metadata, dict) else metadata


def _server(metadata: Any) -> Any:
    env = metadata["environment"]
    major_minor = ".".join(str(env["server_version"]).split(".")[:2])
    return {
        "api_version": metadata["api_version"],
        "auth": metadata["auth"],
        "server": env["server"],
        "server_version": major_minor,
        "project": env["project"],
        "keys": sorted(metadata),
    }


def _instance(metadata: Any) -> Any:
    return {k: metadata[k] for k in ("name", "type", "status", "status_code", "project")}


def _state(metadata: Any) -> Any:
    return {k: metadata[k] for k in ("status", "status_code")}


def _names(metadata: Any) -> Any:
    return sorted(metadata)


def _fields(metadata: Any) -> Any:
    return [sorted(m) for m in metadata]


@dataclass(frozen=True)
class Step:
    """One raw HTTP request of the scenario."""

    id: str
    method: str
    path: str
    body: Any = None
    #: what of a sync answer's metadata is compared (default: nothing but the envelope)
    pick: Pick | None = None
    #: after the answer (and its operation), wait for this lifecycle action of NAME
    then: str | None = None


def _state_step(id: str, action: str, *, then: str | None = None, **extra: Any) -> Step:
    body = {"action": action, **extra}
    return Step(id, "PUT", f"/1.0/instances/{NAME}/state", body, then=then)


def _create(id: str, **extra: Any) -> Step:
    body = {"name": NAME, "type": "container", "source": IMAGE, **extra}
    return Step(id, "POST", "/1.0/instances", body)


#: the raw HTTP requests, in order (ids are the test's and the docs' names for them)
STEPS: tuple[Step, ...] = (
    Step("server", "GET", "/1.0", pick=_server),
    Step("resources-sections", "GET", "/1.0/resources", pick=_keys),
    Step("events-without-websocket", "GET", "/1.0/events"),
    Step("storage-pool-resources", "GET", "/1.0/storage-pools/default/resources", pick=_keys),
    Step("get-missing-storage-pool", "GET", "/1.0/storage-pools/nosuch"),
    Step("profile-fields", "GET", "/1.0/profiles/default", pick=_keys),
    Step("get-missing-project", "GET", "/1.0/projects/nosuch"),
    Step("list-in-missing-project", "GET", "/1.0/instances?project=nosuch", pick=_names),
    Step("events-of-unknown-type", "GET", "/1.0/events?type=nosuch"),
    Step("get-missing-instance", "GET", "/1.0/instances/nosuch"),
    Step("state-of-missing-instance", "PUT", "/1.0/instances/nosuch/state", {"action": "start"}),
    Step("delete-missing-instance", "DELETE", "/1.0/instances/nosuch"),
    _create("create-container", then="instance-created"),
    Step("get-stopped", "GET", f"/1.0/instances/{NAME}", pick=_instance),
    Step("list-recursion-0", "GET", "/1.0/instances", pick=_names),
    Step("list-recursion-1-fields", "GET", "/1.0/instances?recursion=1", pick=_fields),
    Step("list-all-projects", "GET", "/1.0/instances?all-projects=true", pick=_names),
    Step("get-missing-operation", "GET", f"/1.0/operations/{MISSING_OPERATION}"),
    _create("create-duplicate-name"),
    _create("create-missing-image", source={"type": "image", "alias": "nosuch"}),
    _create("create-vm-from-container-image", type="virtual-machine"),
    _create("create-vm-unsupported", type="virtual-machine", source={"type": "none"}),
    _state_step("stop-stopped", "stop", force=True),
    _state_step("start", "start", then="instance-ready"),
    Step("get-ready", "GET", f"/1.0/instances/{NAME}", pick=_instance),
    Step("state-ready", "GET", f"/1.0/instances/{NAME}/state", pick=_state),
    _state_step("start-running", "start"),
    Step("delete-running", "DELETE", f"/1.0/instances/{NAME}"),
    _state_step("freeze", "freeze", then="instance-paused"),
    _state_step("freeze-frozen", "freeze"),
    _state_step("unfreeze", "unfreeze", then="instance-resumed"),
    _state_step("unfreeze-running", "unfreeze"),
    _state_step("restart", "restart", force=True, then="instance-ready"),
    Step("patch-config", "PATCH", f"/1.0/instances/{NAME}", {"config": {"user.diff": "1"}}),
    _state_step("stop-graceful", "stop", force=False, timeout=30, then="instance-shutdown"),
    _state_step("start-again", "start", then="instance-ready"),
    _state_step("stop-forced", "stop", force=True, then="instance-stopped"),
    Step("delete-stopped", "DELETE", f"/1.0/instances/{NAME}", then="instance-deleted"),
    Step("get-deleted", "GET", f"/1.0/instances/{NAME}"),
    Step("create-project", "POST", "/1.0/projects", PROJECT_BODY),
    Step("create-project-again", "POST", "/1.0/projects", PROJECT_BODY),
    Step(
        "create-in-project",
        "POST",
        f"/1.0/instances?project={PROJECT}",
        {"name": NAME, "type": "container", "source": IMAGE},
        then="instance-created",
    ),
    Step("list-every-project", "GET", "/1.0/instances?all-projects=true", pick=_names),
    Step("list-in-project", "GET", f"/1.0/instances?project={PROJECT}", pick=_names),
    Step("get-in-wrong-project", "GET", f"/1.0/instances/{NAME}"),
    Step(
        "delete-in-project",
        "DELETE",
        f"/1.0/instances/{NAME}?project={PROJECT}",
        then="instance-deleted",
    ),
    Step("delete-project", "DELETE", f"/1.0/projects/{PROJECT}"),
)

#: the pylxd calls, in order, after the raw steps (each: id, what it does)
PYLXD_STEPS: tuple[tuple[str, str], ...] = (
    ("pylxd-create", "instances.create(busybox container, wait=True)"),
    ("pylxd-create-duplicate", "instances.create(same name, wait=True)"),
    ("pylxd-create-vm", "instances.create(virtual-machine from busybox, wait=True)"),
    ("pylxd-get-missing", "instances.get('nosuch')"),
    ("pylxd-start", "instance.start(wait=True), then instance-ready"),
    ("pylxd-stop", "instance.stop(wait=True) (pylxd forces)"),
    ("pylxd-delete", "instance.delete(wait=True)"),
    ("pylxd-list", "instances.all() names"),
)


#: the project's own adapter (``IncusHost``, over pylxd), after the pylxd calls
ADAPTER_STEPS: tuple[tuple[str, str], ...] = (
    ("adapter-server-info", "server_info(): server version"),
    ("adapter-create", "create_instance(busybox container, lease L1)"),
    ("adapter-create-same-lease", "create_instance(same name, lease L1): idempotent"),
    ("adapter-create-other-lease", "create_instance(same name, lease L2): refused"),
    ("adapter-create-vm", "create_instance(virtual-machine from busybox): refused"),
    ("adapter-create-missing-image", "create_instance(image nosuch): refused"),
    ("adapter-get-missing", "get_instance('nosuch') is None"),
    ("adapter-start", "start_instance, then instance-ready"),
    ("adapter-start-again", "start_instance of a running one: success"),
    ("adapter-stop", "stop_instance (forced)"),
    ("adapter-stop-again", "stop_instance of a stopped one: success"),
    ("adapter-delete", "delete_instance"),
    ("adapter-delete-again", "delete_instance of a missing one: success"),
    ("adapter-destroy-missing", "destroy_instance of a missing one: success"),
    ("adapter-list", "list_instances() names"),
)


@dataclass
class Transcript:
    """What one endpoint answered, masked: per step id a record, and the event streams."""

    steps: dict[str, Any] = field(default_factory=dict)
    lifecycle: list[Any] = field(default_factory=list)
    operations: list[Any] = field(default_factory=list)
    #: how often the guest's instance-ready came before instance-started (see below)
    ready_before_started: int = 0


class _Watcher:
    """Collects the endpoint's lifecycle and operation events from one WebSocket."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._arrived = anyio.Event()

    async def run(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            self.events.append(message.json())
            self._arrived.set()
            self._arrived = anyio.Event()

    async def until(self, action: str, name: str, *, after: int, timeout_s: float = 30.0) -> None:
        with anyio.fail_after(timeout_s):
            while True:
                for event in self.events[after:]:
                    meta = event.get("metadata") or {}
                    if event["type"] == "lifecycle" and (meta.get("action"), meta.get("name")) == (
                        action,
                        name,
                    ):
                        return
                await self._arrived.wait()

    async def settle(self, op_ids: set[str], *, timeout_s: float = 10.0) -> None:
        """Until every operation in ``op_ids`` has sent its final event."""
        with anyio.fail_after(timeout_s):
            while True:
                final = {
                    e["metadata"]["id"]
                    for e in self.events
                    if e["type"] == "operation" and int(e["metadata"]["status_code"]) >= 200
                }
                if op_ids <= final:
                    return
                await self._arrived.wait()


def _envelope(status: int, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        return {"http": status, "body": body}
    return {
        "http": status,
        "fields": sorted(body),
        "type": body.get("type"),
        "status": body.get("status"),
        "status_code": body.get("status_code"),
        "error_code": body.get("error_code"),
        "error": body.get("error"),
    }


def _operation(op: Any) -> dict[str, Any]:
    metadata = op.get("metadata")
    return {
        "fields": sorted(op),
        "class": op.get("class"),
        "description": op.get("description"),
        "status": op.get("status"),
        "status_code": op.get("status_code"),
        "resources": op.get("resources"),
        "may_cancel": op.get("may_cancel"),
        "err": op.get("err"),
        # values (unpack speed) vary; the shape does not
        "metadata": sorted(metadata) if isinstance(metadata, dict) else metadata,
    }


async def _request(
    http: aiohttp.ClientSession, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    async with http.request(method, path, json=body) as response:
        text = await response.text()
        try:
            return response.status, await response.json(content_type=None)
        except ValueError:
            return response.status, text.strip()


async def _raw_step(http: aiohttp.ClientSession, step: Step, op_ids: set[str]) -> dict[str, Any]:
    status, body = await _request(http, step.method, step.path, step.body)
    record: dict[str, Any] = {"answer": _envelope(status, body)}
    if not isinstance(body, dict):
        return record
    if body.get("type") == "sync" and step.pick is not None:
        record["metadata"] = step.pick(body["metadata"])
    if body.get("type") == "async":
        op = body["metadata"]
        op_ids.add(op["id"])
        record["operation"] = _operation(op)
        operation = str(body["operation"]).split("?", 1)[0]
        record["operation-url-query"] = "?" in str(body["operation"])
        status, waited = await _request(http, "GET", f"{operation}/wait?timeout=30")
        record["wait"] = _envelope(status, waited)
        if isinstance(waited, dict) and waited.get("type") == "sync":
            record["wait"]["operation"] = _operation(waited["metadata"])
        status, got = await _request(http, "GET", operation)
        record["get-operation"] = _envelope(status, got)
        if isinstance(got, dict) and got.get("type") == "sync":
            record["get-operation"]["operation"] = _operation(got["metadata"])
    return record


def _pylxd_error(exc: Exception) -> dict[str, Any]:
    response = getattr(exc, "response", None)
    return {
        "raised": type(exc).__name__,
        "http": getattr(response, "status_code", None),
        "text": str(exc),
    }


def _pylxd_steps(socket: Path, ready: Callable[[], None]) -> dict[str, Any]:
    """In a worker thread: the pylxd calls; ``ready`` blocks until NAME-p is ready."""
    client = Client(endpoint=str(socket))
    name = f"{NAME}-p"
    config = {"name": name, "type": "container", "source": IMAGE}
    out: dict[str, Any] = {}

    def attempt(step_id: str, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except (pylxd_errors.LXDAPIException, pylxd_errors.NotFound) as exc:
            out[step_id] = _pylxd_error(exc)
            return None
        out[step_id] = {"raised": None}
        return result

    inst = attempt("pylxd-create", lambda: client.instances.create(config, wait=True))
    if inst is not None:
        out["pylxd-create"].update(name=inst.name, type=inst.type, status=inst.status)
    attempt("pylxd-create-duplicate", lambda: client.instances.create(config, wait=True))
    vm = {"name": f"{NAME}-vm", "type": "virtual-machine", "source": IMAGE}
    attempt("pylxd-create-vm", lambda: client.instances.create(vm, wait=True))
    attempt("pylxd-get-missing", lambda: client.instances.get("nosuch"))
    if inst is not None:
        attempt("pylxd-start", lambda: inst.start(wait=True))
        ready()
        fresh = client.instances.get(name)
        out["pylxd-start"].update(status=fresh.status, status_code=fresh.status_code)
        attempt("pylxd-stop", lambda: inst.stop(wait=True))
        attempt("pylxd-delete", lambda: inst.delete(wait=True))
    out["pylxd-list"] = sorted(i.name for i in client.instances.all())
    return out


async def _adapter_steps(socket: Path, watcher: _Watcher, seen: int) -> dict[str, Any]:
    host = IncusHost(IncusEndpoint(host="diff", url=str(socket)), operation_timeout_s=30.0)
    name = f"{NAME}-a"
    out: dict[str, Any] = {}

    def spec(lease: str, **fields: Any) -> InstanceSpec:
        fields.setdefault("instance_type", "container")
        return InstanceSpec.for_lease(
            name=name, image="busybox", lease_id=lease, pool="diff", kind="warm", **fields
        )

    async def attempt(step_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            result = await call()
        except IncusError as exc:
            out[step_id] = {"raised": type(exc).__name__, "message": exc.message}
            return None
        out[step_id] = {"raised": None}
        return result

    try:
        info = await attempt("adapter-server-info", host.server_info)
        if info is not None:
            out["adapter-server-info"]["version"] = ".".join(info.server_version.split(".")[:2])
        view = await attempt("adapter-create", lambda: host.create_instance(spec("L1")))
        if view is not None:
            out["adapter-create"].update(status=view.status, lease=view.lease_id)
        await attempt("adapter-create-same-lease", lambda: host.create_instance(spec("L1")))
        await attempt("adapter-create-other-lease", lambda: host.create_instance(spec("L2")))
        await attempt(
            "adapter-create-vm",
            lambda: host.create_instance(spec("L3", instance_type="virtual-machine")),
        )
        await attempt(
            "adapter-create-missing-image",
            lambda: host.create_instance(dataclasses.replace(spec("L4"), image="nosuch")),
        )
        missing = await attempt("adapter-get-missing", lambda: host.get_instance("nosuch"))
        out["adapter-get-missing"]["found"] = missing is not None
        await attempt("adapter-start", lambda: host.start_instance(name))
        await watcher.until("instance-ready", name, after=seen)
        await attempt("adapter-start-again", lambda: host.start_instance(name))
        await attempt("adapter-stop", lambda: host.stop_instance(name))
        await attempt("adapter-stop-again", lambda: host.stop_instance(name))
        await attempt("adapter-delete", lambda: host.delete_instance(name))
        await attempt("adapter-delete-again", lambda: host.delete_instance(name))
        await attempt("adapter-destroy-missing", lambda: host.destroy_instance("nosuch"))
        views = await attempt("adapter-list", host.list_instances)
        out["adapter-list"]["names"] = sorted(v.name for v in views or [])
    finally:
        await host.aclose()
    masked: dict[str, Any] = mask(out)
    return masked


def _lifecycle_record(event: dict[str, Any]) -> dict[str, Any]:
    meta = event["metadata"]
    return {
        "keys": sorted(event),
        "metadata_keys": sorted(meta),
        "action": meta.get("action"),
        "name": meta.get("name"),
        "source": meta.get("source"),
        "project": meta.get("project"),
        "requestor": meta.get("requestor"),
        "context": meta.get("context"),
        "context_key_order": list(meta.get("context") or {}),
        "location": event.get("location"),
        "event_project": event.get("project"),
    }


#: what Incus emits when a start (or restart) operation ends
_STARTS = ("instance-started", "instance-restarted")


def _started_before_ready(lifecycle: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The sequence with a guest's ``instance-ready`` put after its start (or restart).

    On the real daemon the guest's Ready ``PATCH`` (sent by the image's init as soon as it
    runs) races the daemon's own ``instance-started``/``-restarted``, which Incus emits
    only when the operation ends: on a loaded machine ``instance-ready`` sometimes arrives
    first. That order is Incus's, not a simulator choice, so the comparison takes it as
    the simulator's (started, then ready) and counts how often it happened.
    """
    found = list(lifecycle)
    swapped = 0
    for i in range(len(found) - 1):
        first, second = found[i], found[i + 1]
        same = first["name"] == second["name"]
        if same and first["action"] == "instance-ready" and second["action"] in _STARTS:
            found[i], found[i + 1] = second, first
            swapped += 1
    return found, swapped


def _operations(events: list[dict[str, Any]]) -> list[Any]:
    """Per operation: description, the statuses it went through, final err, resources.

    Incus re-sends a Running operation whenever its metadata (unpack progress) changes
    and may deliver the events out of order: the statuses are a set, sorted.
    """
    by_id: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["type"] != "operation":
            continue
        op = event["metadata"]
        entry = by_id.setdefault(
            op["id"],
            {"description": op["description"], "statuses": set(), "err": "", "resources": {}},
        )
        entry["statuses"].add(op["status"])
        entry["err"] = op["err"] or entry["err"]
        entry["resources"] = op["resources"]
    found = [mask({**e, "statuses": sorted(e["statuses"])}) for e in by_id.values()]
    return sorted(found, key=repr)


async def run_scenario(socket: Path) -> Transcript:
    """Every step against the Incus listening on ``socket``; the masked transcript."""
    transcript = Transcript()
    watcher = _Watcher()
    op_ids: set[str] = set()
    connector = aiohttp.UnixConnector(path=str(socket))
    async with (
        aiohttp.ClientSession("http://incus", connector=connector) as http,
        http.ws_connect("/1.0/events?type=lifecycle,operation&all-projects=true") as ws,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(watcher.run, ws)
        for step in STEPS:
            seen = len(watcher.events)
            transcript.steps[step.id] = await _raw_step(http, step, op_ids)
            if step.then is not None:
                await watcher.until(step.then, NAME, after=seen)
        seen = len(watcher.events)
        portal_name = f"{NAME}-p"

        def ready() -> None:
            anyio.from_thread.run(lambda: watcher.until("instance-ready", portal_name, after=seen))

        transcript.steps.update(mask(await anyio.to_thread.run_sync(_pylxd_steps, socket, ready)))
        await watcher.until("instance-deleted", portal_name, after=seen)
        seen = len(watcher.events)
        transcript.steps.update(await _adapter_steps(socket, watcher, seen))
        await watcher.settle(
            {e["metadata"]["id"] for e in watcher.events if e["type"] == "operation"}
        )
        await ws.close()
        tasks.cancel_scope.cancel()
    transcript.steps = mask(transcript.steps)
    lifecycle = [mask(_lifecycle_record(e)) for e in watcher.events if e["type"] == "lifecycle"]
    transcript.lifecycle, transcript.ready_before_started = _started_before_ready(lifecycle)
    transcript.operations = _operations(watcher.events)
    return transcript
