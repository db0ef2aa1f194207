"""Retention inside the fold (CONTRACT.md "Retention"): decided request ids and released
leases are forgotten ``decision_retention_s`` seconds of stream time after their final
decision or release; a replay reproduces it. (That the store deletes what the fold
evicted is in tests/store/test_sqlite.py.)

Property tests reuse the random streams of ``test_fold_properties`` (one second of stream
time per input) with a short retention, and check after every input that nothing is
kept past its retention, nothing pending or active is evicted, the capacity invariant
holds, the derived indexes equal a fresh ``reindex``; and at the end that a replay and a
restart half way reach the same state digest with the same output bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.core.expiry import ExpiryIndex, epoch_second
from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.model import JobId, LeaseState
from reconciler.core.state import Effects, State
from reconciler.store.digest import state_digest
from tests.core.test_fold_properties import Run, budget, derived, out_tuples, over, play
from tests.support.builders import admit, cmd, message, pool, snapshot

RETENTION = 7


def _now(msg: Message) -> int:
    second = epoch_second(msg.timestamp)
    assert second is not None
    return second


def restored(state: State) -> State:
    """What a restarted replica loads: persisted fields (retention's times included)."""
    fresh = State(
        applied_seq=state.applied_seq,
        hosts=dict(state.hosts),
        pools=dict(state.pools),
        classes=dict(state.classes),
        profiles=dict(state.profiles),
        policies=dict(state.policies),
        leases=dict(state.leases),
        decisions=dict(state.decisions),
        jobs=dict(state.jobs),
        released_at=dict(state.released_at),
        decision_retention_s=state.decision_retention_s,
    )
    fresh.reindex()
    return fresh


@dataclass
class RetainedRun(Run):
    """A property run whose state forgets after ``RETENTION`` seconds."""

    def send(self, item: Any) -> Effects:
        fx = super().send(item)
        self.check_retention(self.log[-1], fx)
        return fx

    def check_retention(self, msg: Message, fx: Effects) -> None:
        s = self.state
        now = _now(msg)
        horizon = now - RETENTION
        for rid, record in s.decisions.items():
            if record.phase == "final":
                assert record.final_at is not None and horizon < record.final_at <= now, rid
            else:
                assert record.final_at is None, rid
        for lease_id, lease in s.leases.items():
            if lease.state is LeaseState.RELEASED:
                at = s.released_at.get(lease_id)
                assert at is not None and horizon < at <= now, lease_id
            else:
                assert lease_id not in s.released_at
                if lease.gated and lease.request_id is not None:  # pending: never evicted
                    assert lease.request_id in s.decisions
        assert set(s.released_at) <= set(s.leases)
        for job, lease_id in s.jobs.items():
            assert lease_id in s.leases and s.leases[lease_id].job == job
        for instance, lease_id in s.by_instance.items():
            assert s.leases[lease_id].instance == instance
        for lease_id in fx.leases:  # what was evicted is named for the store to delete
            assert lease_id in s.leases or lease_id not in s.released_at
        if self.strict:
            for host in s.hosts:
                assert not any(over(s, host)), host
        assert derived(s) == derived(restored(s))

    def check_replay(self) -> None:
        for restart_at in (None, len(self.log) // 2):
            replay = State(decision_retention_s=RETENTION)
            for i, (msg, outs) in enumerate(zip(self.log, self.outs, strict=True)):
                if i == restart_at:
                    replay = restored(replay)
                assert out_tuples(fold(replay, msg)) == outs, f"diverged at seq {msg.seq}"
            assert state_digest(replay) == state_digest(self.state)


@budget(150)
@given(data=st.data())
def test_retention_keeps_every_invariant_and_replays_to_the_same_digest(data: Any) -> None:
    run = play(
        data,
        RetainedRun(strict=True, checks=False, state=State(decision_retention_s=RETENTION)),
        steps=80,
    )
    run.check_replay()


@budget(100)
@given(
    events=st.lists(st.tuples(st.integers(0, 50), st.booleans(), st.integers(0, 9)), max_size=60),
    through=st.lists(st.integers(0, 60), max_size=8),
)
def test_the_expiry_index_hands_out_each_entry_once_in_time_order(
    events: list[tuple[int, bool, int]], through: list[int]
) -> None:
    index = ExpiryIndex()
    filed: list[tuple[int, str]] = []
    for second, is_lease, n in events:
        key = f"k{n}"
        (index.add_lease if is_lease else index.add_decision)(second, key)  # type: ignore[arg-type]
        filed.append((second, ("L" if is_lease else "D") + key))
    taken: list[tuple[int, str]] = []
    for limit in sorted(through):
        decisions, leases = index.due(limit)
        got = [(s, "D" + k) for s, k in decisions] + [(s, "L" + k) for s, k in leases]
        assert all(s <= limit for s, _ in got)
        taken += got
    decisions, leases = index.due(10**9)
    taken += [(s, "D" + k) for s, k in decisions] + [(s, "L" + k) for s, k in leases]
    assert sorted(taken) == sorted(filed)
    assert len(index) == 0 and index.due(10**9) == ([], [])


def test_epoch_second_reads_rfc3339_utc_and_refuses_anything_else() -> None:
    assert epoch_second("1970-01-01T00:00:00Z") == 0
    assert epoch_second("2026-12-02T10:00:01.123456789Z") == 1_796_205_601
    assert epoch_second("") is None
    assert epoch_second("not a timestamp at all") is None


# ====================================================================== examples


class Clocked:
    """A state folded one input per ``step`` seconds of stream time."""

    def __init__(self, retention: int | None = 60) -> None:
        self.state = State(decision_retention_s=retention)
        self.seq = 0
        self.second = 0
        self.log: list[Message] = []

    def send(self, item: tuple[str, dict[str, Any]], *, after: int = 1) -> Effects:
        self.seq += 1
        self.second += after
        base = message(self.seq, item)
        minutes, seconds = divmod(self.second, 60)
        hours, minutes = divmod(minutes, 60)
        msg = Message(
            seq=base.seq,
            timestamp=f"2026-12-02T{10 + hours:02d}:{minutes:02d}:{seconds:02d}Z",
            input=base.input,
        )
        self.log.append(msg)
        return fold(self.state, msg)


def decision(fx: Effects) -> dict[str, Any]:
    (out,) = [o for o in fx.outputs if o.subject.startswith("out.decision.")]
    body: dict[str, Any] = orjson.loads(out.payload)
    return body


def fleet(retention: int | None = 60) -> Clocked:
    run = Clocked(retention)
    run.send(snapshot("h1", cpu=8))
    run.send(pool("p", cpu=2, memory_mib=0, disk_gib=0))
    return run


def test_a_decided_request_id_is_new_again_after_the_retention() -> None:
    run = fleet(retention=60)
    first = decision(run.send(admit("r1", "p", "i1")))
    run.send(cmd("release", "rel1", instance="i1"))
    again = run.send(admit("r1", "p", "i1"), after=30)  # within: republished unchanged
    assert decision(again) == first and "r1" in run.state.decisions
    run.send(cmd("release", "noop", instance="x"), after=31)  # 61 s after: forgotten
    assert "r1" not in run.state.decisions
    assert "L3" not in run.state.leases and "L3" not in run.state.released_at
    anew = decision(run.send(admit("r1", "p", "i1")))
    assert anew["outcome"] == "admitted" and anew["input_seq"] != first["input_seq"]


def test_without_retention_nothing_is_forgotten() -> None:
    run = fleet(retention=None)
    run.send(admit("r1", "p", "i1"))
    run.send(cmd("release", "rel1", instance="i1"))
    run.send(cmd("release", "noop", instance="x"), after=10**6)
    assert "r1" in run.state.decisions and "L3" in run.state.leases


def test_an_active_lease_and_its_decision_lease_stay() -> None:
    run = fleet(retention=10)
    run.send(admit("r1", "p", "i1", job="j1"))
    run.send(cmd("release", "noop", instance="x"), after=100)
    assert "r1" not in run.state.decisions  # the decision went ...
    lease = run.state.lease_of_instance("i1")
    assert lease is not None and lease.active  # ... the lease it names did not
    assert run.state.jobs[JobId("j1")] == lease.lease_id


def test_evicting_a_released_lease_drops_its_job_binding() -> None:
    run = fleet(retention=10)
    run.send(admit("r1", "p", "i1", job="j1"))
    run.send(cmd("release", "rel1", instance="i1"))
    fx = run.send(cmd("release", "noop", instance="x"), after=100)
    assert "j1" not in run.state.jobs and fx.jobs == {"j1"}
    assert run.state.lease_of_instance("i1") is None


@pytest.mark.parametrize("retention", [1, 5])
def test_a_replay_with_the_same_retention_reaches_the_same_digest(retention: int) -> None:
    run = fleet(retention=retention)
    for n in range(30):
        run.send(admit(f"r{n % 9}", "p", f"i{n % 5}"), after=n % 3)
        run.send(cmd("release", f"rel{n}", instance=f"i{(n * 7) % 5}"), after=n % 2)
    replay = State(decision_retention_s=retention)
    for msg in run.log:
        fold(replay, msg)
    assert state_digest(replay) == state_digest(run.state)
    other = State(decision_retention_s=retention + 100)
    for msg in run.log:
        fold(other, msg)
    assert state_digest(other) != state_digest(run.state)
