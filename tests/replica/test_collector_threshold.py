"""The garbage collector's threshold (reconciler.replica.collector): ``--gc-threshold``."""

from __future__ import annotations

import gc

import pytest

from reconciler.replica.collector import apply_gc_threshold

pytestmark = pytest.mark.timeout(90)


def test_the_gc_threshold_sets_the_youngest_generation_only() -> None:
    before = gc.get_threshold()
    try:
        assert apply_gc_threshold(0) == before
        assert apply_gc_threshold(12_345) == (12_345, *before[1:])
        with pytest.raises(ValueError, match="threshold"):
            apply_gc_threshold(-1)
        assert gc.get_threshold() == (12_345, *before[1:])
    finally:
        gc.set_threshold(*before)
