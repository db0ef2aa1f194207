"""Attempt identities (reconciler.garm.attempts): tokens that give the runner back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.garm.attempts import find_attempt, job_of, request_id, runner_of_job

pytestmark = pytest.mark.timeout(60)


@given(st.from_regex(r"[a-z][a-z0-9-]{0,61}[a-z0-9]", fullmatch=True), st.integers(1, 64))
def test_attempt_identities_are_tokens_and_give_the_runner_back(name: str, n: int) -> None:
    for step in ("claim", "admit", "created", "injected"):
        rid = request_id(name, n, step)
        assert len(rid) <= 128 and all(c.isalnum() or c in "-_" for c in rid)
    assert runner_of_job(job_of(name, n)) == name
    assert (job_of(name, n) == name) == (n == 1)


class Stored:
    """Decisions as the OUT stream holds them (latest per request id), and leases."""

    def __init__(self, decisions: dict[str, dict[str, Any]]) -> None:
        self.decisions = decisions

    async def last_decision(self, request_id: str) -> dict[str, Any] | None:
        return self.decisions.get(request_id)

    async def query(self, name: str, body: dict[str, Any]) -> Any:
        return None  # no lease is active


async def test_a_create_that_still_waits_in_the_queue_resumes_its_attempt() -> None:
    """A create killed while its admission waited (latest decision ``queued``) is run
    again in the same attempt: it waits on, in its place; one whose wait ended
    (``queue-timeout`` or ``cancelled``) starts the next attempt."""
    queued = {"phase": "pending", "outcome": "queued", "reason": "insufficient-capacity"}
    attempt = await find_attempt(Stored({request_id("r", 1, "admit"): queued}), "r")
    assert attempt.number == 1 and attempt.admit == queued
    for reason in ("queue-timeout", "cancelled"):
        ended = {"phase": "final", "outcome": "rejected", "reason": reason}
        attempt = await find_attempt(Stored({request_id("r", 1, "admit"): ended}), "r")
        assert attempt.number == 2 and attempt.admit is None
