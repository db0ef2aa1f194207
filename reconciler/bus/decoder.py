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

- Config is refused by name, not dead-lettered, where it is only its content that is
  wrong: a config input (``in.config.<kind>.<name>``) whose only schema errors are fields
  its schema does not name decodes to a :class:`~reconciler.core.inputs.RefusedConfig`,
  which the fold rejects on ``out.config.rejected.<kind>.<name>``; each item of an
  ``apply-config`` command is checked against its own kind's schema, and an item that
  fails it is carried with its error, so that the fold refuses the change naming it.

- A :class:`Decoder` compiles the validators of one schema directory when it is made; a
  missing or broken schema directory raises
  :class:`~reconciler.bus.schemas.SchemaLoadError` — a deployment error, never bad input.
- :func:`dead_letter_output` builds what to publish for a bad input: a
  :class:`~reconciler.core.messages.DeadLetter` on ``<prefix>.out.dlq.<reason>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson

from reconciler.bus.schemas import SchemaSet, input_schema_path, load
from reconciler.core.frozen import fast_init
from reconciler.core.inputs import (
    CONFIG_NAME_FIELDS,
    KINDS,
    DomainError,
    Input,
    RefusedConfig,
    apply_config,
    from_payload,
)
from reconciler.core.messages import (
    DEFAULT_PREFIX,
    MAX_PAYLOAD_BYTES,
    DeadLetter,
    DeadLetterReason,
    Output,
    SubjectError,
    Subjects,
)
from reconciler.core.messages import clip as _clip

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "BadInput",
    "Decoded",
    "Decoder",
    "dead_letter_output",
]

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_JSON_TYPE = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_ROUTE_CACHE_MAX = 16_384
_CONFIG_KINDS = frozenset(k for k in KINDS if k.startswith("config."))
_APPLY_CONFIG = "cmd.apply-config"


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

    reason: DeadLetterReason
    error: str


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


_UNKNOWN_FIELD = (
    jsonschema_rs.ValidationErrorKind.AdditionalProperties,
    jsonschema_rs.ValidationErrorKind.UnevaluatedProperties,
)


def _is_unknown_field(exc: jsonschema_rs.ValidationError) -> bool:
    return isinstance(exc.kind, _UNKNOWN_FIELD)


def _schema_error(exc: jsonschema_rs.ValidationError) -> str:
    path = _field_path(exc.instance_path)
    if _is_unknown_field(exc):
        names = ", ".join(repr(n) for n in getattr(exc.kind, "unexpected", ()))
        where = f" in {path}" if path else ""
        return _clip(f"unknown field {names}{where}: the schema names no such field")
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

    def decode(
        self, subject: str, data: bytes, *, prefix: str = DEFAULT_PREFIX
    ) -> Decoded | BadInput:
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
            if kind in _CONFIG_KINDS:
                return self._refused_config(kind, payload, token, validator, exc)
            return BadInput("schema", _schema_error(exc))
        except Exception as exc:  # a validator failure is still only this message's problem
            return BadInput("schema", _clip(f"cannot validate: {type(exc).__name__}: {exc}"))
        if kind == _APPLY_CONFIG:
            return self._apply_config(payload)
        built = _typed(kind, payload, token)
        if isinstance(built, str):
            return BadInput("domain", built)
        return Decoded(kind, built)

    def _refused_config(
        self,
        kind: str,
        payload: dict[str, Any],
        token: str | None,
        validator: jsonschema_rs.Validator,
        first: jsonschema_rs.ValidationError,
    ) -> Decoded | BadInput:
        """A config input that failed its schema: refused by name when its only errors
        are unknown fields (and its subject agrees with it), else dead-lettered."""
        errors = list(validator.iter_errors(payload))
        if not errors or not all(_is_unknown_field(e) for e in errors):
            return BadInput("schema", _schema_error(first))
        word = kind.removeprefix("config.")
        named = payload.get(CONFIG_NAME_FIELDS[word])
        if token is None or named != token:
            return BadInput("domain", f"subject names {token!r} but payload field names {named!r}")
        error = "; ".join(_schema_error(e) for e in errors)
        return Decoded(kind, RefusedConfig(word, token, _clip(f"{word} {token!r}: {error}")))

    def item_errors(self, payload: dict[str, Any]) -> dict[int, str]:
        """The items of an ``apply-config`` payload (its envelope valid) that fail their
        own kind's schema, by index, with the sentence that says why."""
        found: dict[int, str] = {}
        for index, item in enumerate(payload.get("items") or ()):
            validator = self._validators[f"config.{item['kind']}"]
            errors = list(validator.iter_errors(item["payload"]))
            if errors:
                found[index] = _clip("; ".join(_schema_error(e) for e in errors[:4]))
        return found

    def _apply_config(self, payload: dict[str, Any]) -> Decoded | BadInput:
        try:
            return Decoded(_APPLY_CONFIG, apply_config(payload, self.item_errors(payload)))
        except Exception as exc:  # bad input never stops the line
            return BadInput("domain", _clip(f"{_APPLY_CONFIG}: {type(exc).__name__}: {exc}"))

    def problems(self, kind: str, payload: Any, *, subject_token: str | None = None) -> list[str]:
        """Every reason ``payload`` is not a valid input of ``kind`` (none: it is one),
        for a person to read before anything is published: each schema error, its field
        as a JSON pointer path (``flavor/cpu``), else what the fold's own checks refuse
        (what :meth:`decode` would dead-letter)."""
        validator = self._validators.get(kind)
        if validator is None:
            return [f"unknown input kind {kind!r}"]
        found = [
            f"{'/'.join(str(p) for p in error.instance_path) or '(payload)'}: {error.message}"
            for error in validator.iter_errors(payload)
            if not _is_unknown_field(error)  # SchemaSet.unknown_fields says it better
        ]
        if found:
            return found
        if kind == _APPLY_CONFIG:
            change = apply_config(payload, self.item_errors(payload))
            return [
                f"items/{index} ({item.kind} {item.name!r}): {item.error}"
                for index, item in enumerate(change.items)
                if item.error is not None
            ]
        built = _typed(kind, payload, subject_token)
        return [built] if isinstance(built, str) else []

    def _route(self, subject: str, prefix: str) -> _Route | str:
        """Resolve a subject; good routes are cached (bounded: the cache restarts when full)."""
        route = self._resolve(subject, prefix)
        if not isinstance(route, str):
            if len(self._routes) >= _ROUTE_CACHE_MAX:
                self._routes.clear()
            self._routes[(prefix, subject)] = route
        return route

    def _resolve(self, subject: str, prefix: str) -> _Route | str:
        parsed = Subjects(prefix).parse_input(subject)
        if isinstance(parsed, SubjectError):
            return parsed.error
        return parsed.kind, parsed.token, self._validators[parsed.kind]


def _typed(kind: str, payload: Any, token: str | None) -> Input | str:
    """The typed input of a schema-valid payload, or why the fold refuses it."""
    try:
        return from_payload(kind, payload, subject_token=token)
    except DomainError as exc:
        return _clip(str(exc))
    except Exception as exc:  # bad input never stops the line
        return _clip(f"{kind}: unexpected {type(exc).__name__}: {exc}")


def dead_letter_output(
    subject: str, stream_seq: int, data: bytes, reason: DeadLetterReason, error: str
) -> Output:
    """The output (subject without prefix, as the fold's) that dead-letters one input."""
    letter = DeadLetter.of(
        reason=reason, subject=subject, stream_seq=stream_seq, error=error, data=data
    )
    return letter.output()
