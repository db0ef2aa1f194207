"""The garbage collector's policy for a long-running replica (``--gc-threshold``).

Rules:

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

__all__ = ["DEFAULT_GC_THRESHOLD", "apply_gc_threshold"]

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
