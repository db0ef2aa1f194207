"""The executor's commands (docs/interface.md, "Other outputs"): built and read.

``out.exec.<host>.delete``, ``Nats-Msg-Id`` its ``command_id``
(``delete:<lease_id>:<reason>``)::

    {v, command_id, host, instance, project, lease_id, reason}

``out.exec.<host>.create`` (warm top-ups), ``Nats-Msg-Id`` its ``command_id``
(``create:<lease_id>``)::

    {v, command_id, host, instance, project, lease_id, pool, image, profiles, demand,
     gpus:[{index, pci_address}], instance_type}

Rules: sorted-key JSON (:func:`~reconciler.core.messages.envelope.encode`); a create
always names its ``instance_type`` (the pool's, its default spelled out, so the executor
need not know it), and one read without it creates a virtual machine. The fold writes
them through the positional :func:`delete_payload`, :func:`create_payload` and
:func:`exec_output`, without a typed object on the way; :class:`CreateCommand` and
:class:`DeleteCommand` encode through the same functions. The executor parses them
after their JSON Schema (``schemas/out/exec.<verb>.json``) and adds what it does with
them (:mod:`reconciler.executor.commands`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Self

from reconciler.core.frozen import fast_init
from reconciler.core.messages.envelope import Output, encode
from reconciler.core.messages.fields import (
    MessageError,
    field_int,
    field_object,
    field_objects,
    field_str,
    field_strs,
    json_object,
)
from reconciler.core.messages.subjects import ExecVerb
from reconciler.core.model import Resources

__all__ = [
    "DEFAULT_INSTANCE_TYPE",
    "DELETE_REASONS",
    "CommandBase",
    "CreateCommand",
    "DeleteCommand",
    "DeleteReason",
    "ExecCommand",
    "GpuAssignment",
    "create_payload",
    "delete_payload",
    "exec_output",
    "parse_exec_command",
]

DeleteReason = Literal["preempted", "drained", "orphan"]
DELETE_REASONS: Final[tuple[DeleteReason, ...]] = ("preempted", "drained", "orphan")
#: what a create command without ``instance_type`` creates
DEFAULT_INSTANCE_TYPE: Final = "virtual-machine"


def delete_payload(
    command_id: str, host: str, instance: str, project: str, lease_id: str, reason: str
) -> dict[str, Any]:
    """A delete command's JSON object (positional, as the fold writes one)."""
    return {
        "v": 1,
        "command_id": command_id,
        "host": host,
        "instance": instance,
        "project": project,
        "lease_id": lease_id,
        "reason": reason,
    }


def create_payload(
    command_id: str,
    host: str,
    instance: str,
    project: str,
    lease_id: str,
    pool: str,
    image: str,
    profiles: Iterable[str],
    demand: Resources,
    gpus: Iterable[tuple[int, str]],
    instance_type: str,
) -> dict[str, Any]:
    """A create command's JSON object; ``gpus`` as (index, PCI address) pairs."""
    return {
        "v": 1,
        "command_id": command_id,
        "host": host,
        "instance": instance,
        "project": project,
        "lease_id": lease_id,
        "pool": pool,
        "image": image,
        "profiles": list(profiles),
        "demand": demand.as_dict(),
        "gpus": [{"index": index, "pci_address": address} for index, address in gpus],
        "instance_type": instance_type,
    }


def exec_output(verb: ExecVerb, host: str, command_id: str, payload: dict[str, Any]) -> Output:
    """The output of an executor command: its message id is its command id."""
    # the subject spelled out: UNPREFIXED.exec_command(host, verb), without the call
    return Output(f"out.exec.{host}.{verb}", command_id, encode(payload))


@fast_init
@dataclass(frozen=True, slots=True)
class GpuAssignment:
    """One GPU of a create command: the fold's index and the host's PCI address."""

    index: int
    pci_address: str


@dataclass(frozen=True, slots=True)
class CommandBase:
    """What every executor command names: itself, the instance, and its lease."""

    command_id: str
    host: str
    instance: str
    project: str
    lease_id: str

    verb: ClassVar[ExecVerb]

    def as_dict(self) -> dict[str, Any]:
        """The JSON object it travels as."""
        raise NotImplementedError

    def encode(self) -> bytes:
        return encode(self.as_dict())

    def output(self) -> Output:
        """The output that publishes it; its message id is its command id."""
        return exec_output(self.verb, self.host, self.command_id, self.as_dict())


@fast_init
@dataclass(frozen=True, slots=True)
class DeleteCommand(CommandBase):
    """Destroy the lease's VM; a missing one is done."""

    reason: str

    verb: ClassVar[Literal["delete"]] = "delete"

    def as_dict(self) -> dict[str, Any]:
        return delete_payload(
            self.command_id, self.host, self.instance, self.project, self.lease_id, self.reason
        )

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Self:
        return cls(
            command_id=field_str(body, "command_id"),
            host=field_str(body, "host"),
            instance=field_str(body, "instance"),
            project=field_str(body, "project"),
            lease_id=field_str(body, "lease_id"),
            reason=field_str(body, "reason"),
        )


@fast_init
@dataclass(frozen=True, slots=True)
class CreateCommand(CommandBase):
    """Create and start a warm VM for a lease."""

    pool: str
    image: str
    profiles: tuple[str, ...]
    demand: Resources
    gpus: tuple[GpuAssignment, ...]
    instance_type: str = DEFAULT_INSTANCE_TYPE

    verb: ClassVar[Literal["create"]] = "create"

    def as_dict(self) -> dict[str, Any]:
        return create_payload(
            self.command_id,
            self.host,
            self.instance,
            self.project,
            self.lease_id,
            self.pool,
            self.image,
            self.profiles,
            self.demand,
            [(g.index, g.pci_address) for g in self.gpus],
            self.instance_type,
        )

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Self:
        demand = field_object(body, "demand")
        instance_type = body.get("instance_type", DEFAULT_INSTANCE_TYPE)
        if not isinstance(instance_type, str):
            raise MessageError("field 'instance_type' is not a string")
        return cls(
            command_id=field_str(body, "command_id"),
            host=field_str(body, "host"),
            instance=field_str(body, "instance"),
            project=field_str(body, "project"),
            lease_id=field_str(body, "lease_id"),
            pool=field_str(body, "pool"),
            image=field_str(body, "image"),
            profiles=tuple(field_strs(body, "profiles")),
            demand=Resources(
                cpu=field_int(demand, "cpu"),
                memory_mib=field_int(demand, "memory_mib"),
                disk_gib=field_int(demand, "disk_gib"),
            ),
            gpus=tuple(
                GpuAssignment(index=field_int(g, "index"), pci_address=field_str(g, "pci_address"))
                for g in field_objects(body, "gpus")
            ),
            instance_type=instance_type,
        )


ExecCommand = CreateCommand | DeleteCommand


def parse_exec_command(verb: str, data: bytes) -> ExecCommand:
    """An executor command of ``verb`` (``create`` or ``delete``, its subject's last
    token) from its payload; :class:`~reconciler.core.messages.fields.MessageError`
    when it is not one."""
    body = json_object(data, f"an exec {verb} command")
    if verb == "delete":
        return DeleteCommand.from_dict(body)
    if verb == "create":
        return CreateCommand.from_dict(body)
    raise MessageError(f"no executor command {verb!r}")
