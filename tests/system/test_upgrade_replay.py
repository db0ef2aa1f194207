"""``reconciler replay`` of streams the previous release recorded (docs/operations.md,
"Upgrade"): this version's fold reproduces every decision of that release, and a real
change of decision in such a stream is still reported.

The streams are ``tests/data/upgrade/``: a nats-server store holding the ``RC_IN`` and
``RC_OUT`` that release's ``reconciler demo`` story (and a few more commands) left
behind, made by ``record.py`` there with that release's code (its README says how).
A store, because JetStream stamps every message when it stores it and the fold decides
on those stamps: only the store keeps them. ``streams.jsonl`` is the same, readable.
Each test starts a nats-server of its own on a fresh copy of the store, changes the copy
where it says so (an output deleted and published again, changed), and runs the real
``reconciler replay`` against it. The registry of additions itself is tested in
``tests/core/test_compat.py``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import orjson
import pytest

from tests.support.natsserver import NatsProcess, find_binary
from tests.support.repo import ROOT

pytestmark = pytest.mark.timeout(120)

FIXTURE = ROOT / "tests" / "data" / "upgrade"
SCHEMAS = ROOT / "reconciler" / "schemas" / "out"
INSTANCE_TYPE = "out.exec.*.create instance_type"

Row = dict[str, Any]


def recorded() -> list[Row]:
    """``streams.jsonl``: every message of both streams, in order."""
    lines = (FIXTURE / "streams.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def payload(row: Row) -> bytes:
    return base64.b64decode(row["data_b64"]) if "data_b64" in row else row["data"].encode()


def binaries() -> list[Any]:
    """The suite's nats-server, and the 2.10 one of the test extras when it is another:
    the store (written by 2.9.10) must open in both."""
    found = find_binary()
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    params = [pytest.param(found, id="nats-server")]
    if beside.exists() and found is not None and beside.resolve() != Path(found).resolve():
        params.append(pytest.param(str(beside), id="nats-server-beside-python"))
    return params


@contextlib.contextmanager
def recorded_server(tmp_path: Path, binary: str | None = None) -> Iterator[str]:
    """A nats-server of this test's own on a fresh copy of the recorded store."""
    if os.environ.get("RC_TEST_NATS_URL"):
        pytest.skip("the recorded store needs a nats-server of the test's own")
    binary = binary or find_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    workdir = tmp_path / "nats"
    store = workdir / "store"
    store.mkdir(parents=True)
    with tarfile.open(FIXTURE / "streams.tar.gz") as tar:
        tar.extractall(store, filter="data")
    server = NatsProcess(binary, workdir)
    try:
        server.start()
        yield server.url
    finally:
        server.close()


def replay(url: str) -> tuple[int, dict[str, Any]]:
    """``reconciler replay --json`` against ``url``: its exit status and its report."""
    done = subprocess.run(
        [sys.executable, "-m", "reconciler.cli", "replay", "--nats-url", url, "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def outputs_with_ids() -> list[Row]:
    return [r for r in recorded() if r["stream"] == "RC_OUT" and "Nats-Msg-Id" in r["headers"]]


def rewrite(url: str, change: Callable[[Row, dict[str, Any]], bool]) -> list[str]:
    """Publish again, changed, every output with an id that ``change`` changes in place
    (given its row and parsed payload), after deleting the recorded one: the copy's
    ``RC_OUT`` then holds it changed, with its id. Returns the ids changed."""

    async def run() -> list[str]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            # a store recorded minutes ago still remembers its ids: shorten its memory
            info = await js.stream_info("RC_OUT")
            await js.update_stream(info.config.evolve(duplicate_window=0.1))
            changed = []
            for row in outputs_with_ids():
                body = json.loads(payload(row))
                if not change(row, body):
                    continue
                await js.delete_msg("RC_OUT", row["seq"])
                data = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
                for _ in range(50):
                    ack = await js.publish(row["subject"], data, headers=row["headers"])
                    if not ack.duplicate:
                        break
                    await anyio.sleep(0.1)  # the server has not purged the old id yet
                else:
                    raise AssertionError(f"{row['headers']} stays a duplicate")
                changed.append(row["headers"]["Nats-Msg-Id"])
            return changed
        finally:
            await nc.close()

    return anyio.run(run)


# ------------------------------------------------------------------ the recording


def test_the_recorded_store_holds_what_the_dump_says(tmp_path: Path) -> None:
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    rows = recorded()
    with recorded_server(tmp_path) as url:

        async def stored() -> list[Row]:
            nc = await nats.connect(url)
            found = []
            try:
                for stream in ("RC_IN", "RC_OUT"):
                    info = await nc.jetstream().stream_info(stream)
                    assert info.config.max_age in (0, None)  # kept for good
                    for seq in range(1, int(info.state.last_seq) + 1):
                        request = json.dumps({"seq": seq}).encode()
                        api = f"$JS.API.STREAM.MSG.GET.{stream}"
                        msg = json.loads((await nc.request(api, request, timeout=5)).data)
                        found.append({"stream": stream, "seq": seq, **msg["message"]})
            finally:
                await nc.close()
            return found

        messages = anyio.run(stored)
    assert len(messages) == len(rows) == sum(manifest["messages"].values())
    for row, msg in zip(rows, messages, strict=True):
        assert (row["stream"], row["seq"], row["subject"], row["time"]) == (
            msg["stream"],
            msg["seq"],
            msg["subject"],
            msg["time"],
        )
        assert payload(row) == base64.b64decode(msg.get("data", ""))
        for name, value in row["headers"].items():
            assert f"{name}: {value}".encode() in base64.b64decode(msg["hdrs"])
    assert manifest["commit"] == "43f83fd"


@pytest.mark.parametrize("binary", binaries())
def test_the_previous_release_s_stream_replays_without_a_divergence(
    tmp_path: Path, binary: str
) -> None:
    rows = recorded()
    with recorded_server(tmp_path, binary) as url:
        status, report = replay(url)
    assert report["details"] == []
    assert (status, report["ok"], report["divergences"]) == (0, True, 0)
    assert report["inputs"] == sum(r["stream"] == "RC_IN" for r in rows)
    assert report["compared"] == len(outputs_with_ids())
    assert report["older"] == {}  # that release wrote every addition registered so far


# ------------------------------------------------------------------ real changes


def _placement(row: Row, body: dict[str, Any]) -> bool:
    """A GPU job placed on other GPUs than the fold chooses."""
    if row["subject"] != "rc.out.decision.ml-1":
        return False
    assert body["lease"]["gpus"] == [0, 1]
    body["lease"]["gpus"] = [2, 3]
    return True


def _outcome(row: Row, body: dict[str, Any]) -> bool:
    """A request rejected where the fold admits it."""
    if row["subject"] != "rc.out.decision.cold-1":
        return False
    assert body["outcome"] == "admitted"
    body["outcome"] = "rejected"
    return True


def _instance_type(row: Row, body: dict[str, Any]) -> bool:
    """An added field's value changed: only its absence is an older release's."""
    if not row["subject"].endswith(".create") or body["instance_type"] == "container":
        return False
    body["instance_type"] = "container"
    return True


def _detail(row: Row, body: dict[str, Any]) -> bool:
    """A field no release added taken out."""
    if row["subject"] != "rc.out.decision.x-unknown-pool":
        return False
    del body["detail"]
    return True


@pytest.mark.parametrize("change", [_placement, _outcome, _instance_type, _detail])
def test_a_changed_output_in_the_previous_release_s_stream_is_a_divergence(
    tmp_path: Path, change: Callable[[Row, dict[str, Any]], bool]
) -> None:
    with recorded_server(tmp_path) as url:
        changed = rewrite(url, change)
        status, report = replay(url)
    assert changed
    assert status == 1 and not report["ok"]
    assert {(d["kind"], d["msg_id"]) for d in report["details"]} == {
        ("mismatch", msg_id) for msg_id in changed
    }
    assert report["divergences"] == len(changed)


# ------------------------------------------------------------------ additions


def test_outputs_an_older_release_wrote_without_a_later_addition_are_equal(
    tmp_path: Path,
) -> None:
    """Create commands without ``instance_type``, as releases before it wrote them for a
    pool that did not name one: compared as that release wrote them, and counted."""

    def older(row: Row, body: dict[str, Any]) -> bool:
        if not row["subject"].endswith(".create"):
            return False
        assert body.pop("instance_type") == "virtual-machine"
        return True

    with recorded_server(tmp_path) as url:
        changed = rewrite(url, older)
        status, report = replay(url)
    assert len(changed) >= 2
    assert report["details"] == []
    assert (status, report["ok"]) == (0, True)
    assert report["older"] == {INSTANCE_TYPE: len(changed)}
