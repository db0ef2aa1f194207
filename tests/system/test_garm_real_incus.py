"""The GARM provider against the real Incus 6.0 daemon (containers of the busybox test
image, tests/support/realincus.py), with ``reconciler run``, the bridge and the executor over a
real nats-server: the bootstrap really lands and runs in a claimed warm container, and
a cold runner is really created and deleted; a pool's install template and pre-install
scripts really run in a warm and a cold runner (cloud-init's part played from the host,
tests/support/cloud_init_standin.py: the image has no cloud-init); a runner whose create GARM
killed while Incus was still creating it is deleted on the first try.

The tests print what the issue asked to see (run with ``-s``)."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

from reconciler.core.model import PoolName, Resources
from reconciler.garm.bootstrap import LOG_PATH, Injection
from reconciler.incus.client import IncusEndpoint, IncusHost
from reconciler.incus.errors import InstanceNotFound
from reconciler.incus.views import InstanceSpec
from reconciler.replica.replica import Replica
from tests.support import builders as b
from tests.support import cloud_init_standin
from tests.support.bus import BusClient
from tests.support.garm import (
    CONTROLLER,
    GARM_POOL,
    MARKER,
    TOKEN,
    Garm,
    bootstrap,
    write_config,
)
from tests.support.realincus import RealIncus, slow_image
from tests.system.test_e2e_simulated import system_on, until

pytestmark = [pytest.mark.real_incus, pytest.mark.timeout(120)]

HOST = "real-01"


def container_pool(real_incus: RealIncus, name: str, **kw: Any) -> tuple[str, dict[str, Any]]:
    kind, payload = b.pool(name, cpu=1, memory_mib=128, disk_gib=1, instance_type="container", **kw)
    payload["image"] = real_incus.image
    return kind, payload


@contextlib.asynccontextmanager
async def real_world(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> AsyncIterator[tuple[Garm, BusClient, Replica]]:
    bus = BusClient(nc)
    eps = (IncusEndpoint(host=HOST, url=real_incus.url),)
    async with system_on(nats_url, tmp_path, eps, bus, leader_ttl_s=15.0) as replica:
        config = write_config(
            tmp_path / "garm-provider.toml",
            nats_url=nats_url,
            hosts={HOST: str(real_incus.socket)},  # a socket path, as operators write it
            pools={"warm": "real-warm", "small": "real-cold", "slow": "real-slow"},
            address_timeout=0,  # the test image's containers have no network
        )
        yield Garm(config), bus, replica


def names(real_incus: RealIncus) -> set[str]:
    return {str(i["name"]) for i in real_incus.instances()}


async def one_warm(real_incus: RealIncus, replica: Replica) -> str:
    """The name of the warm pool's one container, once it is ready."""
    assert replica.pipeline is not None
    state = replica.pipeline.state
    await until(
        "a warm container is ready", lambda: bool(state.pool_ready.get(PoolName("real-warm"))), 60
    )
    (warm,) = names(real_incus)
    return warm


async def test_a_warm_claim_runs_the_bootstrap_in_the_container(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, replica):
        await bus.send(container_pool(real_incus, "real-warm", min_ready=1, max_ready=1))
        warm = await one_warm(real_incus, replica)

        created = await garm.create(bootstrap("garm-real-warm-1", "warm"))
        assert created.code == 0, created.text
        assert created.json()["provider_id"] == warm
        assert created.json()["name"] == "garm-real-warm-1"
        instance = real_incus.query(f"/1.0/instances/{warm}")
        assert isinstance(instance, dict)
        config = instance["config"]
        assert config["user.runner-controller-id"] == CONTROLLER
        assert config["user.runner-pool-id"] == GARM_POOL
        assert config["user.runner-name"] == "garm-real-warm-1"

        ran = ""
        with anyio.fail_after(30):  # the install script runs in the background
            while "garm-real-warm-1" not in ran:
                ran = real_incus.incus("exec", warm, "--", "cat", MARKER, check=False)
                await anyio.sleep(0.2)
        assert ran.strip() == "bootstrap of garm-real-warm-1 ran as root"
        # a call killed after the start and run again: the script is not started twice
        real_incus.incus("exec", warm, "--", *Injection(files=()).command)
        await anyio.sleep(1.0)
        ran = real_incus.incus("exec", warm, "--", "cat", MARKER)
        assert ran.strip() == "bootstrap of garm-real-warm-1 ran as root"
        log = real_incus.incus("exec", warm, "--", "cat", LOG_PATH)
        assert "already started" in log

        listed = (await garm.list()).json()
        assert [(i["name"], i["provider_id"], i["status"]) for i in listed] == [
            ("garm-real-warm-1", warm, "running")
        ]
        deleted = await garm.delete("garm-real-warm-1")
        assert deleted.code == 0, deleted.text
        assert warm not in names(real_incus)


async def test_a_cold_create_and_delete(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, _replica):
        await bus.send(container_pool(real_incus, "real-cold"))
        created = None
        with anyio.fail_after(30):  # until the bridge's first snapshot is folded
            while created is None or "unknown host" in created.text:
                created = await garm.create(bootstrap("garm-real-cold-1", "small"))
                if created.code == 0:
                    break
                await anyio.sleep(0.5)
        assert created.code == 0, created.text
        assert created.json()["provider_id"] == "garm-real-cold-1"
        inst = real_incus.query("/1.0/instances/garm-real-cold-1")
        assert isinstance(inst, dict)
        assert inst["type"] == "container" and inst["status"] in ("Running", "Ready")
        assert inst["config"]["user.runner-controller-id"] == CONTROLLER
        assert inst["config"]["cloud-init.user-data"].startswith("#cloud-config")
        assert (await garm.get("garm-real-cold-1")).json()["status"] == "running"

        for _ in range(2):
            deleted = await garm.delete("garm-real-cold-1")
            assert deleted.code == 0, deleted.text
        assert "garm-real-cold-1" not in names(real_incus)
        reply = await bus.query("pool", {})
        assert reply["ok"] and reply["result"]["leases"] == []


# ------------------------------------------------------------ templates and pre-install

SEEN_SCRIPT = "/tmp/install_runner.sh.seen"
TEMPLATE = (
    "#!/bin/sh\n"
    "# runner {{ .RunnerName }} for {{ .RepoURL }}, labels '{{ .RunnerLabels }}'\n"
    "{{- if .UseJITConfig }}\n"
    "# JIT configuration: from {{ .MetadataURL }}\n"
    "{{- else }}\n"
    "# registration token: from {{ .MetadataURL }}\n"
    "{{- end }}\n"
    'echo "install of {{ .RunnerName }} marker={{ index .ExtraContext "marker" }}'
    f' as $(id -un)" >> {MARKER}\n'
    # the provider removes /install_runner.sh once it ran (it may hold the token): the
    # test's own template keeps a copy of itself, as rendered in the instance
    f"cat /install_runner.sh > {SEEN_SCRIPT}\n"
)
PRE_INSTALL = (
    "#!/bin/sh\n"
    'echo "pre-install 01-hello: ran as $(id -un)"\n'
    f'echo "pre-install 01-hello ran" >> {MARKER}\n'
    f"chmod 0666 {MARKER}  # prepares the image: the runner user appends to it\n"
)
P2P_PROFILE = "garm-p2p"


def templated(name: str, flavor: str, marker: str) -> dict[str, Any]:
    body = bootstrap(name, flavor)
    body["labels"] = ["self-hosted", "busybox"]
    body["extra_specs"] = {
        "runner_install_template": base64.b64encode(TEMPLATE.encode()).decode(),
        "extra_context": {"marker": marker},
        "pre_install_scripts": {"01-hello": base64.b64encode(PRE_INSTALL.encode()).decode()},
    }
    return body


def p2p_profile(real_incus: RealIncus) -> str:
    """A profile giving containers a point-to-point NIC (no network, no traffic): the
    test gives the container an address of its own, which Incus then reports."""
    profiles = real_incus.query("/1.0/profiles")
    assert isinstance(profiles, list)
    if f"/1.0/profiles/{P2P_PROFILE}" not in profiles:
        real_incus.incus("profile", "create", P2P_PROFILE)
        real_incus.incus(
            "profile", "device", "add", P2P_PROFILE, "eth0", "nic", "nictype=p2p", "name=eth0"
        )
    return P2P_PROFILE


async def read_when(real_incus: RealIncus, instance: str, path: str, text: str) -> str:
    found = ""
    with anyio.fail_after(30):
        while text not in found:
            found = real_incus.incus("exec", instance, "--", "cat", path, check=False)
            await anyio.sleep(0.2)
    return found


def show(title: str, text: str) -> None:
    print(f"\n----- {title} -----\n{text.rstrip()}")


async def test_a_pools_template_and_pre_install_scripts_on_a_warm_and_a_cold_runner(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, replica):
        kind, warm_pool = container_pool(real_incus, "real-warm", min_ready=1, max_ready=1)
        warm_pool["profiles"] = ["default", p2p_profile(real_incus)]
        await bus.send((kind, warm_pool), container_pool(real_incus, "real-cold"))
        warm = await one_warm(real_incus, replica)
        real_incus.incus(  # the container's own address (TEST-NET-1), as DHCP would give
            "exec",
            warm,
            "--",
            "sh",
            "-c",
            "ip addr add 192.0.2.10/24 dev eth0 && ip link set eth0 up",
        )

        created = await garm.create(templated("garm-tpl-warm-1", "warm", "warm-blue"))
        assert created.code == 0, created.text
        answer = created.json()
        assert answer["provider_id"] == warm and answer["name"] == "garm-tpl-warm-1"
        assert answer["addresses"] == [{"address": "192.0.2.10", "type": "public"}]
        assert (answer["os_name"], answer["os_version"]) == ("busybox", "static")
        ran = await read_when(real_incus, warm, MARKER, "install of")
        assert ran.splitlines() == [
            "pre-install 01-hello ran",
            "install of garm-tpl-warm-1 marker=warm-blue as root",  # the image has no runner
        ]
        script = await read_when(real_incus, warm, SEEN_SCRIPT, "install of")
        gone = real_incus.incus("exec", warm, "--", "ls", "/install_runner.sh", check=False)
        assert gone == ""  # removed once it ran
        assert (
            "{{" not in script
            and "runner garm-tpl-warm-1 for https://github.com/octo/repo" in script
        )
        log = real_incus.incus("exec", warm, "--", "cat", LOG_PATH)
        assert "pre-install 01-hello: ran as root" in log
        assert "pre-install script /garm-pre-install/01-hello exited 0" in log
        leftover = real_incus.incus("exec", warm, "--", "ls", "/garm-pre-install", check=False)
        assert leftover == ""  # removed after running, as cloud-init's runcmd does
        show("warm runner: /install_runner.sh", script)
        show(f"warm runner: {LOG_PATH}", log)
        show(f"warm runner: {MARKER}", ran)
        show(
            "warm runner: create answer", orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode()
        )

        created = await garm.create(templated("garm-tpl-cold-1", "small", "cold-green"))
        assert created.code == 0, created.text
        assert created.json()["provider_id"] == "garm-tpl-cold-1"
        assert (created.json()["os_name"], created.json()["os_version"]) == ("busybox", "static")
        data = cloud_init_standin.user_data(real_incus, "garm-tpl-cold-1")
        assert [c for c in data["runcmd"]] == [
            ["/garm-pre-install/01-hello"],
            ["rm", "-rf", "/garm-pre-install"],
            ["su", "-l", "-c", "/install_runner.sh", "runner"],
            ["rm", "-f", "/install_runner.sh"],
        ]
        output = cloud_init_standin.play(real_incus, "garm-tpl-cold-1")
        assert "pre-install 01-hello: ran as root" in output
        ran = real_incus.incus("exec", "garm-tpl-cold-1", "--", "cat", MARKER)
        assert ran.splitlines() == [
            "pre-install 01-hello ran",
            "install of garm-tpl-cold-1 marker=cold-green as runner",
        ]
        script = real_incus.incus("exec", "garm-tpl-cold-1", "--", "cat", SEEN_SCRIPT)
        gone = real_incus.incus(
            "exec", "garm-tpl-cold-1", "--", "ls", "/install_runner.sh", check=False
        )
        assert gone == ""  # removed once it ran
        assert "runner garm-tpl-cold-1 for https://github.com/octo/repo" in script
        show("cold runner: /install_runner.sh", script)
        show(f"cold runner: {cloud_init_standin.OUTPUT_LOG} (runcmd)", output)
        show(f"cold runner: {MARKER}", ran)

        for name in ("garm-tpl-warm-1", "garm-tpl-cold-1"):
            deleted = await garm.delete(name)
            assert deleted.code == 0, deleted.text
        assert not names(real_incus) & {warm, "garm-tpl-cold-1"}


# ------------------------------------------------------------ deletes during a create


async def test_a_destroy_while_incus_creates_the_instance_waits_for_the_create(
    real_incus: RealIncus,
) -> None:
    """Incus refuses a stop or delete while the create operation holds the instance
    ("Instance is busy running a "create" operation"): the adapter waits it out."""
    image = slow_image(real_incus)
    host = IncusHost(IncusEndpoint(host=HOST, url=real_incus.url), operation_timeout_s=60)
    spec = InstanceSpec(
        name="busy-1",
        image=image,
        instance_type="container",
        demand=Resources(cpu=1, memory_mib=128, disk_gib=2),
    )
    try:
        async with anyio.create_task_group() as tg:

            async def create() -> None:
                with contextlib.suppress(InstanceNotFound):  # deleted once created
                    await host.create_instance(spec)

            tg.start_soon(create)
            with anyio.fail_after(30):
                while True:  # until Incus runs the create
                    if await host.running_operations("busy-1"):
                        break
                    await anyio.sleep(0.02)
            waited = await host.destroy_instance("busy-1")
        assert waited == ("Creating instance",)
        assert "busy-1" not in names(real_incus)
    finally:
        await host.aclose()


async def test_garm_deletes_a_runner_whose_create_it_killed_on_the_first_try(
    nc: Client, nats_url: str, tmp_path: Path, real_incus: RealIncus
) -> None:
    """GARM kills a create (``exec_timeout_seconds``) 300 ms after Incus began creating
    the instance, and deletes the runner at once: the delete waits for Incus's create,
    succeeds on the first try and leaves nothing in Incus nor on the books."""
    image = slow_image(real_incus)
    async with real_world(nc, nats_url, tmp_path, real_incus) as (garm, bus, _replica):
        kind, pool = container_pool(real_incus, "real-slow")
        pool["image"] = image
        await bus.send((kind, pool))
        body = bootstrap("garm-killed-1", "slow")
        started = time.monotonic()
        moments: dict[str, float] = {}

        async def incus_is_creating() -> None:
            with anyio.fail_after(60):
                while True:
                    # a busy machine's `incus query` once answered nothing: ask again
                    answer = real_incus.incus("query", "/1.0/operations?recursion=1").strip()
                    ops = orjson.loads(answer) if answer else {}
                    assert isinstance(ops, dict)
                    running = [
                        o
                        for o in ops.get("running") or ()
                        if "/1.0/instances/garm-killed-1"
                        in (o["resources"] or {}).get("instances", ())
                    ]
                    if running:
                        break
                    await anyio.sleep(0.02)
            moments["incus create began"] = time.monotonic() - started
            await anyio.sleep(0.3)
            moments["create killed"] = time.monotonic() - started

        killed = None
        with anyio.fail_after(60):  # until the bridge's first snapshot is folded
            while killed is None or "unknown host" in killed.text:
                killed = await garm.create_killed(body, when=incus_is_creating)
                if killed is None:
                    break
                await anyio.sleep(0.5)
        assert killed is None, killed.text  # killed, not finished
        assert "garm-killed-1" in names(real_incus)  # Incus is still creating it

        deleted = await garm.delete("garm-killed-1")  # GARM's deferred cleanup, at once
        moments["delete done"] = time.monotonic() - started
        assert deleted.code == 0, deleted.text
        logged = [
            orjson.loads(line) for line in deleted.stderr.splitlines() if line.startswith(b"{")
        ]
        (done,) = [e for e in logged if e["event"] == "garm.deleted"]
        assert done["waited_for"] == ["Creating instance"]  # the delete met the create
        assert names(real_incus) == set()
        reply = await bus.query("pool", {})
        assert reply["ok"] and reply["result"]["leases"] == []
        assert TOKEN not in deleted.text
        show(
            "create killed 300 ms into Incus's create, then GARM's delete",
            "\n".join(f"{k:>22}: {v:6.2f} s" for k, v in moments.items())
            + f"\ndelete exit code: {deleted.code} (first try)\n"
            + f"garm.deleted: {orjson.dumps(done).decode()}\n"
            + f"instances left in Incus: {sorted(names(real_incus))}; "
            + f"active leases: {reply['result']['leases']}",
        )
