"""Which Incus the simulator plays: 6.0 LTS (the default) or 7.x, and where they differ.

Rules:

- A :class:`IncusVersion` is parsed from ``6.0``, ``6.0.4``, ``7``, ``7.3``…; any 6.x is
  played as the 6.0 LTS (what Debian ships and what ``tests/support/realincus.py`` runs), any 7.x
  as 7.3 (what ``FACTS.md`` and ``rest-api.yaml`` were read from). Other majors are refused.
- Every behaviour that differs between the two is one property here, named after what it
  decides, so the host, the renderer and the API ask a question rather than compare
  version numbers. ``docs/incus-simulator.md`` lists them with the evidence.
- What both versions do the same way (sorted context keys, the image checks inside the
  create operation, ``instance-shutdown`` for a graceful stop…) is not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_VERSION", "LATEST", "LTS", "IncusVersion", "parse_version"]

LTS = "6.0.4"
LATEST = "7.3"
DEFAULT_VERSION = LTS


@dataclass(frozen=True)
class IncusVersion:
    """One played Incus release (``server_version`` as ``GET /1.0`` reports it)."""

    server_version: str

    @property
    def major(self) -> int:
        return int(self.server_version.split(".", 1)[0])

    @property
    def lts(self) -> bool:
        """The 6.0 LTS (Debian's ``incus-base``)."""
        return self.major == 6

    # ------------------------------------------------------------------ operations

    @property
    def empty_operation_metadata(self) -> Any:
        """An operation's ``metadata`` before anything set it: ``null`` on 6.0, ``{}`` on 7.x."""
        return None if self.lts else {}

    @property
    def wait_failure_is_error_envelope(self) -> bool:
        """``/wait`` of a failed operation: HTTP 200 + error envelope (6.0), not sync (7.x)."""
        return self.lts

    # ------------------------------------------------------------------ instances

    @property
    def duplicate_create_fails_in_operation(self) -> bool:
        """A create with a taken name: 202 then a failed operation (6.0), not a sync 409."""
        return self.lts

    def duplicate_create_error(self, name: str) -> str:
        if self.lts:
            return (
                "Failed creating instance record: Add instance info to the database: "
                'Failed to create "instances" entry: UNIQUE constraint failed: '
                "instances.project_id, instances.name"
            )
        return f'Instance "{name}" already exists'

    @property
    def lists_missing_project_as_empty(self) -> bool:
        """``GET /1.0/instances?project=NOSUCH``: 6.0 answers an empty list, 7.x a 404."""
        return self.lts

    def duplicate_project_error(self, name: str) -> tuple[int, str]:
        """``POST /1.0/projects`` with a taken name: (HTTP status, text)."""
        if self.lts:
            return 500, (
                f'Failed creating project "{name}": Failed adding database record: '
                'Failed to create "projects" entry: UNIQUE constraint failed: projects.name'
            )
        return 409, f'Project "{name}" already exists'

    def missing_instance_error(self, name: str, project: str) -> str:
        """The 404 text for an instance that does not exist."""
        if self.lts:
            return f'Failed to fetch instance "{name}" in project "{project}": Instance not found'
        return "Instance not found"

    def already_frozen_error(self, instance_type: str) -> str:
        if self.lts and instance_type == "container":
            return "The container is already frozen"
        return "The instance is already frozen"

    def not_frozen_error(self, instance_type: str) -> str:
        """Unfreezing what is not frozen (6.0's container driver says it runs)."""
        if self.lts and instance_type == "container":
            return "The container is already running"
        return "The instance isn't frozen"

    # ------------------------------------------------------------------ events, resources

    @property
    def agent_started_event(self) -> bool:
        """7.x emits ``instance-agent-started``; 6.0 has no such action."""
        return not self.lts

    @property
    def resources_have_serial(self) -> bool:
        """``/1.0/resources`` has a ``serial`` section on 7.x only."""
        return not self.lts

    @property
    def patch_update_has_requestor(self) -> bool:
        """Whether the ``instance-updated`` of a (synchronous) PATCH names its requestor."""
        return not self.lts


def parse_version(text: str) -> IncusVersion:
    """``6.0``/``6.0.4``/``6``/``lts`` → 6.0.4; ``7``/``7.3``/``latest`` → 7.3."""
    word = text.strip().lower()
    if word in ("lts", "6", "6.0") or word.startswith("6."):
        return IncusVersion(LTS)
    if word in ("latest", "7") or word.startswith("7."):
        return IncusVersion(LATEST)
    raise ValueError(f"unknown Incus version {text!r}: the simulator plays 6.0 (LTS) or 7.x")
