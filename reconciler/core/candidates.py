"""An incremental index of fitting hosts per request shape, so admission is not O(hosts).

Placing a request evaluates every host once, then keeps the fitting ones in a heap
ordered exactly as :func:`reconciler.core.placement.choose` orders them (room left,
then host name). The state logs every host whose booking, snapshot or inventory
changed; the next placement of the same shape re-evaluates only those hosts. Stale heap
entries are dropped lazily by their stamp. The index is derived data: it is never
persisted, a reload starts it afresh, and its answer is always the one a full scan
would give.

The log is bounded: when it grows past :data:`_MAX_LOG`, each shape takes the hosts it has
not seen yet into its own set of changed hosts (at most one entry per host) and the log
starts again. A shape is evaluated over the whole fleet only when it is first seen (or
evicted past :data:`_MAX_SHAPES`), never because the log overflowed: with 10,000 hosts a
full scan holds the event loop for ~100 ms, and it used to happen every 8,192 booking
changes, i.e. every few seconds at 1,000 commands/s (issue 15).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from reconciler.core.model import HostName

#: (sort key, host name, stamp)
_Entry = tuple[float, HostName, int]
#: a host's filter stage and score (None: no fit; lower is better)
Scorer = Callable[[HostName], tuple[int, float | None]]

_MAX_SHAPES = 64
_MAX_LOG = 8192


@dataclass(slots=True)
class _Shape:
    pos: int
    stamps: dict[HostName, int] = field(default_factory=dict)
    heap: list[_Entry] = field(default_factory=list)
    #: furthest filter stage (an int, see placement.Fit) each host reached, and counts
    stages: dict[HostName, int] = field(default_factory=dict)
    stage_counts: dict[int, int] = field(default_factory=dict)
    #: hosts changed before the log was last cut, not yet re-evaluated for this shape
    pending: set[HostName] = field(default_factory=set)


@dataclass(slots=True)
class CandidateIndex:
    #: hosts whose placement inputs changed, since ``base``
    log: list[HostName] = field(default_factory=list)
    base: int = 0
    shapes: dict[Hashable, _Shape] = field(default_factory=dict)
    counter: int = 0
    #: the scorer each shape was placed with, kept for its next placement by the caller
    #: (placement), dropped with the shapes. A scorer depends on nothing but its shape
    #: and the state this index belongs to.
    scorers: dict[Hashable, Scorer] = field(default_factory=dict)

    def touch(self, host: HostName) -> None:
        self.log.append(host)

    def reset(self) -> None:
        self.log.clear()
        self.shapes.clear()
        self.scorers.clear()

    def best(
        self,
        shape_key: Hashable,
        hosts: list[HostName],
        score: Scorer,
    ) -> tuple[HostName | None, dict[int, int]]:
        """The host with the lowest score, ties by host name, and how many hosts reached
        each filter stage. ``score`` gives a host's stage and its score (None: no fit)."""
        if len(self.log) > _MAX_LOG:
            self._cut_log()
        head = self.base + len(self.log)
        shape = self.shapes.get(shape_key)
        if shape is None:
            if len(self.shapes) >= _MAX_SHAPES:
                self.shapes.clear()
                self.scorers.clear()
            shape = _Shape(pos=head)
            self.shapes[shape_key] = shape
            changed: list[HostName] | set[HostName] = hosts
        else:
            # the shape's pending set takes the log's new hosts, and is emptied below
            changed = shape.pending
            changed.update(self.log[shape.pos - self.base :])
            shape.pos = head
        # rescoring inlined: this loop runs for every host changed since the shape was
        # last placed, a few per admission and the whole fleet on a shape's first one
        counter = self.counter
        stages, stage_counts, stamps, heap = (
            shape.stages,
            shape.stage_counts,
            shape.stamps,
            shape.heap,
        )
        for name in changed:
            stage, value = score(name)
            counter += 1
            old = stages.get(name)
            if old != stage:  # most hosts stay at their stage
                if old is not None:
                    stage_counts[old] -= 1
                stages[name] = stage
                stage_counts[stage] = stage_counts.get(stage, 0) + 1
            if value is None:
                stamps.pop(name, None)
            else:
                stamps[name] = counter
                heapq.heappush(heap, (value, name, counter))
        self.counter = counter
        if changed is shape.pending:
            changed.clear()
        if len(heap) > 4 * len(stamps) + 64:
            shape.heap = heap = [e for e in heap if stamps.get(e[1]) == e[2]]
            heapq.heapify(heap)
        while heap:
            _, name, stamp = heap[0]
            if stamps.get(name) == stamp:
                return name, stage_counts
            heapq.heappop(heap)
        return None, stage_counts

    def _cut_log(self) -> None:
        """Hand every shape the hosts of the log it has not seen, then empty the log."""
        for shape in self.shapes.values():
            shape.pending.update(self.log[shape.pos - self.base :])
        self.base += len(self.log)
        self.log.clear()
        for shape in self.shapes.values():
            shape.pos = self.base
