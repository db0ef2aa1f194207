"""Background operations of one simulated host, after ``cmd/incusd/operations.go``.

Rules:

- An operation is created Pending (105) and is Running (103) before its first rendering,
  so the async envelope always shows it Running.
- Its work is a coroutine: returning finishes it Success (200); raising
  :class:`OperationFailure` finishes it Failure (400) with ``err`` = the message;
  cancellation (simulator shutdown) finishes it Cancelled (401). Any other exception is a
  bug in the simulator and fails the operation with its text.
- A finished operation stays visible for ``retention_s`` (default 5 s, as Incus), then
  ``GET`` answers 404 "Operation not found".
- ``wait(timeout)`` returns when the operation has finished or the timeout has passed,
  whichever is first; a negative timeout waits for ever. It never raises for a failure:
  the caller renders the operation, failure and all.
- Everything runs on the host's event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from reconciler.incus.simulator.wire import StatusCode, rfc3339nano

__all__ = ["Operation", "OperationFailure", "Operations"]

Work = Callable[[], Awaitable[None]]
Listener = Callable[["Operation"], None]


class OperationFailure(Exception):
    """Raised by an operation's work: the operation fails with this message as ``err``.

    ``status`` is the HTTP status of Incus's error value (``api.StatusErrorf``; a plain
    error is 500): Incus 6.0 shows it as the ``error_code`` of a failed ``/wait``.
    """

    def __init__(self, message: str, *, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class Operation:
    """One background task of Incus (class "task")."""

    def __init__(
        self,
        *,
        description: str,
        project: str,
        resources: dict[str, list[str]],
        metadata: Any = None,
    ) -> None:
        self.id = str(uuid.uuid4())
        self.project = project
        self.description = description
        self.resources = resources
        self.created_at = rfc3339nano()
        self.updated_at = self.created_at
        self.status = StatusCode.PENDING
        self.err = ""
        self.err_status = 500  # the HTTP status of the error that failed it
        self.metadata: Any = metadata  # null on Incus 6.0, {} on 7.x, until work sets it
        self.done = asyncio.Event()

    @property
    def url(self) -> str:
        return f"/1.0/operations/{self.id}"

    def set_status(self, status: StatusCode, err: str = "") -> None:
        self.status = status
        self.err = err
        self.updated_at = rfc3339nano()
        if status.is_final:
            self.done.set()

    def render(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "class": "task",
            "description": self.description,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "status": self.status.label,
            "status_code": int(self.status),
            "resources": self.resources,
            "metadata": self.metadata if self.metadata is None else dict(self.metadata),
            "may_cancel": False,
            "err": self.err,
            "location": "none",
        }

    async def wait(self, timeout_s: float) -> None:
        """Until finished, or ``timeout_s`` passed (negative: no limit)."""
        if timeout_s < 0:
            await self.done.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), timeout_s)


class Operations:
    """The operations of one host: run, look up, expire."""

    def __init__(
        self,
        *,
        retention_s: float = 5.0,
        on_change: Listener | None = None,
        empty_metadata: Any = None,
    ) -> None:
        self.retention_s = retention_s
        self._empty_metadata = empty_metadata
        self._by_id: dict[str, Operation] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._expiries: set[asyncio.TimerHandle] = set()
        self._on_change = on_change

    def start(self, *, description: str, project: str, instance_url: str, work: Work) -> Operation:
        """Create an operation for ``work`` and start it; it is Running when returned."""
        op = Operation(
            description=description,
            project=project,
            resources={"instances": [instance_url]},
            metadata=self._empty_metadata,
        )
        self._by_id[op.id] = op
        self._notify(op)
        op.set_status(StatusCode.RUNNING)
        self._notify(op)
        task = asyncio.get_running_loop().create_task(self._run(op, work), name=op.description)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return op

    def get(self, op_id: str) -> Operation | None:
        return self._by_id.get(op_id)

    def all(self) -> list[Operation]:
        return sorted(self._by_id.values(), key=lambda o: (o.created_at, o.id))

    async def close(self) -> None:
        """Cancel running work (operations end Cancelled) and forget every operation."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handle in self._expiries:
            handle.cancel()
        self._expiries.clear()
        self._by_id.clear()

    async def _run(self, op: Operation, work: Work) -> None:
        try:
            await work()
        except OperationFailure as exc:
            op.err_status = exc.status
            self._finish(op, StatusCode.FAILURE, str(exc))
        except asyncio.CancelledError:
            self._finish(op, StatusCode.CANCELLED, "Operation cancelled")
            raise
        except Exception as exc:  # a simulator bug: show it, as Incus shows its own
            self._finish(op, StatusCode.FAILURE, f"{type(exc).__name__}: {exc}")
        else:
            self._finish(op, StatusCode.SUCCESS)

    def _finish(self, op: Operation, status: StatusCode, err: str = "") -> None:
        op.set_status(status, err)
        self._notify(op)
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def expire() -> None:
            self._by_id.pop(op.id, None)
            if handle is not None:
                self._expiries.discard(handle)

        handle = loop.call_later(self.retention_s, expire)
        self._expiries.add(handle)

    def _notify(self, op: Operation) -> None:
        if self._on_change is not None:
            self._on_change(op)
