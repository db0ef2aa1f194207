"""Attempt identities (reconciler.garm.attempts): tokens that give the runner back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.garm.attempts import job_of, request_id, runner_of_job

pytestmark = pytest.mark.timeout(60)


@given(st.from_regex(r"[a-z][a-z0-9-]{0,61}[a-z0-9]", fullmatch=True), st.integers(1, 64))
def test_attempt_identities_are_tokens_and_give_the_runner_back(name: str, n: int) -> None:
    for step in ("claim", "admit", "created", "injected"):
        rid = request_id(name, n, step)
        assert len(rid) <= 128 and all(c.isalnum() or c in "-_" for c in rid)
    assert runner_of_job(job_of(name, n)) == name
    assert (job_of(name, n) == name) == (n == 1)
