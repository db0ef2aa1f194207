"""The operators' lifecycle commands as an operator types them (issue 25), against a real
``reconciler run`` process and nats-server: ``apply`` whole or not at all (``--dry-run``
asking the fold's own checks), sizes and typos refused before anything is sent, ``get``,
``diff`` and ``delete``, ``cordon``, ``drain`` and ``uncordon`` with ``status``; and what
``apply`` and ``cmd`` do when no replica answers.

The tests print what the issue asked to see (run with ``-s``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.cli.test_main import on_bus
from tests.cli.test_operator_commands import invoke, served
from tests.support import builders as b
from tests.support.bus import BusClient

pytestmark = pytest.mark.timeout(120)

__all__ = ["served"]  # the fixture, used by name

MIXED_YAML = """\
# a good pool, and a pool whose warm.min_ready is above its max_ready
- kind: pool
  pool: small
  flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}
  warm: {min_ready: 1, max_ready: 2}
  max_instances: 20
  image: ubuntu/24.04
  profiles: [default]
- kind: pool
  pool: big
  flavor: {cpu: 4, memory_mib: 8192, disk_gib: 40}
  warm: {min_ready: 3, max_ready: 1}
  max_instances: 10
  image: ubuntu/24.04
"""


def shown(title: str, *args: str, url: str | None) -> tuple[int, str, str]:
    """Run ``reconciler ARGS`` (with ``--nats-url url`` unless ``None``) and print it as a
    terminal would show it."""
    code, out, err = invoke(*args, *(("--nats-url", url) if url else ()))
    print(f"\n--- {title}\n$ reconciler {' '.join(args)}\n{out}{err}(exit {code})")
    return code, out, err


def inputs(url: str) -> list[tuple[str, dict[str, Any]]]:
    async def read(bus: BusClient) -> list[tuple[str, dict[str, Any]]]:
        return [(m.subject, orjson.loads(m.data)) for m in await bus.inputs()]

    found: list[tuple[str, dict[str, Any]]] = on_bus(url, read)
    return found


def test_apply_of_the_mixed_file_changes_nothing_dry_run_or_real(
    served: tuple[str, Path],
) -> None:
    url, tmp = served
    mixed = tmp / "mixed.yaml"
    mixed.write_text(MIXED_YAML)
    before = inputs(url)

    code, out, err = shown("dry run", "apply", "--dry-run", str(mixed), url=url)
    assert code == 1
    assert out.splitlines() == [
        "would be created pool small",
        "refused          pool big: pool 'big': warm.min_ready 3 > max_ready 1",
        "1 of 2 item(s) refused: the fold would apply none",
    ]
    assert "dry run, nothing published" in err
    assert inputs(url) == before  # nothing was published

    code, out, err = shown("real", "apply", str(mixed), url=url)
    assert code == 1
    assert "refused          pool big: pool 'big': warm.min_ready 3 > max_ready 1" in out
    assert "rejected (invalid-config): 1 of 2 item(s) refused, nothing applied" in err
    published = inputs(url)[len(before) :]
    assert [subject for subject, _ in published] == ["rc.in.cmd.apply-config"]
    assert [item["payload"]["pool"] for item in published[0][1]["items"]] == ["small", "big"]
    code, out, _ = shown("nothing applied", "get", "pools", url=url)
    assert code == 0 and yaml.safe_load(out) == []


def test_a_file_too_large_to_travel_is_refused_before_anything_is_sent(
    served: tuple[str, Path],
) -> None:
    url, tmp = served
    flavor = {"cpu": 1, "memory_mib": 1024, "disk_gib": 10}
    third = [
        {"kind": "pool", "pool": "a", "flavor": flavor, "max_instances": 5},
        {"kind": "class", "class": "a100", "parameters": {"gpu": {"count": 1}}},
        {
            "kind": "pool",
            "pool": "huge",
            "flavor": flavor,
            "max_instances": 5,
            "image": "x" * 2**21,
        },
    ]
    big = tmp / "third-too-large.yaml"
    big.write_text(yaml.safe_dump(third, width=2**30))
    whole = [
        {
            "kind": "pool",
            "pool": f"p{i}",
            "flavor": flavor,
            "max_instances": 5,
            "image": "i" * 1000,
            "profiles": ["p" * 250] * 8,
        }
        for i in range(600)
    ]
    many = tmp / "whole-too-large.yaml"
    many.write_text(yaml.safe_dump(whole, width=2**30))
    before = inputs(url)
    for args in (("apply", "--dry-run", str(big)), ("apply", str(big))):
        code, _, err = shown("an item too large", *args, url=url)
        assert code == 1
        assert "; nothing published" in err and "problems" not in err
        assert "item 3 (pool 'huge'): 2097" in err and "bytes, over the " in err
    for args in (("apply", "--dry-run", str(many)), ("apply", str(many)), ("diff", str(many))):
        code, _, err = shown("a file too large as a whole", *args, url=url)
        assert code == (2 if args[0] == "diff" else 1)
        assert "the 600 items make one input of" in err and "split the file" in err
    assert inputs(url) == before


def test_get_diff_delete_round_trip(served: tuple[str, Path]) -> None:
    url, tmp = served
    config = tmp / "config.yaml"
    config.write_text(
        textwrap.dedent("""\
        - kind: pool
          pool: web
          flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}
          max_instances: 4
          claims: [{name: g, class: a100}]
        - kind: class
          class: a100
          parameters: {gpu: {count: 1, model: A100}}
        """)
    )
    code, out, _ = shown("what apply would change", "diff", str(config), url=url)
    assert code == 1 and out.splitlines() == ["+ pool web", "+ class a100"]
    assert shown("apply", "apply", str(config), url=url)[0] == 0
    assert shown("nothing left to apply", "diff", str(config), url=url)[0] == 0

    code, out, _ = shown("get", "get", "pools", url=url)
    assert code == 0
    got = tmp / "got.yaml"
    got.write_text(out.replace("max_instances: 4", "max_instances: 6"))
    code, out, _ = shown("an edit, compared", "diff", str(got), url=url)
    assert code == 1 and out.splitlines() == ["~ pool web", "    max_instances: 4 -> 6"]
    assert shown("applied back", "apply", str(got), url=url)[0] == 0
    code, out, _ = shown("as JSON", "get", "pools", "web", "--json", url=url)
    assert code == 0 and orjson.loads(out)[0]["max_instances"] == 6

    code, out, _ = shown("a class in use", "delete", "classes", "a100", url=url)
    assert code == 1 and "class 'a100' is in use by pool 'web'" in out
    code, out, _ = shown("the pool, then the class", "delete", "pools", "web", url=url)
    assert code == 0 and "deleted          pool web" in out
    assert shown("", "delete", "classes", "a100", url=url)[0] == 0
    code, out, _ = shown("gone", "get", "classes", url=url)
    assert code == 0 and yaml.safe_load(out) == []
    code, _, err = shown("what is not there", "delete", "pools", "web", url=url)
    assert code == 1 and "there is no pool named 'web'" in err
    code, _, err = shown("", "get", "pools", "web", url=url)
    assert code == 1 and "there is no pool named 'web'" in err
    code, out, _ = shown("the deleted pool admits nothing", "cmd", "admit", "pool=web",
                         "instance=vm-9", "kind=cold", url=url)  # fmt: skip
    assert code == 1 and "(unknown-pool)" in out


def test_typos_are_refused_before_anything_is_sent(served: tuple[str, Path]) -> None:
    url, tmp = served
    typo = tmp / "typo.yaml"
    typo.write_text(
        "- pool: t\n  flavor: {cpu: 1, memory_mib: 1, disk_gib: 1}\n  max_instances: 1\n"
        "  wram: {min_ready: 1}\n"
    )
    before = inputs(url)
    code, _, err = shown("a typo in a file", "apply", str(typo), url=url)
    assert code == 1 and "item 1 (pool 't'): unknown field 'wram' (did you mean 'warm'?)" in err
    code, _, err = shown("a key=value no command has", "cmd", "admit", "pool=web",
                         "instance=vm-1", "kind=cold", "cpu=4", url=url)  # fmt: skip
    assert code == 1 and "unknown field 'cpu'" in err and "nothing published" in err
    assert inputs(url) == before


def test_apply_and_cmd_fail_when_no_replica_answers(nats_url: str, tmp_path: Path) -> None:
    async def streams(bus: BusClient) -> None:
        await bus.ensure_streams()

    on_bus(nats_url, streams)
    pools = tmp_path / "pools.yaml"
    pools.write_text(MIXED_YAML.replace("min_ready: 3", "min_ready: 0"))
    code, _, err = shown("no replica", "apply", str(pools), "--wait", "1", url=nats_url)
    assert code == 1 and "no decision for apply-" in err and "within 1 s" in err
    code, _, err = shown("no replica", "apply", "--dry-run", str(pools), "--wait", "0",
                         url=nats_url)  # fmt: skip
    assert code == 1 and "(the fold's checks need a synced replica; nothing was published)" in err
    code, _, err = shown("no replica", "cmd", "release", "instance=vm-1", "--wait", "1",
                         url=nats_url)  # fmt: skip
    assert code == 1 and "no final decision" in err
    code, _, err = shown("publish only", "apply", str(pools), "--wait", "0", url=nats_url)
    assert code == 0 and "not waited for" in err


def test_a_host_cordoned_drained_then_empty(served: tuple[str, Path]) -> None:
    url, tmp = served
    db = str(tmp / "rc.db")
    pools = tmp / "warm.yaml"
    pools.write_text(
        "- pool: small\n  flavor: {cpu: 2, memory_mib: 4096, disk_gib: 20}\n"
        "  warm: {min_ready: 2, max_ready: 2}\n  max_instances: 10\n  image: ci\n"
    )
    assert invoke("apply", str(pools), "--nats-url", url)[0] == 0

    async def boot_warm(bus: BusClient) -> list[str]:  # the executor and the bridge's part
        creates = await bus.wait_outputs("rc.out.exec.h1.create", 2, within_s=20)
        names = [orjson.loads(c.data)["instance"] for c in creates]
        for name in names:
            await bus.send(b.lifecycle("h1", "instance-created", name))
            await bus.send(b.lifecycle("h1", "instance-ready", name))
        await bus.wait_caught_up()
        return names

    warm = on_bus(url, boot_warm)
    code, out, _ = shown("cordon", "cordon", "h1", url=url)
    assert code == 0 and "h1 cordoned: nothing new is admitted there" in out
    # a job takes a warm VM: the pool asks for another, which the cordoned host refuses
    code, out, _ = shown("a job on one", "cmd", "claim-warm", "pool=small", "job=job-1", url=url)
    assert code == 0
    busy = next(name for name in warm if name in out)
    (idle,) = [name for name in warm if name != busy]
    code, out, _ = shown("drain", "drain", "h1", url=url)
    assert code == 0
    assert f"h1 draining: 1 idle warm VM(s) deleted ({idle}); 1 other lease(s) run" in out
    code, out, _ = shown("status", "status", "--db", db, url=None)
    line = next(line for line in out.splitlines() if line.startswith("h1 "))
    assert line.split()[1] == "draining" and "1 claimed, 1 draining" in line

    async def gone(bus: BusClient) -> None:
        deletes = await bus.wait_outputs("rc.out.exec.h1.delete", 1)
        assert orjson.loads(deletes[0].data)["reason"] == "drained"
        await bus.send(b.lifecycle("h1", "instance-deleted", idle))
        await bus.wait_caught_up()

    on_bus(url, gone)
    assert invoke("cmd", "release", f"instance={busy}", "--nats-url", url)[0] == 0
    code, out, _ = shown("status, empty", "status", "--db", db, url=None)
    line = next(line for line in out.splitlines() if line.startswith("h1 "))
    assert line.split()[1] == "drained" and line.endswith(" -")
    code, out, _ = shown("uncordon", "uncordon", "h1", url=url)
    assert code == 0 and "h1 uncordoned" in out
    code, out, _ = shown("an unknown host", "drain", "h9", url=url)
    assert code == 1 and "rejected (unknown-host): no host named 'h9' has sent a snapshot" in out
