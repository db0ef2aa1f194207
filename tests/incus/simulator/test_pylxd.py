"""pylxd's own models against the simulator, as GARM-like callers use them.

With ``filterwarnings = error``, a field pylxd does not know (it warns "Attempted to set
unknown attribute") fails these tests: the simulator must not send what Incus does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pylxd import Client
from pylxd import exceptions as pylxd_errors

from reconciler.incus.simulator import SimulatorThread
from tests.incus.conftest import GPU_HOST, wait_until

CONFIG = {
    "name": "garm-7Hj2",
    "type": "virtual-machine",
    "source": {"type": "image", "alias": "ubuntu/24.04"},
    "config": {
        "limits.cpu": "2",
        "limits.memory": "4GiB",
        "user.runner-pool-id": "pool-1",
        "user.os-type": "linux",
    },
}


@pytest.fixture
def client(sim_thread: SimulatorThread) -> Iterator[Client]:
    made = Client(endpoint=sim_thread.endpoints[GPU_HOST], project="ci")
    try:
        yield made
    finally:
        made.api.session.close()


def test_client_connects_and_reads_the_host(client: Client) -> None:
    assert client.trusted and not client.server_clustered
    assert client.host_info["environment"]["project"] == "ci"
    assert client.has_api_extension("resources")
    assert client.resources["gpu"]["total"] == 4
    pool = client.storage_pools.get("default")
    assert pool.driver == "zfs" and pool.resources.get().space["total"] == 4096 * 1024**3
    assert [p.name for p in client.storage_pools.all()] == ["default"]
    assert {p.name for p in client.projects.all()} == {"ci", "default"}
    assert client.projects.get("ci").config["features.profiles"] == "true"
    assert [p.name for p in client.profiles.all()] == ["default"]
    assert client.profiles.get("default").devices["root"]["type"] == "disk"


def test_instance_lifecycle_through_pylxd_models(client: Client) -> None:
    instance = client.instances.create(CONFIG, wait=True)
    assert instance.name == "garm-7Hj2" and client.instances.exists("garm-7Hj2")
    instance.start(wait=True)
    wait_until(lambda: client.instances.get("garm-7Hj2").status_code == 113)  # booted
    fetched = client.instances.get("garm-7Hj2")
    assert (fetched.status, fetched.status_code, fetched.type) == ("Ready", 113, "virtual-machine")
    assert fetched.expanded_config["limits.memory"] == "4GiB"
    assert fetched.state().status_code == 113
    with pytest.raises(pylxd_errors.LXDAPIException, match="Instance is running"):
        fetched.delete(wait=True)
    fetched.stop(wait=True)  # pylxd stops with force=True by default
    with pytest.raises(pylxd_errors.LXDAPIException, match="The instance is already stopped"):
        fetched.stop(wait=True)
    fetched.description = "renamed by nobody"
    fetched.save(wait=True)
    assert client.instances.get("garm-7Hj2").description == "renamed by nobody"
    fetched.delete(wait=True)
    with pytest.raises(pylxd_errors.NotFound, match="Instance not found"):
        client.instances.get("garm-7Hj2")


def test_listing_at_every_recursion(client: Client) -> None:
    client.instances.create(CONFIG, wait=True)
    # A trap of pylxd with real Incus: outside the default project, recursion 0 lists
    # "/1.0/instances/NAME?project=P" and pylxd keeps the query in the name. The adapter
    # lists with recursion 1.
    assert [i.name for i in client.instances.all()] == ["garm-7Hj2?project=ci"]
    assert [i.name for i in client.instances.all(recursion=1)] == ["garm-7Hj2"]
    assert [i.status for i in client.instances.all(recursion=1)] == ["Stopped"]
    full = client.instances.all(recursion=2)
    assert [i.name for i in full] == ["garm-7Hj2"]


@pytest.mark.incus_version("7")  # 6.0 fails inside the operation: test_simulator_lts.py
def test_a_conflicting_create_is_pylxds_conflict(client: Client) -> None:
    client.instances.create(CONFIG, wait=True)
    with pytest.raises(pylxd_errors.Conflict, match='Instance "garm-7Hj2" already exists'):
        client.instances.create(CONFIG, wait=True)


def test_a_failing_create_raises_from_the_wait(sim_thread: SimulatorThread, client: Client) -> None:
    host = sim_thread.host(GPU_HOST)
    sim_thread.call(lambda: host.fail_next("create"))
    with pytest.raises(pylxd_errors.LXDAPIException, match="simulated failure"):
        client.instances.create(CONFIG, wait=True)
    assert not client.instances.exists("garm-7Hj2")
