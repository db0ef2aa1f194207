"""The read-only queries of CONTRACT.md ("Queries") over a folded state.

Each query is called as the NATS adapter calls it: ``QUERIES[name](state, request)``
returns the reply's ``result`` or raises :class:`QueryError` with a contract code. The
``{ok, …}`` envelope, ``health`` and the ``lease`` history belong to the adapter.
The effective-runtime query is covered in ``tests/core/test_runtime.py``.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.core.inputs import ApplyConfig, from_payload
from reconciler.core.model import PoolName
from reconciler.core.queries import QUERIES, QueryError, config_check
from reconciler.core.state import Effects, State
from tests.core.test_fold_properties import Run, budget, play
from tests.support.builders import (
    Fleet,
    admit,
    apply_config,
    cmd,
    gpu,
    gpu_class,
    instance,
    inventory,
    lifecycle,
    pool,
    snapshot,
)

# ---------------------------------------------------------------------------- helpers


def decision(fx: Effects) -> dict[str, Any]:
    (only,) = [orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision.")]
    assert isinstance(only, dict)
    return only


def query(fleet: Fleet, name: str, **request: Any) -> Any:
    return QUERIES[name](fleet.state, request)


def query_error(fleet: Fleet, name: str, **request: Any) -> str:
    with pytest.raises(QueryError) as err:
        QUERIES[name](fleet.state, request)
    return err.value.code


def fleet_with_leases() -> Fleet:
    """h1 holds cold ``vm1`` (job-1) and warm ``w1`` claimed by job-2."""
    fleet = Fleet()
    fleet.send(snapshot("h1"), snapshot("h2"), pool("ci"), pool("warm", max_ready=2))
    assert decision(fleet.send(admit("r1", "ci", "vm1", job="job-1", host="h1")))["outcome"] == (
        "admitted"
    )
    fleet.send(admit("r2", "warm", "w1", kind="warm", host="h1"))
    fleet.send(lifecycle("h1", "instance-ready", "w1"))
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-2"))
    return fleet


def lease_id_of(fleet: Fleet, name: str) -> str:
    lease = fleet.state.lease_of_instance(name)
    assert lease is not None
    return str(lease.lease_id)


# ========================================================================= resolve


def test_resolve_by_instance_name() -> None:
    fleet = fleet_with_leases()

    assert query(fleet, "resolve", identifier="vm1") == {"instance": "vm1"}


def test_resolve_by_the_job_of_a_cold_admission() -> None:
    fleet = fleet_with_leases()

    assert query(fleet, "resolve", identifier="job-1") == {"instance": "vm1"}


def test_resolve_by_the_job_that_claimed_a_warm_vm() -> None:
    fleet = fleet_with_leases()

    assert query(fleet, "resolve", identifier="job-2") == {"instance": "w1"}


def test_resolve_by_lease_id() -> None:
    fleet = fleet_with_leases()

    assert query(fleet, "resolve", identifier=lease_id_of(fleet, "w1")) == {"instance": "w1"}


def test_resolve_by_job_of_an_adopted_vm() -> None:
    fleet = Fleet()
    fleet.send(snapshot("h1"), pool("warm", max_ready=2))
    config = {
        "user.rc.lease-id": "L5",
        "user.rc.pool": "warm",
        "user.rc.kind": "warm",
        "user.rc.job": "job-7",
    }
    fleet.send(inventory("h1", [instance("w7", config=config)]))

    assert query(fleet, "resolve", identifier="job-7") == {"instance": "w7"}


def test_a_job_still_resolves_to_its_instance_after_release() -> None:
    # Contract: "same job → same instance forever"; the core keeps the binding.
    fleet = fleet_with_leases()
    fleet.send(cmd("release", "rel1", instance="w1"))

    assert query(fleet, "resolve", identifier="job-2") == {"instance": "w1"}


def test_resolve_of_an_unknown_identifier_is_not_found() -> None:
    assert query_error(fleet_with_leases(), "resolve", identifier="nobody") == "not-found"


@pytest.mark.parametrize("request_", [{}, {"identifier": ""}, {"identifier": 42}])
def test_resolve_without_an_identifier_string_is_invalid(request_: dict[str, Any]) -> None:
    fleet = fleet_with_leases()

    with pytest.raises(QueryError) as err:
        QUERIES["resolve"](fleet.state, request_)

    assert err.value.code == "invalid"


# =========================================================================== lease


@pytest.mark.parametrize("identifier", ["w1", "job-2", "<lease-id>"])
def test_lease_query_answers_the_lease_by_any_identifier(identifier: str) -> None:
    fleet = fleet_with_leases()
    lease_id = lease_id_of(fleet, "w1")
    identifier = lease_id if identifier == "<lease-id>" else identifier

    result = query(fleet, "lease", identifier=identifier)

    assert result["lease_id"] == lease_id
    assert result["instance"] == "w1"
    assert result["host"] == "h1"
    assert result["host_uid"] == "uid-h1"
    assert result["pool"] == "warm"
    assert result["kind"] == "warm"
    assert result["state"] == "claimed"
    assert result["job"] == "job-2"
    assert result["demand"] == {"cpu": 2, "memory_mib": 4096, "disk_gib": 20}
    assert result["gpus"] == []


def test_lease_query_answers_released_leases_too() -> None:
    fleet = fleet_with_leases()
    fleet.send(cmd("release", "rel1", instance="vm1"))

    assert query(fleet, "lease", identifier="vm1")["state"] == "released"


def test_lease_query_of_an_unknown_identifier_is_not_found() -> None:
    assert query_error(fleet_with_leases(), "lease", identifier="ghost") == "not-found"


def test_lease_query_without_an_identifier_is_invalid() -> None:
    assert query_error(fleet_with_leases(), "lease") == "invalid"


# ===================================================================== assignments


def test_assignments_lists_the_active_leases_on_that_host() -> None:
    fleet = fleet_with_leases()
    fleet.send(admit("r3", "ci", "elsewhere", host="h2"))

    result = query(fleet, "assignments", host="h1", uid="uid-h1")

    assert sorted(le["instance"] for le in result) == ["vm1", "w1"]


def test_assignments_leave_out_released_leases() -> None:
    fleet = fleet_with_leases()
    fleet.send(cmd("release", "rel1", instance="vm1"))

    result = query(fleet, "assignments", host="h1", uid="uid-h1")

    assert [le["instance"] for le in result] == ["w1"]


def test_assignments_are_for_exactly_that_host_identity() -> None:
    fleet = fleet_with_leases()
    fleet.send(snapshot("h1", uid="uid-h1-reinstalled"))  # same name, new identity
    fleet.send(admit("r3", "ci", "vm-new", host="h1"))

    old = query(fleet, "assignments", host="h1", uid="uid-h1")
    new = query(fleet, "assignments", host="h1", uid="uid-h1-reinstalled")

    assert sorted(le["instance"] for le in old) == ["vm1", "w1"]
    assert [le["instance"] for le in new] == ["vm-new"]


def test_assignments_of_an_unknown_host_are_empty() -> None:
    # Contract silent: the core answers an empty list, not not-found.
    assert query(fleet_with_leases(), "assignments", host="h9", uid="uid-h9") == []


def test_assignments_without_a_uid_is_invalid() -> None:
    assert query_error(fleet_with_leases(), "assignments", host="h1") == "invalid"


# ================================================================= unsuitable-hosts


def gpu_hosts() -> Fleet:
    """h-gpu has 2 GPUs, h-cpu none, h-full has no room, h-off is unschedulable."""
    fleet = Fleet()
    fleet.send(
        snapshot("h-gpu", gpus=[gpu(0), gpu(1)]),
        snapshot("h-cpu"),
        snapshot("h-full", cpu=2),
        snapshot("h-off", schedulable=False),
        gpu_class("gpu", count=1),
        pool("ci"),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )
    fleet.send(admit("r0", "ci", "filler", host="h-full"))
    return fleet


def test_unsuitable_hosts_names_the_hosts_where_the_pool_cannot_place() -> None:
    fleet = gpu_hosts()

    result = query(
        fleet, "unsuitable-hosts", pool="ci", potential_hosts=["h-off", "h-gpu", "h-full", "h-cpu"]
    )

    assert result == {"unsuitable": ["h-off", "h-full"]}


def test_unsuitable_hosts_is_a_subset_of_the_potential_hosts() -> None:
    fleet = gpu_hosts()

    result = query(fleet, "unsuitable-hosts", pool="ci", potential_hosts=["h-full"])

    assert result == {"unsuitable": ["h-full"]}


def test_an_unknown_potential_host_is_unsuitable() -> None:
    fleet = gpu_hosts()

    result = query(fleet, "unsuitable-hosts", pool="ci", potential_hosts=["h-gpu", "h-nope"])

    assert result == {"unsuitable": ["h-nope"]}


def test_the_pool_claims_make_hosts_without_gpus_unsuitable() -> None:
    fleet = gpu_hosts()

    result = query(fleet, "unsuitable-hosts", pool="ml", potential_hosts=["h-gpu", "h-cpu"])

    assert result == {"unsuitable": ["h-cpu"]}


def test_request_claims_are_added_to_the_pool_claims() -> None:
    fleet = gpu_hosts()
    claims = [{"name": "extra", "class": "gpu", "parameters": {"gpu": {"count": 2}}}]

    with_claims = query(
        fleet, "unsuitable-hosts", pool="ml", claims=claims, potential_hosts=["h-gpu"]
    )
    with_ci = query(fleet, "unsuitable-hosts", pool="ci", claims=claims, potential_hosts=["h-gpu"])

    assert with_claims == {"unsuitable": ["h-gpu"]}  # 1 (pool) + 2 (request) > 2 GPUs
    assert with_ci == {"unsuitable": []}


def test_a_request_claim_replaces_the_pool_claim_of_the_same_name() -> None:
    fleet = gpu_hosts()
    claims = [{"name": "g", "class": "gpu", "parameters": {"gpu": {"count": 2}}}]

    result = query(fleet, "unsuitable-hosts", pool="ml", claims=claims, potential_hosts=["h-gpu"])

    assert result == {"unsuitable": []}


def test_unsuitable_hosts_with_an_invalid_claim_is_invalid() -> None:
    fleet = gpu_hosts()
    claims = [{"name": "g", "class": "no-such-class"}]

    assert (
        query_error(fleet, "unsuitable-hosts", pool="ci", claims=claims, potential_hosts=["h-gpu"])
        == "invalid"
    )


def test_unsuitable_hosts_with_a_contradicting_claim_is_invalid() -> None:
    fleet = gpu_hosts()
    fleet.send(gpu_class("a100", model="A100"))
    claims = [{"name": "g", "class": "a100", "parameters": {"gpu": {"model": "H100"}}}]

    assert (
        query_error(fleet, "unsuitable-hosts", pool="ci", claims=claims, potential_hosts=[])
        == "invalid"
    )


@pytest.mark.parametrize(
    "request_",
    [
        {"pool": "ci"},
        {"pool": "ci", "potential_hosts": "h-gpu"},
        {"pool": "ci", "potential_hosts": [1]},
        {"pool": "ci", "potential_hosts": [], "claims": {"name": "g"}},
        {"pool": "ci", "potential_hosts": [], "claims": [{"name": "g"}]},
        {"potential_hosts": []},
    ],
)
def test_malformed_unsuitable_hosts_requests_are_invalid(request_: dict[str, Any]) -> None:
    fleet = gpu_hosts()

    with pytest.raises(QueryError) as err:
        QUERIES["unsuitable-hosts"](fleet.state, request_)

    assert err.value.code == "invalid"


def test_unsuitable_hosts_for_an_unknown_pool_is_not_found() -> None:
    # Contract silent on which code; the core answers not-found.
    fleet = gpu_hosts()

    assert query_error(fleet, "unsuitable-hosts", pool="ghost", potential_hosts=[]) == "not-found"


# ---------------------------------------------------------------------- config


def config_of(fleet: Fleet, **request: Any) -> Any:
    return QUERIES["config"](fleet.state, request)


def test_config_lists_the_config_in_force_as_apply_accepts_it() -> None:
    fleet = Fleet()
    fleet.send(pool("b"), pool("a", max_instances=3), gpu_class("a100", model="A100"))
    everything = config_of(fleet)["items"]
    assert [
        (i["kind"], i["payload"].get("pool", i["payload"].get("class"))) for i in everything
    ] == [
        ("pool", "a"),
        ("pool", "b"),
        ("class", "a100"),
    ]
    (one,) = config_of(fleet, kind="pool", name="a")["items"]
    assert one["payload"]["max_instances"] == 3 and one["payload"]["v"] == 1
    assert config_of(fleet, kind="gpu-policy") == {"items": []}
    with pytest.raises(QueryError) as missing:
        config_of(fleet, kind="pool", name="zzz")
    assert missing.value.code == "not-found"
    for bad in ({"kind": "pools"}, {"name": "a"}):
        with pytest.raises(QueryError) as invalid:
            config_of(fleet, **bad)
        assert invalid.value.code == "invalid"


def test_config_check_says_what_apply_would_do_field_by_field() -> None:
    fleet = Fleet()
    fleet.send(pool("a", min_ready=1, max_ready=2))
    _, body = apply_config(
        "check", pool("a", min_ready=2, max_ready=2), pool("bad", min_ready=2, max_ready=1)
    )
    change = from_payload("cmd.apply-config", body)
    assert isinstance(change, ApplyConfig)
    result = config_check(fleet.state, change)
    assert result == {
        "ok": False,
        "items": [
            {
                "kind": "pool",
                "name": "a",
                "change": "updated",
                "fields": [["warm.min_ready", 1, 2]],
            },
            {"kind": "pool", "name": "bad", "error": "pool 'bad': warm.min_ready 2 > max_ready 1"},
        ],
    }
    assert fleet.state.pools[PoolName("a")].warm.min_ready == 1


def test_the_queue_query_lists_waiting_requests_in_admission_order() -> None:
    from reconciler.core.queries import queue
    from tests.support.builders import Fleet, admit, pool, snapshot

    f = Fleet()
    f.send(snapshot("h1", cpu=4), pool("low"), pool("high", priority=5))
    f.send(admit("a1", "low", "vm-1"), admit("a2", "low", "vm-2"))
    f.send(admit("l1", "low", "vm-3", wait_s=60), admit("l2", "low", "vm-4", wait_s=60))
    f.send(admit("h1", "high", "vm-5", wait_s=30))
    every = queue(f.state, {})["requests"]
    assert [(r["request_id"], r["pool"], r["position"]) for r in every] == [
        ("h1", "high", 1),
        ("l1", "low", 1),
        ("l2", "low", 2),
    ]
    assert every[0]["tenant"] is None and every[0]["reason"] == "insufficient-capacity"
    assert every[0]["queued_at"] == "2026-12-02T10:00:08Z"
    assert every[0]["deadline"] == "2026-12-02T10:00:38.000Z"
    assert [r["request_id"] for r in queue(f.state, {"pool": "low"})["requests"]] == ["l1", "l2"]
    assert queue(f.state, {"tenant": "nobody"})["requests"] == []
    # the first `limit` in admission order, and how many matched
    first = queue(f.state, {"limit": 2})
    assert [r["request_id"] for r in first["requests"]] == ["h1", "l1"] and first["total"] == 3
    low = queue(f.state, {"pool": "low", "limit": 1})
    assert [(r["request_id"], r["position"]) for r in low["requests"]] == [("l1", 1)]
    assert low["total"] == 2


@pytest.mark.parametrize("limit", [0, 1001, "5", True])
def test_the_queue_query_refuses_a_limit_out_of_range(limit: object) -> None:
    from reconciler.core.queries import queue

    with pytest.raises(QueryError, match="'limit' must be an integer from 1 to 1000"):
        queue(Fleet().state, {"limit": limit})


# =========================================================================== fleet


def test_fleet_answers_hosts_pools_and_the_fleets_totals() -> None:
    fleet = fleet_with_leases()
    fleet.send(snapshot("g1", gpus=[gpu(0), gpu(1)]), cmd("cordon", "k1", host="h2"))

    answer = query(fleet, "fleet")

    assert [h["host"] for h in answer["hosts"]] == ["g1", "h1", "h2"]
    h1 = answer["hosts"][1]
    assert h1["booked"]["cpu"] > 0 and h1["leases_by_state"] == {"claimed": 1, "reserved": 1}
    assert answer["hosts"][0]["gpus_total"] == 2 and answer["hosts"][0]["gpus_free"] == [0, 1]
    assert answer["hosts"][2]["cordon"] == "cordoned"
    assert [p["pool"] for p in answer["pools"]] == ["ci", "warm"]
    assert answer["pools"][1]["claimed"] == 1
    totals = answer["totals"]
    assert totals["allocatable"]["gpus"] == 2 and totals["booked"]["gpus"] == 0
    assert totals["allocatable"]["cpu"] == sum(h["allocatable"]["cpu"] for h in answer["hosts"])
    assert totals["booked"]["cpu"] == h1["booked"]["cpu"]
    assert totals["hosts"] == {"schedulable": 2, "unschedulable": 0, "cordoned": 1, "draining": 0}
    assert answer["hosts_total"] == 3 and answer["next_after"] is None
    assert answer["applied_seq"] == fleet.state.applied_seq


def test_fleet_pages_hosts_in_name_order() -> None:
    fleet = Fleet()
    fleet.send(*(snapshot(f"h{i:02d}") for i in range(7)))

    first = query(fleet, "fleet", limit=3)
    second = query(fleet, "fleet", limit=3, after=first["next_after"])
    last = query(fleet, "fleet", limit=3, after=second["next_after"])

    assert [h["host"] for h in first["hosts"]] == ["h00", "h01", "h02"]
    assert [h["host"] for h in second["hosts"]] == ["h03", "h04", "h05"]
    assert [h["host"] for h in last["hosts"]] == ["h06"] and last["next_after"] is None
    assert first["hosts_total"] == 7 and first["totals"]["hosts"]["schedulable"] == 7


@pytest.mark.parametrize(
    "request_", [{"limit": 0}, {"limit": 501}, {"limit": "3"}, {"limit": True}, {"after": 3}]
)
def test_malformed_fleet_requests_are_invalid(request_: dict[str, Any]) -> None:
    assert query_error(fleet_with_leases(), "fleet", **request_) == "invalid"


# ======================================================================= decisions


def test_decisions_are_the_newest_first_with_their_reasons() -> None:
    fleet = fleet_with_leases()
    fleet.send(admit("r9", "nope", "vm9"))

    answer = query(fleet, "decisions")

    shown = [(d["request_id"], d["outcome"], d.get("reason")) for d in answer["decisions"]]
    assert shown == [
        ("r9", "rejected", "unknown-pool"),
        ("c1", "claimed", None),
        ("r2", "admitted", None),
        ("r1", "admitted", None),
    ]
    newest = answer["decisions"][0]
    assert newest["verb"] == "admit" and newest["phase"] == "final" and "lease" not in newest
    assert newest["input_seq"] == fleet.seq and newest["decided_at"].startswith("2026-")
    claim = answer["decisions"][1]
    assert claim["lease"]["instance"] == "w1" and claim["lease"]["job"] == "job-2"


def test_decisions_stop_at_the_limit_and_look_as_far_back_as_it_takes() -> None:
    fleet = fleet_with_leases()
    for i in range(30):
        fleet.send(admit(f"x{i}", "nope", f"vm-x{i}"))

    assert [d["request_id"] for d in query(fleet, "decisions", limit=2)["decisions"]] == [
        "x29",
        "x28",
    ]
    everything = query(fleet, "decisions", limit=200)["decisions"]
    assert len(everything) == 33 and everything[-1]["request_id"] == "r1"


def test_decisions_show_a_preemption_waiting_for_its_victims_as_pending() -> None:
    fleet = Fleet()
    fleet.send(snapshot("h1", cpu=2), pool("warm", cpu=1, max_ready=4), pool("cold", cpu=2))
    for i in range(2):
        fleet.send(admit(f"w{i}", "warm", f"w{i}", kind="warm", host="h1"))
        fleet.send(lifecycle("h1", "instance-ready", f"w{i}"))
    fleet.send(admit("p1", "cold", "vm1", preemptible=True))

    (newest, *_) = query(fleet, "decisions")["decisions"]

    assert (newest["request_id"], newest["phase"], newest["outcome"]) == (
        "p1",
        "pending",
        "pending",
    )


def test_a_long_detail_is_cut_in_a_summary() -> None:
    from reconciler.core.queries import decision_summary

    body = {"request_id": "r", "verb": "admit", "phase": "final", "outcome": "rejected"}
    summary = decision_summary(orjson.dumps({**body, "detail": "x" * 5000, "input_seq": 3}))

    assert len(summary["detail"]) == 1025 and summary["input_seq"] == 3


@pytest.mark.parametrize("request_", [{"limit": 0}, {"limit": 201}, {"limit": 2.5}])
def test_malformed_decisions_requests_are_invalid(request_: dict[str, Any]) -> None:
    assert query_error(fleet_with_leases(), "decisions", **request_) == "invalid"


@budget(60)
@given(data=st.data(), limit=st.integers(1, 40))
def test_decisions_are_the_newest_kept_whatever_the_history(data: Any, limit: int) -> None:
    """The ``decisions`` query, which walks the retention index by second, answers what
    a scan of every kept decision would: the final ones and those waiting at a launch
    gate, newest input first, ``limit`` of them."""
    run = play(data, Run(checks=False, state=State(decision_retention_s=30)), steps=80)
    state = run.state
    gated = {
        state.leases[lease_id].request_id
        for ids in state.gated_on_host.values()
        for lease_id in ids
    }
    kept = [
        orjson.loads(r.payload)
        for r in state.decisions.values()
        if r.phase == "final" or r.request_id in gated
    ]
    kept.sort(key=lambda d: (d["input_seq"], d["request_id"]), reverse=True)

    answer = QUERIES["decisions"](state, {"limit": limit})["decisions"]

    assert [(d["request_id"], d["phase"]) for d in answer] == [
        (d["request_id"], d["phase"]) for d in kept[:limit]
    ]
