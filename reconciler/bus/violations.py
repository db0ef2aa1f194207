"""Permission violations reported by the NATS server, as typed errors.

Why: a NATS server refuses a publish or a subscription that the user's permissions do
not allow without answering the call: it sends ``-ERR 'Permissions Violation …'``, which
nats-py hands to the connection's error callback (``nats: permissions violation for
publish to "…"``), and the call itself waits for a reply that never comes. A component
without a permission it needs would hang, then time out with nothing to say why.

Rules:

- :func:`~reconciler.bus.connection.connect` registers a :class:`ViolationWatch` for
  every client it makes and feeds it every error; :func:`watch_of` finds it (a client
  made elsewhere gets a watch that never fires).
- nats-py reports the subject in lower case; :func:`guarded` restores the spelling of
  a subject the caller names.
- :func:`guarded` runs one call and, if the server reports a violation meanwhile (one
  that ``match`` accepts), cancels it and raises :class:`PermissionViolation` at once,
  naming the operation and the subject the user needs permission for. Nothing of the
  user's credentials is in it.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio
from nats.aio.client import Client

__all__ = ["PermissionViolation", "ViolationWatch", "guarded", "parse_violation", "watch_of"]

T = TypeVar("T")

_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"\s]+)\"?", re.IGNORECASE
)


class PermissionViolation(PermissionError):
    """The NATS server refused this user an operation on a subject."""

    def __init__(self, operation: Literal["publish", "subscribe"], subject: str) -> None:
        self.operation = operation
        self.subject = subject
        super().__init__(
            f"the NATS server refused to let this user {operation} "
            f"{'to' if operation == 'publish' else 'on'} {subject!r}: the user needs "
            f"{operation} permission on it (see docs/operations.md, 'Permissions')"
        )


def parse_violation(error: BaseException | str) -> PermissionViolation | None:
    """The violation an error of nats-py's error callback reports, if it is one."""
    found = _VIOLATION.search(str(error))
    if found is None:
        return None
    operation: Literal["publish", "subscribe"] = (
        "publish" if found.group(1).lower() == "publish" else "subscribe"
    )
    return PermissionViolation(operation, found.group(2))


class ViolationWatch:
    """The violations one connection was told of, for callers waiting on them."""

    def __init__(self) -> None:
        self.count = 0
        self.last: PermissionViolation | None = None
        #: callbacks of the calls in progress (see :func:`guarded`)
        self._waiters: set[Callable[[PermissionViolation], None]] = set()

    def record(self, error: BaseException | str) -> PermissionViolation | None:
        """Feed an error of the connection; the violation it is, if it is one."""
        violation = parse_violation(error)
        if violation is not None:
            self.count += 1
            self.last = violation
            for waiter in list(self._waiters):
                waiter(violation)
        return violation

    def add(self, waiter: Callable[[PermissionViolation], None]) -> None:
        self._waiters.add(waiter)

    def discard(self, waiter: Callable[[PermissionViolation], None]) -> None:
        self._waiters.discard(waiter)


_WATCHES: weakref.WeakKeyDictionary[Client, ViolationWatch] = weakref.WeakKeyDictionary()


def watch_of(nc: Client) -> ViolationWatch:
    """The watch of ``nc`` (registered by ``connect``; a silent one otherwise)."""
    watch = _WATCHES.get(nc)
    if watch is None:
        watch = _WATCHES[nc] = ViolationWatch()
    return watch


def _any(_: PermissionViolation) -> bool:
    return True


async def guarded(
    nc: Client,
    call: Callable[[], Awaitable[T]],
    *,
    match: Callable[[PermissionViolation], bool] = _any,
    subjects: tuple[str, ...] = (),
) -> T:
    """``await call()``, unless the server reports a violation first: then
    :class:`PermissionViolation`, at once. nats-py reports subjects in lower case: a
    violation of one of ``subjects`` (the subjects the call uses) names it as written.

    The call runs in the caller's task (no task of its own: this is on the path of every
    input a bridge publishes); a violation cancels it through a cancel scope."""
    watch = watch_of(nc)
    refused: list[PermissionViolation] = []
    with anyio.CancelScope() as scope:

        def on_violation(violation: PermissionViolation) -> None:
            if not refused and match(violation):
                refused.append(violation)
                scope.cancel()

        watch.add(on_violation)
        try:
            return await call()
        finally:
            watch.discard(on_violation)
    # only a violation cancels the scope (an outer cancellation propagates past it)
    violation = refused[0]
    for subject in subjects:
        if subject.lower() == violation.subject.lower():
            raise PermissionViolation(violation.operation, subject)
    raise violation
