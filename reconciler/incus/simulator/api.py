"""The Incus REST API of one simulated host, as aiohttp routes.

Rules:

- Only paths and methods that exist in Incus's ``rest-api.yaml`` are served here (the
  comparison tests check it); the simulator's own controls live under ``/_sim/`` in
  :mod:`.control`.
- Every answer is one of the three envelopes of :mod:`.wire`. Handlers raise
  :class:`~reconciler.incus.simulator.wire.ApiError`; the middleware renders it, and
  renders aiohttp's own 404/405 the way Incus does ("not found", "method not allowed").
- ``project`` selects the project (default ``default``; unknown: 404 "Project not
  found"); ``all-projects=true`` lists every project, and with ``project`` is a 400.
- ``recursion`` 0 gives paths (``?project=P`` outside the default project), 1 objects,
  2 objects with their state; ``filter`` understands ``FIELD eq|ne VALUE`` joined by
  ``and`` (fields ``name``, ``status``, ``type``, ``project``, ``config.KEY``).
- ``GET /1.0/events`` follows gorilla/websocket's checks: a non-WebSocket request is a
  400, and an ``Origin`` whose host differs from the ``Host`` header (ws4py's
  ``ws+unix://localhost`` against ``localhost:None`` over a unix socket) is a 403.
- The ``requestor`` of lifecycle events is ``root``/``unix`` over a unix socket, and the
  peer address with protocol ``tls`` over TCP (the simulator trusts every client).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import WSMsgType, web

from reconciler.incus.simulator import render
from reconciler.incus.simulator.events import EVENT_TYPES, Listener
from reconciler.incus.simulator.host import SimHost, SimInstance
from reconciler.incus.simulator.operations import Operation
from reconciler.incus.simulator.wire import (
    ApiError,
    StatusCode,
    async_response,
    error_response,
    sync_response,
)

__all__ = ["HOST_KEY", "PING_INTERVAL_KEY", "add_incus_routes", "error_middleware"]

HOST_KEY = web.AppKey("sim_host", SimHost)
PING_INTERVAL_KEY = web.AppKey("sim_ping_interval", float)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message)
    except web.HTTPNotFound:
        return error_response(404, "not found")
    except web.HTTPMethodNotAllowed:
        return error_response(405, "method not allowed")


# ---------------------------------------------------------------------- request helpers


def _host(request: web.Request) -> SimHost:
    return request.app[HOST_KEY]


def _project(request: web.Request) -> str:
    return request.query.get("project") or "default"


def _all_projects(request: web.Request) -> bool:
    return request.query.get("all-projects", "").lower() in ("1", "true", "yes", "on")


def _recursion(request: web.Request) -> int:
    text = request.query.get("recursion", "0").split(";", 1)[0]
    try:
        return max(0, min(int(text), 2))
    except ValueError:
        return 0


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid character in request body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "json: cannot unmarshal array into Go value of type api.object")
    return body


def requestor(request: web.Request) -> dict[str, str]:
    """Who asked, as Incus records it in lifecycle events."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family == socket.AF_UNIX:
        return {"username": "root", "protocol": "unix", "address": "@"}
    peer = transport.get_extra_info("peername") if transport is not None else None
    address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
    return {"username": "simulator", "protocol": "tls", "address": address}


def _operation(op: Operation) -> web.Response:
    return async_response(op.render())


# ---------------------------------------------------------------------- server, resources


async def get_server(request: web.Request) -> web.Response:
    host = _host(request)
    host.require_project(_project(request))
    return sync_response(
        render.server(host, project=_project(request), requestor=requestor(request))
    )


async def get_resources(request: web.Request) -> web.Response:
    return sync_response(render.resources(_host(request)))


def _pool(request: web.Request) -> str:
    host = _host(request)
    name = request.match_info["name"]
    if name != host.shape.storage_pool:
        raise ApiError(404, "Storage pool not found")
    return name


async def list_storage_pools(request: web.Request) -> web.Response:
    host = _host(request)
    name = host.shape.storage_pool
    if _recursion(request) == 0:
        return sync_response([f"/1.0/storage-pools/{name}"])
    return sync_response([render.storage_pool(host, name)])


async def get_storage_pool(request: web.Request) -> web.Response:
    return sync_response(render.storage_pool(_host(request), _pool(request)))


async def get_storage_pool_resources(request: web.Request) -> web.Response:
    _pool(request)
    return sync_response(render.storage_pool_resources(_host(request)))


# ---------------------------------------------------------------------- projects, profiles


async def list_projects(request: web.Request) -> web.Response:
    host = _host(request)
    names = sorted(host.projects)
    if _recursion(request) == 0:
        return sync_response([f"/1.0/projects/{n}" for n in names])
    return sync_response([render.project(host, n) for n in names])


async def get_project(request: web.Request) -> web.Response:
    host = _host(request)
    name = request.match_info["name"]
    host.require_project(name)
    return sync_response(render.project(host, name))


async def create_project(request: web.Request) -> web.Response:
    host = _host(request)
    name = str((await _body(request)).get("name") or "")
    if not name:
        raise ApiError(400, "No name provided")
    host.create_project(name, requestor=requestor(request))
    return sync_response(None, status=201, location=f"/1.0/projects/{name}")


async def delete_project(request: web.Request) -> web.Response:
    _host(request).delete_project(request.match_info["name"], requestor=requestor(request))
    return sync_response(None)


async def list_profiles(request: web.Request) -> web.Response:
    host = _host(request)
    project = _project(request)
    profiles = host.require_project(project)
    suffix = "" if project == "default" else f"?project={project}"
    if _recursion(request) == 0:
        return sync_response([f"/1.0/profiles/{n}{suffix}" for n in sorted(profiles)])
    return sync_response([render.profile(host, project, profiles[n]) for n in sorted(profiles)])


async def get_profile(request: web.Request) -> web.Response:
    host = _host(request)
    project = _project(request)
    item = host.require_project(project).get(request.match_info["name"])
    if item is None:
        raise ApiError(404, "Profile not found")
    return sync_response(render.profile(host, project, item))


# ---------------------------------------------------------------------- instances


def _matches(host: SimHost, inst: SimInstance, clauses: list[tuple[str, str, str]]) -> bool:
    config, _ = host.expanded(inst)
    fields = {
        "name": inst.name,
        "status": inst.status.label,
        "type": inst.type,
        "project": inst.project,
    }
    for field, op, value in clauses:
        actual = config.get(field[7:]) if field.startswith("config.") else fields.get(field)
        if (actual == value) != (op == "eq"):
            return False
    return True


def _parse_filter(text: str) -> list[tuple[str, str, str]]:
    clauses = []
    for part in (p.strip() for p in text.split(" and ")):
        if not part:
            continue
        words = part.split(" ", 2)
        if len(words) != 3 or words[1] not in ("eq", "ne"):
            raise ApiError(400, f"Invalid filter: {part}")
        clauses.append((words[0], words[1], words[2].strip("\"'")))
    return clauses


async def list_instances(request: web.Request) -> web.Response:
    host = _host(request)
    if _all_projects(request):
        if "project" in request.query:
            raise ApiError(400, "Cannot specify a project when requesting all projects")
        chosen = host.instances_in(None)
    else:
        project = _project(request)
        if project in host.projects or not host.version.lists_missing_project_as_empty:
            host.require_project(project)
        chosen = host.instances_in(project)
    clauses = _parse_filter(request.query.get("filter", ""))
    chosen = [i for i in chosen if _matches(host, i, clauses)]
    recursion = _recursion(request)
    if recursion == 0:
        return sync_response([render.instance_url(i) for i in chosen])
    if recursion == 1:
        return sync_response([render.instance(host, i) for i in chosen])
    return sync_response([render.instance_full(host, i) for i in chosen])


async def create_instance(request: web.Request) -> web.Response:
    body = await _body(request)
    op = _host(request).create_instance(
        project=_project(request), request=body, requestor=requestor(request)
    )
    return _operation(op)


async def get_instance(request: web.Request) -> web.Response:
    host = _host(request)
    inst = host.require_instance(_project(request), request.match_info["name"])
    if _recursion(request) >= 1:
        return sync_response(render.instance_full(host, inst))
    return sync_response(render.instance(host, inst))


async def put_instance(request: web.Request) -> web.Response:
    host = _host(request)
    project, name = _project(request), request.match_info["name"]
    host.require_instance(project, name)
    body = await _body(request)
    who = requestor(request)
    op = host.update_operation(
        project=project,
        name=name,
        apply=lambda: host.update_instance(
            project=project, name=name, request=body, replace=True, requestor=who
        ),
    )
    return _operation(op)


async def patch_instance(request: web.Request) -> web.Response:
    host = _host(request)
    body = await _body(request)
    host.update_instance(
        project=_project(request),
        name=request.match_info["name"],
        request=body,
        replace=False,
        requestor=requestor(request) if host.version.patch_update_has_requestor else None,
    )
    return sync_response({})


async def delete_instance(request: web.Request) -> web.Response:
    op = _host(request).delete_instance(
        project=_project(request), name=request.match_info["name"], requestor=requestor(request)
    )
    return _operation(op)


async def get_instance_state(request: web.Request) -> web.Response:
    host = _host(request)
    inst = host.require_instance(_project(request), request.match_info["name"])
    return sync_response(render.instance_state(host, inst))


async def put_instance_state(request: web.Request) -> web.Response:
    host = _host(request)
    body = await _body(request)
    op = host.change_state(
        project=_project(request),
        name=request.match_info["name"],
        request=body,
        requestor=requestor(request),
    )
    return _operation(op)


async def post_instance_file(request: web.Request) -> web.Response:
    mode = request.headers.get("X-Incus-mode", "0644")
    try:
        mode_bits = int(mode, 8)
    except ValueError:
        raise ApiError(400, f"Invalid file mode {mode!r}") from None
    _host(request).push_file(
        project=_project(request),
        name=request.match_info["name"],
        path=request.query.get("path", ""),
        content=await request.read(),
        mode=mode_bits,
    )
    return sync_response({})


async def post_instance_exec(request: web.Request) -> web.Response:
    host = _host(request)
    body = await _body(request)
    op = host.execute(project=_project(request), name=request.match_info["name"], request=body)
    return _operation(op)


# ---------------------------------------------------------------------- operations


def _require_operation(request: web.Request) -> Operation:
    op = _host(request).operations.get(request.match_info["id"])
    if op is None:
        raise ApiError(404, "Operation not found")
    return op


async def list_operations(request: web.Request) -> web.Response:
    by_status: dict[str, list[Any]] = {}
    recursion = _recursion(request)
    for op in _host(request).operations.all():
        entry: Any = op.render() if recursion >= 1 else op.url
        by_status.setdefault(op.status.label.lower(), []).append(entry)
    return sync_response(by_status)


async def get_operation(request: web.Request) -> web.Response:
    return sync_response(_require_operation(request).render())


async def delete_operation(request: web.Request) -> web.Response:
    _require_operation(request)
    raise ApiError(400, "This operation can't be cancelled")


async def wait_operation(request: web.Request) -> web.Response:
    op = _require_operation(request)
    try:
        timeout = int(request.query.get("timeout", "-1"))
    except ValueError:
        timeout = -1
    await op.wait(timeout)
    failed = op.status in (StatusCode.FAILURE, StatusCode.CANCELLED)
    if failed and _host(request).version.wait_failure_is_error_envelope:
        return error_response(op.err_status, op.err, http_status=200)  # Incus 6.0
    return sync_response(op.render())


# ---------------------------------------------------------------------- events


def _same_origin(origin: str, host_header: str) -> bool:
    """gorilla/websocket's ``checkSameOrigin``: the Origin's host equals the Host header."""
    try:
        parsed = urlsplit(origin)
    except ValueError:
        return False
    return parsed.netloc.lower() == host_header.lower()


async def events(request: web.Request) -> web.StreamResponse:
    host = _host(request)
    project = request.query.get("project", "")
    every_project = _all_projects(request)
    if every_project and project:
        raise ApiError(400, "Cannot specify a project when requesting all projects")
    if not every_project:
        project = project or "default"
        host.require_project(project)
    types = [t for t in request.query.get("type", "").split(",") if t] or list(EVENT_TYPES)
    for event_type in types:
        if event_type not in EVENT_TYPES:
            raise ApiError(400, f'"{event_type}" isn\'t a supported event type')
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return web.Response(status=400, text="Bad Request\n")
    origin = request.headers.get("Origin")
    if origin is not None and not _same_origin(origin, request.headers.get("Host", "")):
        return web.Response(status=403, text="Forbidden\n", headers={"Sec-WebSocket-Version": "13"})
    ws = web.WebSocketResponse(autoping=True)
    await ws.prepare(request)
    listener = Listener(
        ws=ws, request=request, project=None if every_project else project, types=frozenset(types)
    )
    host.events.add(listener)
    try:
        await _serve_listener(listener, ping_interval=request.app[PING_INTERVAL_KEY])
    finally:
        host.events.remove(listener)
    return ws


async def _serve_listener(listener: Listener, *, ping_interval: float) -> None:
    ws = listener.ws

    async def read() -> None:  # client frames are ignored; a close ends the stream
        async for message in ws:
            if message.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                break
        listener.queue.put_nowait(None)

    async def ping() -> None:
        while True:
            await asyncio.sleep(ping_interval)
            await ws.ping()

    tasks = [asyncio.create_task(read()), asyncio.create_task(ping())]
    try:
        while (payload := await listener.queue.get()) is not None:
            await ws.send_str(payload.decode())
    except (ConnectionError, RuntimeError):
        pass  # the peer is gone
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, RuntimeError):
                await task
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.close()


# ---------------------------------------------------------------------- routes


def add_incus_routes(app: web.Application) -> None:
    """Register every Incus path the simulator serves."""
    app.router.add_get("/1.0", get_server)
    app.router.add_get("/1.0/resources", get_resources)
    app.router.add_get("/1.0/events", events)
    app.router.add_get("/1.0/storage-pools", list_storage_pools)
    app.router.add_get("/1.0/storage-pools/{name}", get_storage_pool)
    app.router.add_get("/1.0/storage-pools/{name}/resources", get_storage_pool_resources)
    app.router.add_get("/1.0/projects", list_projects)
    app.router.add_post("/1.0/projects", create_project)
    app.router.add_get("/1.0/projects/{name}", get_project)
    app.router.add_delete("/1.0/projects/{name}", delete_project)
    app.router.add_get("/1.0/profiles", list_profiles)
    app.router.add_get("/1.0/profiles/{name}", get_profile)
    app.router.add_get("/1.0/instances", list_instances)
    app.router.add_post("/1.0/instances", create_instance)
    app.router.add_get("/1.0/instances/{name}", get_instance)
    app.router.add_put("/1.0/instances/{name}", put_instance)
    app.router.add_patch("/1.0/instances/{name}", patch_instance)
    app.router.add_delete("/1.0/instances/{name}", delete_instance)
    app.router.add_get("/1.0/instances/{name}/state", get_instance_state)
    app.router.add_put("/1.0/instances/{name}/state", put_instance_state)
    app.router.add_post("/1.0/instances/{name}/files", post_instance_file)
    app.router.add_post("/1.0/instances/{name}/exec", post_instance_exec)
    app.router.add_get("/1.0/operations", list_operations)
    app.router.add_get("/1.0/operations/{id}", get_operation)
    app.router.add_delete("/1.0/operations/{id}", delete_operation)
    app.router.add_get("/1.0/operations/{id}/wait", wait_operation)
