"""Example tests of the fold: one rule of DESIGN.md / CONTRACT.md per test.

Each test builds a small fleet from contract-shaped payloads (``tests/support/builders.py``),
folds it, and reads the decisions and other outputs back as JSON, the way a consumer
of ``rc.out.…`` would.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from reconciler.core.model import LeaseState
from reconciler.core.state import Effects
from tests.support.builders import (
    Fleet,
    admit,
    cmd,
    gpu,
    gpu_class,
    instance,
    inventory,
    lifecycle,
    observation,
    pool,
    res,
    snapshot,
)

# ---------------------------------------------------------------------------- helpers


def decisions(fx: Effects) -> list[dict[str, Any]]:
    return [orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision.")]


def decision(fx: Effects) -> dict[str, Any]:
    """The one decision a step published."""
    (only,) = decisions(fx)
    return only


def outputs(fx: Effects, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o.subject, orjson.loads(o.payload)) for o in fx.outputs if o.subject.startswith(prefix)
    ]


def fleet_of(*items: tuple[str, dict[str, Any]]) -> Fleet:
    fleet = Fleet()
    fleet.send(*items)
    return fleet


def state_of(fleet: Fleet, name: str) -> str:
    lease = fleet.state.lease_of_instance(name)
    assert lease is not None, name
    return lease.state.value


def admitted(
    fleet: Fleet, request_id: str, pool_name: str, name: str, **fields: Any
) -> dict[str, Any]:
    """Admit and insist it was admitted; return the decision's lease."""
    d = decision(fleet.send(admit(request_id, pool_name, name, **fields)))
    assert d["outcome"] == "admitted", d
    return dict(d["lease"])


def ready_warm(fleet: Fleet, pool_name: str, name: str, *, host: str) -> dict[str, Any]:
    """A warm VM admitted on ``host`` and reported ready by Incus."""
    lease = admitted(fleet, f"rq-{name}", pool_name, name, kind="warm", host=host)
    fleet.send(lifecycle(host, "instance-ready", name))
    assert state_of(fleet, name) == "ready"
    return lease


def tagged(lease_id: str, pool_name: str, kind: str, job: str | None = None) -> dict[str, str]:
    config = {"user.rc.lease-id": lease_id, "user.rc.pool": pool_name, "user.rc.kind": kind}
    if job is not None:
        config["user.rc.job"] = job
    return config


# ============================================================ admit (cold and warm)


def test_cold_admit_reserves_a_lease_with_the_pool_flavor_on_a_suitable_host() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci", cpu=2, memory_mib=4096, disk_gib=20))

    d = decision(fleet.send(admit("r1", "ci", "vm1", job="job-1")))

    assert d["verb"] == "admit"
    assert d["phase"] == "final"
    assert d["outcome"] == "admitted"
    assert d["request_id"] == "r1"
    assert d["input_seq"] == 3
    assert d["decided_at"] == "2026-12-02T10:00:03Z"
    assert d["lease"]["instance"] == "vm1"
    assert d["lease"]["host"] == "h1"
    assert d["lease"]["host_uid"] == "uid-h1"
    assert d["lease"]["pool"] == "ci"
    assert d["lease"]["kind"] == "cold"
    assert d["lease"]["state"] == "reserved"
    assert d["lease"]["job"] == "job-1"
    assert d["lease"]["demand"] == res(2, 4096, 20)
    assert d["lease"]["gpus"] == []


def test_decision_is_published_on_its_request_subject_with_phase_msg_id() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))

    fx = fleet.send(admit("r1", "ci", "vm1"))

    (out,) = fx.outputs
    assert out.subject == "out.decision.r1"
    assert out.msg_id == "decision:r1:final"


def test_cold_admit_publishes_no_executor_command() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))

    fx = fleet.send(admit("r1", "ci", "vm1"))

    assert outputs(fx, "out.exec.") == []


def test_warm_admit_reserves_and_publishes_the_exec_create_command() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0), gpu(1)]),
        gpu_class("one-gpu", count=1),
        pool("warm", max_ready=2, claims=[{"name": "g", "class": "one-gpu"}]),
    )

    fx = fleet.send(admit("r1", "warm", "w1", kind="warm"))

    d = decision(fx)
    assert d["outcome"] == "admitted"
    assert d["lease"]["kind"] == "warm"
    assert d["lease"]["state"] == "reserved"
    ((subject, create),) = outputs(fx, "out.exec.")
    assert subject == "out.exec.h1.create"
    lease_id = d["lease"]["lease_id"]
    assert create == {
        "v": 1,
        "command_id": f"create:{lease_id}",
        "host": "h1",
        "instance": "w1",
        "project": "default",
        "lease_id": lease_id,
        "pool": "warm",
        "image": "ubuntu/24.04",
        "profiles": ["default"],
        "demand": res(2, 4096, 20),
        "gpus": [{"index": 0, "pci_address": "0000:01:00.0"}],
        "instance_type": "virtual-machine",
    }
    exec_out = next(o for o in fx.outputs if o.subject.startswith("out.exec."))
    assert exec_out.msg_id == create["command_id"]


def test_a_pool_of_containers_carries_its_instance_type_on_the_create_command() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2, instance_type="container"))

    fx = fleet.send(admit("r1", "warm", "w1", kind="warm"))

    ((_, create),) = outputs(fx, "out.exec.")
    assert create["instance_type"] == "container"


def test_a_pool_that_names_virtual_machines_says_so_on_the_create_command() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2, instance_type="virtual-machine"))

    fx = fleet.send(admit("r1", "warm", "w1", kind="warm"))

    ((_, create),) = outputs(fx, "out.exec.")
    assert create["instance_type"] == "virtual-machine"


def test_a_pool_that_says_nothing_asks_for_virtual_machines_on_the_create_command() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))

    fx = fleet.send(admit("r1", "warm", "w1", kind="warm"))

    ((_, create),) = outputs(fx, "out.exec.")
    assert create["instance_type"] == "virtual-machine"


def test_admission_books_capacity_so_the_next_request_that_does_not_fit_is_rejected() -> None:
    fleet = fleet_of(snapshot("h1", cpu=4), pool("ci", cpu=3))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(admit("r2", "ci", "vm2")))

    assert d["outcome"] == "rejected"
    assert d["reason"] == "insufficient-capacity"


def test_host_reserve_is_not_allocatable() -> None:
    fleet = fleet_of(snapshot("h1", cpu=8, reserve=res(4)), pool("ci", cpu=3))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(admit("r2", "ci", "vm2")))

    assert d["reason"] == "insufficient-capacity"


def test_rejected_admission_reserves_nothing() -> None:
    fleet = fleet_of(snapshot("h1", cpu=1), pool("ci", cpu=2))

    fx = fleet.send(admit("r1", "ci", "vm1"))

    assert decision(fx)["outcome"] == "rejected"
    assert "lease" not in decision(fx)
    assert fleet.state.leases == {}


# ===================================================== admit: every rejection reason


def test_request_that_fits_no_empty_host_is_rejected_no_suitable_host() -> None:
    fleet = fleet_of(snapshot("h1", cpu=4), pool("big", cpu=8))

    d = decision(fleet.send(admit("r1", "big", "vm1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "no-suitable-host")


def test_request_with_no_known_host_is_rejected_no_suitable_host() -> None:
    fleet = fleet_of(pool("ci"))

    d = decision(fleet.send(admit("r1", "ci", "vm1")))

    assert d["reason"] == "no-suitable-host"


def test_request_whose_gpu_claim_no_host_can_ever_satisfy_is_no_suitable_host() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0)]),
        gpu_class("two-gpus", count=2),
        pool("ml", claims=[{"name": "g", "class": "two-gpus"}]),
    )

    d = decision(fleet.send(admit("r1", "ml", "vm1")))

    assert d["reason"] == "no-suitable-host"


def test_unschedulable_hosts_reject_host_unschedulable() -> None:
    fleet = fleet_of(snapshot("h1", schedulable=False), pool("ci"))

    d = decision(fleet.send(admit("r1", "ci", "vm1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "host-unschedulable")


def test_an_unschedulable_host_is_skipped_for_a_schedulable_one() -> None:
    fleet = fleet_of(snapshot("h1", schedulable=False), snapshot("h2"), pool("ci"))

    assert admitted(fleet, "r1", "ci", "vm1")["host"] == "h2"


def test_selected_host_that_is_full_is_rejected_selected_host_unsuitable() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), snapshot("h2", cpu=16), pool("ci", cpu=2))
    admitted(fleet, "r1", "ci", "vm1", host="h1")

    d = decision(fleet.send(admit("r2", "ci", "vm2", host="h1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "selected-host-unsuitable")


def test_unknown_selected_host_is_rejected_selected_host_unsuitable() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))

    d = decision(fleet.send(admit("r1", "ci", "vm1", host="nowhere")))

    assert d["reason"] == "selected-host-unsuitable"


def test_selected_host_outside_the_pool_selector_is_selected_host_unsuitable() -> None:
    fleet = fleet_of(
        snapshot("h1", labels={"zone": "a"}),
        snapshot("h2", labels={"zone": "b"}),
        pool("ci", host_selector={"zone": "a"}),
    )

    d = decision(fleet.send(admit("r1", "ci", "vm1", host="h2")))

    assert d["reason"] == "selected-host-unsuitable"


def test_selected_unschedulable_host_is_rejected_host_unschedulable() -> None:
    fleet = fleet_of(snapshot("h1", schedulable=False), snapshot("h2"), pool("ci"))

    d = decision(fleet.send(admit("r1", "ci", "vm1", host="h1")))

    assert d["reason"] == "host-unschedulable"


def test_admit_to_an_unknown_pool_is_rejected_unknown_pool() -> None:
    fleet = fleet_of(snapshot("h1"))

    d = decision(fleet.send(admit("r1", "nope", "vm1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "unknown-pool")


def test_pool_at_max_instances_rejects_pool_at_max() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci", max_instances=1))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(admit("r2", "ci", "vm2")))

    assert (d["outcome"], d["reason"]) == ("rejected", "pool-at-max")


def test_released_leases_no_longer_count_toward_max_instances() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci", max_instances=1))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("release", "rel1", instance="vm1"))

    admitted(fleet, "r2", "ci", "vm2")


def test_warm_pool_at_max_ready_unclaimed_rejects_pool_at_max() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=1))
    admitted(fleet, "r1", "warm", "w1", kind="warm")

    d = decision(fleet.send(admit("r2", "warm", "w2", kind="warm")))

    assert d["reason"] == "pool-at-max"


def test_a_claimed_warm_vm_frees_a_max_ready_slot() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=1))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))

    admitted(fleet, "r2", "warm", "w2", kind="warm")


def test_claim_naming_an_unknown_class_is_invalid_claim() -> None:
    fleet = fleet_of(snapshot("h1", gpus=[gpu(0)]), pool("ci"))

    d = decision(fleet.send(admit("r1", "ci", "vm1", claims=[{"name": "g", "class": "ghost"}])))

    assert (d["outcome"], d["reason"]) == ("rejected", "invalid-claim")
    assert "ghost" in d["detail"]


def test_claim_contradicting_the_class_model_is_invalid_claim() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, model="A100"), gpu(1, model="H100")]),
        gpu_class("a100", count=1, model="A100"),
        pool("ml"),
    )

    d = decision(
        fleet.send(
            admit(
                "r1",
                "ml",
                "vm1",
                claims=[{"name": "g", "class": "a100", "parameters": {"gpu": {"model": "H100"}}}],
            )
        )
    )

    assert d["reason"] == "invalid-claim"


def test_claim_asking_fewer_gpus_than_its_class_is_invalid_claim() -> None:
    fleet = fleet_of(snapshot("h1", gpus=[gpu(0), gpu(1)]), gpu_class("pair", count=2), pool("ml"))

    d = decision(
        fleet.send(
            admit(
                "r1",
                "ml",
                "vm1",
                claims=[{"name": "g", "class": "pair", "parameters": {"gpu": {"count": 1}}}],
            )
        )
    )

    assert d["reason"] == "invalid-claim"


def test_claim_may_narrow_its_class_with_a_larger_count() -> None:
    fleet = fleet_of(snapshot("h1", gpus=[gpu(0), gpu(1)]), gpu_class("gpu", count=1), pool("ml"))

    lease = admitted(
        fleet,
        "r1",
        "ml",
        "vm1",
        claims=[{"name": "g", "class": "gpu", "parameters": {"gpu": {"count": 2}}}],
    )

    assert lease["gpus"] == [0, 1]


def test_request_claim_with_the_pool_claims_name_replaces_it() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0), gpu(1), gpu(2)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )

    lease = admitted(
        fleet,
        "r1",
        "ml",
        "vm1",
        claims=[{"name": "g", "class": "gpu", "parameters": {"gpu": {"count": 3}}}],
    )

    assert lease["gpus"] == [0, 1, 2]


def test_request_claim_with_a_new_name_is_added_to_the_pool_claims() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0), gpu(1), gpu(2)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )

    lease = admitted(fleet, "r1", "ml", "vm1", claims=[{"name": "extra", "class": "gpu"}])

    assert lease["gpus"] == [0, 1]


def test_second_admit_for_an_active_instance_is_duplicate_instance() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(admit("r2", "ci", "vm1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "duplicate-instance")
    assert len(fleet.state.leases) == 1


def test_a_released_instance_name_may_be_admitted_again() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    first = admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("release", "rel1", instance="vm1"))

    second = admitted(fleet, "r2", "ci", "vm1")

    assert second["lease_id"] != first["lease_id"]


# ====================================================================== idempotency


def test_same_request_id_resends_the_same_decision_bytes_and_changes_nothing() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    first = fleet.send(admit("r1", "ci", "vm1"))
    leases_before = copy.deepcopy(fleet.state.leases)

    again = fleet.send(admit("r1", "ci", "vm1"))

    assert [(o.subject, o.msg_id, o.payload) for o in again.outputs] == [
        (o.subject, o.msg_id, o.payload) for o in first.outputs
    ]
    assert fleet.state.leases == leases_before
    assert again.transitions == []


def test_same_request_id_with_other_fields_still_gets_the_first_decision() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    first = decision(fleet.send(admit("r1", "ci", "vm1")))

    again = decision(fleet.send(admit("r1", "ci", "vm-other")))

    assert again == first
    assert fleet.state.lease_of_instance("vm-other") is None


def test_a_rejection_is_resent_unchanged_even_once_the_request_could_succeed() -> None:
    fleet = fleet_of(pool("ci"))
    first = fleet.send(admit("r1", "ci", "vm1"))
    fleet.send(snapshot("h1"))

    again = fleet.send(admit("r1", "ci", "vm1"))

    assert again.outputs[0].payload == first.outputs[0].payload
    assert fleet.state.leases == {}


def test_every_verb_is_idempotent_by_request_id() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "ci", "vm1")
    ready_warm(fleet, "warm", "w1", host="h1")
    ready_warm(fleet, "warm", "w2", host="h1")
    commands = [
        cmd("mark-created", "m1", instance="vm1"),
        cmd("claim-warm", "c1", pool="warm", job="job-1"),
        cmd("mark-warm-injected", "i1", job="job-1", instance="w1"),
        cmd("authorize-warm-drain", "d1", instance="w2"),
        cmd("mark-deleting", "del1", instance="vm1"),
        cmd("release", "rel1", instance="vm1"),
        cmd("render-runtime", "rr1", instance="w1"),
    ]
    for command in commands:
        first = fleet.send(command)
        leases_before = copy.deepcopy(fleet.state.leases)
        again = fleet.send(command)
        assert [o.payload for o in again.outputs] == [
            o.payload for o in first.outputs if o.subject.startswith("out.decision.")
        ], command
        assert fleet.state.leases == leases_before, command


# ================================================================ placement choices


def test_pack_places_on_the_host_left_with_the_least_room() -> None:
    fleet = fleet_of(snapshot("h-a"), snapshot("h-b"), pool("fill", cpu=4), pool("ci"))
    admitted(fleet, "r0", "fill", "filler", host="h-b")

    assert admitted(fleet, "r1", "ci", "vm1")["host"] == "h-b"


def test_spread_places_on_the_host_left_with_the_most_room() -> None:
    fleet = fleet_of(
        snapshot("h-a"), snapshot("h-b"), pool("fill", cpu=4), pool("ci", placement="spread")
    )
    admitted(fleet, "r0", "fill", "filler", host="h-a")

    assert admitted(fleet, "r1", "ci", "vm1")["host"] == "h-b"


@pytest.mark.parametrize("placement", ["pack", "spread"])
def test_equal_hosts_tie_break_on_the_host_name(placement: str) -> None:
    fleet = fleet_of(
        snapshot("h-c"), snapshot("h-a"), snapshot("h-b"), pool("ci", placement=placement)
    )

    assert admitted(fleet, "r1", "ci", "vm1")["host"] == "h-a"


def test_pack_fills_one_host_before_the_next() -> None:
    fleet = fleet_of(snapshot("h-a"), snapshot("h-b"), pool("ci"))

    hosts = [admitted(fleet, f"r{i}", "ci", f"vm{i}")["host"] for i in range(3)]

    assert hosts == ["h-a", "h-a", "h-a"]


def test_spread_alternates_between_equal_hosts() -> None:
    fleet = fleet_of(snapshot("h-a"), snapshot("h-b"), pool("ci", placement="spread"))

    hosts = [admitted(fleet, f"r{i}", "ci", f"vm{i}")["host"] for i in range(4)]

    assert hosts == ["h-a", "h-b", "h-a", "h-b"]


def test_a_selected_host_is_honoured_over_the_placement_choice() -> None:
    fleet = fleet_of(snapshot("h-a"), snapshot("h-b"), pool("fill", cpu=4), pool("ci"))
    admitted(fleet, "r0", "fill", "filler", host="h-b")

    assert admitted(fleet, "r1", "ci", "vm1", host="h-a")["host"] == "h-a"


def test_pool_host_selector_limits_placement_to_matching_hosts() -> None:
    fleet = fleet_of(
        snapshot("h-a", labels={"arch": "arm64"}),
        snapshot("h-b", labels={"arch": "amd64"}),
        pool("ci", host_selector={"arch": "amd64"}),
    )

    assert admitted(fleet, "r1", "ci", "vm1")["host"] == "h-b"


def test_pool_host_selector_matching_no_host_is_no_suitable_host() -> None:
    fleet = fleet_of(
        snapshot("h-a", labels={"arch": "arm64"}), pool("ci", host_selector={"arch": "riscv"})
    )

    d = decision(fleet.send(admit("r1", "ci", "vm1")))

    assert d["reason"] == "no-suitable-host"


def test_class_host_selector_limits_placement_to_matching_hosts() -> None:
    fleet = fleet_of(
        snapshot("h-a", gpus=[gpu(0)]),
        snapshot("h-b", gpus=[gpu(0)], labels={"gpu-tier": "prod"}),
        gpu_class("prod-gpu", count=1, host_selector={"gpu-tier": "prod"}),
        pool("ml", claims=[{"name": "g", "class": "prod-gpu"}]),
    )

    assert admitted(fleet, "r1", "ml", "vm1")["host"] == "h-b"


def test_all_claims_of_a_request_are_placed_together_on_one_host() -> None:
    # h-a could serve either claim alone, but not both; only h-b holds them together.
    fleet = fleet_of(
        snapshot("h-a", gpus=[gpu(0)]),
        snapshot("h-b", gpus=[gpu(0), gpu(1)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "train", "class": "gpu"}, {"name": "infer", "class": "gpu"}]),
    )

    lease = admitted(fleet, "r1", "ml", "vm1")

    assert lease["host"] == "h-b"
    assert lease["gpus"] == [0, 1]


def test_gpu_choice_takes_the_lowest_free_matching_index() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, model="V100"), gpu(1), gpu(2), gpu(3)]),
        gpu_class("a100", count=1, model="A100"),
        pool("ml", claims=[{"name": "g", "class": "a100"}]),
    )

    first = admitted(fleet, "r1", "ml", "vm1")
    second = admitted(fleet, "r2", "ml", "vm2")

    assert first["gpus"] == [1]
    assert second["gpus"] == [2]


def test_gpu_choice_respects_min_memory() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, memory_mib=16384), gpu(1, memory_mib=81920)]),
        gpu_class("big-gpu", count=1, min_memory_mib=40000),
        pool("ml", claims=[{"name": "g", "class": "big-gpu"}]),
    )

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [1]


def test_gpu_choice_prefers_one_numa_node_over_the_lowest_indexes() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, numa=0), gpu(1, numa=1), gpu(2, numa=0), gpu(3, numa=1)]),
        gpu_class("pair", count=2),
        pool("ml", claims=[{"name": "g", "class": "pair"}]),
    )

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [0, 2]


def test_gpu_choice_takes_the_numa_node_that_still_has_enough_free_gpus() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, numa=0), gpu(1, numa=1), gpu(2, numa=0), gpu(3, numa=1)]),
        gpu_class("one", count=1),
        gpu_class("pair", count=2),
        pool("single", claims=[{"name": "g", "class": "one"}]),
        pool("ml", claims=[{"name": "g", "class": "pair"}]),
    )
    assert admitted(fleet, "r0", "single", "vm0")["gpus"] == [0]

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [1, 3]


def test_gpu_choice_spans_numa_nodes_when_no_node_has_enough() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0, numa=0), gpu(1, numa=1), gpu(2, numa=2)]),
        gpu_class("pair", count=2),
        pool("ml", claims=[{"name": "g", "class": "pair"}]),
    )

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [0, 1]


def test_each_gpu_index_belongs_to_at_most_one_lease() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )
    admitted(fleet, "r1", "ml", "vm1")

    d = decision(fleet.send(admit("r2", "ml", "vm2")))

    assert d["reason"] == "insufficient-capacity"


# ============================================================== admit-preemptible


def full_host_with_warm_vms(*, cpu: int = 4) -> Fleet:
    """Host h1 full of 1-vCPU ready warm VMs of pool ``warm``, plus a cold pool."""
    fleet = fleet_of(
        snapshot("h1", cpu=cpu),
        pool("warm", cpu=1, max_ready=10),
        pool("cold", cpu=2),
    )
    for i in range(cpu):
        ready_warm(fleet, "warm", f"w{i}", host="h1")
    return fleet


def test_preemptible_admit_that_fits_is_admitted_at_once() -> None:
    fleet = fleet_of(snapshot("h1"), pool("cold"))

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert (d["verb"], d["phase"], d["outcome"]) == ("admit-preemptible", "final", "admitted")
    assert "victims" not in d


def test_preemptible_admit_marks_victims_publishes_deletes_and_answers_pending() -> None:
    fleet = full_host_with_warm_vms()

    fx = fleet.send(admit("r1", "cold", "vm1", preemptible=True))

    d = decision(fx)
    assert (d["phase"], d["outcome"]) == ("pending", "pending")
    assert fx.outputs[-1].msg_id == "decision:r1:pending"
    victims = d["victims"]
    assert len(victims) == 2
    assert {v["host"] for v in victims} == {"h1"}
    for v in victims:
        assert state_of(fleet, v["instance"]) == "victim"
    deletes = outputs(fx, "out.exec.h1.delete")
    assert sorted((p["instance"], p["reason"]) for _, p in deletes) == sorted(
        (v["instance"], "preempted") for v in victims
    )
    assert d["lease"]["state"] == "reserved"
    assert d["lease"]["awaiting_victims"] == [v["lease_id"] for v in victims]


def test_plain_admit_never_preempts() -> None:
    fleet = full_host_with_warm_vms()

    d = decision(fleet.send(admit("r1", "cold", "vm1")))

    assert d["reason"] == "insufficient-capacity"
    assert all(le.state is LeaseState.READY for le in fleet.state.leases.values())


def test_pending_reservation_holds_the_victims_capacity() -> None:
    fleet = full_host_with_warm_vms()
    fleet.send(admit("r1", "cold", "vm1", preemptible=True))

    d = decision(fleet.send(admit("r2", "cold", "vm2")))

    assert d["reason"] == "insufficient-capacity"


def test_launch_gate_stays_shut_until_every_victim_is_released() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    first, second = (v["instance"] for v in pending["victims"])

    fleet.send(lifecycle("h1", "instance-deleted", first))
    fx = fleet.send(snapshot("h1", revision=2, cpu=4))

    assert decisions(fx) == []
    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None and lease.gated
    assert state_of(fleet, second) == "victim"


def test_launch_gate_stays_shut_without_a_newer_snapshot_or_inventory() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    fx = Effects()
    for v in pending["victims"]:
        fx.extend(fleet.send(lifecycle("h1", "instance-deleted", v["instance"])))

    assert decisions(fx) == []
    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None and lease.gated


def test_launch_gate_opens_on_a_newer_snapshot_after_victims_are_deleted() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    for v in pending["victims"]:
        fleet.send(lifecycle("h1", "instance-deleted", v["instance"]))

    fx = fleet.send(snapshot("h1", revision=2, cpu=4))

    d = decision(fx)
    assert (d["verb"], d["phase"], d["outcome"]) == ("admit-preemptible", "final", "admitted")
    assert fx.outputs[-1].msg_id == "decision:r1:final"
    assert d["lease"]["lease_id"] == pending["lease"]["lease_id"]
    assert "awaiting_victims" not in d["lease"]
    for v in pending["victims"]:
        assert state_of(fleet, v["instance"]) == "released"


def test_launch_gate_opens_on_a_newer_inventory_after_victims_are_released() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    for i, v in enumerate(pending["victims"]):
        fleet.send(cmd("release", f"rel{i}", instance=v["instance"]))
    survivors = [
        instance(le.instance, cpu=1, config=tagged(le.lease_id, "warm", "warm"))
        for le in fleet.state.leases.values()
        if le.state is LeaseState.READY
    ]

    d = decision(fleet.send(inventory("h1", survivors)))

    assert (d["phase"], d["outcome"]) == ("final", "admitted")


def test_launch_gate_stays_shut_while_a_newer_snapshot_does_not_prove_the_fit() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    for v in pending["victims"]:
        fleet.send(lifecycle("h1", "instance-deleted", v["instance"]))

    shrunk = fleet.send(snapshot("h1", revision=2, cpu=3))
    grown = fleet.send(snapshot("h1", revision=3, cpu=4))

    assert decisions(shrunk) == []
    assert decision(grown)["outcome"] == "admitted"


def test_launch_gate_opens_when_the_last_victim_goes_after_a_newer_snapshot() -> None:
    # The contract only asks for a snapshot newer than the pending decision.
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    first, second = (v["instance"] for v in pending["victims"])
    fleet.send(lifecycle("h1", "instance-deleted", first))
    fleet.send(snapshot("h1", revision=2, cpu=4))

    d = decision(fleet.send(lifecycle("h1", "instance-deleted", second)))

    assert d["outcome"] == "admitted"


def test_resending_a_preemptible_admit_returns_its_current_phase() -> None:
    fleet = full_host_with_warm_vms()
    pending = fleet.send(admit("r1", "cold", "vm1", preemptible=True))

    while_pending = fleet.send(admit("r1", "cold", "vm1", preemptible=True))
    assert [o.payload for o in while_pending.outputs] == [pending.outputs[-1].payload]
    assert outputs(while_pending, "out.exec.") == []

    for v in decision(pending)["victims"]:
        fleet.send(lifecycle("h1", "instance-deleted", v["instance"]))
    final = fleet.send(snapshot("h1", revision=2, cpu=4))
    after = fleet.send(admit("r1", "cold", "vm1", preemptible=True))

    assert [(o.msg_id, o.payload) for o in after.outputs] == [
        (o.msg_id, o.payload) for o in final.outputs
    ]


def test_once_the_launch_gate_opens_the_lease_can_be_marked_created() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))
    for v in pending["victims"]:
        fleet.send(lifecycle("h1", "instance-deleted", v["instance"]))
    fleet.send(snapshot("h1", revision=2, cpu=4))

    d = decision(fleet.send(cmd("mark-created", "m1", instance="vm1")))

    assert (d["outcome"], d["lease"]["state"]) == ("ok", "created")


def test_victims_book_again_once_their_pending_reservation_is_released() -> None:
    # DESIGN: a victim's capacity is promised to the pending reservation that names it.
    # With that reservation gone the victim VMs still run (their delete is in flight),
    # so their capacity must not be handed to a request that skips the launch gate.
    fleet = full_host_with_warm_vms()
    fleet.send(admit("r1", "cold", "vm1", preemptible=True))
    fleet.send(cmd("release", "cancel", instance="vm1"))

    d = decision(fleet.send(admit("r2", "cold", "vm2")))

    assert (d["outcome"], d.get("reason")) == ("rejected", "insufficient-capacity")


def test_mark_created_is_wrong_state_while_the_launch_gate_is_shut() -> None:
    fleet = full_host_with_warm_vms()
    fleet.send(admit("r1", "cold", "vm1", preemptible=True))

    d = decision(fleet.send(cmd("mark-created", "m1", instance="vm1")))

    assert (d["outcome"], d["reason"]) == ("error", "wrong-state")


def test_preemptible_admit_with_no_candidates_is_rejected_insufficient_capacity() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("cold", cpu=2))
    admitted(fleet, "r0", "cold", "vm0")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert (d["outcome"], d["reason"]) == ("rejected", "insufficient-capacity")


def test_claimed_and_booting_warm_vms_are_never_victims() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("warm", cpu=1, max_ready=2), pool("cold", cpu=1))
    ready_warm(fleet, "warm", "w-claimed", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))
    admitted(fleet, "r-boot", "warm", "w-booting", kind="warm")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert d["reason"] == "insufficient-capacity"


# ------------------------------------------------------------------ victim choice


def test_victim_set_is_minimal_not_the_greedy_prefix() -> None:
    # Candidates in order: tiny (1 vCPU), tiny, large (4 vCPU). Taking them in order
    # fits only at the third; walking back returns both tiny ones: large alone is enough.
    fleet = fleet_of(
        snapshot("h1", cpu=8),
        pool("tiny", cpu=1, memory_mib=1024, disk_gib=10, max_ready=5, priority=0),
        pool("large", cpu=4, memory_mib=1024, disk_gib=10, max_ready=5, priority=1),
        pool("fill", cpu=2, memory_mib=1024, disk_gib=10),
        pool("job", cpu=4, memory_mib=1024, disk_gib=10),
    )
    admitted(fleet, "r-fill", "fill", "filler")
    ready_warm(fleet, "large", "large-1", host="h1")
    ready_warm(fleet, "tiny", "tiny-1", host="h1")
    ready_warm(fleet, "tiny", "tiny-2", host="h1")

    d = decision(fleet.send(admit("r1", "job", "vm1", preemptible=True)))

    assert d["outcome"] == "pending"
    assert [v["instance"] for v in d["victims"]] == ["large-1"]
    assert state_of(fleet, "tiny-1") == "ready"
    assert state_of(fleet, "tiny-2") == "ready"


def test_victims_come_from_the_lowest_priority_pool_first() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=2),
        pool("precious", cpu=1, max_ready=5, priority=10),
        pool("cheap", cpu=1, max_ready=5, priority=1),
        pool("cold", cpu=1),
    )
    ready_warm(fleet, "cheap", "cheap-1", host="h1")
    ready_warm(fleet, "precious", "precious-1", host="h1")  # newer, but higher priority

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert [v["instance"] for v in d["victims"]] == ["cheap-1"]


def test_victims_come_from_the_pool_furthest_above_min_ready_at_equal_priority() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=4),
        pool("near", cpu=1, min_ready=1, max_ready=5),  # 2 ready: 1 above
        pool("far", cpu=1, min_ready=0, max_ready=5),  # 2 ready: 2 above
        pool("cold", cpu=1),
    )
    ready_warm(fleet, "far", "far-1", host="h1")
    ready_warm(fleet, "far", "far-2", host="h1")
    ready_warm(fleet, "near", "near-1", host="h1")
    ready_warm(fleet, "near", "near-2", host="h1")  # newest of all

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert [v["instance"] for v in d["victims"]] == ["far-2"]


def test_victims_are_the_newest_ready_first_within_a_pool() -> None:
    fleet = fleet_of(snapshot("h1", cpu=3), pool("warm", cpu=1, max_ready=5), pool("cold", cpu=1))
    # Admitted in one order, ready in another: it is the ready order that counts.
    admitted(fleet, "ra", "warm", "w-a", kind="warm")
    admitted(fleet, "rb", "warm", "w-b", kind="warm")
    admitted(fleet, "rc", "warm", "w-c", kind="warm")
    fleet.send(lifecycle("h1", "instance-ready", "w-c"))
    fleet.send(lifecycle("h1", "instance-ready", "w-a"))
    fleet.send(lifecycle("h1", "instance-ready", "w-b"))

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert [v["instance"] for v in d["victims"]] == ["w-b"]


def test_protect_min_ready_never_takes_a_pool_below_min_ready() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=3),
        pool("guarded", cpu=1, min_ready=2, max_ready=5, protect_min_ready=True, priority=0),
        pool("other", cpu=1, max_ready=5, priority=9),
        pool("cold", cpu=1),
    )
    ready_warm(fleet, "guarded", "g-1", host="h1")
    ready_warm(fleet, "guarded", "g-2", host="h1")
    ready_warm(fleet, "other", "o-1", host="h1")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert [v["instance"] for v in d["victims"]] == ["o-1"]


def test_protect_min_ready_can_leave_nothing_to_preempt() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=2),
        pool("guarded", cpu=1, min_ready=2, max_ready=5, protect_min_ready=True),
        pool("cold", cpu=1),
    )
    ready_warm(fleet, "guarded", "g-1", host="h1")
    ready_warm(fleet, "guarded", "g-2", host="h1")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert (d["outcome"], d["reason"]) == ("rejected", "insufficient-capacity")
    assert state_of(fleet, "g-1") == state_of(fleet, "g-2") == "ready"


def test_protect_min_ready_still_gives_up_leases_above_min_ready() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=3),
        pool("guarded", cpu=1, min_ready=2, max_ready=5, protect_min_ready=True),
        pool("cold", cpu=1),
    )
    for i in range(3):
        ready_warm(fleet, "guarded", f"g-{i}", host="h1")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert [v["instance"] for v in d["victims"]] == ["g-2"]


def test_preemption_host_with_the_fewest_victims_wins() -> None:
    fleet = fleet_of(
        snapshot("h-a", cpu=4),
        snapshot("h-b", cpu=4),
        pool("tiny", cpu=1, max_ready=10),
        pool("mid", cpu=2, max_ready=10),
        pool("cold", cpu=2),
    )
    for i in range(4):
        ready_warm(fleet, "tiny", f"t-{i}", host="h-a")  # needs 2 victims for 2 vCPU
    for i in range(2):
        ready_warm(fleet, "mid", f"m-{i}", host="h-b")  # needs 1 victim

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert d["lease"]["host"] == "h-b"
    assert len(d["victims"]) == 1


def test_preemption_host_with_the_least_victim_capacity_wins_among_equal_counts() -> None:
    fleet = fleet_of(
        snapshot("h-a", cpu=4),
        snapshot("h-b", cpu=4),
        pool("big", cpu=4, max_ready=10),
        pool("mid", cpu=2, max_ready=10),
        pool("fill", cpu=2),
        pool("cold", cpu=2),
    )
    ready_warm(fleet, "big", "big-1", host="h-a")  # 1 victim of 4 vCPU
    ready_warm(fleet, "mid", "mid-1", host="h-b")  # 1 victim of 2 vCPU
    admitted(fleet, "r-fill", "fill", "filler", host="h-b")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert d["lease"]["host"] == "h-b"
    assert [v["instance"] for v in d["victims"]] == ["mid-1"]


def test_preemption_ties_between_hosts_break_on_the_host_name() -> None:
    fleet = fleet_of(
        snapshot("h-b", cpu=1),
        snapshot("h-a", cpu=1),
        pool("warm", cpu=1, max_ready=10),
        pool("cold", cpu=1),
    )
    ready_warm(fleet, "warm", "w-b", host="h-b")
    ready_warm(fleet, "warm", "w-a", host="h-a")

    d = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    assert d["lease"]["host"] == "h-a"
    assert [v["instance"] for v in d["victims"]] == ["w-a"]


def test_preemption_frees_gpus_held_by_victims() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0)]),
        gpu_class("gpu", count=1),
        pool("warm-gpu", max_ready=2, claims=[{"name": "g", "class": "gpu"}]),
        pool("train", claims=[{"name": "g", "class": "gpu"}]),
    )
    ready_warm(fleet, "warm-gpu", "w1", host="h1")

    d = decision(fleet.send(admit("r1", "train", "vm1", preemptible=True)))

    assert d["outcome"] == "pending"
    assert d["lease"]["gpus"] == [0]
    assert [v["instance"] for v in d["victims"]] == ["w1"]


# ======================================================================= claim-warm


def test_claim_warm_binds_the_job_to_a_ready_warm_vm() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))

    assert (d["verb"], d["outcome"]) == ("claim-warm", "claimed")
    assert d["lease"]["instance"] == "w1"
    assert d["lease"]["state"] == "claimed"
    assert d["lease"]["job"] == "job-1"


def test_claim_warm_takes_the_oldest_ready_vm_first() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=3))
    admitted(fleet, "ra", "warm", "w-a", kind="warm")
    admitted(fleet, "rb", "warm", "w-b", kind="warm")
    fleet.send(lifecycle("h1", "instance-ready", "w-b"))
    fleet.send(lifecycle("h1", "instance-ready", "w-a"))

    first = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))
    second = decision(fleet.send(cmd("claim-warm", "c2", pool="warm", job="job-2")))

    assert first["lease"]["instance"] == "w-b"
    assert second["lease"]["instance"] == "w-a"


def test_same_job_always_gets_the_same_instance() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=3))
    ready_warm(fleet, "warm", "w1", host="h1")
    first = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))
    ready_warm(fleet, "warm", "w2", host="h1")

    again = decision(fleet.send(cmd("claim-warm", "c2", pool="warm", job="job-1")))

    assert again["outcome"] == "claimed"
    assert again["lease"]["instance"] == first["lease"]["instance"] == "w1"
    assert state_of(fleet, "w2") == "ready"


def test_one_warm_vm_is_bound_to_one_job_only() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=3))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))

    d = decision(fleet.send(cmd("claim-warm", "c2", pool="warm", job="job-2")))

    assert d["outcome"] == "no-warm"
    assert "lease" not in d


def test_claim_warm_with_no_warm_vm_at_all_is_no_warm() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))

    assert d["outcome"] == "no-warm"
    assert "reason" not in d


def test_claim_warm_while_warm_vms_are_still_booting_is_no_warm_not_ready() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")
    fleet.send(lifecycle("h1", "instance-created", "w1"))

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))

    assert (d["outcome"], d["reason"]) == ("no-warm", "not-ready")
    assert state_of(fleet, "w1") == "created"


def test_claim_warm_in_an_unknown_pool_is_no_warm_unknown_pool() -> None:
    fleet = fleet_of(snapshot("h1"))

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="ghost", job="job-1")))

    assert (d["outcome"], d["reason"]) == ("no-warm", "unknown-pool")


def test_claim_warm_only_binds_vms_of_the_named_pool() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm-a", max_ready=2), pool("warm-b", max_ready=2))
    ready_warm(fleet, "warm-a", "a1", host="h1")

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm-b", job="job-1")))

    assert d["outcome"] == "no-warm"


def test_a_suspect_warm_vm_is_not_claimed() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(inventory("h1", []))

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))

    assert d["outcome"] == "no-warm"


# ============================================================= authorize-warm-drain


def test_drain_of_an_unclaimed_ready_vm_is_authorized_and_deletes_it_as_drained() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    lease = ready_warm(fleet, "warm", "w1", host="h1")

    fx = fleet.send(cmd("authorize-warm-drain", "d1", instance="w1"))

    d = decision(fx)
    assert (d["verb"], d["outcome"]) == ("authorize-warm-drain", "authorized")
    assert d["lease"]["state"] == "draining"
    ((subject, delete),) = outputs(fx, "out.exec.")
    assert subject == "out.exec.h1.delete"
    assert delete == {
        "v": 1,
        "command_id": f"delete:{lease['lease_id']}:drained",
        "host": "h1",
        "instance": "w1",
        "project": "default",
        "lease_id": lease["lease_id"],
        "reason": "drained",
    }


def test_a_draining_vm_can_no_longer_be_claimed() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("authorize-warm-drain", "d1", instance="w1"))

    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))

    assert d["outcome"] == "no-warm"
    assert state_of(fleet, "w1") == "draining"


def test_drain_of_a_claimed_vm_is_refused_already_claimed() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))

    fx = fleet.send(cmd("authorize-warm-drain", "d1", instance="w1"))

    d = decision(fx)
    assert (d["outcome"], d["reason"]) == ("refused", "already-claimed")
    assert outputs(fx, "out.exec.") == []
    assert state_of(fleet, "w1") == "claimed"


def test_drain_of_an_injected_vm_is_refused_already_claimed() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))
    fleet.send(cmd("mark-warm-injected", "i1", job="job-1", instance="w1"))

    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance="w1")))

    assert d["reason"] == "already-claimed"


def test_drain_of_a_booting_vm_is_refused_not_ready() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")

    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance="w1")))

    assert (d["outcome"], d["reason"]) == ("refused", "not-ready")


def test_second_drain_of_a_draining_vm_is_refused_draining() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("authorize-warm-drain", "d1", instance="w1"))

    fx = fleet.send(cmd("authorize-warm-drain", "d2", instance="w1"))

    assert (decision(fx)["outcome"], decision(fx)["reason"]) == ("refused", "draining")
    assert outputs(fx, "out.exec.") == []


def test_drain_of_an_unknown_instance_is_refused_unknown_instance() -> None:
    fleet = fleet_of(snapshot("h1"))

    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance="ghost")))

    assert (d["outcome"], d["reason"]) == ("refused", "unknown-instance")


def test_drain_of_a_released_instance_is_refused_unknown_instance() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(lifecycle("h1", "instance-deleted", "w1"))

    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance="w1")))

    assert d["reason"] == "unknown-instance"


def test_drain_of_a_cold_vm_is_refused_wrong_state() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))

    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance="vm1")))

    assert (d["outcome"], d["reason"]) == ("refused", "wrong-state")


def test_drain_of_a_victim_is_refused_wrong_state() -> None:
    fleet = full_host_with_warm_vms()
    pending = decision(fleet.send(admit("r1", "cold", "vm1", preemptible=True)))

    victim = pending["victims"][0]["instance"]
    d = decision(fleet.send(cmd("authorize-warm-drain", "d1", instance=victim)))

    assert (d["outcome"], d["reason"]) == ("refused", "wrong-state")


# ====================================================================== mark-created


def test_mark_created_moves_reserved_to_created() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(cmd("mark-created", "m1", instance="vm1")))

    assert (d["verb"], d["outcome"]) == ("mark-created", "ok")
    assert d["lease"]["state"] == "created"


def test_mark_created_of_an_already_created_lease_is_ok() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(lifecycle("h1", "instance-created", "vm1"))

    d = decision(fleet.send(cmd("mark-created", "m1", instance="vm1")))

    assert d["outcome"] == "ok"


def test_mark_created_of_an_unknown_instance_is_error_no_lease() -> None:
    fleet = fleet_of(snapshot("h1"))

    d = decision(fleet.send(cmd("mark-created", "m1", instance="ghost")))

    assert (d["outcome"], d["reason"]) == ("error", "no-lease")
    assert fleet.state.leases == {}


def test_mark_created_of_a_released_instance_is_error_no_lease() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("release", "rel1", instance="vm1"))

    d = decision(fleet.send(cmd("mark-created", "m1", instance="vm1")))

    assert d["reason"] == "no-lease"


def test_mark_created_of_a_ready_warm_vm_is_error_wrong_state() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")

    d = decision(fleet.send(cmd("mark-created", "m1", instance="w1")))

    assert (d["outcome"], d["reason"]) == ("error", "wrong-state")
    assert state_of(fleet, "w1") == "ready"


# ================================================================ mark-warm-injected


def claimed_warm_fleet() -> Fleet:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))
    return fleet


def test_mark_warm_injected_moves_claimed_to_injected_for_the_claiming_job() -> None:
    fleet = claimed_warm_fleet()

    d = decision(fleet.send(cmd("mark-warm-injected", "i1", job="job-1", instance="w1")))

    assert (d["verb"], d["outcome"]) == ("mark-warm-injected", "ok")
    assert d["lease"]["state"] == "injected"


def test_mark_warm_injected_for_another_job_is_error_wrong_job() -> None:
    fleet = claimed_warm_fleet()

    d = decision(fleet.send(cmd("mark-warm-injected", "i1", job="job-2", instance="w1")))

    assert (d["outcome"], d["reason"]) == ("error", "wrong-job")
    assert state_of(fleet, "w1") == "claimed"


def test_mark_warm_injected_of_an_unclaimed_vm_is_error_wrong_state() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")

    d = decision(fleet.send(cmd("mark-warm-injected", "i1", job="job-1", instance="w1")))

    assert (d["outcome"], d["reason"]) == ("error", "wrong-state")


def test_mark_warm_injected_of_an_unknown_instance_is_error_no_lease() -> None:
    fleet = fleet_of(snapshot("h1"))

    d = decision(fleet.send(cmd("mark-warm-injected", "i1", job="job-1", instance="ghost")))

    assert (d["outcome"], d["reason"]) == ("error", "no-lease")


def test_mark_warm_injected_twice_for_the_same_job_is_ok() -> None:
    fleet = claimed_warm_fleet()
    fleet.send(cmd("mark-warm-injected", "i1", job="job-1", instance="w1"))

    d = decision(fleet.send(cmd("mark-warm-injected", "i2", job="job-1", instance="w1")))

    assert d["outcome"] == "ok"
    assert d["lease"]["state"] == "injected"


# =================================================================== mark-deleting


def test_mark_deleting_moves_an_active_lease_to_deleting_and_it_still_books() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("ci", cpu=2))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(cmd("mark-deleting", "del1", instance="vm1")))

    assert (d["verb"], d["outcome"]) == ("mark-deleting", "ok")
    assert d["lease"]["state"] == "deleting"
    assert decision(fleet.send(admit("r2", "ci", "vm2")))["reason"] == "insufficient-capacity"


@pytest.mark.parametrize("known", ["unknown", "released"])
def test_mark_deleting_of_an_unknown_or_released_instance_is_ok(known: str) -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    if known == "released":
        admitted(fleet, "r1", "ci", "vm1")
        fleet.send(cmd("release", "rel1", instance="vm1"))

    d = decision(fleet.send(cmd("mark-deleting", "del1", instance="vm1")))

    assert d["outcome"] == "ok"
    assert "reason" not in d
    if known == "released":
        assert state_of(fleet, "vm1") == "released"


# ========================================================================= release


def test_release_ends_the_lease_and_frees_its_capacity() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("ci", cpu=2))
    admitted(fleet, "r1", "ci", "vm1")

    d = decision(fleet.send(cmd("release", "rel1", instance="vm1")))

    assert (d["verb"], d["outcome"]) == ("release", "ok")
    assert d["lease"]["state"] == "released"
    admitted(fleet, "r2", "ci", "vm2")


@pytest.mark.parametrize("known", ["unknown", "released"])
def test_release_of_an_unknown_or_released_instance_is_ok(known: str) -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    if known == "released":
        admitted(fleet, "r1", "ci", "vm1")
        fleet.send(cmd("release", "rel1", instance="vm1"))

    fx = fleet.send(cmd("release", "rel2", instance="vm1"))

    assert decision(fx)["outcome"] == "ok"
    assert fx.transitions == []


# ======================================================================= lifecycle


def test_lifecycle_instance_created_moves_reserved_to_created() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    fleet.send(lifecycle("h1", "instance-created", "vm1"))

    assert state_of(fleet, "vm1") == "created"


@pytest.mark.parametrize("action", ["instance-ready", "instance-agent-started"])
def test_lifecycle_ready_moves_a_created_warm_vm_to_ready(action: str) -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")
    fleet.send(lifecycle("h1", "instance-created", "w1"))

    fleet.send(lifecycle("h1", action, "w1"))

    assert state_of(fleet, "w1") == "ready"


def test_lifecycle_ready_does_not_make_a_cold_vm_ready() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(lifecycle("h1", "instance-created", "vm1"))

    fx = fleet.send(lifecycle("h1", "instance-ready", "vm1"))

    assert state_of(fleet, "vm1") == "created"
    assert fx.transitions == []


def test_lifecycle_instance_deleted_releases_the_lease() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")

    fleet.send(lifecycle("h1", "instance-deleted", "w1"))

    assert state_of(fleet, "w1") == "released"


@pytest.mark.parametrize(
    "action",
    [
        "instance-started",
        "instance-stopped",
        "instance-shutdown",
        "instance-restarted",
        "instance-updated",
        "instance-renamed",
    ],
)
def test_other_lifecycle_actions_change_nothing(action: str) -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")
    before = copy.deepcopy(fleet.state.leases)

    fx = fleet.send(lifecycle("h1", action, "w1"))

    assert fleet.state.leases == before
    assert fx.transitions == []
    assert fx.outputs == []


def test_lifecycle_from_another_host_changes_nothing() -> None:
    fleet = fleet_of(snapshot("h1"), snapshot("h2"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1", host="h1")

    fleet.send(lifecycle("h2", "instance-deleted", "vm1"))

    assert state_of(fleet, "vm1") == "reserved"


def test_lifecycle_for_an_unknown_instance_changes_nothing() -> None:
    fleet = fleet_of(snapshot("h1"))

    fx = fleet.send(lifecycle("h1", "instance-created", "stranger"))

    assert fleet.state.leases == {}
    assert fx.outputs == []


# ====================================================================== inventory


@pytest.mark.parametrize("created", [False, True])
def test_an_inventory_that_shows_ready_makes_a_booting_warm_vm_ready(created: bool) -> None:
    """Incus remembers that the guest said ready (status Ready, 113): a warm VM whose
    instance-ready event the bridge missed becomes ready on the next inventory."""
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")
    if created:
        fleet.send(lifecycle("h1", "instance-created", "w1"))

    fx = fleet.send(inventory("h1", [instance("w1", status="Ready", status_code=113)]))

    assert state_of(fleet, "w1") == "ready"
    assert [(t.event, t.from_state, t.to_state) for t in fx.transitions] == [
        ("inventory-ready", "created" if created else "reserved", "ready")
    ]
    lease = fleet.state.lease_of_instance("w1")
    assert lease is not None and lease.ready_seq == fx.transitions[0].input_seq
    late = fleet.send(lifecycle("h1", "instance-ready", "w1"))
    assert late.transitions == []
    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))
    assert d["lease"]["instance"] == "w1"


def test_an_inventory_that_shows_running_leaves_a_booting_warm_vm_booting() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    admitted(fleet, "r1", "warm", "w1", kind="warm")

    fleet.send(inventory("h1", [instance("w1", status="Running", status_code=103)]))

    assert state_of(fleet, "w1") == "created"


def test_an_inventory_that_shows_ready_does_not_make_a_cold_vm_ready() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    fleet.send(inventory("h1", [instance("vm1", status="Ready", status_code=113)]))

    assert state_of(fleet, "vm1") == "created"


def test_an_inventory_that_shows_ready_leaves_a_claimed_warm_vm_claimed() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1"))

    fx = fleet.send(inventory("h1", [instance("w1", status="Ready", status_code=113)]))

    assert state_of(fleet, "w1") == "claimed"
    assert fx.transitions == []


def test_inventory_adopts_a_tagged_ready_warm_vm() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))

    fleet.send(inventory("h1", [instance("w1", config=tagged("L77", "warm", "warm"))]))

    lease = fleet.state.lease_of_instance("w1")
    assert lease is not None
    assert (lease.state, lease.kind.value, lease.pool, lease.adopted) == (
        LeaseState.READY,
        "warm",
        "warm",
        True,
    )
    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-1")))
    assert d["lease"]["instance"] == "w1"


def test_inventory_adopts_a_stopped_tagged_warm_vm_as_created() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))

    fleet.send(
        inventory(
            "h1",
            [
                instance(
                    "w1", status="Stopped", status_code=102, config=tagged("L77", "warm", "warm")
                )
            ],
        )
    )

    assert state_of(fleet, "w1") == "created"


def test_inventory_adopts_a_tagged_cold_vm_as_created() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))

    fleet.send(inventory("h1", [instance("vm1", config=tagged("L77", "ci", "cold"))]))

    assert state_of(fleet, "vm1") == "created"


def test_inventory_adopts_a_tagged_warm_vm_with_a_job_as_claimed_by_that_job() -> None:
    fleet = fleet_of(snapshot("h1"), pool("warm", max_ready=2))

    fleet.send(inventory("h1", [instance("w1", config=tagged("L77", "warm", "warm", job="job-9"))]))

    assert state_of(fleet, "w1") == "claimed"
    d = decision(fleet.send(cmd("claim-warm", "c1", pool="warm", job="job-9")))
    assert d["lease"]["instance"] == "w1"


def test_adopted_vms_book_their_observed_resources_and_gpus() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=8, gpus=[gpu(0), gpu(1)]),
        gpu_class("gpu", count=1),
        pool("ml", cpu=2, claims=[{"name": "g", "class": "gpu"}]),
    )
    fleet.send(
        inventory(
            "h1", [instance("old", cpu=6, gpus=["0000:01:00.0"], config=tagged("L1", "ml", "cold"))]
        )
    )

    lease = admitted(fleet, "r1", "ml", "vm1")
    d = decision(fleet.send(admit("r2", "ml", "vm2")))

    assert lease["gpus"] == [1]
    assert d["reason"] == "insufficient-capacity"


def test_inventory_does_not_adopt_an_instance_it_already_leases() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    lease = admitted(fleet, "r1", "ci", "vm1")

    fleet.send(inventory("h1", [instance("vm1", config=tagged(lease["lease_id"], "ci", "cold"))]))

    assert len(fleet.state.leases) == 1
    assert state_of(fleet, "vm1") == "created"


def test_foreign_vms_count_against_capacity() -> None:
    fleet = fleet_of(snapshot("h1", cpu=16), pool("ci", cpu=4))
    fleet.send(inventory("h1", [instance("someone-elses", cpu=13)]))

    d = decision(fleet.send(admit("r1", "ci", "vm1")))

    assert d["reason"] == "insufficient-capacity"
    assert fleet.state.lease_of_instance("someone-elses") is None


def test_foreign_vms_gpus_are_not_handed_out() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0), gpu(1)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )
    fleet.send(inventory("h1", [instance("someone-elses", gpus=["0000:01:00.0"])]))

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [1]


def test_foreign_gpus_seen_before_the_first_snapshot_are_not_handed_out() -> None:
    # At start-up the bridge may publish a host's inventory before its snapshot.
    fleet = fleet_of(gpu_class("gpu", count=1), pool("ml", claims=[{"name": "g", "class": "gpu"}]))
    fleet.send(inventory("h1", [instance("someone-elses", gpus=["0000:01:00.0"])]))
    fleet.send(snapshot("h1", gpus=[gpu(0), gpu(1)]))

    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [1]


def test_an_over_committed_host_admits_nothing_even_a_zero_demand() -> None:
    fleet = fleet_of(
        snapshot("h1", cpu=4, memory_mib=8192),
        snapshot("h2", cpu=4, memory_mib=8192, schedulable=False),
        pool("nothing", cpu=0, memory_mib=0, disk_gib=0),
    )
    fleet.send(inventory("h1", [instance("hog", cpu=1, memory_mib=16384)]))

    d = decision(fleet.send(admit("r1", "nothing", "vm1")))

    assert (d["outcome"], d["reason"]) == ("rejected", "insufficient-capacity")


def test_a_lease_missing_from_inventory_becomes_suspect_but_is_not_released() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("ci", cpu=2))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))

    fx = fleet.send(inventory("h1", []))

    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None
    assert lease.state is LeaseState.CREATED
    assert lease.as_dict().get("suspect") is True
    assert outputs(fx, "out.exec.") == []
    assert decision(fleet.send(admit("r2", "ci", "vm2")))["reason"] == "insufficient-capacity"


def test_a_reserved_lease_missing_from_inventory_is_not_suspect() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    fleet.send(inventory("h1", []))

    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None and lease.suspect_revision is None


def test_inventory_showing_a_reserved_lease_marks_it_created() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")

    fleet.send(inventory("h1", [instance("vm1")]))

    assert state_of(fleet, "vm1") == "created"


def test_a_suspect_lease_seen_again_in_inventory_is_no_longer_suspect() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))
    fleet.send(inventory("h1", [], revision=1))

    fleet.send(inventory("h1", [instance("vm1")], revision=2))

    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None and lease.suspect_revision is None


def test_observation_present_clears_suspicion() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))
    fleet.send(inventory("h1", []))

    fleet.send(observation("h1", "vm1", present=True))

    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None
    assert lease.suspect_revision is None
    assert lease.state is LeaseState.CREATED


def test_observation_absent_releases_a_suspect_lease() -> None:
    fleet = fleet_of(snapshot("h1", cpu=2), pool("ci", cpu=2))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))
    fleet.send(inventory("h1", [], revision=3))

    fleet.send(observation("h1", "vm1", present=False, checked_revision=3))

    assert state_of(fleet, "vm1") == "released"
    admitted(fleet, "r2", "ci", "vm2")


def test_observation_absent_older_than_the_suspicion_is_ignored() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))
    fleet.send(inventory("h1", [], revision=3))

    fleet.send(observation("h1", "vm1", present=False, checked_revision=2))

    assert state_of(fleet, "vm1") == "created"


def test_observation_absent_of_a_lease_that_is_not_suspect_changes_nothing() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))

    fleet.send(observation("h1", "vm1", present=False))

    assert state_of(fleet, "vm1") == "created"


def test_observation_absent_of_a_suspect_victim_opens_the_way_for_the_gate() -> None:
    fleet = fleet_of(snapshot("h1", cpu=1), pool("warm", cpu=1, max_ready=2), pool("cold", cpu=1))
    ready_warm(fleet, "warm", "w1", host="h1")
    fleet.send(admit("r1", "cold", "vm1", preemptible=True))
    fleet.send(inventory("h1", [], revision=5))

    d = decision(fleet.send(observation("h1", "w1", present=False, checked_revision=5)))

    assert state_of(fleet, "w1") == "released"
    assert (d["request_id"], d["outcome"]) == ("r1", "admitted")


def test_inventory_showing_a_vm_of_a_released_lease_deletes_it_as_orphan() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    lease = admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("release", "rel1", instance="vm1"))

    fx = fleet.send(
        inventory("h1", [instance("vm1", config=tagged(lease["lease_id"], "ci", "cold"))])
    )

    ((subject, delete),) = outputs(fx, "out.exec.")
    assert subject == "out.exec.h1.delete"
    assert (delete["instance"], delete["reason"]) == ("vm1", "orphan")


# ============================================================== stale host revisions


def test_a_stale_snapshot_revision_is_ignored() -> None:
    fleet = fleet_of(snapshot("h1", revision=5, cpu=2), pool("ci", cpu=4))

    fleet.send(snapshot("h1", revision=4, cpu=16))
    fleet.send(snapshot("h1", revision=5, cpu=16))

    assert decision(fleet.send(admit("r1", "ci", "vm1")))["reason"] == "no-suitable-host"


def test_a_newer_snapshot_revision_replaces_the_host() -> None:
    fleet = fleet_of(snapshot("h1", revision=5, cpu=2), pool("ci", cpu=4))

    fleet.send(snapshot("h1", revision=6, cpu=16))

    admitted(fleet, "r1", "ci", "vm1")


def test_a_stale_inventory_revision_is_ignored() -> None:
    fleet = fleet_of(snapshot("h1", cpu=16), pool("ci", cpu=4))
    fleet.send(inventory("h1", [instance("hog", cpu=16)], revision=5))

    fleet.send(inventory("h1", [], revision=4))
    fleet.send(inventory("h1", [], revision=5))

    assert decision(fleet.send(admit("r1", "ci", "vm1")))["reason"] == "insufficient-capacity"


def test_a_stale_inventory_does_not_make_leases_suspect() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci"))
    fleet.send(inventory("h1", [], revision=5))
    admitted(fleet, "r1", "ci", "vm1")
    fleet.send(cmd("mark-created", "m1", instance="vm1"))

    fleet.send(inventory("h1", [], revision=5))

    lease = fleet.state.lease_of_instance("vm1")
    assert lease is not None and lease.suspect_revision is None


# ============================================================ config validation


def rejected(fx: Effects) -> list[tuple[str, dict[str, Any]]]:
    return outputs(fx, "out.config.rejected.")


def test_bad_pool_is_rejected_by_name_and_the_last_good_one_stays() -> None:
    fleet = fleet_of(snapshot("h1"), pool("ci", cpu=2))

    fx = fleet.send(pool("ci", cpu=8, min_ready=3, max_ready=1))

    ((subject, payload),) = rejected(fx)
    assert subject == "out.config.rejected.pool.ci"
    assert (payload["v"], payload["kind"], payload["name"]) == (1, "pool", "ci")
    assert "'ci'" in payload["error"]
    assert payload["input_seq"] == 3
    assert admitted(fleet, "r1", "ci", "vm1")["demand"]["cpu"] == 2


def test_pool_with_max_ready_above_max_instances_is_rejected() -> None:
    fleet = Fleet()

    fx = fleet.send(pool("ci", max_ready=5, max_instances=2))

    assert [s for s, _ in rejected(fx)] == ["out.config.rejected.pool.ci"]
    assert "ci" not in fleet.state.pools


def test_bad_class_is_rejected_by_name_and_the_last_good_one_stays() -> None:
    fleet = fleet_of(
        snapshot("h1", gpus=[gpu(0), gpu(1)]),
        gpu_class("gpu", count=1),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )

    fx = fleet.send(gpu_class("gpu", count=0))

    ((subject, payload),) = rejected(fx)
    assert subject == "out.config.rejected.class.gpu"
    assert (payload["kind"], payload["name"]) == ("class", "gpu")
    assert "'gpu'" in payload["error"]
    assert admitted(fleet, "r1", "ml", "vm1")["gpus"] == [0]


def test_class_with_an_empty_model_is_rejected() -> None:
    fleet = Fleet()

    fx = fleet.send(gpu_class("gpu", model=""))

    assert [s for s, _ in rejected(fx)] == ["out.config.rejected.class.gpu"]
    assert "gpu" not in fleet.state.classes


def test_a_good_config_publishes_no_rejection() -> None:
    fleet = Fleet()

    fx = fleet.send(pool("ci"), gpu_class("gpu"))

    assert rejected(fx) == []
