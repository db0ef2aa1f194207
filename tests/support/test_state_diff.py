"""Where two states differ (tests/support/state_diff.py), as the system tests print it."""

from __future__ import annotations

from reconciler.core.model import LeaseId
from reconciler.core.state import State
from tests.support.state_diff import differences


def test_equal_states_have_no_differences() -> None:
    assert differences(State(applied_seq=7), State(applied_seq=7)) == []


def test_the_position_and_each_differing_row_are_named_with_both_sides() -> None:
    first = State(applied_seq=7, released_at={LeaseId("L1"): 100, LeaseId("L2"): 200})
    second = State(applied_seq=8, released_at={LeaseId("L1"): 100, LeaseId("L3"): 300})
    lines = differences(first, second, names=("replay", "replica-1"))
    assert lines == [
        "applied_seq: replay 7, replica-1 8",
        "released_at: 2 differ, first ['L2', 'L3']",
        "  L2: replay 200",
        "      replica-1 None",
        "  L3: replay None",
        "      replica-1 300",
    ]
