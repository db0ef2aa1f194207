"""The keyed work queue keeps client-go's workqueue rules (DESIGN.md, "keyed work queues")."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from reconciler.work.queue import (
    ExponentialBackoff,
    PermanentError,
    QueueShutDown,
    TemporaryError,
    WorkQueue,
    run_workers,
)
from tests.support.clock import FakeClock


def drain(queue: WorkQueue[str]) -> list[str]:
    """Take and finish every ready key, in order."""
    taken = []
    while (key := queue.try_get()) is not None:
        taken.append(key)
        queue.done(key)
    return taken


# ---------------------------------------------------------------------------- dedup, FIFO


def test_keys_come_out_in_fifo_order() -> None:
    q: WorkQueue[str] = WorkQueue()
    for key in ["c", "a", "b"]:
        q.add(key)
    assert q.queued() == ("c", "a", "b")
    assert drain(q) == ["c", "a", "b"]


def test_a_key_queued_twice_is_queued_once_at_its_first_place() -> None:
    q: WorkQueue[str] = WorkQueue()
    for key in ["a", "b", "a", "c", "b", "a"]:
        q.add(key)
    assert len(q) == 3
    assert drain(q) == ["a", "b", "c"]
    assert q.try_get() is None


# ---------------------------------------------------------------------------- one holder


def test_a_key_is_never_handed_to_two_workers() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    assert q.try_get() == "a"
    q.add("a")
    assert q.try_get() is None  # "a" is processing: the second worker gets nothing
    assert q.processing() == frozenset({"a"})
    assert q.queued() == ()


def test_a_key_re_added_while_processing_runs_once_more_after_done() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("b")
    assert q.try_get() == "a"
    q.add("a")
    q.add("a")
    assert q.queued() == ("b",)
    q.done("a")
    assert q.queued() == ("b", "a")  # once, and behind what was already queued
    assert drain(q) == ["b", "a"]
    assert q.try_get() is None


def test_done_without_get_is_an_error() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    with pytest.raises(ValueError, match="not being processed"):
        q.done("a")


# ---------------------------------------------------------------------------- delays, backoff


def test_add_after_waits_for_the_delay() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 5)
    assert q.try_get() is None
    assert q.waiting() == {"a": clock.now + 5}
    clock.advance(4.999)
    assert q.try_get() is None
    clock.advance(0.001)
    assert q.try_get() == "a"
    assert q.waiting() == {}


def test_add_after_keeps_the_earlier_due_time_and_non_positive_delay_adds_now() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 10)
    q.add_after("a", 3)
    q.add_after("a", 20)
    assert q.waiting() == {"a": clock.now + 3}
    clock.advance(3)
    assert drain(q) == ["a"]
    clock.advance(100)
    assert drain(q) == []  # the superseded due times do not fire again
    q.add_after("b", 0)
    q.add_after("c", -1)
    assert q.queued() == ("b", "c")


def test_a_delayed_key_that_is_already_queued_is_not_queued_twice() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 1)
    q.add("a")
    clock.advance(1)
    assert q.queued() == ("a",)


def test_rate_limited_adds_back_off_exponentially_up_to_the_cap_until_forgotten() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock, backoff_base=0.5, backoff_cap=3.0)
    start = clock.now
    delays = []
    for _ in range(5):
        q.add_rate_limited("a")
        delays.append(q.waiting()["a"] - start)
        clock.advance(delays[-1])
        assert q.try_get() == "a"
        q.done("a")
        start = clock.now
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert q.num_requeues("a") == 5
    q.forget("a")
    assert q.num_requeues("a") == 0
    q.add_rate_limited("a")
    assert q.waiting()["a"] == clock.now + 0.5


def test_backoff_is_per_key_and_survives_huge_failure_counts() -> None:
    backoff: ExponentialBackoff[str] = ExponentialBackoff(base=0.005, cap=60.0)
    for _ in range(5000):
        backoff.when("a")
    assert backoff.when("a") == 60.0
    assert backoff.when("b") == 0.005
    with pytest.raises(ValueError):
        ExponentialBackoff[str](base=2.0, cap=1.0)


# ---------------------------------------------------------------------------- shutdown


async def test_get_waits_for_an_add() -> None:
    q: WorkQueue[str] = WorkQueue()
    got: list[str] = []

    async def getter() -> None:
        got.append(await q.get())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(getter)
            await anyio.sleep(0.01)
            assert got == []
            q.add("a")
    assert got == ["a"]


async def test_get_wakes_for_a_delayed_key() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.05)
    with anyio.fail_after(2):
        started = anyio.current_time()
        assert await q.get() == "a"
    assert anyio.current_time() - started >= 0.04


async def test_a_waiting_get_notices_an_earlier_delayed_key() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("late", 30)
    got: list[str] = []

    async def getter() -> None:
        got.append(await q.get())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(getter)
            await anyio.sleep(0.01)
            q.add_after("soon", 0.02)
    assert got == ["soon"]


async def test_shutdown_wakes_waiting_gets_and_refuses_later_ones() -> None:
    q: WorkQueue[str] = WorkQueue()
    outcomes: list[str] = []

    async def getter() -> None:
        try:
            await q.get()
        except QueueShutDown:
            outcomes.append("shut down")

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(getter)
            await anyio.sleep(0.01)
            q.shutdown()
    assert outcomes == ["shut down"] * 3
    q.add("a")  # ignored
    q.add_after("b", 0)
    with pytest.raises(QueueShutDown):
        await q.get()
    with pytest.raises(QueueShutDown):
        q.try_get()
    assert len(q) == 0


def test_shutdown_drops_queued_and_waiting_keys() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add_after("b", 1)
    q.shutdown()
    assert q.queued() == ()
    assert q.waiting() == {}
    assert q.shutting_down


async def test_shutdown_and_drain_waits_for_work_in_flight() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("b")
    a, b = q.try_get(), q.try_get()
    assert (a, b) == ("a", "b")
    drained = anyio.Event()

    async def drainer() -> None:
        await q.shutdown_and_drain()
        drained.set()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drainer)
            await anyio.sleep(0.01)
            assert not drained.is_set()
            q.add("a")  # ignored: shutting down
            q.done("a")
            await anyio.sleep(0.01)
            assert not drained.is_set()
            q.done("b")
    assert drained.is_set()
    assert q.processing() == frozenset()


async def test_shutdown_and_drain_with_nothing_in_flight_returns_at_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    with anyio.fail_after(1):
        await q.shutdown_and_drain()


async def test_async_iteration_ends_at_shutdown() -> None:
    q: WorkQueue[str] = WorkQueue()
    for key in "abc":
        q.add(key)
    seen = []
    with anyio.fail_after(2):
        async for key in q:
            seen.append(key)
            q.done(key)
            if len(seen) == 3:
                q.shutdown()
    assert seen == ["a", "b", "c"]


# ---------------------------------------------------------------------------- run_workers


async def test_workers_never_run_one_key_twice_at_once_and_run_it_after_each_add() -> None:
    q: WorkQueue[int] = WorkQueue(name="concurrent")
    holders: dict[int, int] = defaultdict(int)
    runs: dict[int, int] = defaultdict(int)
    added_since_run: set[int] = set()

    async def handler(key: int) -> None:
        holders[key] += 1
        assert holders[key] == 1, f"key {key} held twice"
        added_since_run.discard(key)
        runs[key] += 1
        await anyio.sleep(0.001 * (key % 3))
        holders[key] -= 1

    async def producer() -> None:
        for round_ in range(30):
            for key in range(10):
                if (key + round_) % 3:
                    q.add(key)
                    added_since_run.add(key)
            await anyio.sleep(0.001)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_workers, q, handler, workers=4))
            await producer()
            while added_since_run or len(q) or q.processing():  # noqa: ASYNC110
                await anyio.sleep(0.005)
            q.shutdown()
    assert added_since_run == set()
    assert set(runs) == set(range(10))


async def test_run_workers_retries_failures_as_their_kind_says() -> None:
    q: WorkQueue[str] = WorkQueue(backoff_base=0.01, backoff_cap=0.02)
    calls: dict[str, int] = defaultdict(int)
    finished = anyio.Event()

    async def handler(key: str) -> None:
        calls[key] += 1
        if key == "permanent":
            raise PermanentError("bad config")
        if key == "temporary" and calls[key] < 3:
            raise TemporaryError("not yet", delay=0.01)
        if key == "crash" and calls[key] < 3:
            raise RuntimeError("boom")
        if calls["temporary"] >= 3 and calls["crash"] >= 3 and calls["permanent"] >= 1:
            finished.set()

    for key in ["permanent", "temporary", "crash"]:
        q.add(key)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_workers, q, handler, workers=2))
            await finished.wait()
            await anyio.sleep(0.05)  # a wrongly retried key would run again by now
            await q.shutdown_and_drain()
    assert calls == {"permanent": 1, "temporary": 3, "crash": 3}
    assert q.num_requeues("crash") == 0  # forgotten after the success
    assert q.num_requeues("permanent") == 0


async def test_cancelling_workers_marks_keys_in_flight_done() -> None:
    q: WorkQueue[str] = WorkQueue()
    started = anyio.Event()

    async def handler(key: str) -> None:
        started.set()
        await anyio.sleep_forever()

    q.add("a")
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_workers, q, handler, workers=1))
            await started.wait()
            assert q.processing() == frozenset({"a"})
            tg.cancel_scope.cancel()
    assert q.processing() == frozenset()


async def test_run_workers_needs_a_worker() -> None:
    async def handler(key: str) -> None:
        pass

    with pytest.raises(ValueError):
        await run_workers(WorkQueue[str](), handler, workers=0)


def test_temporary_error_rejects_a_negative_delay() -> None:
    with pytest.raises(ValueError):
        TemporaryError("x", delay=-1)


# ---------------------------------------------------------------------------- property


KEYS = st.sampled_from(["a", "b", "c", "d"])
WORKERS = st.integers(min_value=0, max_value=2)


class WorkQueueMachine(RuleBasedStateMachine):
    """Random interleavings of add/add_after/get/done/time by three logical workers.

    Checks: a key is never held by two workers; the ready list holds each key once and
    never a key in flight; every add (or due delayed add) is followed by a get of that key
    that happened after it, once time runs out and the workers finish everything.
    """

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock()
        self.queue: WorkQueue[str] = WorkQueue(clock=self.clock)
        self.held: list[str | None] = [None, None, None]
        self.step = 0
        self.needs: dict[str, int] = {}  # key -> step of its latest add that needs a run
        self.delayed: dict[str, float] = {}  # key -> earliest due time (model)
        self.last_get: dict[str, int] = {}

    def _tick(self) -> None:
        self.step += 1

    def _need(self, key: str) -> None:
        self.needs[key] = self.step

    @rule(key=KEYS)
    def add(self, key: str) -> None:
        self._tick()
        self.queue.add(key)
        self._need(key)

    @rule(key=KEYS, delay=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def add_after(self, key: str, delay: float) -> None:
        self._tick()
        self.queue.add_after(key, delay)
        if delay <= 0:
            self._need(key)
        else:
            due = self.clock.now + delay
            self.delayed[key] = min(due, self.delayed.get(key, due))

    @rule(key=KEYS)
    def add_rate_limited(self, key: str) -> None:
        self._tick()
        before = self.clock.now
        self.queue.add_rate_limited(key)
        due = self.queue.waiting()[key]
        assert due > before
        self.delayed[key] = min(due, self.delayed.get(key, due))

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 5.0]))
    def advance(self, seconds: float) -> None:
        self._tick()
        self.clock.advance(seconds)
        self._fire_due()

    def _fire_due(self) -> None:
        for key, due in list(self.delayed.items()):
            if due <= self.clock.now:
                del self.delayed[key]
                self._need(key)

    @rule(worker=WORKERS)
    def get(self, worker: int) -> None:
        if self.held[worker] is not None:
            return
        self._tick()
        key = self.queue.try_get()
        if key is None:
            return
        assert key not in self.held, f"{key} handed to a second worker"
        self.held[worker] = key
        self.last_get[key] = self.step

    @precondition(lambda self: any(self.held))
    @rule(worker=WORKERS)
    def done(self, worker: int) -> None:
        key = self.held[worker]
        if key is None:
            return
        self._tick()
        self.held[worker] = None
        self.queue.done(key)

    @rule(key=KEYS)
    def forget(self, key: str) -> None:
        self.queue.forget(key)
        assert self.queue.num_requeues(key) == 0

    @invariant()
    def one_holder_and_dedup(self) -> None:
        held = [key for key in self.held if key is not None]
        assert len(held) == len(set(held))
        assert self.queue.processing() == frozenset(held)
        queued = self.queue.queued()
        assert len(queued) == len(set(queued)), f"duplicate in ready list {queued}"
        assert not set(queued) & set(held), "a key in flight is also ready"

    @invariant()
    def waiting_matches_the_model(self) -> None:
        self._fire_due()  # the queue promotes due keys when looked at
        assert self.queue.waiting() == self.delayed

    def teardown(self) -> None:
        if not hasattr(self, "queue"):
            return
        for worker, key in enumerate(self.held):
            if key is not None:
                self._tick()
                self.held[worker] = None
                self.queue.done(key)
        self._tick()
        self.clock.advance(10_000)  # past every backoff and delay
        self._fire_due()
        while (key := self.queue.try_get()) is not None:
            self._tick()
            self.last_get[key] = self.step
            self.queue.done(key)
        for key, step in self.needs.items():
            assert self.last_get.get(key, -1) > step, f"{key} added at step {step} never ran"
        assert self.queue.waiting() == {}
        assert len(self.queue) == 0


TestWorkQueueMachine = WorkQueueMachine.TestCase
TestWorkQueueMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


async def test_run_with_resync_adds_every_key_again_and_shuts_the_queue_down() -> None:
    from reconciler.work.queue import run_with_resync

    queue: WorkQueue[str] = WorkQueue(name="resync")
    seen: list[str] = []

    async def handler(key: str) -> None:
        seen.append(key)

    with anyio.move_on_after(0.35):
        await run_with_resync(queue, handler, keys=lambda: ["a", "b"], every_s=0.1, workers=2)
    assert seen.count("a") >= 3 and seen.count("b") >= 3
    assert queue.shutting_down


async def test_a_resync_round_is_added_in_slices_spread_over_the_interval() -> None:
    from reconciler.work.queue import run_with_resync

    queue: WorkQueue[str] = WorkQueue(name="paced")
    seen: list[str] = []

    async def handler(key: str) -> None:
        seen.append(key)

    # six keys in slices of two over 300 s: the second slice is due after 100 s
    with anyio.move_on_after(0.3):
        await run_with_resync(
            queue, handler, keys=lambda: list("abcdef"), every_s=300.0, slice_size=2
        )
    assert seen == ["a", "b"]


async def test_a_resync_round_is_capped_at_its_rate() -> None:
    from reconciler.work.queue import run_with_resync

    queue: WorkQueue[str] = WorkQueue(name="capped")
    seen: list[str] = []

    async def handler(key: str) -> None:
        seen.append(key)

    # every 0.01 s would add everything at once; 2 keys at 0.01 keys/s waits 200 s
    with anyio.move_on_after(0.3):
        await run_with_resync(
            queue, handler, keys=lambda: list("abcdef"), every_s=0.01, slice_size=2, max_rate=0.01
        )
    assert seen == ["a", "b"]
    with pytest.raises(ValueError, match="max_rate"):
        await run_with_resync(queue, handler, keys=list, every_s=1.0, max_rate=0)
