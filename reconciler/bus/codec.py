"""Input decoding (subject + bytes → typed input) and dead letters (docs/interface.md,
"Dead letters").

Rules:

- :func:`decode` never raises for any input: it returns :class:`Decoded` or
  :class:`BadInput` with one of the contract's dead-letter reasons, checked in this order:

  1. ``too-large``: more than 1 MiB (1,048,576 bytes);
  2. ``decode``: not UTF-8 JSON, or not a JSON object;
  3. ``schema``: a subject that is not ``<prefix>.in.host.<host>.<kind>``,
     ``<prefix>.in.config.<kind>.<name>`` or ``<prefix>.in.cmd.<verb>`` with a known kind or
     verb and tokens of ``[A-Za-z0-9_-]{1,128}``; or a payload that fails its JSON Schema
     (``schemas/in/<kind>.json``); the error names the failing field's path;
  4. ``domain``: :func:`reconciler.core.inputs.from_payload` refused it (a subject token
     that disagrees with the payload, a repeated GPU index…).

- Validators are compiled once per schema directory, on first use (or by :func:`preload`
  at start-up); a missing or broken schema directory raises
  :class:`~reconciler.bus.schemas.SchemaLoadError` — a deployment error, never bad input.
- :func:`dead_letter` builds what to publish for a bad input: the subject
  ``<prefix>.out.dlq.<reason>``, the ``Nats-Msg-Id`` ``dlq:<stream_seq>`` and the payload
  ``{v, subject, stream_seq, error, payload_b64}``, the original payload cut at 64 KiB.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import jsonschema_rs
import orjson

from reconciler.bus.schemas import SchemaSet, input_schema_path, load
from reconciler.core.frozen import fast_init
from reconciler.core.inputs import KINDS, DomainError, Input, from_payload
from reconciler.core.state import Output

__all__ = [
    "DLQ_PAYLOAD_CUT",
    "MAX_PAYLOAD_BYTES",
    "REASONS",
    "BadInput",
    "Decoded",
    "Decoder",
    "Reason",
    "dead_letter",
    "dead_letter_output",
    "decode",
    "preload",
]

MAX_PAYLOAD_BYTES: Final = 1_048_576
DLQ_PAYLOAD_CUT: Final = 65_536
#: error texts are clipped to this many characters (a schema error may quote the payload)
MAX_ERROR_CHARS: Final = 1_024

Reason = Literal["decode", "schema", "too-large", "domain"]
REASONS: Final[tuple[Reason, ...]] = ("decode", "schema", "too-large", "domain")

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_JSON_TYPE = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_ROUTE_CACHE_MAX = 16_384


@fast_init
@dataclass(frozen=True, slots=True)
class Decoded:
    """A good input: its kind (``"host.snapshot"``, ``"cmd.admit"``…) and its typed value."""

    kind: str
    input: Input


@fast_init
@dataclass(frozen=True, slots=True)
class BadInput:
    """A bad input: the dead-letter reason and a sentence that says what is wrong."""

    reason: Reason
    error: str


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _field_path(parts: list[str | int]) -> str:
    """``["gpus", 0, "index"]`` → ``gpus[0].index``; odd keys are quoted: ``config["user.x"]``."""
    out: list[str] = []
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _PLAIN_KEY.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{orjson.dumps(part).decode()}]")
    return "".join(out)


def _schema_error(exc: jsonschema_rs.ValidationError) -> str:
    path = _field_path(exc.instance_path)
    return _clip(f"{path}: {exc.message}" if path else exc.message)


# A resolved subject: (input kind, its name token or None for commands, its validator).
_Route = tuple[str, str | None, jsonschema_rs.Validator]


class Decoder:
    """Decodes input messages against one schema directory's compiled validators."""

    __slots__ = ("_routes", "_validators")

    def __init__(
        self, *, schemas_dir: Path | None = None, schemas: SchemaSet | None = None
    ) -> None:
        found = schemas if schemas is not None else load(schemas_dir)
        self._validators: dict[str, jsonschema_rs.Validator] = {
            kind: found.validator(input_schema_path(kind)) for kind in KINDS
        }
        self._routes: dict[tuple[str, str], _Route] = {}

    def decode(self, subject: str, data: bytes, *, prefix: str = "rc") -> Decoded | BadInput:
        """Decode one input message; see the module's rules. Never raises."""
        if len(data) > MAX_PAYLOAD_BYTES:
            return BadInput(
                "too-large", f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES} bytes"
            )
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return BadInput("decode", _clip(f"not UTF-8 JSON: {exc}"))
        if type(payload) is not dict:
            name = _JSON_TYPE.get(type(payload), "null")
            return BadInput("decode", f"payload is a JSON {name}, not an object")
        route = self._routes.get((prefix, subject))
        if route is None:
            resolved = self._route(subject, prefix)
            if isinstance(resolved, str):
                return BadInput("schema", resolved)
            route = resolved
        kind, token, validator = route
        try:
            validator.validate(payload)
        except jsonschema_rs.ValidationError as exc:
            return BadInput("schema", _schema_error(exc))
        except Exception as exc:  # a validator failure is still only this message's problem
            return BadInput("schema", _clip(f"cannot validate: {type(exc).__name__}: {exc}"))
        try:
            return Decoded(kind, from_payload(kind, payload, subject_token=token))
        except DomainError as exc:
            return BadInput("domain", _clip(str(exc)))
        except Exception as exc:  # bad input never stops the line
            return BadInput("domain", _clip(f"{kind}: unexpected {type(exc).__name__}: {exc}"))

    def _route(self, subject: str, prefix: str) -> _Route | str:
        """Resolve a subject; good routes are cached (bounded: the cache restarts when full)."""
        route = self._resolve(subject, prefix)
        if not isinstance(route, str):
            if len(self._routes) >= _ROUTE_CACHE_MAX:
                self._routes.clear()
            self._routes[(prefix, subject)] = route
        return route

    def _resolve(self, subject: str, prefix: str) -> _Route | str:
        head = f"{prefix}.in."
        shown = _clip(repr(subject))
        if not subject.startswith(head):
            return f"subject {shown} is not under {head}"
        parts = subject[len(head) :].split(".")
        token: str | None
        if len(parts) == 2 and parts[0] == "cmd":
            kind, token = f"cmd.{parts[1]}", None
        elif len(parts) == 3 and parts[0] == "host":
            kind, token = f"host.{parts[2]}", parts[1]
        elif len(parts) == 3 and parts[0] == "config":
            kind, token = f"config.{parts[1]}", parts[2]
        else:
            return (
                f"subject {shown} is not {head}host.<host>.<kind>, "
                f"{head}config.<kind>.<name> or {head}cmd.<verb>"
            )
        validator = self._validators.get(kind)
        if validator is None:
            return f"subject {shown}: unknown input kind {kind!r}"
        if token is not None and not _TOKEN.fullmatch(token):
            return f"subject {shown}: {token!r} is not a subject token of [A-Za-z0-9_-]{{1,128}}"
        return kind, token, validator


_default: Decoder | None = None


def preload(*, schemas_dir: Path | None = None) -> Decoder:
    """Compile the default decoder's validators now (at start-up), and return it."""
    global _default
    _default = Decoder(schemas_dir=schemas_dir)
    return _default


def decode(subject: str, data: bytes, *, prefix: str = "rc") -> Decoded | BadInput:
    """Decode one input message with the default decoder (``$RC_SCHEMAS_DIR`` or ``schemas/``)."""
    decoder = _default if _default is not None else preload()
    return decoder.decode(subject, data, prefix=prefix)


def dead_letter_output(
    subject: str, stream_seq: int, data: bytes, reason: Reason, error: str
) -> Output:
    """The output (subject without prefix, as the fold's) that dead-letters one input."""
    if reason not in REASONS:
        raise ValueError(f"unknown dead-letter reason {reason!r}")
    payload: dict[str, Any] = {
        "v": 1,
        "subject": subject,
        "stream_seq": stream_seq,
        "error": _clip(error),
        "payload_b64": base64.b64encode(data[:DLQ_PAYLOAD_CUT]).decode("ascii"),
    }
    return Output(
        f"out.dlq.{reason}",
        f"dlq:{stream_seq}",
        orjson.dumps(payload, option=orjson.OPT_SORT_KEYS),
    )


def dead_letter(
    subject: str,
    stream_seq: int,
    data: bytes,
    reason: Reason,
    error: str,
    *,
    prefix: str = "rc",
) -> tuple[str, str, bytes]:
    """The ``(subject, Nats-Msg-Id, payload)`` that dead-letters one input message."""
    out = dead_letter_output(subject, stream_seq, data, reason, error)
    assert out.msg_id is not None
    return f"{prefix}.{out.subject}", out.msg_id, out.payload
