"""The simulator's own control surface over HTTP, under ``/_sim/`` (not Incus API).

Rules:

- Every route calls one :class:`~reconciler.incus.simulator.host.SimHost` control and
  answers ``{"ok": true, "result": …}``; a bad request answers 400 and an unknown
  instance 404, both as ``{"ok": false, "error": "…"}``.
- The routes mirror the in-process controls one to one, so a test written against the
  Python API can drive a subprocess the same way:

  ==========================================  ===========================================
  ``GET /_sim/state``                          ``host.summary()``
  ``POST /_sim/instances``                     ``host.add_instance(name, …)``
  ``POST /_sim/instances/{name}/remove``       ``host.remove_instance(name, project, silent)``
  ``POST /_sim/instances/{name}/status``       ``host.set_status(name, status, …)``
  ``POST /_sim/instances/{name}/ready``        ``host.guest_ready(name, project)``
  ``POST /_sim/instances/{name}/poweroff``     ``host.guest_poweroff(name, project)``
  ``POST /_sim/faults``                        ``host.fail_next(kind, count, name, message)``
                                               or, with ``rate``, ``host.set_failure_rate``
  ``DELETE /_sim/faults``                      ``host.clear_faults()``
  ``POST /_sim/boot-delay``                    ``host.set_boot_delay(seconds)``
  ``POST /_sim/resources``                     ``host.set_resources(**fields)``
  ``POST /_sim/projects``                      ``host.add_project(name)``
  ``POST /_sim/events/drop``                   ``host.drop_event_streams(graceful)``
  ==========================================  ===========================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from reconciler.incus.simulator.api import HOST_KEY
from reconciler.incus.simulator.host import SimHost
from reconciler.incus.simulator.shapes import shape_to_json
from reconciler.incus.simulator.wire import ApiError, json_response

__all__ = ["CONTROL_PREFIX", "add_control_routes"]

CONTROL_PREFIX = "/_sim"

Control = Callable[[SimHost, dict[str, Any], web.Request], Awaitable[Any]]


def _route(control: Control) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            result = await control(request.app[HOST_KEY], body, request)
        except (KeyError, ApiError) as exc:
            return json_response({"ok": False, "error": str(exc)}, status=404)
        except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
            return json_response({"ok": False, "error": str(exc)}, status=400)
        return json_response({"ok": True, "result": result})

    return handler


async def _state(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    return {**host.summary(), "shape": shape_to_json(host.shape)}


async def _add_instance(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    inst = host.add_instance(
        str(body["name"]),
        project=str(body.get("project", "default")),
        status=str(body.get("status", "Running")),
        config=body.get("config"),
        devices=body.get("devices"),
        profiles=body.get("profiles"),
        silent=bool(body.get("silent", True)),
    )
    return {"name": inst.name, "project": inst.project, "status": inst.status.label}


async def _remove(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    return host.remove_instance(
        request.match_info["name"],
        project=str(body.get("project", "default")),
        silent=bool(body.get("silent", True)),
    )


async def _status(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    host.set_status(
        request.match_info["name"],
        str(body["status"]),
        project=str(body.get("project", "default")),
        silent=bool(body.get("silent", True)),
    )
    return None


async def _ready(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    return host.guest_ready(request.match_info["name"], project=str(body.get("project", "default")))


async def _poweroff(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    host.guest_poweroff(request.match_info["name"], project=str(body.get("project", "default")))
    return None


async def _faults(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    kind = str(body["kind"])
    if "rate" in body:
        host.set_failure_rate(kind, float(body["rate"]))
    else:
        host.fail_next(
            kind,
            count=int(body.get("count", 1)),
            name=body.get("name"),
            message=body.get("message"),
        )
    return host.summary()["faults"]


async def _clear_faults(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    host.clear_faults()
    return None


async def _boot_delay(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    host.set_boot_delay(float(body["seconds"]))
    return dataclasses.asdict(host.timing)


async def _resources(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    return shape_to_json(host.set_resources(**body))


async def _projects(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    host.add_project(str(body["name"]))
    return sorted(host.projects)


async def _drop_events(host: SimHost, body: dict[str, Any], request: web.Request) -> Any:
    return await host.drop_event_streams(graceful=bool(body.get("graceful", False)))


def add_control_routes(app: web.Application) -> None:
    p = CONTROL_PREFIX
    app.router.add_get(f"{p}/state", _route(_state))
    app.router.add_post(f"{p}/instances", _route(_add_instance))
    app.router.add_post(f"{p}/instances/{{name}}/remove", _route(_remove))
    app.router.add_post(f"{p}/instances/{{name}}/status", _route(_status))
    app.router.add_post(f"{p}/instances/{{name}}/ready", _route(_ready))
    app.router.add_post(f"{p}/instances/{{name}}/poweroff", _route(_poweroff))
    app.router.add_post(f"{p}/faults", _route(_faults))
    app.router.add_delete(f"{p}/faults", _route(_clear_faults))
    app.router.add_post(f"{p}/boot-delay", _route(_boot_delay))
    app.router.add_post(f"{p}/resources", _route(_resources))
    app.router.add_post(f"{p}/projects", _route(_projects))
    app.router.add_post(f"{p}/events/drop", _route(_drop_events))
