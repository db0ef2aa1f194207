"""The admission queue folded (issue 26): requests that wait for room, in order, and the
one final decision each gets (admitted, timed out, cancelled).

Examples first, then hypothesis properties over random streams: every request ends
with exactly one final decision; nothing waits while room it fits stands idle (modulo
the documented backfill rule); a replay gives the same bytes and the same digest.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.fold import fold
from reconciler.core.fold.queue import idle_fit, ordered
from reconciler.core.model import PoolName, RequestId
from reconciler.core.state import Effects, State
from reconciler.core.waiting import BACKFILL_LIMIT, epoch_ms, iso_ms
from reconciler.store.digest import state_digest
from tests.support.builders import Fleet, admit, cmd, pool, snapshot


def decisions(fx: Effects) -> list[dict[str, Any]]:
    out = [orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision")]
    return [d for d in out if isinstance(d, dict)]


def of(fx: Effects, request_id: str) -> list[dict[str, Any]]:
    return [d for d in decisions(fx) if d["request_id"] == request_id]


def fleet(cpu: int = 4, **pool_fields: Any) -> Fleet:
    """One host of ``cpu`` vCPUs and pool ``p`` of 2-vCPU VMs: two fit at a time."""
    f = Fleet()
    f.send(snapshot("h1", cpu=cpu), pool("p", **pool_fields))
    return f


def tick(request_id: str, waiting: str = "none") -> tuple[str, dict[str, Any]]:
    return cmd("queue-timeout", request_id, waiting=waiting)


def test_a_request_that_waits_is_queued_then_admitted_when_a_release_frees_room() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    fx = f.send(admit("a3", "p", "vm-3", wait_s=60))
    (queued,) = of(fx, "a3")
    assert (queued["phase"], queued["outcome"], queued["reason"], queued["position"]) == (
        "pending",
        "queued",
        "insufficient-capacity",
        1,
    )
    fx = f.send(admit("a4", "p", "vm-4", wait_s=60))
    (second,) = of(fx, "a4")
    assert second["position"] == 2
    fx = f.send(cmd("release", "r1", instance="vm-1"))
    (admitted,) = of(fx, "a3")
    assert (admitted["phase"], admitted["outcome"]) == ("final", "admitted")
    # its lease is named after its own admit's position (input 5), not the release's
    assert admitted["lease"]["lease_id"] == "L5"
    assert of(fx, "a4") == []
    assert list(f.state.waiting) == [RequestId("a4")]


def test_a_request_without_a_wait_is_refused_at_once_as_before() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    fx = f.send(admit("a3", "p", "vm-3"))
    (refused,) = of(fx, "a3")
    assert (refused["phase"], refused["outcome"], refused["reason"]) == (
        "final",
        "rejected",
        "insufficient-capacity",
    )
    assert "position" not in refused
    assert not f.state.waiting


def test_an_explicit_wait_of_zero_overrides_the_pools_default() -> None:
    f = fleet(wait_s=60)
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    assert of(f.send(admit("a3", "p", "vm-3")), "a3")[0]["outcome"] == "queued"
    assert of(f.send(admit("a4", "p", "vm-4", wait_s=0)), "a4")[0]["outcome"] == "rejected"


def test_a_wait_ends_on_message_time_with_queue_timeout() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=3))  # input 5 at 10:00:05: deadline 10:00:08
    assert of(f.send(tick("t1", "a3"), tick("t2", "a3")), "a3") == []  # 10:00:06, :07
    fx = f.send(tick("t3", "a3"))  # 10:00:08: due
    (ended,) = of(fx, "a3")
    assert (ended["phase"], ended["outcome"], ended["reason"]) == (
        "final",
        "rejected",
        "queue-timeout",
    )
    assert not f.state.waiting and not f.state.queue.by_instance


def test_a_release_of_a_waiting_requests_instance_cancels_it() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=60))
    fx = f.send(cmd("release", "r3", instance="vm-3"))
    (cancelled,) = of(fx, "a3")
    assert (cancelled["outcome"], cancelled["reason"]) == ("rejected", "cancelled")
    (ok,) = of(fx, "r3")
    assert ok["outcome"] == "ok"
    # and it never takes the room that a later release frees
    fx = f.send(cmd("release", "r1", instance="vm-1"))
    assert of(fx, "a3") == []


def test_a_request_larger_than_every_host_is_refused_at_once() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("big", cpu=8))
    (refused,) = of(f.send(admit("a1", "big", "vm-1", wait_s=60)), "a1")
    assert (refused["outcome"], refused["reason"]) == ("rejected", "no-suitable-host")


def test_pool_at_max_waits_and_a_larger_maximum_admits() -> None:
    f = fleet(cpu=16, max_instances=1)
    f.send(admit("a1", "p", "vm-1"))
    (queued,) = of(f.send(admit("a2", "p", "vm-2", wait_s=60)), "a2")
    assert (queued["outcome"], queued["reason"]) == ("queued", "pool-at-max")
    (admitted,) = of(f.send(pool("p", max_instances=2)), "a2")
    assert admitted["outcome"] == "admitted"


def test_a_grown_host_admits_what_waits() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=60))
    fx = f.send(snapshot("h1", revision=2, cpu=6))
    assert of(fx, "a3")[0]["outcome"] == "admitted"


def test_higher_priority_goes_first_then_input_order() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("low", priority=0), pool("high", priority=10))
    f.send(admit("a1", "low", "vm-1"), admit("a2", "low", "vm-2"))
    f.send(admit("q-low", "low", "vm-3", wait_s=60))
    f.send(admit("q-high", "high", "vm-4", wait_s=60))
    assert [w.request_id for w in ordered(f.state)] == ["q-high", "q-low"]
    fx = f.send(cmd("release", "r1", instance="vm-1"))
    assert of(fx, "q-high")[0]["outcome"] == "admitted" and of(fx, "q-low") == []


def test_a_later_request_of_the_same_shape_queues_behind_without_being_placed() -> None:
    f = fleet(cpu=16, max_instances=1)
    f.send(admit("a1", "p", "vm-1"))
    f.send(admit("a2", "p", "vm-2", wait_s=60))
    (behind,) = of(f.send(admit("a3", "p", "vm-3", wait_s=60)), "a3")
    assert behind["outcome"] == "queued" and behind["position"] == 2
    assert "a2" in behind["detail"]


def test_a_warm_top_up_does_not_take_room_a_queued_request_waits_for() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("p"), pool("w", cpu=1, min_ready=0, max_ready=4))
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("q", "p", "vm-3", wait_s=60))
    f.send(cmd("release", "r1", instance="vm-1"))  # q is admitted at once
    f.send(admit("q2", "p", "vm-4", wait_s=60))
    f.send(snapshot("h1", revision=2, cpu=5))  # 1 vCPU free: q2 does not fit
    fx = f.send(admit("warm-1", "w", "warm-1", kind="warm", wait_s=0))
    (refused,) = of(fx, "warm-1")
    assert refused["outcome"] == "rejected" and "kept for 1 queued" in refused["detail"]


def test_a_resent_queued_admit_is_answered_with_its_pending_decision() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    first = of(f.send(admit("a3", "p", "vm-3", wait_s=60)), "a3")
    again = of(f.send(admit("a3", "p", "vm-3", wait_s=60)), "a3")
    assert first == again and len(f.state.waiting) == 1


def test_a_second_admit_for_a_waiting_instance_is_a_duplicate() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=60))
    (dup,) = of(f.send(admit("a4", "p", "vm-3", wait_s=60)), "a4")
    assert (dup["outcome"], dup["reason"]) == ("rejected", "duplicate-instance")


def test_milliseconds_round_trip() -> None:
    assert iso_ms(epoch_ms("2026-12-05T20:53:21.123456789Z") or 0) == "2026-12-05T20:53:21.123Z"
    assert epoch_ms("2026-12-05T20:53:21Z") == 1796504001000
    assert epoch_ms("not a time") is None


# -------------------------------------------------------------------- properties

POOLS = {"s": 1, "m": 2, "l": 3}  # pool -> vCPUs (priority 0, 0, 5)

Op = tuple[str, ...]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(sorted(POOLS)), st.sampled_from([0, 0, 5, 30])),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("grow"), st.integers(2, 10)),
        st.tuples(st.just("tick")),
    ),
    max_size=60,
)


def _stream(script: list[Op]) -> list[tuple[str, dict[str, Any]]]:
    items: list[tuple[str, dict[str, Any]]] = [
        snapshot("h1", cpu=4),
        snapshot("h2", cpu=3),
        pool("s", cpu=1, max_instances=5),
        pool("m", cpu=2),
        pool("l", cpu=3, priority=5),
        (
            "config.tenant",
            {"v": 1, "tenant": "t1", "pools": ["s"], "quota": {"cpu": 3}, "cohort": "c"},
        ),
        ("config.tenant", {"v": 1, "tenant": "t3", "pools": ["m"], "weight": 3, "cohort": "c"}),
    ]
    revision = 1
    for n, op in enumerate(script):
        if op[0] == "admit":
            items.append(admit(f"q{n}", op[1], f"vm-{n}", wait_s=int(op[2])))
        elif op[0] == "release":
            items.append(cmd("release", f"r{n}", instance=f"vm-{op[1]}"))
        elif op[0] == "grow":
            revision += 1
            items.append(snapshot("h2", revision=revision, cpu=int(op[1])))
        else:
            items.append(tick(f"t{n}"))
    return items


def _fits_now(state: State, request_id: RequestId) -> bool:
    return idle_fit(state, state.waiting[request_id]) is not None


@settings(max_examples=150, deadline=None)
@given(ops)
def test_every_request_ends_once_and_nothing_waits_while_room_it_fits_stands_idle(
    script: list[Op],
) -> None:
    f = Fleet()
    seen: dict[str, list[dict[str, Any]]] = {}
    for item in _stream(script):
        fx = f.send(item)
        for d in decisions(fx):
            seen.setdefault(d["request_id"], []).append(d)
        for request_id in f.state.waiting:
            assert not _fits_now(f.state, request_id), f"{request_id} waits but fits"
        # the queue's counts agree with its entries
        per_pool: dict[PoolName, int] = {}
        for w in f.state.waiting.values():
            per_pool[w.pool] = per_pool.get(w.pool, 0) + 1
        assert per_pool == f.state.queue.per_pool
    for rid, ds in seen.items():
        if not rid.startswith("q"):
            continue
        finals = [d for d in ds if d["phase"] == "final"]
        pendings = [d for d in ds if d["phase"] == "pending"]
        assert len(finals) <= 1 and len(pendings) <= 1
        if rid in f.state.waiting:
            assert not finals and pendings[0]["outcome"] == "queued"
        else:
            assert len(finals) == 1, ds
            if pendings:
                assert finals[0]["outcome"] == "admitted" or finals[0]["reason"] in (
                    "queue-timeout",
                    "cancelled",
                )


@settings(max_examples=60, deadline=None)
@given(ops)
def test_a_replay_gives_the_same_bytes_and_the_same_digest(script: list[Op]) -> None:
    f = Fleet()
    live: list[tuple[str, str | None, bytes]] = []
    for item in _stream(script):
        live.extend((o.subject, o.msg_id, o.payload) for o in f.send(item).outputs)
    again = State()
    replayed: list[tuple[str, str | None, bytes]] = []
    for msg in f.log:
        replayed.extend((o.subject, o.msg_id, o.payload) for o in fold(again, msg).outputs)
    assert replayed == live
    assert state_digest(again) == state_digest(f.state)
    # a state rebuilt from its persisted parts has the same queue
    f.state.reindex()
    assert [w.request_id for w in ordered(f.state)] == [w.request_id for w in ordered(again)]


def test_backfill_is_bounded() -> None:
    """A large request at the head is overtaken by smaller ones at most BACKFILL_LIMIT
    times on room it could use; then the room is kept for it."""
    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("small", cpu=1), pool("big", cpu=4))
    f.send(admit("x", "small", "x-0"))  # 3 free: big does not fit
    f.send(admit("big", "big", "big-1", wait_s=600))
    passed = 0
    for n in range(BACKFILL_LIMIT + 3):
        fx = f.send(admit(f"s{n}", "small", f"s-{n}", wait_s=600))
        outcome = of(fx, f"s{n}")[0]["outcome"]
        if outcome == "admitted":
            passed += 1
            f.send(cmd("release", f"rs{n}", instance=f"s-{n}"))
    assert passed == BACKFILL_LIMIT
    assert f.state.waiting[RequestId("big")].passed == BACKFILL_LIMIT
    fx = f.send(cmd("release", "rx", instance="x-0"))
    assert of(fx, "big")[0]["outcome"] == "admitted"


def test_a_waiting_request_whose_pool_is_deleted_is_refused_for_good() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=60))
    fx = f.send(
        (
            "cmd.apply-config",
            {"v": 1, "request_id": "del", "delete": [{"kind": "pool", "name": "p"}]},
        )
    )
    (ended,) = of(fx, "a3")
    assert (ended["outcome"], ended["reason"]) == ("rejected", "unknown-pool")
    assert not f.state.waiting


def test_a_waiting_requests_job_bound_meanwhile_ends_it() -> None:
    f = fleet()
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    f.send(admit("a3", "p", "vm-3", wait_s=60, job="job-7"))
    f.send(snapshot("h1", revision=2, cpu=6))  # room: a3 is admitted and binds job-7
    f.send(admit("a4", "p", "vm-4", wait_s=60, job="job-7"))
    (refused,) = of(f.send(admit("a5", "p", "vm-5", job="job-7")), "a5")
    assert refused["reason"] == "already-claimed"


def test_the_reason_a_request_waits_for_follows_what_blocks_it() -> None:
    f = fleet(cpu=16, max_instances=2)
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    assert of(f.send(admit("q", "p", "vm-3", wait_s=60)), "q")[0]["reason"] == "pool-at-max"
    f.send(snapshot("h1", revision=2, cpu=4), pool("p", max_instances=10))
    assert f.state.waiting[RequestId("q")].reason == "insufficient-capacity"
