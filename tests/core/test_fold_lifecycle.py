"""Example tests of the fold's lifecycle inputs (issue 25): config applied whole or not
at all (``apply-config``), deleted, checked without applying; hosts cordoned, drained
and uncordoned; failures the executor reports; outputs too large for the bus.

Each builds a small fleet from contract-shaped payloads and reads what the fold
published, as a consumer of ``rc.out.…`` would.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from reconciler.core import inputs as ev
from reconciler.core.configs import CONFIG_KINDS, diff_payloads
from reconciler.core.fold import OutputTooLarge, fold_input
from reconciler.core.fold.config import MAX_DECISION_ITEMS, plan_change
from reconciler.core.inputs import from_payload
from reconciler.core.messages import MAX_OUTPUT_BYTES, Decision
from reconciler.core.model import HostName, JobId, LeaseId, LeaseState, PoolName
from reconciler.core.state import Effects
from reconciler.store.digest import state_digest
from tests.support.builders import (
    Fleet,
    admit,
    apply_config,
    cmd,
    failure,
    gpu,
    gpu_class,
    gpu_profile,
    lifecycle,
    pool,
    snapshot,
)

H1 = HostName("h1")


def decision(fx: Effects) -> dict[str, Any]:
    (only,) = [orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision")]
    assert isinstance(only, dict)
    return only


def subjects(fx: Effects) -> list[str]:
    return [o.subject for o in fx.outputs]


def host_fleet(**snap: Any) -> Fleet:
    fleet = Fleet()
    fleet.send(snapshot("h1", cpu=16, memory_mib=65536, disk_gib=400, **snap))
    return fleet


def warm_ready(fleet: Fleet, pool_name: str, name: str) -> LeaseId:
    fleet.send(
        admit(f"w-{name}", pool_name, name, kind="warm"),
        lifecycle("h1", "instance-created", name),
        lifecycle("h1", "instance-ready", name),
    )
    lease = fleet.state.lease_of_instance(name)
    assert lease is not None and lease.state is LeaseState.READY
    return lease.lease_id


# ------------------------------------------------------------------ apply-config


def test_a_change_with_one_bad_item_changes_nothing_and_names_it() -> None:
    fleet = host_fleet()
    fx = fleet.send(
        apply_config(
            "a1",
            pool("good", min_ready=1, max_ready=2),
            pool("bad", min_ready=3, max_ready=1),
        )
    )
    d = decision(fx)
    assert (d["verb"], d["outcome"], d["reason"]) == ("apply-config", "rejected", "invalid-config")
    assert d["items"] == [
        {"kind": "pool", "name": "bad", "error": "pool 'bad': warm.min_ready 3 > max_ready 1"}
    ]
    assert d["detail"].startswith("1 of 2 item(s) refused, nothing applied")
    assert fleet.state.pools == {} and subjects(fx) == ["out.decision.a1"]


def test_a_good_change_is_applied_whole_and_says_what_became_of_each_item() -> None:
    fleet = host_fleet()
    fleet.send(pool("kept"), pool("changed", max_instances=4))
    fx = fleet.send(
        apply_config("a1", pool("kept"), pool("changed", max_instances=5), gpu_class("a100"))
    )
    d = decision(fx)
    assert d["outcome"] == "applied"
    assert [(i["name"], i["change"]) for i in d["items"]] == [
        ("kept", "unchanged"),
        ("changed", "updated"),
        ("a100", "created"),
    ]
    assert d["detail"] == "3 item(s): 1 unchanged, 1 updated, 1 created"
    assert fleet.state.pools[PoolName("changed")].max_instances == 5
    assert fleet.state.pools[PoolName("kept")].seq == 1 + 1  # left as it was, not rewritten
    assert fx.pool_rows == {"changed"} and fx.classes == {"a100"}
    # the same request id again: its decision, unchanged, and nothing else
    again = fleet.send(
        apply_config("a1", pool("kept"), pool("changed", max_instances=9), gpu_class("a100"))
    )
    assert decision(again) == d and fleet.state.pools[PoolName("changed")].max_instances == 5


def test_what_the_schema_cannot_say_is_refused_per_item() -> None:
    fleet = host_fleet()
    change = apply_config(
        "a1",
        pool("twice"),
        pool("twice"),
        pool("dup", claims=[{"name": "x", "class": "c"}, {"name": "x", "class": "c"}]),
        delete=(("pool", "ghost"), ("pool", "twice")),
    )
    d = decision(fleet.send(change))
    assert [(i["name"], i["error"]) for i in d["items"]] == [
        ("twice", "pool 'twice' is named twice in the change"),
        ("dup", "pool 'dup': claim names repeat"),
        ("ghost", "there is no pool named 'ghost'"),
        ("twice", "pool 'twice' is named twice in the change"),
    ]


def test_an_item_the_decoder_refused_is_refused_with_its_error() -> None:
    kind, payload = apply_config("a1", pool("p"))
    payload["items"][0]["payload"]["wram"] = {}
    built = from_payload(kind, payload)
    assert isinstance(built, ev.ApplyConfig) and built.items[0].error is None
    change = ev.apply_config(payload, {0: "unknown field 'wram': the schema names no such field"})
    fleet = host_fleet()
    fx = Effects()
    fold_input(fleet.state, 5, "2026-12-02T10:00:05Z", change, fx)
    d = decision(fx)
    assert d["items"] == [
        {
            "kind": "pool",
            "name": "p",
            "error": "unknown field 'wram': the schema names no such field",
        }
    ]


def test_a_class_is_not_deleted_while_a_pool_names_it_unless_the_pool_goes_too() -> None:
    fleet = host_fleet()
    fleet.send(gpu_class("a100"), pool("gpu", claims=[{"name": "g", "class": "a100"}]))
    d = decision(fleet.send(apply_config("d1", delete=(("class", "a100"),))))
    assert d["items"][0]["error"] == "class 'a100' is in use by pool 'gpu'"
    # the pool changed in the same change to name another class: the class may go
    moved = pool("gpu", claims=[{"name": "g", "class": "h100"}])
    d = decision(fleet.send(apply_config("d2", moved, delete=(("class", "a100"),))))
    assert d["outcome"] == "applied" and "a100" not in fleet.state.classes


def test_a_gpu_profile_is_not_deleted_while_a_host_names_it() -> None:
    fleet = Fleet()
    fleet.send(
        gpu_profile("compute"),
        snapshot("h1", cpu=8, memory_mib=8192, disk_gib=80, gpus=[gpu(0)], gpu_profile="compute"),
    )
    d = decision(fleet.send(apply_config("d1", delete=(("gpu-profile", "compute"),))))
    assert d["items"][0]["error"].startswith("gpu-profile 'compute' is in use by host 'h1'")


def test_a_changed_gpu_profile_needs_a_newer_revision() -> None:
    fleet = host_fleet()
    fleet.send(gpu_profile("p", revision=2))
    same = decision(fleet.send(apply_config("a1", gpu_profile("p", revision=2))))
    assert same["items"] == [{"kind": "gpu-profile", "name": "p", "change": "unchanged"}]
    stale = decision(fleet.send(apply_config("a2", gpu_profile("p", revision=2, ecc=True))))
    assert "revision 2 is not newer than 2" in stale["items"][0]["error"]
    newer = decision(fleet.send(apply_config("a3", gpu_profile("p", revision=3, ecc=True))))
    assert newer["items"][0]["change"] == "updated"


def test_a_deleted_pool_admits_nothing_and_drains_its_idle_warm_vms() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=1, max_ready=3, max_instances=10))
    warm_ready(fleet, "p", "w-claimed")
    fleet.send(cmd("claim-warm", "c1", pool="p", job="job-1"))
    ready = warm_ready(fleet, "p", "w-ready")
    fleet.send(admit("boot", "p", "w-boot", kind="warm"))
    fleet.send(admit("cold", "p", "cold-1"))
    fx = fleet.send(apply_config("d1", delete=(("pool", "p"),)))
    d = decision(fx)
    assert d["outcome"] == "applied"
    assert d["detail"] == "1 item(s): 1 deleted; 2 warm VM(s) of deleted pools drained"
    deletes = [orjson.loads(o.payload) for o in fx.outputs if o.subject == "out.exec.h1.delete"]
    assert sorted((x["instance"], x["reason"]) for x in deletes) == [
        ("w-boot", "drained"),
        ("w-ready", "drained"),
    ]
    state = fleet.state
    assert state.leases[ready].state is LeaseState.DRAINING
    assert state.lease_of_instance("w-boot").state is LeaseState.DELETING  # type: ignore[union-attr]
    # the claimed VM and the cold lease run to their end
    assert state.lease_of_instance("w-claimed").state is LeaseState.CLAIMED  # type: ignore[union-attr]
    assert state.lease_of_instance("cold-1").state is LeaseState.RESERVED  # type: ignore[union-attr]
    refused = decision(fleet.send(admit("again", "p", "cold-2")))
    assert (refused["outcome"], refused["reason"]) == ("rejected", "unknown-pool")
    assert fx.pool_rows == {"p"} and "p" not in state.pools


def test_plan_change_is_the_folds_verdict_without_changing_anything() -> None:
    fleet = host_fleet()
    fleet.send(pool("p"))
    before = state_digest(fleet.state)
    _, payload = apply_config("x", pool("p", max_instances=7), pool("q"), delete=(("pool", "z"),))
    change = from_payload("cmd.apply-config", payload)
    assert isinstance(change, ev.ApplyConfig)
    planned = plan_change(fleet.state, change)
    assert [(r.name, r.change, r.error) for r in planned] == [
        ("p", "updated", None),
        ("q", "created", None),
        ("z", None, "there is no pool named 'z'"),
    ]
    assert state_digest(fleet.state) == before


def test_a_change_lists_at_most_so_many_items() -> None:
    fleet = host_fleet()
    names = [f"p{i}" for i in range(MAX_DECISION_ITEMS + 3)]
    d = decision(fleet.send(apply_config("big", *(pool(n) for n in names))))
    assert len(d["items"]) == MAX_DECISION_ITEMS and len(fleet.state.pools) == len(names)
    assert d["detail"].endswith(f"(the first {MAX_DECISION_ITEMS} listed)")
    Decision.parse(orjson.dumps(d))  # read back as any consumer would


def test_every_config_kind_reads_back_as_the_payload_it_was_given() -> None:
    """``get`` prints an entity's payload; ``apply`` of it changes nothing."""
    items = [
        pool("p", min_ready=1, max_ready=2, claims=[{"name": "g", "class": "a100"}]),
        gpu_class("a100", model="A100", host_selector={"gpu": "yes"}),
        gpu_profile("compute", power_limit_w=300),
        (
            "config.gpu-policy",
            {
                "v": 1,
                "name": "mig",
                "priority": 3,
                "selector": {"models": ["A100"], "indexes": [0, 1]},
                "overrides": {"mig_mode": "enabled", "ecc": True},
            },
        ),
    ]
    fleet = host_fleet()
    fleet.send(*items)
    for kind, payload in items:
        spec = CONFIG_KINDS[kind.removeprefix("config.")]
        name = payload[spec.name_field]
        shown = spec.payload(spec.table(fleet.state)[name])
        built = spec.build(from_payload(kind, shown), 0)
        assert spec.payload(built) == shown
        assert diff_payloads(shown, spec.payload(spec.build(from_payload(kind, payload), 0))) == []
    d = decision(
        fleet.send(
            apply_config(
                "back",
                *(
                    (
                        kind,
                        CONFIG_KINDS[kind.removeprefix("config.")].payload(
                            CONFIG_KINDS[kind.removeprefix("config.")].table(fleet.state)[
                                payload[CONFIG_KINDS[kind.removeprefix("config.")].name_field]
                            ]
                        ),
                    )
                    for kind, payload in items
                ),
            )
        )
    )
    assert {i["change"] for i in d["items"]} == {"unchanged"}


def test_diff_payloads_names_each_field_that_differs() -> None:
    before = {"v": 1, "warm": {"min_ready": 1, "max_ready": 2}, "profiles": ["a"], "x": 1}
    after = {"v": 1, "warm": {"min_ready": 2, "max_ready": 2}, "profiles": ["a", "b"]}
    found = [(path, old, new) for path, old, new in diff_payloads(before, after)]
    assert found[0] == ("warm.min_ready", 1, 2)
    assert found[1] == ("profiles", ["a"], ["a", "b"])
    assert found[2][0] == "x" and found[2][1] == 1 and repr(found[2][2]) == "(absent)"


def test_a_single_config_input_refused_for_an_unknown_field_keeps_the_last_good() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", max_instances=3))
    fx = Effects()
    refused = ev.RefusedConfig("pool", "p", "pool 'p': unknown field 'wram'")
    fold_input(fleet.state, 9, "2026-12-02T10:00:09Z", refused, fx)
    (out,) = fx.outputs
    assert out.subject == "out.config.rejected.pool.p"
    assert orjson.loads(out.payload)["error"] == "pool 'p': unknown field 'wram'"
    assert fleet.state.pools[PoolName("p")].max_instances == 3


# ------------------------------------------------------------------ hosts


def test_cordon_keeps_new_work_off_and_what_runs_there_on() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=0, max_ready=2), admit("c1", "p", "cold-1"))
    d = decision(fleet.send(cmd("cordon", "k1", host="h1")))
    assert (d["outcome"], d["detail"]) == ("ok", "h1 cordoned: nothing new is admitted there")
    refused = decision(fleet.send(admit("c2", "p", "cold-2")))
    assert (refused["outcome"], refused["reason"]) == ("rejected", "host-unschedulable")
    assert fleet.state.lease_of_instance("cold-1").active  # type: ignore[union-attr]
    assert decision(fleet.send(cmd("cordon", "k2", host="h1")))["detail"] == (
        "h1 is cordoned already"
    )
    # a reinstalled host (a new uid) keeps its cordon: it is the name's
    fleet.send(snapshot("h1", uid="uid-new", cpu=16, memory_mib=65536, disk_gib=400))
    assert fleet.state.hosts[H1].cordon == "cordoned"
    assert decision(fleet.send(cmd("uncordon", "u1", host="h1")))["detail"] == "h1 uncordoned"
    assert decision(fleet.send(admit("c3", "p", "cold-3")))["outcome"] == "admitted"


def test_uncordon_does_not_override_a_snapshot_that_says_unschedulable() -> None:
    fleet = host_fleet(schedulable=False)
    fleet.send(pool("p"), cmd("cordon", "k1", host="h1"))
    d = decision(fleet.send(cmd("uncordon", "u1", host="h1")))
    assert d["detail"].startswith("h1 uncordoned; its snapshot says unschedulable")
    assert decision(fleet.send(admit("c1", "p", "cold-1")))["reason"] == "host-unschedulable"


def test_drain_deletes_idle_warm_vms_and_lets_claimed_ones_end() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=0, max_ready=3, max_instances=10))
    idle = warm_ready(fleet, "p", "w-idle")
    claimed = warm_ready(fleet, "p", "w-job")
    fleet.send(cmd("claim-warm", "c1", pool="p", job="job-1"))
    assert fleet.state.leases[claimed].state is LeaseState.CLAIMED or (
        fleet.state.leases[idle].state is LeaseState.CLAIMED
    )
    busy = fleet.state.jobs[JobId("job-1")]
    fx = fleet.send(cmd("drain", "d1", host="h1"))
    d = decision(fx)
    free = idle if busy == claimed else claimed
    name = fleet.state.leases[free].instance
    assert d["detail"] == (
        f"h1 draining: 1 idle warm VM(s) deleted ({name}); 1 other lease(s) run to their end"
    )
    assert fleet.state.leases[free].state is LeaseState.DRAINING
    assert fleet.state.leases[busy].state is LeaseState.CLAIMED
    assert fleet.state.hosts[H1].cordon == "draining"
    assert decision(fleet.send(admit("w9", "p", "w-9", kind="warm")))["outcome"] == "rejected"
    # the drained VM and the job's VM go; the host is empty, still draining
    fleet.send(
        lifecycle("h1", "instance-deleted", name),
        lifecycle("h1", "instance-deleted", fleet.state.leases[busy].instance),
    )
    assert fleet.state.on_host[H1] == set() and fleet.state.hosts[H1].cordon == "draining"


def test_host_commands_name_a_known_host() -> None:
    fleet = host_fleet()
    for verb in ("cordon", "uncordon", "drain"):
        d = decision(fleet.send(cmd(verb, f"{verb}-x", host="h9")))
        assert (d["outcome"], d["reason"]) == ("rejected", "unknown-host")
        assert d["detail"] == "no host named 'h9' has sent a snapshot"


# ------------------------------------------------------------------ failures


def test_a_refused_create_releases_the_lease_with_its_fault() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=1, max_ready=2), admit("w1", "p", "w-1", kind="warm"))
    lease = fleet.state.lease_of_instance("w-1")
    assert lease is not None
    fx = fleet.send(failure("h1", "w-1", lease.lease_id, "create", "Image not found"))
    released = fleet.state.leases[lease.lease_id]
    assert released.state is LeaseState.RELEASED
    assert released.fault == "create failed: Image not found"
    assert [(t.event, t.to_state) for t in fx.transitions] == [("create-failed", "released")]
    assert fx.failed_pools == {"p"} and fx.outputs == []
    assert released.as_dict()["fault"] == "create failed: Image not found"
    # the room is free again
    assert fleet.state.booked[H1] == [0, 0, 0]


def test_a_failure_for_what_is_gone_or_moved_on_changes_nothing() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=0, max_ready=2))
    ready = warm_ready(fleet, "p", "w-1")
    before = dict(fleet.state.leases)
    for item in (
        failure("h1", "w-1", ready, "start"),  # it is ready: the failure came too late
        failure("h1", "w-1", "L999", "create"),  # no such lease
        failure("h2", "w-1", ready, "create"),  # not there
    ):
        fx = fleet.send(item)
        assert fx.outputs == [] and fx.transitions == [] and fx.notes
    assert fleet.state.leases == before
    assert fleet.state.leases[ready].state is LeaseState.READY


def test_a_delete_that_cannot_be_done_leaves_the_lease_deleting_and_booking() -> None:
    fleet = host_fleet()
    fleet.send(pool("p", min_ready=0, max_ready=2))
    ready = warm_ready(fleet, "p", "w-1")
    fleet.send(cmd("authorize-warm-drain", "d1", instance="w-1"))
    fx = fleet.send(failure("h1", "w-1", ready, "delete", "instance is busy"))
    lease = fleet.state.leases[ready]
    assert lease.state is LeaseState.DELETING and lease.fault == "delete failed: instance is busy"
    assert fleet.state.booked[H1] == [2, 4096, 20]
    assert [(t.from_state, t.to_state) for t in fx.transitions] == [("draining", "deleting")]


def test_a_victim_that_cannot_be_deleted_ends_the_preemption_waiting_for_it() -> None:
    fleet = Fleet()
    fleet.send(
        snapshot("h1", cpu=4, memory_mib=8192, disk_gib=80),
        pool("warm", cpu=2, memory_mib=2048, disk_gib=10, min_ready=0, max_ready=2),
        pool("big", cpu=4, memory_mib=4096, disk_gib=20),
    )
    a = warm_ready(fleet, "warm", "w-a")
    b = warm_ready(fleet, "warm", "w-b")
    pending = decision(fleet.send(admit("big-1", "big", "big-1", preemptible=True)))
    assert pending["outcome"] == "pending"
    assert {v["lease_id"] for v in pending["victims"]} == {a, b}
    fleet.send(lifecycle("h1", "instance-deleted", "w-a"))  # one victim went
    fx = fleet.send(failure("h1", "w-b", b, "delete", "instance is busy"))
    d = decision(fx)
    assert (d["verb"], d["phase"], d["outcome"], d["reason"]) == (
        "admit-preemptible",
        "final",
        "rejected",
        "preemption-failed",
    )
    assert d["detail"] == "victim w-b on h1 cannot be deleted: delete failed: instance is busy"
    assert d["lease"]["state"] == "released" and d["lease"]["fault"]
    victim = fleet.state.leases[b]
    assert victim.state is LeaseState.DELETING and victim.victim_of is None
    # the victim books its room again (it still runs); the request books nothing
    assert fleet.state.booked[H1] == [2, 2048, 10]


# ------------------------------------------------------------------ bounded outputs


def test_an_input_whose_command_would_be_too_large_for_the_bus_raises() -> None:
    fleet = host_fleet()
    kind, payload = pool("huge", min_ready=1, max_ready=1)
    payload["image"] = "i" * MAX_OUTPUT_BYTES  # past the schema's bound, as from_payload allows
    fleet.send((kind, payload))
    with pytest.raises(OutputTooLarge, match="create command would be"):
        fleet.send(admit("w1", "huge", "w-1", kind="warm"))
