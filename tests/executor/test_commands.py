"""The executor's commands (reconciler.executor.commands): parsing, and failures sorted
by what to do about them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from reconciler.core.model import TAG_KIND, TAG_LEASE_ID, TAG_POOL
from reconciler.executor.commands import (
    CommandParser,
    CreateCommand,
    DeleteCommand,
    Refusal,
    Retry,
    classify,
    invalid_instance_name,
)
from reconciler.incus.errors import (
    ApiRejected,
    ImageNotFound,
    ImageTypeMismatch,
    IncusUnavailable,
    InstanceExists,
    InstanceNameTaken,
    InstanceTypeUnsupported,
    OperationFailed,
    OperationLost,
    OperationTimedOut,
)
from tests.support.executor import (
    PREFIX,
    create_cmd,
    delete_cmd,
)

pytestmark = pytest.mark.timeout(60)

CPU, OTHER = "host-01", "host-02"


def test_instance_names_follow_incus_rule() -> None:
    for good in ("a", "w-4", "rc-small-7", "x" * 63, "1a", "a1"):
        assert invalid_instance_name(good) is None, good
    for bad in ("", "x" * 64, "-a", "a-", "123", "a_b", "a.b", "a/b", "ä"):
        assert invalid_instance_name(bad) is not None, bad


def test_parser_refuses_bad_commands_with_a_reason() -> None:
    parser = CommandParser()
    good = create_cmd(CPU, "w-1", "L1")

    def parse(payload: Any, subject: str = f"{PREFIX}.out.exec.{CPU}.create") -> Any:
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        return parser.parse(subject, data, prefix=PREFIX, host=CPU)

    parsed = parse(good)
    assert isinstance(parsed, CreateCommand)
    assert parsed.key == f"{CPU}/ci/w-1"
    spec = parsed.spec(storage_pool="fast")
    assert spec.tags == {TAG_LEASE_ID: "L1", TAG_POOL: "small", TAG_KIND: "warm"}
    assert spec.storage_pool == "fast"
    deleted = parse(delete_cmd(CPU, "w-1", "L1"), f"{PREFIX}.out.exec.{CPU}.delete")
    assert isinstance(deleted, DeleteCommand)
    assert deleted.reason == "drained"

    cases: list[tuple[Any, str, str]] = [
        (b"\xff", "decode", f"{PREFIX}.out.exec.{CPU}.create"),
        (b"[1]", "decode", f"{PREFIX}.out.exec.{CPU}.create"),
        (b"x" * 1_048_577, "too-large", f"{PREFIX}.out.exec.{CPU}.create"),
        (good, "subject", f"{PREFIX}.out.exec.{CPU}.restart"),
        (good, "subject", f"{PREFIX}.out.status.host.{CPU}"),
        ({k: v for k, v in good.items() if k != "image"}, "schema", ""),
        ({**good, "v": 2}, "schema", ""),
        ({**good, "instance": "-bad"}, "schema", ""),
        ({**good, "host": OTHER}, "wrong-host", ""),
        (good, "wrong-host", f"{PREFIX}.out.exec.{OTHER}.create"),
        (good, "schema", f"{PREFIX}.out.exec.{CPU}.delete"),
    ]
    for payload, reason, subject in cases:
        refused = parse(payload, subject or f"{PREFIX}.out.exec.{CPU}.create")
        assert isinstance(refused, Refusal), (payload, subject)
        assert refused.reason == reason, (refused, subject)


def test_failures_are_sorted_by_what_to_do() -> None:
    h = "h"
    assert classify(IncusUnavailable(h, "refused")).retry is Retry.FOREVER
    assert classify(OperationTimedOut(h, "slow")).retry is Retry.FOREVER
    busy = OperationFailed(h, 'Instance is busy running a "start" operation')
    assert classify(busy).retry is Retry.FOREVER
    flaky = OperationFailed(h, "Failed creating instance from image: simulated failure")
    assert classify(flaky).retry is Retry.LIMITED
    image = OperationFailed(h, "Failed creating instance from image: Image not found")
    assert classify(image).retry is Retry.NEVER
    profile = ApiRejected(h, 'Requested profile "x" doesn\'t exist', status=500)
    assert classify(profile).retry is Retry.NEVER
    assert classify(ApiRejected(h, "Invalid config", status=400)).retry is Retry.NEVER
    assert classify(InstanceExists(h, "taken", status=409)).reason == "name-taken"
    assert classify(ApiRejected(h, "not trusted", status=403)).retry is Retry.FOREVER
    assert classify(ApiRejected(h, "oops", status=500)).retry is Retry.LIMITED


@pytest.mark.parametrize(
    "refusal",
    [
        ImageTypeMismatch(
            "h",
            'Requested image\'s type "container" doesn\'t match instance type "virtual-machine"',
        ),
        InstanceTypeUnsupported(
            "h", 'Instance type "virtual-machine" is not supported on this server'
        ),
        ImageNotFound("h", "Image not provided for instance creation"),
    ],
)
def test_refused_creates_are_never_retried(refusal: OperationFailed) -> None:
    failure = classify(refusal)

    assert (failure.retry, failure.reason) == (Retry.NEVER, "refused")


def test_an_operation_gone_before_its_end_was_seen_is_tried_again() -> None:
    lost = OperationLost("h", "operation 1234 is gone; its outcome is unknown")

    assert (classify(lost).retry, classify(lost).reason) == (Retry.LIMITED, "operation-lost")


def test_a_name_taken_inside_the_operation_is_never_retried() -> None:
    taken = InstanceNameTaken("h", "UNIQUE constraint failed: instances.project_id, instances.name")

    assert (classify(taken).retry, classify(taken).reason) == (Retry.NEVER, "name-taken")
