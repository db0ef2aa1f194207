"""One simulated Incus host: its instances, their state machine, faults and controls.

Rules:

- **One loop.** A :class:`SimHost` lives on one asyncio event loop; its methods must be
  called on that loop (from another thread, go through
  :meth:`~reconciler.incus.simulator.fleet.SimulatorThread.call`).
- **Incus's checks, Incus's words.** Synchronous refusals raise
  :class:`~reconciler.incus.simulator.wire.ApiError` with Incus's status and text
  ("Instance not found", "Instance is running", "Requested profile \"x\" doesn't
  exist", …); refusals inside an operation raise
  :class:`~reconciler.incus.simulator.operations.OperationFailure` ("The instance is
  already stopped", "The instance is already running", …).
- **VM lifecycle.** Create (operation) → Stopped 102 and ``instance-created``. Start →
  Running 103 and ``instance-started``; after the boot delay the guest agent connects
  (``instance-agent-started``, on 7.x only: Incus 6.0 has no such action) and the guest
  reports ready with ``PATCH /1.0 {"state":"Ready"}`` on /dev/incus/sock: Ready 113
  (Incus shows Ready while ``volatile.last_state.ready`` is true) and ``instance-ready``
  without requestor. Refusals that Incus 6.0 makes inside the create operation (taken
  name, missing image, image of the other type, no VM support) fail the operation and
  emit no lifecycle event; what differs between releases is in :mod:`.versions`.
  A forced stop → Stopped and ``instance-stopped``; a graceful stop
  (or a guest power-off) → ``instance-shutdown``. Freeze → Frozen 110
  (``instance-paused``), unfreeze → back (``instance-resumed``). Delete → gone and
  ``instance-deleted``; refused while the VM runs (any status but Stopped and Error).
- **One action at a time per instance**, as Incus's operation locks: a second one fails
  inside its operation with ``Instance is busy running a "<action>" operation``.
- **Faults** are one-shot per instance name (the next create/start/boot of that name) or
  counted (the next N of any name) or a rate (a seeded random draw, so runs repeat).
- **Controls** (``remove_instance``, ``add_instance``, ``set_status``, ``guest_ready``,
  ``guest_poweroff``,
  ``fail_next_*``, ``set_boot_delay``, ``set_resources``, ``drop_event_streams``) are the
  test and demo surface, not Incus API; ``silent=True`` changes state without an event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.incus.simulator.events import (
    EventHub,
    instance_source,
    lifecycle_event,
    project_event,
)
from reconciler.incus.simulator.operations import Operation, OperationFailure, Operations
from reconciler.incus.simulator.shapes import GpuShape, HostShape, HostTls, host_tls
from reconciler.incus.simulator.versions import DEFAULT_VERSION, IncusVersion
from reconciler.incus.simulator.wire import ZERO_TIME, ApiError, StatusCode, rfc3339nano

__all__ = ["FaultKind", "Profile", "SimHost", "SimInstance", "Timing", "validate_instance_name"]

FaultKind = str  # "create" | "start" | "boot"
FAULT_KINDS = ("create", "start", "boot")

#: statuses in which Incus considers a VM running (``isRunningStatusCode``)
RUNNING_STATUSES = frozenset({StatusCode.RUNNING, StatusCode.READY, StatusCode.FROZEN})
STATUS_BY_NAME = {
    s.label: s
    for s in (
        StatusCode.RUNNING,
        StatusCode.STOPPED,
        StatusCode.FROZEN,
        StatusCode.ERROR,
        StatusCode.READY,
    )
}
STATE_ACTIONS = {
    "start": "Starting instance",
    "stop": "Stopping instance",
    "restart": "Restarting instance",
    "freeze": "Freezing instance",
    "unfreeze": "Unfreezing instance",
}
_NAME_CHARS = re.compile(r"^[A-Za-z0-9-]+$")


def _unpack_progress() -> dict[str, Any]:
    """A create-from-image operation's final ``metadata``: the unpack progress."""
    return {
        "create_instance_from_image_unpack_progress": "Unpacking image: 100% (100.00MB/s)",
        "progress": {
            "percent": "100",
            "speed": "100000000",
            "stage": "create_instance_from_image_unpack",
        },
    }


def _missing_profile(name: str, *, status: int) -> ApiError:
    return ApiError(status, f'Requested profile "{name}" doesn\'t exist')


def validate_instance_name(name: str) -> None:
    """Incus's ``instance.ValidName`` (``validate.IsHostname``); raises a 400 ApiError."""
    problem = None
    if not 1 <= len(name) <= 63:
        problem = "Name must be 1-63 characters long"
    elif name.startswith("-"):
        problem = 'Name must not start with "-" character'
    elif name.endswith("-"):
        problem = 'Name must not end with "-" character'
    elif name.isdigit():
        problem = "Name cannot be a number"
    elif not _NAME_CHARS.match(name):
        problem = "Name can only contain alphanumeric and hyphen characters"
    if problem is not None:
        raise ApiError(400, f"Invalid instance name: {problem}")


@dataclass(kw_only=True)
class Timing:
    """How long simulated work takes, in seconds."""

    boot_delay_s: float = 2.0  # start → agent started (and ready)
    ready_delay_s: float = 0.0  # agent started → ready
    action_delay_s: float = 0.0  # create, start, forced stop, delete
    shutdown_delay_s: float = 0.0  # graceful stop
    report_ready: bool = True  # the guest reports Ready (113) after its agent starts


@dataclass
class Profile:
    name: str
    description: str = ""
    config: dict[str, str] = field(default_factory=dict)
    devices: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class Faults:
    counted: dict[FaultKind, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    rates: dict[FaultKind, float] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0.0))
    by_name: dict[FaultKind, set[str]] = field(
        default_factory=lambda: {k: set() for k in FAULT_KINDS}
    )
    messages: dict[FaultKind, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class SimInstance:
    """One instance as the host keeps it (rendered by :mod:`.render`)."""

    name: str
    project: str
    type: str = "virtual-machine"
    architecture: str = "x86_64"
    config: dict[str, str] = field(default_factory=dict)
    devices: dict[str, dict[str, str]] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=lambda: ["default"])
    description: str = ""
    ephemeral: bool = False
    created_at: str = field(default_factory=rfc3339nano)
    last_used_at: str = ZERO_TIME
    started_at: str = ZERO_TIME
    status: StatusCode = StatusCode.STOPPED
    agent_running: bool = False
    busy: str | None = None  # the action holding the operation lock
    boot: asyncio.TimerHandle | None = None
    generation: int = 0  # bumped on every stop: stale boot timers do nothing
    thawed_status: StatusCode = StatusCode.RUNNING
    #: files pushed into the instance (path -> (content, mode)), and commands executed
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    executed: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.project, self.name)

    @property
    def is_running(self) -> bool:
        return self.status in RUNNING_STATUSES


class SimHost:
    """The state and behaviour of one Incus host; the HTTP layer is in :mod:`.api`."""

    def __init__(
        self,
        shape: HostShape,
        *,
        timing: Timing | None = None,
        operation_retention_s: float = 5.0,
        seed: int = 0,
        version: IncusVersion | None = None,
    ) -> None:
        self.shape = shape
        self.timing = timing or Timing()
        self.version = version or IncusVersion(DEFAULT_VERSION)
        self.events = EventHub()
        self.operations = Operations(
            retention_s=operation_retention_s,
            on_change=self._op_event,
            empty_metadata=self.version.empty_operation_metadata,
        )
        #: images by alias or fingerprint → type ("container"/"virtual-machine");
        #: ``None``: every image exists and has the requested type
        self.images: dict[str, str] | None = None
        #: why virtual machines cannot be created here (``None``: they can)
        self.vm_unsupported: str | None = None
        self.faults = Faults()
        self.projects: dict[str, dict[str, Profile]] = {}
        self.instances: dict[tuple[str, str], SimInstance] = {}
        self._rng = random.Random(f"{seed}:{shape.name}")
        self._tasks: set[asyncio.Task[Any]] = set()
        for project in shape.all_projects:
            self.add_project(project)

    # ------------------------------------------------------------------ identity

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def tls(self) -> HostTls:
        return host_tls(self.shape.name)

    # ------------------------------------------------------------------ lookups

    def require_project(self, project: str) -> dict[str, Profile]:
        try:
            return self.projects[project]
        except KeyError:
            raise ApiError(404, "Project not found") from None

    def require_instance(self, project: str, name: str) -> SimInstance:
        self.require_project(project)
        inst = self.instances.get((project, name))
        if inst is None:
            raise ApiError(404, self.version.missing_instance_error(name, project))
        return inst

    def instances_in(self, project: str | None) -> list[SimInstance]:
        """Instances of ``project`` (``None``: every project), by project then name."""
        chosen = (i for i in self.instances.values() if project is None or i.project == project)
        return sorted(chosen, key=lambda i: (i.project, i.name))

    def expanded(self, inst: SimInstance) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """Profiles applied in order, then the instance's own config and devices."""
        profiles = self.projects.get(inst.project, {})
        config: dict[str, str] = {}
        devices: dict[str, dict[str, str]] = {}
        for profile_name in inst.profiles:
            profile = profiles.get(profile_name)
            if profile is not None:
                config.update(profile.config)
                devices.update({k: dict(v) for k, v in profile.devices.items()})
        config.update(inst.config)
        devices.update({k: dict(v) for k, v in inst.devices.items()})
        return config, devices

    # ------------------------------------------------------------------ Incus actions

    def create_instance(
        self, *, project: str, request: dict[str, Any], requestor: dict[str, str]
    ) -> Operation:
        """``POST /1.0/instances``: checks as ``instancesPost``, then a create operation."""
        profiles_of_project = self.require_project(project)
        name = str(request.get("name") or "")
        profiles = request.get("profiles")
        profile_names = ["default"] if profiles is None else [str(p) for p in profiles]
        for profile_name in profile_names:
            if profile_name not in profiles_of_project:
                raise _missing_profile(profile_name, status=500)
        duplicate = (project, name) in self.instances
        if duplicate and not self.version.duplicate_create_fails_in_operation:
            raise ApiError(409, self.version.duplicate_create_error(name))
        validate_instance_name(name)
        source = request.get("source") or {}
        source_type = source.get("type", "")
        if source_type not in ("image", "none"):
            raise ApiError(400, f"Unknown source type {source_type}")
        if source_type == "image" and not (
            source.get("alias") or source.get("fingerprint") or source.get("properties")
        ):
            raise ApiError(
                400, "Must specify one of alias, fingerprint or properties for init from image"
            )
        instance_type = str(request.get("type") or "container")
        inst = SimInstance(
            name=name,
            project=project,
            type=instance_type,
            architecture=self.shape.architecture,
            config={str(k): str(v) for k, v in (request.get("config") or {}).items()},
            devices={
                str(k): {str(a): str(b) for a, b in v.items()}
                for k, v in (request.get("devices") or {}).items()
            },
            profiles=profile_names,
            description=str(request.get("description") or ""),
            ephemeral=bool(request.get("ephemeral", False)),
        )
        inst.config["volatile.uuid"] = str(uuid.uuid4())
        image = str(source.get("fingerprint") or source.get("alias") or "")
        if image:
            inst.config["volatile.base_image"] = hashlib.sha256(image.encode()).hexdigest()
        start = bool(request.get("start", False))
        refusal = self._create_refusal(
            image=image if source_type == "image" else None,
            instance_type=instance_type,
            duplicate=duplicate,
            name=name,
        )
        if refusal is None:
            inst.busy = "create"
            self.instances[inst.key] = inst  # the record exists while the image unpacks

        async def work() -> None:
            if refusal is not None:  # Incus 6.0 checks these inside the operation
                raise OperationFailure(refusal)
            try:
                await self._sleep(self.timing.action_delay_s)
                self._maybe_fail("create", inst, "Failed creating instance from image")
            except BaseException:
                self.instances.pop(inst.key, None)
                raise
            inst.busy = None
            if image and source_type == "image":
                op.metadata = _unpack_progress()
            pool = self._root_pool(inst)
            self._emit(
                inst,
                "instance-created",
                requestor,
                {"type": inst.type, "storage-pool": pool, "location": "none"},
            )
            if start:
                await self._locked(inst, "start", lambda: self._start(inst, requestor))

        op = self._operation(description="Creating instance", inst=inst, work=work)
        return op

    def _create_refusal(
        self, *, image: str | None, instance_type: str, duplicate: bool, name: str
    ) -> str | None:
        """Why a create fails inside its operation (in Incus's order), or ``None``."""
        if image is not None and self.images is not None:
            image_type = self.images.get(image)
            if image_type is None:
                return "Image not provided for instance creation"
            if image_type != instance_type:
                return (
                    f"Requested image's type \"{image_type}\" doesn't match "
                    f'instance type "{instance_type}"'
                )
        if instance_type == "virtual-machine" and self.vm_unsupported is not None:
            return (
                'Failed creating instance record: Instance type "virtual-machine" is not '
                f"supported on this server: {self.vm_unsupported}"
            )
        if duplicate:
            return self.version.duplicate_create_error(name)
        return None

    def delete_instance(self, *, project: str, name: str, requestor: dict[str, str]) -> Operation:
        """``DELETE /1.0/instances/NAME``: refused while running, else a delete operation."""
        inst = self.require_instance(project, name)
        if inst.is_running:
            raise ApiError(400, "Instance is running")

        async def work() -> None:
            async def delete() -> None:
                await self._sleep(self.timing.action_delay_s)
                self._forget(inst)
                self._emit(inst, "instance-deleted", requestor)

            await self._locked(inst, "delete", delete)

        return self._operation(description="Deleting instance", inst=inst, work=work)

    def change_state(
        self, *, project: str, name: str, request: dict[str, Any], requestor: dict[str, str]
    ) -> Operation:
        """``PUT /1.0/instances/NAME/state``: always an operation for a known action."""
        inst = self.require_instance(project, name)
        action = str(request.get("action", ""))
        if action not in STATE_ACTIONS:
            raise ApiError(400, f"Unknown action: '{action}'")
        force = bool(request.get("force", False))
        timeout = int(request.get("timeout", -1) if request.get("timeout") is not None else -1)
        immediate = force or timeout == 0
        runs: dict[str, Callable[[], Awaitable[None]]] = {
            "start": lambda: self._start(inst, requestor),
            "stop": lambda: self._stop(inst, requestor, force=immediate),
            "restart": lambda: self._restart(inst, requestor, force=immediate),
            "freeze": lambda: self._freeze(inst, requestor),
            "unfreeze": lambda: self._unfreeze(inst, requestor),
        }

        async def work() -> None:
            await self._locked(inst, action, runs[action])

        return self._operation(description=STATE_ACTIONS[action], inst=inst, work=work)

    def update_instance(
        self,
        *,
        project: str,
        name: str,
        request: dict[str, Any],
        replace: bool,
        requestor: dict[str, str] | None,
    ) -> None:
        """``PUT`` (replace) or ``PATCH`` (merge) the writable fields; ``instance-updated``."""
        inst = self.require_instance(project, name)
        profiles = request.get("profiles")
        if profiles is not None:
            for profile_name in profiles:
                if profile_name not in self.projects[project]:
                    raise _missing_profile(profile_name, status=400)
        volatile = {k: v for k, v in inst.config.items() if k.startswith("volatile.")}
        config = {str(k): str(v) for k, v in (request.get("config") or {}).items()}
        devices = {str(k): dict(v) for k, v in (request.get("devices") or {}).items()}
        if replace:
            inst.config = {**config, **volatile}
            inst.devices = devices
            inst.profiles = list(profiles) if profiles is not None else inst.profiles
        else:
            inst.config.update(config)
            inst.devices.update(devices)
            if profiles is not None:
                inst.profiles = list(profiles)
        if "description" in request:
            inst.description = str(request["description"])
        if "ephemeral" in request:
            inst.ephemeral = bool(request["ephemeral"])
        self._emit(inst, "instance-updated", requestor)

    def update_operation(self, *, project: str, name: str, apply: Callable[[], None]) -> Operation:
        """``PUT /1.0/instances/NAME`` is asynchronous: run ``apply`` inside an operation."""
        inst = self.require_instance(project, name)

        async def work() -> None:
            apply()

        return self._operation(description="Updating instance", inst=inst, work=work)

    def push_file(self, *, project: str, name: str, path: str, content: bytes, mode: int) -> None:
        """``POST /1.0/instances/NAME/files``: needs a running instance (as Incus does
        for a VM, through its agent)."""
        inst = self.require_instance(project, name)
        if not path.startswith("/"):
            raise ApiError(400, "Path must be absolute")
        if not inst.is_running:
            raise ApiError(400, "Instance is not running")
        inst.files[path] = (content, mode)

    def execute(self, *, project: str, name: str, request: dict[str, Any]) -> Operation:
        """``POST /1.0/instances/NAME/exec`` without websockets (``record-output``): the
        command is recorded and "returns" 0; nothing runs."""
        inst = self.require_instance(project, name)
        if not inst.is_running:
            raise ApiError(400, "Instance is not running")
        command = request.get("command")
        if not isinstance(command, list) or not command:
            raise ApiError(400, "Command must be a non-empty list")
        environment = {str(k): str(v) for k, v in (request.get("environment") or {}).items()}

        async def work() -> None:
            await self._sleep(self.timing.action_delay_s)
            inst.executed.append(([str(c) for c in command], environment))
            op.metadata = {"return": 0, "output": {}}

        op = self._operation(description="Executing command", inst=inst, work=work)
        return op

    # ------------------------------------------------------------------ state machine

    async def _locked(
        self, inst: SimInstance, action: str, run: Callable[[], Awaitable[None]]
    ) -> None:
        if inst.busy is not None:
            raise OperationFailure(f'Instance is busy running a "{inst.busy}" operation')
        inst.busy = action
        try:
            await run()
        finally:
            inst.busy = None

    async def _start(self, inst: SimInstance, requestor: dict[str, str] | None) -> None:
        if inst.is_running:
            raise OperationFailure("The instance is already running")
        await self._sleep(self.timing.action_delay_s)
        self._maybe_fail("start", inst, "Failed to start instance")
        self._check_gpus(inst)
        now = rfc3339nano()
        inst.status = StatusCode.RUNNING
        inst.started_at = inst.last_used_at = now
        inst.config["volatile.last_state.power"] = "RUNNING"
        self._emit(inst, "instance-started", requestor)
        self._schedule_boot(inst)

    async def _stop(
        self, inst: SimInstance, requestor: dict[str, str] | None, *, force: bool
    ) -> None:
        if not inst.is_running:
            raise OperationFailure("The instance is already stopped", status=400)
        await self._sleep(self.timing.action_delay_s if force else self.timing.shutdown_delay_s)
        self._power_off(inst)
        self._emit(inst, "instance-stopped" if force else "instance-shutdown", requestor)

    async def _restart(self, inst: SimInstance, requestor: dict[str, str], *, force: bool) -> None:
        if not inst.is_running:
            raise OperationFailure("The instance isn't running")
        await self._sleep(self.timing.action_delay_s if force else self.timing.shutdown_delay_s)
        self._power_off(inst)
        await self._sleep(self.timing.action_delay_s)
        self._maybe_fail("start", inst, "Failed to start instance")
        inst.status = StatusCode.RUNNING
        inst.started_at = inst.last_used_at = rfc3339nano()
        inst.config["volatile.last_state.power"] = "RUNNING"
        self._emit(inst, "instance-restarted", requestor)
        self._schedule_boot(inst)

    async def _freeze(self, inst: SimInstance, requestor: dict[str, str]) -> None:
        if not inst.is_running:
            raise OperationFailure("The instance isn't running")
        if inst.status is StatusCode.FROZEN:
            raise OperationFailure(self.version.already_frozen_error(inst.type))
        inst.thawed_status = inst.status
        inst.status = StatusCode.FROZEN
        self._emit(inst, "instance-paused", requestor)

    async def _unfreeze(self, inst: SimInstance, requestor: dict[str, str]) -> None:
        if inst.status is not StatusCode.FROZEN:
            raise OperationFailure(self.version.not_frozen_error(inst.type))
        inst.status = inst.thawed_status
        self._emit(inst, "instance-resumed", requestor)

    def _schedule_boot(self, inst: SimInstance) -> None:
        if self._draw("boot", inst):
            return  # the guest never boots: no agent, never ready
        generation = inst.generation
        loop = asyncio.get_running_loop()

        def agent_started() -> None:
            if inst.generation != generation or not inst.is_running:
                return
            inst.agent_running = True
            if self.version.agent_started_event:
                self._emit(inst, "instance-agent-started", None)
            # the guest's own ``PATCH /1.0 {"state":"Ready"}`` on /dev/incus/sock
            if self.timing.report_ready:
                inst.boot = loop.call_later(self.timing.ready_delay_s, ready)

        def ready() -> None:
            if inst.generation == generation:
                self._guest_ready(inst)

        inst.boot = loop.call_later(self.timing.boot_delay_s, agent_started)

    def _guest_ready(self, inst: SimInstance) -> bool:
        """The guest's ``PATCH /1.0 {"state":"Ready"}`` on /dev/incus/sock (devIncus)."""
        if inst.status is not StatusCode.RUNNING:
            return False
        inst.status = StatusCode.READY
        inst.config["volatile.last_state.ready"] = "true"
        self._emit(inst, "instance-ready", None)  # the guest, not an API client: no requestor
        return True

    def _power_off(self, inst: SimInstance) -> None:
        inst.generation += 1
        if inst.boot is not None:
            inst.boot.cancel()
            inst.boot = None
        inst.status = StatusCode.STOPPED
        inst.agent_running = False
        inst.started_at = ZERO_TIME
        inst.config["volatile.last_state.power"] = "STOPPED"
        inst.config.pop("volatile.last_state.ready", None)

    def _check_gpus(self, inst: SimInstance) -> None:
        _, devices = self.expanded(inst)
        present = {g.pci_address for g in self.shape.gpus}
        taken = {
            pci: other.name
            for other in self.instances.values()
            if other is not inst and other.is_running
            for pci in self.gpu_addresses(other)
        }
        for device_name, device in sorted(devices.items()):
            if device.get("type") != "gpu" or not device.get("pci"):
                continue
            pci = device["pci"]
            if pci not in present:
                raise OperationFailure(
                    f'Failed to start device "{device_name}": Failed to detect requested GPU device'
                )
            if pci in taken:
                raise OperationFailure(
                    f'Failed to start device "{device_name}": '
                    f'GPU "{pci}" is in use by "{taken[pci]}"'
                )

    def gpu_addresses(self, inst: SimInstance) -> list[str]:
        _, devices = self.expanded(inst)
        return sorted(d["pci"] for d in devices.values() if d.get("type") == "gpu" and d.get("pci"))

    # ------------------------------------------------------------------ controls

    def add_project(self, project: str) -> None:
        """A project with a ``default`` profile (root disk on the host's pool, one NIC)."""
        if project in self.projects:
            return
        self.projects[project] = {
            "default": Profile(
                name="default",
                description="Default Incus profile",
                devices={
                    "root": {"type": "disk", "path": "/", "pool": self.shape.storage_pool},
                    "eth0": {"type": "nic", "name": "eth0", "network": "incusbr0"},
                },
            )
        }

    def create_project(self, name: str, *, requestor: dict[str, str]) -> None:
        """``POST /1.0/projects``: a new project and ``project-created``."""
        if name in self.projects:
            raise ApiError(*self.version.duplicate_project_error(name))
        self.add_project(name)
        self.events.publish(
            project_event(action="project-created", project=name, requestor=requestor)
        )

    def delete_project(self, name: str, *, requestor: dict[str, str]) -> None:
        """``DELETE /1.0/projects/NAME``: only an empty project other than ``default``."""
        self.require_project(name)
        if name == "default":
            raise ApiError(403, "The 'default' project cannot be deleted")
        if self.instances_in(name):
            raise ApiError(400, "Only empty projects can be removed")
        del self.projects[name]
        self.events.publish(
            project_event(action="project-deleted", project=name, requestor=requestor)
        )

    def add_profile(self, profile: Profile, *, project: str = "default") -> None:
        self.require_project(project)[profile.name] = profile

    def add_instance(
        self,
        name: str,
        *,
        project: str = "default",
        status: str = "Running",
        config: dict[str, str] | None = None,
        devices: dict[str, dict[str, str]] | None = None,
        profiles: list[str] | None = None,
        silent: bool = True,
    ) -> SimInstance:
        """Put an instance on the host as if it had always been there (a foreign VM)."""
        validate_instance_name(name)
        self.require_project(project)
        if (project, name) in self.instances:
            raise ValueError(f"instance {project}/{name} exists")
        inst = SimInstance(
            name=name,
            project=project,
            architecture=self.shape.architecture,
            config=dict(config or {}),
            devices=dict(devices or {}),
            profiles=list(profiles) if profiles is not None else ["default"],
        )
        inst.config.setdefault("volatile.uuid", str(uuid.uuid4()))
        self.instances[inst.key] = inst
        self.set_status(name, status, project=project, silent=True)
        if not silent:
            self._emit(inst, "instance-created", None)
        return inst

    def remove_instance(self, name: str, *, project: str = "default", silent: bool = True) -> bool:
        """Delete ``name`` whatever its state; ``silent`` sends no ``instance-deleted``."""
        inst = self.instances.get((project, name))
        if inst is None:
            return False
        self._forget(inst)
        if not silent:
            self._emit(inst, "instance-deleted", None)
        return True

    def set_status(
        self, name: str, status: str, *, project: str = "default", silent: bool = True
    ) -> None:
        """Force ``name`` into ``status`` (Running, Ready, Stopped, Frozen, Error)."""
        inst = self.instances.get((project, name))
        if inst is None:
            raise KeyError(f"no instance {project}/{name} on {self.name}")
        try:
            code = STATUS_BY_NAME[status]
        except KeyError:
            raise ValueError(
                f"unknown status {status!r} (one of {sorted(STATUS_BY_NAME)})"
            ) from None
        if code in (StatusCode.STOPPED, StatusCode.ERROR):
            self._power_off(inst)
        inst.status = code
        inst.agent_running = code in (StatusCode.RUNNING, StatusCode.READY, StatusCode.FROZEN)
        if code is StatusCode.READY:
            inst.config["volatile.last_state.ready"] = "true"
        if code in RUNNING_STATUSES and inst.started_at == ZERO_TIME:
            inst.started_at = inst.last_used_at = rfc3339nano()
        if not silent:
            self._emit(inst, "instance-updated", None)

    def guest_ready(self, name: str, *, project: str = "default") -> bool:
        """The guest reports Ready now (an image that signals late, with ``--no-ready``):
        Ready 113 and ``instance-ready``; ``False`` if it is not Running."""
        return self._guest_ready(self.require_instance(project, name))

    def guest_poweroff(self, name: str, *, project: str = "default") -> None:
        """The guest powers itself off: Stopped and ``instance-shutdown`` (no requestor)."""
        inst = self.require_instance(project, name)
        if inst.is_running:
            self._power_off(inst)
            self._emit(inst, "instance-shutdown", None)

    def fail_next(
        self,
        kind: FaultKind,
        *,
        count: int = 1,
        name: str | None = None,
        message: str | None = None,
    ) -> None:
        """Fail the next ``count`` ``kind`` actions (or the next one of instance ``name``).

        ``kind`` is ``create`` (the operation fails, no instance), ``start`` (the start
        operation fails, the VM stays Stopped) or ``boot`` (the VM runs but its agent never
        starts and it never becomes ready).
        """
        self._check_kind(kind)
        if name is not None:
            self.faults.by_name[kind].add(name)
        else:
            self.faults.counted[kind] += count
        if message is not None:
            self.faults.messages[kind] = message

    def set_failure_rate(self, kind: FaultKind, rate: float) -> None:
        """Fail each ``kind`` action with probability ``rate`` (seeded: runs repeat)."""
        self._check_kind(kind)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate}")
        self.faults.rates[kind] = rate

    def clear_faults(self) -> None:
        self.faults = Faults()

    def set_boot_delay(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("boot delay must be >= 0")
        self.timing.boot_delay_s = seconds

    def set_resources(self, **changes: Any) -> HostShape:
        """Replace fields of the shape (``cpu``, ``memory_mib``, ``storage_gib``, ``gpus``…)."""
        if "gpus" in changes:
            changes["gpus"] = tuple(
                g if isinstance(g, GpuShape) else GpuShape(**g) for g in changes["gpus"]
            )
        self.shape = dataclasses.replace(self.shape, **changes)
        return self.shape

    async def drop_event_streams(self, *, graceful: bool = False) -> int:
        """End every ``/1.0/events`` WebSocket (a lost stream unless ``graceful``)."""
        return await self.events.drop_all(graceful=graceful)

    def summary(self) -> dict[str, Any]:
        """What the host holds, for tests and ``GET /_sim/state``."""
        return {
            "name": self.name,
            "fingerprint": self.tls.fingerprint,
            "instances": [
                {
                    "name": i.name,
                    "project": i.project,
                    "status": i.status.label,
                    "status_code": int(i.status),
                    "agent": i.agent_running,
                }
                for i in self.instances_in(None)
            ],
            "operations": len(self.operations.all()),
            "event_listeners": self.events.listeners,
            "timing": dataclasses.asdict(self.timing),
            "faults": {
                "counted": dict(self.faults.counted),
                "rates": dict(self.faults.rates),
                "by_name": {k: sorted(v) for k, v in self.faults.by_name.items()},
            },
        }

    async def close(self) -> None:
        for inst in self.instances.values():
            if inst.boot is not None:
                inst.boot.cancel()
        await self.operations.close()
        await self.events.drop_all(graceful=False)

    # ------------------------------------------------------------------ internals

    def _check_kind(self, kind: str) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} (one of {FAULT_KINDS})")

    def _draw(self, kind: FaultKind, inst: SimInstance) -> bool:
        """Whether this ``kind`` action on ``inst`` fails; consumes one-shot faults."""
        by_name = self.faults.by_name[kind]
        if inst.name in by_name:
            by_name.discard(inst.name)
            return True
        if self.faults.counted[kind] > 0:
            self.faults.counted[kind] -= 1
            return True
        rate = self.faults.rates[kind]
        return rate > 0 and self._rng.random() < rate

    def _maybe_fail(self, kind: FaultKind, inst: SimInstance, prefix: str) -> None:
        if self._draw(kind, inst):
            detail = self.faults.messages.get(kind, "simulated failure")
            raise OperationFailure(f"{prefix}: {detail}")

    def _forget(self, inst: SimInstance) -> None:
        inst.generation += 1
        if inst.boot is not None:
            inst.boot.cancel()
            inst.boot = None
        self.instances.pop(inst.key, None)

    def _root_pool(self, inst: SimInstance) -> str:
        _, devices = self.expanded(inst)
        for device in devices.values():
            if device.get("type") == "disk" and device.get("path") == "/":
                return device.get("pool", self.shape.storage_pool)
        return self.shape.storage_pool

    def _operation(
        self, *, description: str, inst: SimInstance, work: Callable[[], Awaitable[None]]
    ) -> Operation:
        return self.operations.start(
            description=description,
            project=inst.project,
            instance_url=instance_source(inst.name, inst.project),
            work=work,
        )

    def _emit(
        self,
        inst: SimInstance,
        action: str,
        requestor: dict[str, str] | None,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.events.publish(
            lifecycle_event(
                action=action,
                name=inst.name,
                project=inst.project,
                requestor=requestor,
                context=context,
            )
        )

    def _op_event(self, op: Operation) -> None:
        self.events.publish(
            {
                "type": "operation",
                "timestamp": rfc3339nano(),
                "metadata": op.render(),
                "location": "none",
                "project": op.project,
            }
        )

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)
