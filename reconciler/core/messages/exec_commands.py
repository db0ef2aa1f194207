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
need not know it), and one read without it creates a virtual machine. The executor
parses them after their JSON Schema (``schemas/out/exec.<verb>.json``) and adds what it
does with them (:mod:`reconciler.executor.commands`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Self

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
from reconciler.core.messages.ids import create_command_id, delete_command_id
from reconciler.core.messages.subjects import UNPREFIXED, ExecVerb
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
    "parse_exec_command",
]

DeleteReason = Literal["preempted", "drained", "orphan"]
DELETE_REASONS: Final[tuple[DeleteReason, ...]] = ("preempted", "drained", "orphan")
#: what a create command without ``instance_type`` creates
DEFAULT_INSTANCE_TYPE: Final = "virtual-machine"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuAssignment:
    """One GPU of a create command: the fold's index and the host's PCI address."""

    index: int
    pci_address: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandBase:
    """What every executor command names: itself, the instance, and its lease."""

    command_id: str
    host: str
    instance: str
    project: str
    lease_id: str

    verb: ClassVar[ExecVerb]

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": 1,
            "command_id": self.command_id,
            "host": self.host,
            "instance": self.instance,
            "project": self.project,
            "lease_id": self.lease_id,
        }

    def encode(self) -> bytes:
        return encode(self.as_dict())

    def output(self) -> Output:
        """The output that publishes it; its message id is its command id."""
        return Output(UNPREFIXED.exec_command(self.host, self.verb), self.command_id, self.encode())


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteCommand(CommandBase):
    """Destroy the lease's VM; a missing one is done."""

    reason: str

    verb: ClassVar[Literal["delete"]] = "delete"

    @classmethod
    def for_lease(
        cls, *, lease_id: str, host: str, instance: str, project: str, reason: DeleteReason
    ) -> Self:
        """The delete of a lease's VM, where it runs, with its command id."""
        return cls(
            command_id=delete_command_id(lease_id, reason),
            host=host,
            instance=instance,
            project=project,
            lease_id=lease_id,
            reason=reason,
        )

    def as_dict(self) -> dict[str, Any]:
        return {**CommandBase.as_dict(self), "reason": self.reason}

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


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateCommand(CommandBase):
    """Create and start a warm VM for a lease."""

    pool: str
    image: str
    profiles: tuple[str, ...]
    demand: Resources
    gpus: tuple[GpuAssignment, ...]
    instance_type: str = DEFAULT_INSTANCE_TYPE

    verb: ClassVar[Literal["create"]] = "create"

    @classmethod
    def for_lease(
        cls,
        *,
        lease_id: str,
        host: str,
        instance: str,
        project: str,
        pool: str,
        image: str,
        profiles: tuple[str, ...],
        demand: Resources,
        gpus: tuple[GpuAssignment, ...],
        instance_type: str,
    ) -> Self:
        """The create of a warm lease's VM, with its command id."""
        return cls(
            command_id=create_command_id(lease_id),
            host=host,
            instance=instance,
            project=project,
            lease_id=lease_id,
            pool=pool,
            image=image,
            profiles=profiles,
            demand=demand,
            gpus=gpus,
            instance_type=instance_type,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **CommandBase.as_dict(self),
            "pool": self.pool,
            "image": self.image,
            "profiles": list(self.profiles),
            "demand": self.demand.as_dict(),
            "gpus": [{"index": g.index, "pci_address": g.pci_address} for g in self.gpus],
            "instance_type": self.instance_type,
        }

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
