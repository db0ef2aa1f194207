"""GPU runtime: profiles, policies, the effective-runtime query and its staleness rule.

DESIGN.md, "GPU runtime": a host names a GPU profile whose defaults apply to every GPU;
accepted runtime policies select GPUs (host labels, model, index) and override fields in
``(priority, name)`` order, later winning; a lease's effective runtime is refused with
``stale-runtime-inputs`` while the host's GPU inputs or profile revision differ from the
ones it was admitted (or last re-rendered) against.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from reconciler.core.queries import QUERIES, QueryError
from reconciler.core.state import Effects
from tests.support.builders import (
    Fleet,
    admit,
    cmd,
    gpu,
    gpu_class,
    gpu_policy,
    gpu_profile,
    pool,
    snapshot,
)

DEFAULTS = {
    "mig_mode": "disabled",
    "compute_mode": "default",
    "persistence": False,
    "power_limit_w": None,
    "ecc": False,
}

# ---------------------------------------------------------------------------- helpers


def decision(fx: Effects) -> dict[str, Any]:
    (only,) = [orjson.loads(o.payload) for o in fx.outputs if o.subject.startswith("out.decision.")]
    assert isinstance(only, dict)
    return only


def rejected(fx: Effects) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o.subject, orjson.loads(o.payload))
        for o in fx.outputs
        if o.subject.startswith("out.config.rejected.")
    ]


def gpu_fleet(
    *,
    gpus: int = 2,
    count: int | None = None,
    labels: dict[str, str] | None = None,
    profile: str | None = "base",
    models: list[str] | None = None,
) -> Fleet:
    """Host h1 with ``gpus`` GPUs naming ``profile``; pool ``ml`` claims ``count`` of them."""
    models = models or ["A100"] * gpus
    fleet = Fleet()
    fleet.send(
        snapshot(
            "h1",
            gpus=[gpu(i, model=models[i]) for i in range(gpus)],
            labels=labels,
            gpu_profile=profile,
        ),
        gpu_class("gpu", count=count if count is not None else gpus),
        pool("ml", claims=[{"name": "g", "class": "gpu"}]),
    )
    return fleet


def admit_lease(fleet: Fleet, name: str = "vm1") -> str:
    d = decision(fleet.send(admit(f"r-{name}", "ml", name)))
    assert d["outcome"] == "admitted", d
    return str(d["lease"]["lease_id"])


def runtime(fleet: Fleet, lease_id: str) -> list[dict[str, Any]]:
    result: Any = QUERIES["effective-runtime"](fleet.state, {"lease_id": lease_id})
    assert isinstance(result, list)
    return result


def runtime_error(fleet: Fleet, request: dict[str, Any]) -> str:
    with pytest.raises(QueryError) as err:
        QUERIES["effective-runtime"](fleet.state, request)
    return err.value.code


def by_index(result: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {item["index"]: item["runtime"] for item in result}


# ======================================================================== profiles


def test_profile_defaults_apply_to_every_gpu_of_the_lease() -> None:
    fleet = gpu_fleet()
    fleet.send(
        gpu_profile(
            "base",
            mig_mode="enabled",
            compute_mode="exclusive-process",
            persistence=True,
            power_limit_w=300,
            ecc=True,
        )
    )
    lease_id = admit_lease(fleet)

    expected = {
        "mig_mode": "enabled",
        "compute_mode": "exclusive-process",
        "persistence": True,
        "power_limit_w": 300,
        "ecc": True,
    }
    assert runtime(fleet, lease_id) == [
        {"index": 0, "runtime": expected},
        {"index": 1, "runtime": expected},
    ]


def test_runtime_lists_only_the_lease_gpus() -> None:
    fleet = gpu_fleet(gpus=3, count=1)
    fleet.send(gpu_profile("base"))
    admit_lease(fleet, "vm0")
    lease_id = admit_lease(fleet, "vm1")

    assert [item["index"] for item in runtime(fleet, lease_id)] == [1]


def test_a_lease_without_gpus_has_an_empty_runtime() -> None:
    fleet = Fleet()
    fleet.send(snapshot("h1"), pool("ci"))
    lease_id = decision(fleet.send(admit("r1", "ci", "vm1")))["lease"]["lease_id"]

    assert runtime(fleet, lease_id) == []


def test_host_without_a_profile_gets_the_built_in_defaults() -> None:
    # The contract is silent here; the core falls back to GpuRuntime()'s defaults.
    fleet = gpu_fleet(profile=None, gpus=1)
    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id)) == {0: DEFAULTS}


# ======================================================================== policies


def test_a_policy_overrides_only_the_fields_it_names() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base", persistence=True, ecc=True))
    fleet.send(gpu_policy("cap-power", overrides={"power_limit_w": 250}))
    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id))[0] == {
        **DEFAULTS,
        "persistence": True,
        "ecc": True,
        "power_limit_w": 250,
    }


def test_policies_apply_in_priority_order_so_the_higher_priority_wins() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("a-high", priority=10, overrides={"power_limit_w": 400}))
    fleet.send(gpu_policy("z-low", priority=1, overrides={"power_limit_w": 100}))
    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] == 400


def test_policies_of_equal_priority_apply_in_name_order_so_the_later_name_wins() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("bravo", overrides={"compute_mode": "prohibited"}))
    fleet.send(gpu_policy("alpha", overrides={"compute_mode": "exclusive-process"}))
    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id))[0]["compute_mode"] == "prohibited"


def test_policies_each_win_the_fields_only_they_set() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("p1", priority=1, overrides={"ecc": True, "power_limit_w": 100}))
    fleet.send(gpu_policy("p2", priority=2, overrides={"power_limit_w": 200}))
    lease_id = admit_lease(fleet)

    rt = by_index(runtime(fleet, lease_id))[0]
    assert (rt["ecc"], rt["power_limit_w"]) == (True, 200)


def test_a_policy_may_reset_the_power_limit_to_null() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base", power_limit_w=300))
    fleet.send(gpu_policy("uncap", overrides={"power_limit_w": None}))
    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] is None


def test_policy_selector_by_host_labels() -> None:
    fleet = gpu_fleet(gpus=1, labels={"rack": "r1"})
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("rack-r1", host_labels={"rack": "r1"}, overrides={"ecc": True}))
    fleet.send(gpu_policy("rack-r2", host_labels={"rack": "r2"}, overrides={"persistence": True}))
    lease_id = admit_lease(fleet)

    rt = by_index(runtime(fleet, lease_id))[0]
    assert (rt["ecc"], rt["persistence"]) == (True, False)


def test_policy_selector_by_model() -> None:
    fleet = gpu_fleet(gpus=2, models=["A100", "H100"])
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("hopper", models=["H100"], overrides={"mig_mode": "enabled"}))
    lease_id = admit_lease(fleet)

    rt = by_index(runtime(fleet, lease_id))
    assert (rt[0]["mig_mode"], rt[1]["mig_mode"]) == ("disabled", "enabled")


def test_policy_selector_by_index() -> None:
    fleet = gpu_fleet(gpus=3)
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("first-two", indexes=[0, 1], overrides={"persistence": True}))
    lease_id = admit_lease(fleet)

    rt = by_index(runtime(fleet, lease_id))
    assert [rt[i]["persistence"] for i in range(3)] == [True, True, False]


def test_every_given_selector_field_must_match() -> None:
    fleet = gpu_fleet(gpus=2, models=["A100", "H100"], labels={"rack": "r1"})
    fleet.send(gpu_profile("base"))
    fleet.send(
        gpu_policy(
            "narrow",
            host_labels={"rack": "r1"},
            models=["H100"],
            indexes=[0],
            overrides={"ecc": True},
        )
    )
    lease_id = admit_lease(fleet)

    rt = by_index(runtime(fleet, lease_id))
    assert (rt[0]["ecc"], rt[1]["ecc"]) == (False, False)


def test_a_policy_change_applies_to_existing_leases_without_re_rendering() -> None:
    # Contract silent: the core re-evaluates policies on every query; only GPU inputs and
    # the profile revision are part of a lease's rendering basis.
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    lease_id = admit_lease(fleet)

    fleet.send(gpu_policy("later", overrides={"ecc": True}))

    assert by_index(runtime(fleet, lease_id))[0]["ecc"] is True


# ====================================================================== staleness


def test_runtime_is_stale_after_the_host_gpu_labels_change_until_re_rendered() -> None:
    fleet = gpu_fleet(gpus=1, labels={"rack": "r1"})
    fleet.send(gpu_profile("base"))
    lease_id = admit_lease(fleet)

    fleet.send(snapshot("h1", revision=2, gpus=[gpu(0)], labels={"rack": "r2"}, gpu_profile="base"))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "stale-runtime-inputs"
    d = decision(fleet.send(cmd("render-runtime", "rr1", instance="vm1")))
    assert (d["verb"], d["outcome"]) == ("render-runtime", "ok")
    assert by_index(runtime(fleet, lease_id)) == {0: DEFAULTS}


def test_runtime_is_stale_after_the_host_gpus_change() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    lease_id = admit_lease(fleet)

    fleet.send(snapshot("h1", revision=2, gpus=[gpu(0, model="A100X")], gpu_profile="base"))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "stale-runtime-inputs"


def test_runtime_is_stale_after_the_host_names_another_profile() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"), gpu_profile("other", ecc=True))
    lease_id = admit_lease(fleet)

    fleet.send(snapshot("h1", revision=2, gpus=[gpu(0)], gpu_profile="other"))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "stale-runtime-inputs"
    fleet.send(cmd("render-runtime", "rr1", instance="vm1"))
    assert by_index(runtime(fleet, lease_id))[0]["ecc"] is True


def test_runtime_is_stale_after_the_profile_revision_changes_until_re_rendered() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base", revision=1, power_limit_w=300))
    lease_id = admit_lease(fleet)

    fleet.send(gpu_profile("base", revision=2, power_limit_w=350))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "stale-runtime-inputs"
    fleet.send(cmd("render-runtime", "rr1", instance="vm1"))
    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] == 350


def test_runtime_is_stale_once_a_profile_the_host_named_arrives() -> None:
    fleet = gpu_fleet(gpus=1)  # names "base", which is not configured yet
    lease_id = admit_lease(fleet)
    assert by_index(runtime(fleet, lease_id)) == {0: DEFAULTS}

    fleet.send(gpu_profile("base", ecc=True))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "stale-runtime-inputs"


def test_a_snapshot_changing_only_capacity_does_not_make_runtime_stale() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    lease_id = admit_lease(fleet)

    fleet.send(snapshot("h1", revision=2, cpu=32, gpus=[gpu(0)], gpu_profile="base"))

    assert by_index(runtime(fleet, lease_id)) == {0: DEFAULTS}


def test_a_stale_profile_revision_is_ignored_and_changes_nothing() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base", revision=3, power_limit_w=300))
    lease_id = admit_lease(fleet)

    fx = fleet.send(gpu_profile("base", revision=3, power_limit_w=999))

    assert rejected(fx) == []
    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] == 300


def test_a_lease_admitted_after_a_change_is_rendered_against_the_new_inputs() -> None:
    fleet = gpu_fleet(gpus=2, count=1)
    fleet.send(gpu_profile("base", revision=1))
    fleet.send(gpu_profile("base", revision=2, ecc=True))

    lease_id = admit_lease(fleet)

    assert by_index(runtime(fleet, lease_id))[0]["ecc"] is True


def test_render_runtime_of_an_unknown_instance_is_error_no_lease() -> None:
    fleet = gpu_fleet()

    d = decision(fleet.send(cmd("render-runtime", "rr1", instance="ghost")))

    assert (d["outcome"], d["reason"]) == ("error", "no-lease")


# ================================================================= query errors


def test_effective_runtime_of_an_unknown_lease_is_not_found() -> None:
    assert runtime_error(gpu_fleet(), {"lease_id": "L999"}) == "not-found"


def test_effective_runtime_of_a_released_lease_is_not_found() -> None:
    fleet = gpu_fleet()
    lease_id = admit_lease(fleet)
    fleet.send(cmd("release", "rel1", instance="vm1"))

    assert runtime_error(fleet, {"lease_id": lease_id}) == "not-found"


@pytest.mark.parametrize("request_", [{}, {"lease_id": ""}, {"lease_id": 7}])
def test_effective_runtime_without_a_lease_id_string_is_invalid(request_: dict[str, Any]) -> None:
    assert runtime_error(gpu_fleet(), request_) == "invalid"


# ============================================================== config rejections


@pytest.mark.parametrize("power_limit_w", [0, -5])
def test_bad_gpu_profile_is_rejected_by_name_and_the_last_good_one_stays(
    power_limit_w: int,
) -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base", revision=1, power_limit_w=300))
    lease_id = admit_lease(fleet)

    fx = fleet.send(gpu_profile("base", revision=2, power_limit_w=power_limit_w))

    ((subject, payload),) = rejected(fx)
    assert subject == "out.config.rejected.gpu-profile.base"
    assert (payload["v"], payload["kind"], payload["name"]) == (1, "gpu-profile", "base")
    assert "'base'" in payload["error"]
    assert payload["input_seq"] == fleet.seq
    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] == 300


@pytest.mark.parametrize(
    "overrides",
    [
        {"fan_speed": 100},
        {"mig_mode": "sometimes"},
        {"compute_mode": "shared"},
        {"persistence": "yes"},
        {"ecc": 1},
        {"power_limit_w": 0},
        {"power_limit_w": True},
    ],
)
def test_bad_gpu_policy_is_rejected_by_name_and_the_last_good_one_stays(
    overrides: dict[str, Any],
) -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    fleet.send(gpu_policy("tune", overrides={"power_limit_w": 250}))
    lease_id = admit_lease(fleet)

    fx = fleet.send(gpu_policy("tune", overrides=overrides))

    ((subject, payload),) = rejected(fx)
    assert subject == "out.config.rejected.gpu-policy.tune"
    assert (payload["kind"], payload["name"]) == ("gpu-policy", "tune")
    assert "'tune'" in payload["error"]
    assert by_index(runtime(fleet, lease_id))[0]["power_limit_w"] == 250


def test_gpu_policy_selecting_a_negative_index_is_rejected() -> None:
    fleet = gpu_fleet(gpus=1)

    fx = fleet.send(gpu_policy("neg", indexes=[-1], overrides={"ecc": True}))

    assert [s for s, _ in rejected(fx)] == ["out.config.rejected.gpu-policy.neg"]
    assert "neg" not in fleet.state.policies


def test_a_rejected_new_policy_never_applies() -> None:
    fleet = gpu_fleet(gpus=1)
    fleet.send(gpu_profile("base"))
    lease_id = admit_lease(fleet)

    fleet.send(gpu_policy("bad", overrides={"ecc": True, "volts": 3}))

    assert by_index(runtime(fleet, lease_id))[0]["ecc"] is False
