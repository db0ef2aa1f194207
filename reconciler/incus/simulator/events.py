"""The event stream of one simulated host (``GET /1.0/events``), after ``cmd/incusd/events.go``.

Rules:

- A listener names its project (``project=P``, default ``default``) or asks for every
  project (``all-projects=true``; both together is a 400). It gets only events of its
  types (``type=a,b``; empty = every type it may see) and, unless it listens to every
  project, only events of its project.
- One JSON text frame per event, in publication order; each listener has its own queue,
  so a slow listener never delays another or the host.
- Lifecycle events have Incus's exact shape: ``{type, timestamp, metadata:{action,
  source, requestor?, context?, name, project}, location, project}``; ``source`` carries
  ``?project=P`` outside the default project, as ``api.URL.Project`` renders it;
  ``requestor`` is present only for actions done by an API request (an operation).
- :meth:`EventHub.drop_all` ends every stream: gracefully (close frame) or abruptly
  (transport aborted, no close frame: a lost network), so clients can test reconnection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from reconciler.incus.simulator.wire import rfc3339nano

__all__ = [
    "EVENT_TYPES",
    "EventHub",
    "Listener",
    "instance_source",
    "lifecycle_event",
    "project_event",
]

#: the event types Incus serves (``eventTypes`` in events.go)
EVENT_TYPES = ("logging", "operation", "lifecycle", "network-acl")


def instance_source(name: str, project: str) -> str:
    """``/1.0/instances/NAME``, with ``?project=P`` outside the default project."""
    path = f"/1.0/instances/{name}"
    return path if project == "default" else f"{path}?project={project}"


def lifecycle_event(
    *,
    action: str,
    name: str,
    project: str,
    requestor: dict[str, str] | None = None,
    context: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A lifecycle event of instance ``name`` exactly as Incus sends it."""
    metadata: dict[str, Any] = {"action": action, "source": instance_source(name, project)}
    if requestor is not None:
        metadata["requestor"] = requestor
    if context:
        metadata["context"] = dict(sorted(context.items()))  # a Go map: keys sorted
    metadata["name"] = name
    metadata["project"] = project
    return {
        "type": "lifecycle",
        "timestamp": rfc3339nano(),
        "metadata": metadata,
        "location": "none",
        "project": project,
    }


def project_event(*, action: str, project: str, requestor: dict[str, str]) -> dict[str, Any]:
    """``project-created``/``project-deleted`` as Incus sends it (no name, no context)."""
    return {
        "type": "lifecycle",
        "timestamp": rfc3339nano(),
        "metadata": {
            "action": action,
            "source": f"/1.0/projects/{project}",
            "requestor": requestor,
        },
        "location": "none",
        "project": project,
    }


@dataclass(eq=False)
class Listener:
    """One connected ``/1.0/events`` WebSocket."""

    ws: web.WebSocketResponse
    request: web.Request
    project: str | None  # None: every project
    types: frozenset[str]
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def wants(self, event: dict[str, Any]) -> bool:
        if event["type"] not in self.types:
            return False
        return self.project is None or event.get("project", "") in ("", self.project)


class EventHub:
    """Fans events out to the listeners of one host."""

    def __init__(self) -> None:
        self._listeners: set[Listener] = set()
        self.published = 0

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    def add(self, listener: Listener) -> None:
        self._listeners.add(listener)

    def remove(self, listener: Listener) -> None:
        self._listeners.discard(listener)

    def publish(self, event: dict[str, Any]) -> None:
        self.published += 1
        payload: bytes | None = None
        for listener in self._listeners:
            if listener.wants(event):
                if payload is None:
                    payload = orjson.dumps(event)
                listener.queue.put_nowait(payload)

    async def drop_all(self, *, graceful: bool = False) -> int:
        """End every stream (close frame if ``graceful``, else abort); return how many."""
        dropped = list(self._listeners)
        self._listeners.clear()
        for listener in dropped:
            if graceful:
                listener.queue.put_nowait(None)  # the writer closes after what is queued
            else:
                transport = listener.request.transport
                if transport is not None:
                    transport.abort()
                listener.queue.put_nowait(None)
        return len(dropped)
