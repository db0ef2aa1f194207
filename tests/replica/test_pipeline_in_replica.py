"""The caches' pipeline: batches that grow while the writer is busy, and a fold that
fails on one input (a bug) recovered by dead-lettering it, whether it arrived in a batch
of its own, in one being merged, or in a later chunk of its batch; and an input whose
output the bus could not carry, dead-lettered ``too-large`` the same way."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from nats.aio.client import Client

import reconciler.replica.pipeline as pipeline_module
from reconciler.bus.schemas import SCHEMAS_DIR_ENV, schemas_dir
from reconciler.core.fold import fold_input
from reconciler.core.inputs import Input
from reconciler.core.messages import MAX_OUTPUT_BYTES, MAX_PAYLOAD_BYTES
from reconciler.core.state import Effects, State
from reconciler.store.digest import state_digest
from reconciler.store.sqlite import Store
from tests.support import builders as b
from tests.support.bus import BusClient, fast_config, running_replica

pytestmark = pytest.mark.timeout(90)

FLEET = [
    b.snapshot("h1", cpu=64, memory_mib=262144, disk_gib=4000),
    b.pool("web", cpu=1, memory_mib=1024, disk_gib=10, min_ready=0, max_ready=0),
]


def admits(first: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    return [b.admit(f"a{i}", "web", f"vm-{i}") for i in range(first, first + count)]


async def test_what_arrives_while_the_writer_is_busy_joins_the_batch_in_hand(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    bus = BusClient(nc)
    async with running_replica(fast_config(nats_url, tmp_path / "rc.db")) as replica:
        await bus.send(*FLEET)
        await bus.wait_caught_up()
        pipeline, store = replica.pipeline, replica.store
        assert pipeline is not None and store is not None and store._writer is not None
        batches_before = pipeline.batches
        async with store._writer._lock:  # the writer is busy with something else
            for item in admits(0, 40):
                await bus.send(item)  # one at a time: a fetch each, folded on arrival
            with anyio.fail_after(10):
                while pipeline.state.applied_seq < len(FLEET) + 40:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
        for i in range(40):
            assert (await bus.decision(f"a{i}"))["outcome"] == "admitted"
        await bus.wait_caught_up()
        # at most the batch handed over before the lock, and the one that grew meanwhile
        assert pipeline.batches - batches_before <= 3
        info = await bus.js.consumer_info("RC_IN", pipeline.consumer.durable)
        assert info.num_ack_pending == 0  # every input acknowledged after its commit


@pytest.mark.parametrize(
    ("merged", "chunk"),
    [(False, None), (True, None), (False, 3)],
    ids=["own-batch", "merged-batch", "later-chunk"],
)
async def test_a_fold_bug_dead_letters_that_input_and_the_line_goes_on(
    nc: Client,
    nats_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    merged: bool,
    chunk: int | None,
) -> None:
    real_fold = fold_input  # what the pipeline calls
    if chunk is not None:  # a5 is folded in a later chunk of its batch
        monkeypatch.setattr(pipeline_module, "FOLD_CHUNK", chunk)

    def buggy_fold(state: State, seq: int, timestamp: str, item: Input, fx: Effects) -> Effects:
        if getattr(item, "request_id", None) == "a5":
            state.hosts.clear()  # half-changed, then the bug
            raise RuntimeError("a bug in the fold")
        return real_fold(state, seq, timestamp, item, fx)

    monkeypatch.setattr(pipeline_module, "fold_input", buggy_fold)
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    if chunk is not None:  # all in the stream first: one fetch, folded chunk by chunk
        await bus.ensure_streams()
        await bus.send(*FLEET, *admits(0, 10))
    async with running_replica(fast_config(nats_url, db)) as replica:
        if chunk is None:
            await bus.send(*FLEET)
        await bus.wait_caught_up()
        pipeline, store = replica.pipeline, replica.store
        assert pipeline is not None and store is not None and store._writer is not None
        if merged:
            async with store._writer._lock:
                for item in admits(0, 10):
                    await bus.send(item)
                await anyio.sleep(0.3)  # folded into the batch in hand, a5 included
        elif chunk is None:
            await bus.send(*admits(0, 10))
        for i in range(10):
            if i != 5:
                assert (await bus.decision(f"a{i}"))["outcome"] == "admitted"
        dead = await bus.wait_output("rc.out.dlq.domain")
        assert "internal error" in dead.json()["error"]
        await bus.wait_caught_up()
        assert "h1" in pipeline.state.hosts  # the half-changed state was dropped
        live = state_digest(pipeline.state)
    async with await Store.open(db) as reopened:
        assert state_digest(await reopened.load_state()) == live


def lenient_pool_schemas(tmp_path: Path) -> Path:
    """A copy of the schemas whose pool image has no bound (the bound keeps every create
    command of a schema-valid pool small enough for the bus)."""
    schemas = tmp_path / "schemas"
    shutil.copytree(str(schemas_dir()), schemas)
    pool_schema = schemas / "in" / "config.pool.json"
    document = orjson.loads(pool_schema.read_bytes())
    del document["properties"]["image"]["maxLength"]
    pool_schema.write_bytes(orjson.dumps(document))
    return schemas


async def test_an_input_whose_output_would_be_too_large_is_dead_lettered_too_large(
    nc: Client, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision or command the bus could not carry is never committed: the step is
    dropped, the input dead-lettered ``too-large``, and the next input decided. The
    schemas' bounds keep such outputs from schema-valid inputs; here the bound on a
    pool's image is lifted so that a warm VM's create command passes the bus's."""
    monkeypatch.setenv(SCHEMAS_DIR_ENV, str(lenient_pool_schemas(tmp_path)))
    kind, huge = b.pool("huge", min_ready=0, max_ready=1)
    huge["image"] = "i" * (MAX_OUTPUT_BYTES + 1_000)  # the input fits, its create does not
    assert len(orjson.dumps(huge)) <= MAX_PAYLOAD_BYTES
    bus = BusClient(nc)
    db = tmp_path / "rc.db"
    async with running_replica(fast_config(nats_url, db)) as replica:
        await bus.send(*FLEET, (kind, huge))
        await bus.send(b.admit("w1", "huge", "w-1", kind="warm"), b.admit("a1", "web", "vm-1"))
        assert (await bus.decision("a1"))["outcome"] == "admitted"
        dead = (await bus.wait_output("rc.out.dlq.too-large")).json()
        assert dead["error"].startswith("its create command would be 1")
        assert dead["subject"] == "rc.in.cmd.admit"
        await bus.wait_caught_up()
        pipeline = replica.pipeline
        assert pipeline is not None and pipeline.state.lease_of_instance("w-1") is None
        assert await bus.outputs("rc.out.decision.w1") == []
        live = state_digest(pipeline.state)
    async with await Store.open(db) as reopened:
        assert state_digest(await reopened.load_state()) == live
