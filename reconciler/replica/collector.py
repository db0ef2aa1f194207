"""The garbage collector kept off the folded state, so that its pauses do not grow with it.

A replica's state (every lease, decision, host and job: hundreds of thousands of small
objects on a large fleet) is long-lived and forms no reference cycles: reference counting
frees whatever the fold replaces. CPython's collector cannot know that. Each object that
survives two young collections joins the oldest generation, and once that generation has
grown by a quarter since the last full collection, the next collection scans all of it:
with 10,000 hosts and 100,000 leases admitted after start-up, ``scripts/bench``'s fleet
phase saw full collections of 267 and 350 ms, and collections of the middle generation of
40 to 145 ms while the leases came in: the decision latency's p99 was those pauses.

Rules of the freeze (``reconciler run`` applies them with ``--gc-threshold`` > 0):

- At start-up, once the store is loaded: one full collection, then ``gc.freeze()``: every
  live object moves to the permanent generation, which no collection scans.
- After a commit, at most once per :data:`FREEZE_EVERY_S`: ``gc.freeze()`` again. It
  costs nothing (CPython splices the generations' lists), and what the batches added to
  the state since the last freeze never reaches the oldest generation: collections of
  every generation scan about a second's worth of new objects, whatever the state's size.
  Frozen objects are still freed by reference counting the moment they are dropped.
- What freezing cannot free is a reference cycle that dies after it was frozen (a task of
  a past leadership term, an exception kept with its frames): young collections found
  none while the bench folded millions of inputs, but a service runs for years, so once
  every :data:`FULL_EVERY_S` the permanent generation is thawed, collected in full, and
  frozen again, logged as ``gc.full_collection`` with its pause and what it freed. That
  pause grows with the state (about 0.3 s at 100,000 leases on two shared cores): once an
  hour is far below any percentile anyone measures.

The threshold (``--gc-threshold``, :func:`apply_gc_threshold`):

- CPython collects its youngest generation every 700 net allocations of container
  objects, and every tenth of those also the middle one. A replica holds a large,
  long-lived state (every lease, job and decision) and allocates a burst of objects per
  input, so with that default the collector runs hundreds of times a second; on
  ``scripts/bench``'s throughput phase it took 0.72 s of 8.2 s of the main process's CPU
  (about 7 µs an input, more than encoding the batch's rows), and its full collections
  paused the event loop for 96 to 123 ms.
- ``--gc-threshold N`` makes the youngest generation hold ``N`` allocations before it is
  collected (the older two keep CPython's 10 and 10). At 10,000 the same phase spent
  0.19 s collecting, its longest pause was about 40 ms, and the resident set did not
  move: the state's objects are freed by reference counting, never by the collector
  (frozen dataclasses of strings, numbers and tuples form no cycles), so a larger young
  generation only means fewer passes over the same live objects.
- With a threshold, the replica also freezes what it loaded from its store
  (``RunConfig.freeze_loaded_state``): a full collection over 100,000 loaded leases
  takes about 100 ms, and frozen objects are never scanned again. They form no cycles,
  so nothing that dies later is kept by the freeze.
- ``0`` keeps the interpreter's own behaviour: its thresholds, nothing frozen.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import anyio
import structlog

__all__ = [
    "DEFAULT_GC_THRESHOLD",
    "FREEZE_EVERY_S",
    "FULL_EVERY_S",
    "StateCollector",
    "apply_gc_threshold",
]

logger = structlog.get_logger(__name__)

#: allocations between two collections of the youngest generation (CPython: 700)
DEFAULT_GC_THRESHOLD = 10_000


def apply_gc_threshold(threshold: int) -> tuple[int, int, int]:
    """Set the youngest generation's threshold (``0``: leave the interpreter's); returns
    the thresholds in force."""
    if threshold < 0:
        raise ValueError(f"the garbage collector's threshold must be >= 0, got {threshold}")
    if threshold > 0:
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(threshold, middle, oldest)
    return gc.get_threshold()


#: the shortest time between two freezes after commits
FREEZE_EVERY_S = 1.0
#: how often the permanent generation is thawed and collected in full (0: never)
FULL_EVERY_S = 3600.0


class StateCollector:
    """Keeps the collector's generations to what changed recently (see the module)."""

    def __init__(
        self,
        *,
        freeze_every_s: float = FREEZE_EVERY_S,
        full_every_s: float = FULL_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.freeze_every_s = freeze_every_s
        self.full_every_s = full_every_s
        self._clock = clock
        self._frozen_at = clock()
        #: freezes after commits, and full collections, so far (the metrics read them)
        self.freezes = 0
        self.full_collections = 0

    def loaded(self, **context: object) -> None:
        """The store is loaded: collect what is garbage already, freeze the rest."""
        gc.collect()
        gc.freeze()
        self._frozen_at = self._clock()
        logger.info("gc.frozen", objects=gc.get_freeze_count(), **context)

    def notify(self, _commit: object) -> None:
        """Commit listener: freeze what the state gained, once per ``freeze_every_s``."""
        now = self._clock()
        if now - self._frozen_at >= self.freeze_every_s:
            gc.freeze()
            self._frozen_at = now
            self.freezes += 1

    def full_collection(self) -> int:
        """Thaw, collect everything, freeze again; the number of objects freed."""
        started = time.perf_counter()
        gc.unfreeze()
        try:
            freed = gc.collect()
        finally:
            gc.freeze()
            self._frozen_at = self._clock()
        self.full_collections += 1
        logger.info(
            "gc.full_collection",
            seconds=round(time.perf_counter() - started, 3),
            freed=freed,
            frozen=gc.get_freeze_count(),
        )
        return freed

    async def run(self) -> None:
        """A full collection every ``full_every_s`` (never when 0)."""
        if self.full_every_s <= 0:
            await anyio.sleep_forever()
        while True:
            await anyio.sleep(self.full_every_s)
            self.full_collection()
