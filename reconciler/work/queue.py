"""Keyed work queues for the leader's reconcilers, after client-go's ``workqueue``.

Rules (docs/architecture.md, "Packages"); each holds at every instant:

- **Dedup.** A key queued twice is queued once. Queued keys are handed out in FIFO order of
  their first queueing.
- **One holder.** A key handed out by :meth:`WorkQueue.get` is *processing* until its
  holder calls :meth:`WorkQueue.done`; it is never handed to a second worker meanwhile.
- **Nothing lost.** A key re-added while processing is marked dirty and queued again on
  ``done``, so it runs once more after the current run: every add is followed by a run
  that started after it.
- **Backoff.** :meth:`WorkQueue.add_rate_limited` re-adds a key after a per-key delay that
  doubles with each failure, ``base * 2**failures`` up to ``cap``; :meth:`WorkQueue.forget`
  resets it (call it after a success).
- **Delays.** :meth:`WorkQueue.add_after` adds a key once its delay has passed. While a key
  waits, a second ``add_after`` keeps the earlier due time.
- **Shutdown.** :meth:`WorkQueue.shutdown` ignores later adds, drops what is queued or
  waiting, and makes every pending and future :meth:`WorkQueue.get` raise
  :class:`QueueShutDown`; :meth:`WorkQueue.shutdown_and_drain` also waits until every key
  in flight is ``done``.

Time is read only through the injected ``clock`` (seconds, monotonic). Async waiting uses
anyio's clock, so an injected clock must run at the real rate for :meth:`WorkQueue.get`
to wake on time; tests with a fake clock use the synchronous :meth:`WorkQueue.try_get`.
The queue is not thread-safe: use it from one event loop.

:func:`run_workers` runs ``n`` workers over a queue. A handler's failure decides the
retry, after kopf: :class:`PermanentError` is logged and forgotten, :class:`TemporaryError`
is retried after its ``delay`` (or the key's backoff), any other exception is retried with
backoff. A worker lets the event loop run after every key, even when the next one is
ready at once, so that a long queue never holds the loop (the fold and the publishing of
decisions share it): the loop is held for one handler at most.

:func:`run_with_resync` adds every key again every interval, *paced*: a round's keys
are added in slices of at most :data:`RESYNC_SLICE`, spread evenly over the interval, so
that a round over 10,000 hosts is ~1,000 keys a second in small steps, not 10,000 keys
at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

import anyio
import structlog

__all__ = [
    "RESYNC_SLICE",
    "ExponentialBackoff",
    "Handler",
    "PermanentError",
    "QueueShutDown",
    "TemporaryError",
    "WorkQueue",
    "run_with_resync",
    "run_workers",
]

K = TypeVar("K", bound=Hashable)

logger = structlog.get_logger(__name__)

Clock = Callable[[], float]


class QueueShutDown(Exception):
    """The queue was shut down: no more keys will be handed out."""


class PermanentError(Exception):
    """A handler failure that retrying cannot fix: logged, the key's backoff forgotten."""


class TemporaryError(Exception):
    """A handler failure worth retrying, after ``delay`` seconds or the key's backoff."""

    def __init__(self, message: str = "", *, delay: float | None = None) -> None:
        super().__init__(message)
        if delay is not None and not delay >= 0:
            raise ValueError(f"delay must be >= 0, got {delay!r}")
        self.delay = delay


class ExponentialBackoff(Generic[K]):
    """Per-key failure counter: the n-th delay (from 0) is ``min(base * 2**n, cap)``."""

    def __init__(self, *, base: float = 0.005, cap: float = 60.0) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"need 0 < base <= cap, got base={base!r} cap={cap!r}")
        self.base = base
        self.cap = cap
        self._failures: dict[K, int] = {}

    def when(self, key: K) -> float:
        """Count one more failure of ``key`` and return the delay before its retry."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        # 2**failures overflows a float past ~1024; the cap is reached long before.
        exponent = min(failures, math.ceil(math.log2(self.cap / self.base)) + 1)
        return min(self.base * 2.0**exponent, self.cap)

    def failures(self, key: K) -> int:
        """How many failures of ``key`` were counted since it was last forgotten."""
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        """Reset ``key``'s failure count: its next delay is ``base`` again."""
        self._failures.pop(key, None)


class WorkQueue(Generic[K]):
    """A deduplicating FIFO of keys with per-key exclusion, delays and backoff.

    Keys must be hashable and must not be ``None`` (:meth:`try_get` returns ``None`` for
    "nothing ready").
    """

    def __init__(
        self,
        *,
        name: str = "workqueue",
        clock: Clock = time.monotonic,
        backoff_base: float = 0.005,
        backoff_cap: float = 60.0,
    ) -> None:
        self.name = name
        self._clock = clock
        self._backoff: ExponentialBackoff[K] = ExponentialBackoff(
            base=backoff_base, cap=backoff_cap
        )
        self._queue: deque[K] = deque()  # ready keys, FIFO, each at most once
        self._dirty: set[K] = set()  # keys that need a run: queued, or re-added in flight
        self._processing: set[K] = set()  # keys handed out and not yet done
        self._waiting: list[tuple[float, int, K]] = []  # heap of (due, tie, key)
        self._due: dict[K, float] = {}  # key -> due time of its live heap entry
        self._ties = itertools.count()
        self._shutting_down = False
        self._wakeup: anyio.Event | None = None  # created by a waiting get(), set on change
        self._drained: anyio.Event | None = None

    # ------------------------------------------------------------------ adding

    def add(self, key: K) -> None:
        """Queue ``key`` for a run, unless it is queued already; ignored after shutdown."""
        if self._shutting_down or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._wake()

    def add_after(self, key: K, delay: float) -> None:
        """Queue ``key`` once ``delay`` seconds have passed; ``delay <= 0`` adds now.

        A key already waiting keeps the earlier of its due times.
        """
        if self._shutting_down:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self._clock() + delay
        current = self._due.get(key)
        if current is not None and current <= due:
            return
        self._due[key] = due
        heapq.heappush(self._waiting, (due, next(self._ties), key))
        self._wake()  # a waiting get() may need an earlier timeout

    def add_rate_limited(self, key: K) -> None:
        """Queue ``key`` after its backoff delay, and count one more failure."""
        self.add_after(key, self._backoff.when(key))

    def forget(self, key: K) -> None:
        """Reset ``key``'s backoff (it does not remove the key from the queue)."""
        self._backoff.forget(key)

    def num_requeues(self, key: K) -> int:
        """Failures counted for ``key`` since it was last forgotten."""
        return self._backoff.failures(key)

    # ------------------------------------------------------------------ taking

    def try_get(self) -> K | None:
        """Hand out the next ready key without waiting, or ``None`` if none is ready.

        Raises :class:`QueueShutDown` after shutdown.
        """
        if self._shutting_down:
            raise QueueShutDown(self.name)
        self._promote_due()
        if not self._queue:
            return None
        key = self._queue.popleft()
        self._processing.add(key)
        self._dirty.discard(key)
        return key

    async def get(self) -> K:
        """Wait for the next ready key and hand it out; the caller must call :meth:`done`.

        Raises :class:`QueueShutDown` once the queue is shut down, also while waiting.
        Cancelling a waiting ``get`` hands out nothing.
        """
        while True:
            key = self.try_get()
            if key is not None:
                return key
            if self._wakeup is None:
                self._wakeup = anyio.Event()
            wakeup = self._wakeup
            with anyio.move_on_after(self._seconds_to_next_due()):
                await wakeup.wait()

    def done(self, key: K) -> None:
        """Mark ``key``'s run finished; a key re-added meanwhile is queued again."""
        try:
            self._processing.remove(key)
        except KeyError:
            raise ValueError(f"{self.name}: done({key!r}) for a key not being processed") from None
        if key in self._dirty and not self._shutting_down:
            self._queue.append(key)
            self._wake()
        if not self._processing and self._drained is not None:
            self._drained.set()

    def __aiter__(self) -> WorkQueue[K]:
        """``async for key in queue`` takes keys until shutdown; call :meth:`done` for each."""
        return self

    async def __anext__(self) -> K:
        try:
            return await self.get()
        except QueueShutDown:
            raise StopAsyncIteration from None

    # ------------------------------------------------------------------ shutdown

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def shutdown(self) -> None:
        """Stop handing out keys: drop queued and waiting keys, wake every ``get``."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._queue.clear()
        self._dirty.clear()
        self._waiting.clear()
        self._due.clear()
        self._wake()

    async def shutdown_and_drain(self) -> None:
        """Shut down, then wait until every key handed out is ``done``."""
        self.shutdown()
        while self._processing:
            if self._drained is None or self._drained.is_set():
                self._drained = anyio.Event()
            await self._drained.wait()

    # ------------------------------------------------------------------ introspection

    def __len__(self) -> int:
        """Keys ready to be handed out now (not those processing or still waiting)."""
        self._promote_due()
        return len(self._queue)

    def queued(self) -> tuple[K, ...]:
        """The ready keys, in the order they will be handed out."""
        self._promote_due()
        return tuple(self._queue)

    def processing(self) -> frozenset[K]:
        """The keys handed out and not yet done."""
        return frozenset(self._processing)

    def waiting(self) -> dict[K, float]:
        """Keys added with a delay that has not passed yet, with their due times."""
        self._promote_due()
        return dict(self._due)

    # ------------------------------------------------------------------ internals

    def _promote_due(self) -> None:
        if not self._waiting:
            return
        now = self._clock()
        while self._waiting and self._waiting[0][0] <= now:
            due, _, key = heapq.heappop(self._waiting)
            if self._due.get(key) != due:
                continue  # superseded by an earlier due time
            del self._due[key]
            self.add(key)

    def _seconds_to_next_due(self) -> float | None:
        while self._waiting:
            due, _, key = self._waiting[0]
            if self._due.get(key) == due:
                return max(due - self._clock(), 0.0)
            heapq.heappop(self._waiting)  # stale entry
        return None

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


Handler = Callable[[K], Awaitable[None]]


async def run_workers(queue: WorkQueue[K], handler: Handler[K], *, workers: int = 1) -> None:
    """Run ``workers`` tasks that take keys from ``queue`` and await ``handler(key)``.

    Returns once the queue is shut down and every worker has finished its current key;
    cancelling it cancels the handlers in flight (their keys are still marked done).
    A success forgets the key's backoff; failures are retried as the module docstring says.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    async with anyio.create_task_group() as tg:
        for index in range(workers):
            tg.start_soon(_work, queue, handler, index, name=f"{queue.name}-worker-{index}")


#: at most this many keys of a resync round are added at once (see the module's rules)
RESYNC_SLICE = 64


async def run_with_resync(
    queue: WorkQueue[K],
    handler: Handler[K],
    *,
    keys: Callable[[], Iterable[K]],
    every_s: float,
    workers: int = 1,
    slice_size: int = RESYNC_SLICE,
    max_rate: float | None = None,
) -> None:
    """:func:`run_workers`, plus every key of ``keys()`` added again every ``every_s``
    (client-go's resync: a lost event is made up for), paced as the module's rules say:
    a round of ``n`` keys is added ``slice_size`` at a time, a slice every
    ``every_s * slice_size / n`` seconds, and never more than ``max_rate`` keys a second
    (a round of many keys then takes longer than ``every_s``). Shuts the queue down on
    exit."""
    if slice_size < 1:
        raise ValueError(f"slice_size must be >= 1, got {slice_size!r}")
    if max_rate is not None and not max_rate > 0:
        raise ValueError(f"max_rate must be > 0, got {max_rate!r}")

    async def resync() -> None:
        while True:
            round_keys = list(keys())
            slices = max(1, math.ceil(len(round_keys) / slice_size))
            pause = every_s / slices
            if max_rate is not None:
                pause = max(pause, min(slice_size, len(round_keys)) / max_rate)
            for start in range(0, max(len(round_keys), 1), slice_size):
                for key in round_keys[start : start + slice_size]:
                    queue.add(key)
                await anyio.sleep(pause)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(resync, name=f"{queue.name}-resync")
            await run_workers(queue, handler, workers=workers)
            tg.cancel_scope.cancel()
    finally:
        queue.shutdown()


async def _work(queue: WorkQueue[K], handler: Handler[K], index: int) -> None:
    log = logger.bind(queue=queue.name, worker=index)
    async for key in queue:
        try:
            await handler(key)
        except PermanentError as exc:
            log.error("work.permanent_error", key=key, error=str(exc))
            queue.forget(key)
        except TemporaryError as exc:
            if exc.delay is None:
                queue.add_rate_limited(key)
            else:
                queue.add_after(key, exc.delay)
            log.warning(
                "work.temporary_error",
                key=key,
                error=str(exc),
                delay=exc.delay,
                requeues=queue.num_requeues(key),
            )
        except Exception as exc:
            queue.add_rate_limited(key)
            log.exception(
                "work.failed",
                key=key,
                error=repr(exc),
                requeues=queue.num_requeues(key),
            )
        else:
            queue.forget(key)
        finally:
            queue.done(key)
        # the next key may be ready at once: let the loop run first (module rules)
        await anyio.lowlevel.checkpoint()
