"""Query replies (docs/interface.md, "Queries"): ``{ok: true, result}`` or
``{ok: false, error: {code, message}}``.

The codes are the contract's (``cache-not-ready``, ``stale-runtime-inputs``,
``not-found``, ``invalid``) and ``internal`` (an addition) for a failure of the replica.
A reply is plain JSON in the order written (queries are not replayed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from reconciler.core.messages.fields import json_object

__all__ = [
    "CACHE_NOT_READY",
    "INTERNAL",
    "INVALID",
    "NOT_FOUND",
    "STALE_RUNTIME_INPUTS",
    "QueryReply",
    "error_reply",
    "ok_reply",
]

CACHE_NOT_READY: Final = "cache-not-ready"
STALE_RUNTIME_INPUTS: Final = "stale-runtime-inputs"
NOT_FOUND: Final = "not-found"
INVALID: Final = "invalid"
INTERNAL: Final = "internal"


def ok_reply(result: Any) -> bytes:
    return orjson.dumps({"ok": True, "result": result})


def error_reply(code: str, message: str) -> bytes:
    return orjson.dumps({"ok": False, "error": {"code": code, "message": message}})


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryReply:
    """A reply, read: its result, or its error's code and message."""

    ok: bool
    result: Any = None
    code: str | None = None
    message: str | None = None
    #: the reply as read
    body: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, data: bytes) -> QueryReply:
        """A reply's bytes, read; :class:`~reconciler.core.messages.fields.MessageError`
        when they are not a JSON object."""
        body = json_object(data, "the reply")
        if body.get("ok") is True:
            return cls(ok=True, result=body.get("result"), body=body)
        error = body.get("error")
        if not isinstance(error, dict):
            error = {}
        code, message = error.get("code"), error.get("message")
        return cls(
            ok=False,
            code=code if isinstance(code, str) else None,
            message=message if isinstance(message, str) else None,
            body=body,
        )
