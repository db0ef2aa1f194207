"""The candidate index (reconciler.core.candidates) answers what a full scan answers, also
across cuts of its change log, which never make it scan the whole fleet again (issue 15)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core import candidates
from reconciler.core.candidates import CandidateIndex
from reconciler.core.model import HostName

HOSTS = [HostName(f"h{i:02d}") for i in range(12)]

#: (host index, new score or None for no fit) changes, with placements of shape 0 or 1
steps = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, len(HOSTS) - 1), st.none() | st.integers(0, 5)),
        st.tuples(st.just("best"), st.integers(0, 1), st.none()),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(steps=steps)
def test_the_index_picks_what_a_full_scan_picks_across_log_cuts(
    steps: list[tuple[str, int, int | None]],
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(candidates, "_MAX_LOG", 3)  # cut the log often
        scores: dict[HostName, int | None] = dict.fromkeys(HOSTS, 1)
        index = CandidateIndex()
        evaluated: list[HostName] = []

        def score(shape: int) -> object:
            def of(name: HostName) -> tuple[int, float | None]:
                evaluated.append(name)
                value = scores[name]
                if value is None:
                    return 1, None
                return 2, float(value * (shape + 1))

            return of

        since: dict[int, set[HostName]] = {0: set(), 1: set()}
        for op, a, b in steps:
            if op == "set":
                scores[HOSTS[a]] = b
                index.touch(HOSTS[a])
                for touched in since.values():
                    touched.add(HOSTS[a])
                continue
            first_time = a not in index.shapes
            evaluated.clear()
            best, _ = index.best(a, HOSTS, score(a))  # type: ignore[arg-type]
            fits = [(v * (a + 1), n) for n, v in scores.items() if v is not None]
            assert best == (min(fits)[1] if fits else None)
            if not first_time:  # only the hosts changed since, never the whole fleet again
                assert len(evaluated) == len(set(evaluated))
                assert set(evaluated) <= since[a]
            since[a] = set()
