"""Widening a pipe (reconciler.store.pipes) leaves what is not one alone."""

from __future__ import annotations

from pathlib import Path

from reconciler.store.pipes import widen_pipe


def test_widening_what_is_not_a_pipe_changes_nothing_and_says_so(tmp_path: Path) -> None:
    with (tmp_path / "file").open("wb") as file:
        assert widen_pipe(file, 4 << 20) == 0
