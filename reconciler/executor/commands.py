"""The executor's commands: parsed and checked before anything touches Incus, and failures
sorted by what to do next.

Rules:

- :meth:`CommandParser.parse` never raises for any message. It returns a
  :class:`CreateCommand` or :class:`DeleteCommand`, or a :class:`Refusal` with a stable
  reason code, checked in this order: ``too-large`` (over 1 MiB), ``decode`` (not a UTF-8
  JSON object), ``subject`` (not ``<prefix>.out.exec.<host>.create|delete``),
  ``schema`` (fails ``schemas/out/exec.<verb>.json``), ``wrong-host`` (the subject's or
  the payload's host is not the host this consumer manages), ``invalid-name`` (the
  instance is not a valid Incus name: 1-63 of ``[A-Za-z0-9-]``, no leading or trailing
  ``-``, not all digits; checked here as well as in the schema, so a laxer schema never
  lets one through). A refused command is never sent to Incus.
- :func:`classify` sorts an Incus failure by what the caller should do, after kopf's
  temporary/permanent split: ``FOREVER`` (the host is unreachable, an operation timed
  out, the instance is busy with another operation: retry with backoff for as long as it
  takes), ``LIMITED`` (an operation failed for a reason that may pass, e.g. an image
  that could not be unpacked: retry with backoff a bounded number of times) and ``NEVER``
  (Incus refused the request itself: a bad image, an unknown profile or project, an
  invalid request, a name taken by another lease: retrying sends the same request and
  gets the same answer).
- Pure functions and frozen dataclasses; no I/O.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jsonschema_rs
import orjson

from reconciler.bus.schemas import SchemaSet, load
from reconciler.core import messages
from reconciler.core.messages import EXEC_VERBS, ExecSubject, ExecVerb, Subjects
from reconciler.incus.errors import (
    ApiRejected,
    CreateRefused,
    IncusError,
    IncusUnavailable,
    InstanceExists,
    InstanceNameTaken,
    InstanceRunning,
    OperationFailed,
    OperationLost,
    OperationTimedOut,
)
from reconciler.incus.views import InstanceSpec

__all__ = [
    "MAX_COMMAND_BYTES",
    "Command",
    "CommandParser",
    "CreateCommand",
    "DeleteCommand",
    "Failure",
    "Refusal",
    "Retry",
    "classify",
    "instance_key",
    "invalid_instance_name",
]

MAX_COMMAND_BYTES: Final = 1_048_576
_MAX_ERROR_CHARS: Final = 512
_NAME_CHARS = re.compile(r"[A-Za-z0-9-]+")
#: the kind tag of every VM the executor creates: warm pools are its only creations
WARM: Final = "warm"


def invalid_instance_name(name: str) -> str | None:
    """Why ``name`` is not a valid Incus instance name, or ``None`` when it is one."""
    if not 1 <= len(name) <= 63:
        return "must be 1-63 characters long"
    if not _NAME_CHARS.fullmatch(name):
        return "may only contain letters, digits and '-'"
    if name.startswith("-") or name.endswith("-"):
        return "must not start or end with '-'"
    if name.isdigit():
        return "must not be all digits"
    return None


def instance_key(host: str, project: str, instance: str) -> str:
    """The work-queue key of one instance: ``host/project/instance`` (none holds a '/')."""
    return f"{host}/{project}/{instance}"


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 1] + "…"


class _Keyed(messages.CommandBase):
    """What the executor adds to every command: its work-queue key and log fields."""

    __slots__ = ()

    @property
    def key(self) -> str:
        return instance_key(self.host, self.project, self.instance)

    def log_fields(self) -> dict[str, Any]:
        return {
            "command_id": self.command_id,
            "verb": self.verb,
            "host": self.host,
            "project": self.project,
            "instance": self.instance,
            "lease_id": self.lease_id,
        }


class DeleteCommand(_Keyed, messages.DeleteCommand):
    """``<prefix>.out.exec.<host>.delete``: destroy the lease's VM; missing is done."""

    __slots__ = ()

    def log_fields(self) -> dict[str, Any]:
        return {**super().log_fields(), "reason": self.reason}


class CreateCommand(_Keyed, messages.CreateCommand):
    """``<prefix>.out.exec.<host>.create``: create and start a warm VM for a lease."""

    __slots__ = ()

    def spec(self, *, storage_pool: str = "default") -> InstanceSpec:
        """The instance to create: the pool's image, profiles and instance type, the demand
        as limits and root size on ``storage_pool``, GPUs by PCI address (in index order),
        the lease tags."""
        return InstanceSpec.for_lease(
            name=self.instance,
            image=self.image,
            lease_id=self.lease_id,
            pool=self.pool,
            kind=WARM,
            project=self.project,
            profiles=self.profiles,
            demand=self.demand,
            gpu_pci=tuple(g.pci_address for g in sorted(self.gpus, key=lambda g: g.index)),
            storage_pool=storage_pool,
            instance_type=self.instance_type,
        )

    def log_fields(self) -> dict[str, Any]:
        return {**super().log_fields(), "pool": self.pool, "instance_type": self.instance_type}


Command = CreateCommand | DeleteCommand


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A command refused before Incus: the reason code, a sentence, and what is known."""

    reason: str
    error: str
    command_id: str | None = None
    instance: str | None = None

    def log_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"refusal": self.reason, "error": self.error}
        if self.command_id is not None:
            fields["command_id"] = self.command_id
        if self.instance is not None:
            fields["instance"] = self.instance
        return fields


class CommandParser:
    """Parses exec commands against the contract's compiled JSON Schemas."""

    def __init__(self, *, schemas_dir: Path | None = None, schemas: SchemaSet | None = None):
        found = schemas if schemas is not None else load(schemas_dir)
        self._validators = {verb: found.validator(f"out/exec.{verb}.json") for verb in EXEC_VERBS}

    def parse(self, subject: str, data: bytes, *, prefix: str, host: str) -> Command | Refusal:
        """One message of ``host``'s consumer as a command, or why it is refused."""
        if len(data) > MAX_COMMAND_BYTES:
            return Refusal(reason="too-large", error=f"payload of {len(data)} bytes")
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return Refusal(reason="decode", error=_clip(f"not UTF-8 JSON: {exc}"))
        if type(payload) is not dict:
            return Refusal(reason="decode", error="payload is not a JSON object")
        command_id = payload.get("command_id")
        instance = payload.get("instance")
        known = {
            "command_id": command_id if isinstance(command_id, str) else None,
            "instance": instance if isinstance(instance, str) else None,
        }
        subjects = Subjects(prefix)
        route = subjects.parse_output(subject)
        if not isinstance(route, ExecSubject):
            expected = subjects.exec_command("<host>", "create|delete")
            return Refusal(
                reason="subject", error=_clip(f"subject {subject!r} is not {expected}"), **known
            )
        subject_host, verb = route.host, route.verb
        try:
            self._validators[verb].validate(payload)
        except jsonschema_rs.ValidationError as exc:
            where = ".".join(str(p) for p in exc.instance_path)
            error = f"{where}: {exc.message}" if where else exc.message
            return Refusal(reason="schema", error=_clip(error), **known)
        if subject_host != host or payload["host"] != host:
            return Refusal(
                reason="wrong-host",
                error=_clip(
                    f"command for host {payload['host']!r} on subject {subject!r} "
                    f"reached the consumer of host {host!r}"
                ),
                **known,
            )
        problem = invalid_instance_name(payload["instance"])
        if problem is not None:
            return Refusal(
                reason="invalid-name",
                error=_clip(f"instance name {payload['instance']!r} {problem}"),
                **known,
            )
        return _command(verb, payload)


def _command(verb: ExecVerb, p: dict[str, Any]) -> Command:
    if verb == "delete":
        return DeleteCommand.from_dict(p)
    return CreateCommand.from_dict(p)


# ---------------------------------------------------------------------------- failures


class Retry(enum.Enum):
    """What to do after a failure."""

    FOREVER = "forever"  # temporary: retry with backoff, however long it takes
    LIMITED = "limited"  # may pass: retry with backoff up to the attempt limit
    NEVER = "never"  # a definite refusal: record it and terminate the command


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A sorted failure: what to do, a stable reason code and Incus's words."""

    retry: Retry
    reason: str
    error: str


#: texts of a request Incus will refuse again however often it is sent
_DEFINITE = re.compile(
    r"doesn't exist|does not exist|not found|Invalid|invalid|Unknown|"
    r"Failed to detect requested GPU device|must be|not supported|No such",
)
_BUSY = "Instance is busy"


def classify(exc: IncusError) -> Failure:
    """Sort an Incus failure by what to do next (see the module's rules)."""
    error = _clip(exc.message)
    if isinstance(exc, IncusUnavailable):
        return Failure(retry=Retry.FOREVER, reason="unavailable", error=error)
    if isinstance(exc, OperationTimedOut):
        return Failure(retry=Retry.FOREVER, reason="timed-out", error=error)
    if isinstance(exc, OperationLost):  # the next attempt looks at the instance again
        return Failure(retry=Retry.LIMITED, reason="operation-lost", error=error)
    if isinstance(exc, InstanceNameTaken):
        return Failure(retry=Retry.NEVER, reason="name-taken", error=error)
    if isinstance(exc, CreateRefused):
        return Failure(retry=Retry.NEVER, reason="refused", error=error)
    if isinstance(exc, OperationFailed):
        if _BUSY in exc.err:
            return Failure(retry=Retry.FOREVER, reason="busy", error=error)
        if _DEFINITE.search(exc.err):
            return Failure(retry=Retry.NEVER, reason="refused", error=error)
        return Failure(retry=Retry.LIMITED, reason="operation-failed", error=error)
    if isinstance(exc, InstanceExists):
        return Failure(retry=Retry.NEVER, reason="name-taken", error=error)
    if isinstance(exc, InstanceRunning):  # restarted between our forced stop and delete
        return Failure(retry=Retry.LIMITED, reason="running", error=error)
    if isinstance(exc, ApiRejected):
        if exc.status in (401, 403):  # trust not (yet) set up: an operator can fix it
            return Failure(retry=Retry.FOREVER, reason="forbidden", error=error)
        if exc.status in (502, 503, 504):
            return Failure(retry=Retry.FOREVER, reason="unavailable", error=error)
        if 400 <= exc.status < 500 or _DEFINITE.search(exc.message):
            return Failure(retry=Retry.NEVER, reason="refused", error=error)
        return Failure(retry=Retry.LIMITED, reason="server-error", error=error)
    return Failure(retry=Retry.LIMITED, reason="incus-error", error=error)
