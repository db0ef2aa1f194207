"""The garbage collector kept off the folded state (reconciler.replica.collector): what the
state gains is frozen after commits, at most once a second, and a full collection now and
then frees the reference cycles that died frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from reconciler.replica.collector import StateCollector


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """The test process's own objects are never left frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_commits_freeze_what_the_state_gained_at_most_once_per_interval() -> None:
    clock = Clock()
    collector = StateCollector(freeze_every_s=1.0, clock=clock)
    new = [object() for _ in range(1000)]  # what a batch added
    clock.now += 0.5
    collector.notify(None)
    assert collector.freezes == 0 and gc.get_freeze_count() == 0
    clock.now += 0.5
    collector.notify(None)
    assert collector.freezes == 1
    assert gc.get_freeze_count() >= len(new)  # out of every collection from now on
    collector.notify(None)  # same instant: nothing more
    assert collector.freezes == 1


def test_a_cycle_that_dies_frozen_is_freed_by_the_full_collection() -> None:
    collector = StateCollector(clock=Clock())
    cycle = Cycle()
    alive = weakref.ref(cycle)
    gc.freeze()
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: no ordinary collection sees it
    assert collector.full_collection() >= 1
    assert alive() is None
    assert collector.full_collections == 1
    assert gc.get_freeze_count() > 0  # and everything alive is frozen again


def test_frozen_objects_without_cycles_are_still_freed_when_dropped() -> None:
    collector = StateCollector(freeze_every_s=0.0, clock=Clock())
    leases = [{"lease_id": f"L{i}", "gpus": [i]} for i in range(1000)]
    collector.notify(None)
    frozen = gc.get_freeze_count()
    del leases
    assert gc.get_freeze_count() <= frozen - 2000  # reference counting freed them at once


@pytest.mark.parametrize("folded", [True, False])
def test_the_replays_collector_is_off_until_the_freeze_and_as_found_afterwards(
    folded: bool,
) -> None:
    """The replay (reconciler.replay.replay) turns the collector off until the decoded
    snapshot is frozen (turned on at the end of the decoding, it would at once scan every
    object the decoding made), and leaves it as it found it, also when it fails before."""
    from reconciler.replay.replay import FOLD_GC_THRESHOLD, _FoldCollector

    thresholds = gc.get_threshold()
    assert gc.isenabled()
    collector = _FoldCollector()
    try:
        assert not gc.isenabled()
        assert gc.get_threshold()[0] == max(thresholds[0], FOLD_GC_THRESHOLD)
        if folded:
            collector.freeze()
            assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        collector.restore()
    assert gc.isenabled() and gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0
