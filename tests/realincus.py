"""The tests' private, real Incus daemon (see :mod:`reconciler.cli.local_incus`).

One daemon per test session (``real_incus_daemon`` in ``conftest.py``); tests that use it
are marked ``@pytest.mark.real_incus`` and counted in the session's summary. Where it
cannot run they skip with the reason, unless ``RC_REQUIRE_REAL_INCUS=1`` (set by
``scripts/test`` where it installed the packages, so in CI), where that is a failure.
"""

from __future__ import annotations

import os

from reconciler.cli.local_incus import (
    IMAGE_ALIAS,
    LocalIncus,
    start_local_incus,
    unavailable,
)

__all__ = [
    "IMAGE_ALIAS",
    "REQUIRE_ENV",
    "RealIncus",
    "required",
    "start_real_incus",
    "unavailable",
]

REQUIRE_ENV = "RC_REQUIRE_REAL_INCUS"

RealIncus = LocalIncus
start_real_incus = start_local_incus


def required() -> bool:
    """Whether a missing daemon is a failure rather than a skip (CI)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")
