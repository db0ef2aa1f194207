"""What can go wrong talking to Incus, named after the condition.

Rules:

- pylxd, requests and ws4py errors never leave :mod:`reconciler.incus` as such: they are
  translated at the boundary into :class:`IncusError` subclasses with ``raise … from``,
  so callers handle one small family and still see the cause.
- Split by what the caller should do: :class:`IncusUnavailable` and
  :class:`OperationTimedOut` are temporary (retry with backoff); :class:`ApiRejected` and
  :class:`OperationFailed` are Incus's answer (retrying the same request gives the same
  answer unless the world changed); :class:`EventStreamLost` means reconnect.
- **Refused creates are permanent.** Incus 6.0 accepts a create it cannot do with 202
  and fails its operation; :class:`CreateRefused` and its kinds name the conditions that
  the same request can never get past (an image of the other type, an instance type the
  server cannot run, a missing image, a name already taken), whichever version said it.
- Every error names its host, so a log line or a dead letter says where.
"""

from __future__ import annotations

__all__ = [
    "ApiRejected",
    "CreateRefused",
    "EventStreamLost",
    "EventStreamRefused",
    "ImageNotFound",
    "ImageTypeMismatch",
    "IncusError",
    "IncusUnavailable",
    "InstanceAlreadyRunning",
    "InstanceAlreadyStopped",
    "InstanceBusy",
    "InstanceExists",
    "InstanceNameTaken",
    "InstanceNotFound",
    "InstanceRunning",
    "InstanceTypeUnsupported",
    "NotFound",
    "OperationFailed",
    "OperationLost",
    "OperationTimedOut",
]


class IncusError(Exception):
    """Something went wrong with Incus host ``host``."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.message = message


class IncusUnavailable(IncusError):
    """The host did not answer (refused, reset, timed out): temporary, retry later."""


class ApiRejected(IncusError):
    """Incus answered with an error envelope: HTTP ``status`` and Incus's ``message``."""

    def __init__(self, host: str, message: str, *, status: int) -> None:
        super().__init__(host, message)
        self.status = status


class NotFound(ApiRejected):
    """A 404: the project, pool, operation or instance does not exist."""


class InstanceNotFound(NotFound):
    """The instance does not exist (404 "Instance not found", in 6.0 after a prefix)."""


class InstanceRunning(ApiRejected):
    """Delete refused: the instance is not Stopped or Error (400 "Instance is running")."""


class InstanceExists(ApiRejected):
    """Create refused: the name is taken, and not by this lease's instance (409)."""


class OperationFailed(IncusError):
    """A background operation ended in Failure; ``err`` is Incus's text."""

    def __init__(self, host: str, err: str) -> None:
        super().__init__(host, err)
        self.err = err


class InstanceAlreadyStopped(OperationFailed):
    """A stop of a stopped instance ("The instance is already stopped")."""


class InstanceAlreadyRunning(OperationFailed):
    """A start of a running instance ("The instance is already running")."""


class InstanceBusy(OperationFailed):
    """Another operation of the instance holds its lock ("Instance is busy running a
    "create" operation"): temporary, it passes when that operation ends."""


class CreateRefused(OperationFailed):
    """A create whose operation failed for a reason no retry of the same request changes."""


class ImageTypeMismatch(CreateRefused):
    """The image is of the other type ("Requested image's type … doesn't match …")."""


class InstanceTypeUnsupported(CreateRefused):
    """The server cannot run this instance type (e.g. VMs without ``vhost_vsock``)."""


class ImageNotFound(CreateRefused):
    """The image named by the create is not there ("Image not provided …", "not found")."""


class InstanceNameTaken(CreateRefused):
    """Another instance has the name (6.0: "UNIQUE constraint failed: instances…")."""


class OperationLost(IncusError):
    """The operation was gone before its end was seen (Incus forgets finished operations
    after a few seconds): its outcome is unknown, so look at the instance again."""


class OperationTimedOut(IncusError):
    """A background operation did not finish within the adapter's bound: temporary."""


class EventStreamLost(IncusError):
    """The ``/1.0/events`` stream ended or went silent: reconnect with backoff."""


class EventStreamRefused(IncusError):
    """The ``/1.0/events`` WebSocket handshake was refused (e.g. 403 for an ``Origin``)."""
