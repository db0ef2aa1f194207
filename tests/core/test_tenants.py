"""Tenants (issue 26): quotas, cohorts that borrow and lend, reclaim of what a tenant
lent, and fair sharing by weighted dominant-resource share."""

from __future__ import annotations

from typing import Any

import orjson

from reconciler.core.configs import CONFIG_KINDS
from reconciler.core.inputs import from_payload
from reconciler.core.model import LeaseState, RequestId
from reconciler.core.queries import queue
from reconciler.core.state import Effects
from reconciler.core.tenants import quota_refusal, usage
from tests.support.builders import Fleet, admit, apply_config, cmd, lifecycle, pool, snapshot


def tenant(name: str, pools: list[str], **fields: Any) -> tuple[str, dict[str, Any]]:
    return "config.tenant", {"v": 1, "tenant": name, "pools": pools, **fields}


def outcome(fx: Effects, request_id: str) -> tuple[str, str | None]:
    for o in fx.outputs:
        if o.subject == f"out.decision.{request_id}":
            body = orjson.loads(o.payload)
            return body["outcome"], body.get("reason")
    raise AssertionError(f"no decision for {request_id}")


def test_a_tenant_payload_round_trips_through_get_and_apply() -> None:
    item = tenant(
        "team-a",
        ["a"],
        quota={"cpu": 8, "instances": 4},
        weight=3,
        cohort="ci",
        borrowing_limit={"cpu": 4},
        lending_limit=None,
    )
    f = Fleet()
    f.send(item)
    spec = CONFIG_KINDS["tenant"]
    shown = spec.payload(f.state.tenants["team-a"])
    assert shown == item[1]
    assert spec.payload(spec.build(from_payload("config.tenant", shown), 0)) == shown


def test_limits_without_a_cohort_are_refused_by_name() -> None:
    f = Fleet()
    fx = f.send(tenant("t", ["p"], borrowing_limit={"cpu": 1}))
    (rejected,) = [orjson.loads(o.payload) for o in fx.outputs]
    assert "need a cohort" in rejected["error"] and not f.state.tenants


def test_a_pool_belongs_to_one_tenant_at_most() -> None:
    f = Fleet()
    f.send(pool("p"), pool("q"), tenant("a", ["p"]))
    fx = f.send(tenant("b", ["q", "p"]))
    (rejected,) = [orjson.loads(o.payload) for o in fx.outputs]
    assert rejected["error"] == (
        "tenant 'b': pool 'p' belongs to tenant 'a' already (a pool belongs to one tenant at most)"
    )
    assert sorted(f.state.tenants) == ["a"]
    f.send(tenant("a", ["p", "q"]))  # a tenant may name its own pools again
    assert f.state.tenants["a"].pools == ("p", "q")

    # in one change: both tenants as the change would leave them, and nothing applied
    fx = f.send(apply_config("c1", tenant("c", ["r"]), tenant("d", ["r"])))
    (decision,) = [orjson.loads(o.payload) for o in fx.outputs]
    assert decision["outcome"] == "rejected" and decision["reason"] == "invalid-config"
    errors = [item.get("error", "") for item in decision["items"]]
    assert ["belongs to tenant 'd'" in errors[0], "belongs to tenant 'c'" in errors[1]] == [
        True,
        True,
    ]
    assert sorted(f.state.tenants) == ["a"]
    # moving a pool from one tenant to another in one change is fine
    fx = f.send(apply_config("c2", tenant("a", ["p"]), tenant("e", ["q"])))
    (decision,) = [orjson.loads(o.payload) for o in fx.outputs]
    assert decision["outcome"] == "applied", decision
    assert f.state.tenants["e"].pools == ("q",)


def test_a_quota_refuses_or_queues_and_a_release_admits() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=16), pool("p"), tenant("t", ["p"], quota={"cpu": 4}))
    f.send(admit("a1", "p", "vm-1"), admit("a2", "p", "vm-2"))
    assert outcome(f.send(admit("a3", "p", "vm-3")), "a3") == ("rejected", "tenant-quota")
    assert outcome(f.send(admit("a4", "p", "vm-4", wait_s=60)), "a4") == (
        "queued",
        "tenant-quota",
    )
    assert queue(f.state, {"tenant": "t"})["requests"][0]["tenant"] == "t"
    assert outcome(f.send(cmd("release", "r1", instance="vm-1")), "a4") == ("admitted", None)


def test_a_larger_quota_admits_what_waits() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=16), pool("p"), tenant("t", ["p"], quota={"instances": 1}))
    f.send(admit("a1", "p", "vm-1"))
    assert outcome(f.send(admit("a2", "p", "vm-2", wait_s=60)), "a2")[0] == "queued"
    fx = f.send(tenant("t", ["p"], quota={"instances": 2}))
    assert outcome(fx, "a2") == ("admitted", None)


def cohort_fleet(**a_fields: Any) -> Fleet:
    f = Fleet()
    f.send(snapshot("h1", cpu=32), pool("pa"), pool("pb"))
    f.send(
        tenant("a", ["pa"], quota={"cpu": 4}, cohort="ci", **a_fields),
        tenant("b", ["pb"], quota={"cpu": 4}, cohort="ci"),
    )
    return f


def test_a_tenant_borrows_what_its_cohort_does_not_use() -> None:
    f = cohort_fleet()
    f.send(*(admit(f"a{n}", "pa", f"a-{n}") for n in range(4)))  # 8 vCPUs: 4 borrowed
    assert usage(f.state, f.state.tenants["a"])[0] == 8
    assert outcome(f.send(admit("a9", "pa", "a-9")), "a9") == ("rejected", "tenant-quota")


def test_a_borrowing_limit_bounds_what_is_borrowed() -> None:
    f = cohort_fleet(borrowing_limit={"cpu": 2})
    f.send(*(admit(f"a{n}", "pa", f"a-{n}") for n in range(3)))  # 6: 2 borrowed
    fx = f.send(admit("a3", "pa", "a-3"))
    assert outcome(fx, "a3") == ("rejected", "tenant-quota")
    a = f.state.tenants["a"]
    assert "borrowing limit" in (quota_refusal(f.state, a, [2, 0, 0, 0, 1]) or "")


def test_a_lending_limit_keeps_part_of_a_quota_for_its_tenant() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=32), pool("pa"), pool("pb"))
    f.send(
        tenant("a", ["pa"], quota={"cpu": 4}, cohort="ci"),
        tenant("b", ["pb"], quota={"cpu": 4}, cohort="ci", lending_limit={"cpu": 2}),
    )
    f.send(*(admit(f"a{n}", "pa", f"a-{n}") for n in range(3)))  # 6: 2 borrowed of b's 2
    assert outcome(f.send(admit("a3", "pa", "a-3")), "a3") == ("rejected", "tenant-quota")


def test_a_tenant_under_its_quota_reclaims_idle_warm_vms_of_a_borrower() -> None:
    f = Fleet()
    f.send(snapshot("h1", cpu=8), pool("pa", min_ready=0, max_ready=4), pool("pb"))
    f.send(
        tenant("a", ["pa"], quota={"cpu": 4}, cohort="ci"),
        tenant("b", ["pb"], quota={"cpu": 4}, cohort="ci"),
    )
    # a borrows: 4 warm VMs of 2 vCPUs (8 > its 4), all idle and ready; one claimed
    for n in range(4):
        f.send(
            admit(f"w{n}", "pa", f"w-{n}", kind="warm"),
            lifecycle("h1", "instance-created", f"w-{n}"),
            lifecycle("h1", "instance-ready", f"w-{n}"),
        )
    f.send(cmd("claim-warm", "c0", pool="pa", job="job-0"))
    claimed = {le.instance for le in f.state.leases.values() if le.job is not None}
    fx = f.send(admit("b1", "pb", "b-1", wait_s=60))
    assert outcome(fx, "b1") == ("queued", "insufficient-capacity")
    drained = [le for le in f.state.leases.values() if le.state is LeaseState.DRAINING]
    assert len(drained) == 1 and drained[0].instance not in claimed  # never a running job
    deletes = [o.subject for o in fx.outputs if o.subject.startswith("out.exec.")]
    assert deletes == ["out.exec.h1.delete"]
    # nothing more is drained while that one goes
    fx = f.send(snapshot("h1", revision=2, cpu=8))
    assert [o for o in fx.outputs if o.subject.startswith("out.exec.")] == []
    fx = f.send(lifecycle("h1", "instance-deleted", drained[0].instance))
    assert outcome(fx, "b1") == ("admitted", None)
    assert RequestId("b1") not in f.state.waiting


def test_fair_sharing_admits_by_weighted_share() -> None:
    """Two tenants of weights 1 and 3 flooding a full host: as its jobs end, admissions
    go 1:3 (lowest weighted share first, input order on a tie)."""
    f = Fleet()
    f.send(snapshot("h1", cpu=16), pool("p1"), pool("p3"), pool("other"))
    f.send(tenant("one", ["p1"], weight=1), tenant("three", ["p3"], weight=3))
    f.send(*(admit(f"o{n}", "other", f"o-{n}") for n in range(8)))
    for n in range(40):
        f.send(admit(f"x{n}", "p1", f"x-{n}", wait_s=3600))
        f.send(admit(f"y{n}", "p3", f"y-{n}", wait_s=3600))
    admitted: list[str] = []
    for n in range(8):
        fx = f.send(cmd("release", f"r{n}", instance=f"o-{n}"))
        admitted += [
            orjson.loads(o.payload)["request_id"][0]
            for o in fx.outputs
            if o.subject.startswith("out.decision.") and b'"admitted"' in o.payload
        ]
    assert admitted == ["x", "y", "y", "y", "x", "y", "y", "y"]
