"""What goes on the wire: status codes, the three envelopes, timestamps, API errors.

Rules (FACTS.md, ``shared/api/response.go`` and ``status_code.go``):

- **Sync**: HTTP 200 (201 for a create that answers at once), all seven fields, even empty.
- **Async**: HTTP 202, ``Location: /1.0/operations/<uuid>``, ``status_code`` 100 and the
  operation (already Running) as metadata.
- **Error**: HTTP status = ``error_code``, ``metadata`` null, ``status``/``status_code``
  empty. Handlers raise :class:`ApiError`; one middleware renders it.
- Timestamps are Go's RFC 3339 with nanoseconds, trailing zeros trimmed, in UTC (``Z``);
  Go's zero time is ``0001-01-01T00:00:00Z``.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import orjson
from aiohttp import web

__all__ = [
    "ZERO_TIME",
    "ApiError",
    "StatusCode",
    "async_response",
    "error_body",
    "error_response",
    "json_response",
    "rfc3339nano",
    "sync_body",
    "sync_response",
]

ZERO_TIME = "0001-01-01T00:00:00Z"


class StatusCode(enum.IntEnum):
    """Incus's status codes; ``label`` is the text Incus shows next to the number."""

    OPERATION_CREATED = 100
    STARTED = 101
    STOPPED = 102
    RUNNING = 103
    CANCELLING = 104
    PENDING = 105
    STARTING = 106
    STOPPING = 107
    ABORTING = 108
    FREEZING = 109
    FROZEN = 110
    THAWED = 111
    ERROR = 112
    READY = 113
    SUCCESS = 200
    FAILURE = 400
    CANCELLED = 401

    @property
    def label(self) -> str:
        if self is StatusCode.OPERATION_CREATED:
            return "Operation created"
        return self.name.capitalize()

    @property
    def is_final(self) -> bool:
        """An operation with this status has finished."""
        return self >= 200


class ApiError(Exception):
    """An Incus error response: HTTP ``status`` and Incus's ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def rfc3339nano(ns: int | None = None) -> str:
    """Go's ``time.RFC3339Nano`` rendering of ``ns`` (epoch nanoseconds, default now), UTC."""
    if ns is None:
        ns = time.time_ns()
    seconds, fraction = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if fraction:
        text += "." + f"{fraction:09d}".rstrip("0")
    return text + "Z"


def sync_body(metadata: Any) -> dict[str, Any]:
    return {
        "type": "sync",
        "status": StatusCode.SUCCESS.label,
        "status_code": int(StatusCode.SUCCESS),
        "operation": "",
        "error_code": 0,
        "error": "",
        "metadata": metadata,
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "status": "",
        "status_code": 0,
        "operation": "",
        "error_code": status,
        "error": message,
        "metadata": None,
    }


def json_response(
    body: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def sync_response(metadata: Any, *, status: int = 200, location: str | None = None) -> web.Response:
    headers = {"Location": location} if location else None
    return json_response(sync_body(metadata), status=status, headers=headers)


def async_response(operation: dict[str, Any]) -> web.Response:
    url = f"/1.0/operations/{operation['id']}"
    body = {
        "type": "async",
        "status": StatusCode.OPERATION_CREATED.label,
        "status_code": int(StatusCode.OPERATION_CREATED),
        "operation": url,
        "error_code": 0,
        "error": "",
        "metadata": operation,
    }
    return json_response(body, status=202, headers={"Location": url})


def error_response(status: int, message: str, *, http_status: int | None = None) -> web.Response:
    """An error envelope; HTTP status = ``error_code`` unless ``http_status`` says otherwise
    (Incus 6.0's ``/wait`` of a failed operation: 200 with ``error_code`` 500)."""
    return json_response(
        error_body(status, message), status=status if http_status is None else http_status
    )
