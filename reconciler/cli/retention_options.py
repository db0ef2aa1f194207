"""The retention options of ``reconciler run`` (docs/long-lived.md).

``--decision-retention`` is part of the fold: every replica, and every ``reconciler
replay`` of the same stream, must use the same value, or they evict different things at
different inputs and their state digests differ. ``replay`` therefore takes it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from reconciler.core.retention import DEFAULT_DECISION_RETENTION_S
from reconciler.replica.reservation_reaper import (
    DEFAULT_JOURNAL_RETENTION_S,
    DEFAULT_RESERVATION_TIMEOUT_S,
)

__all__ = [
    "DEFAULT_DECISION_RETENTION_S",
    "DEFAULT_JOURNAL_RETENTION_S",
    "DEFAULT_RESERVATION_TIMEOUT_S",
    "decision_retention_option",
    "retention_options",
]

F = TypeVar("F", bound=Callable[..., Any])


def decision_retention_option(f: F) -> F:
    """``--decision-retention`` (``RC_DECISION_RETENTION``), in seconds of stream time."""
    return click.option(
        "--decision-retention",
        envvar="RC_DECISION_RETENTION",
        show_envvar=True,
        type=click.IntRange(min=1),
        default=DEFAULT_DECISION_RETENTION_S,
        show_default=True,
        help="Seconds of stream time a decided request id is remembered (its decision "
        "re-sent unchanged) after its final decision, and a released lease kept after its "
        "release. Evicted inside the fold: replicas and replays must use the same value.",
    )(f)


def retention_options(f: F) -> F:
    """``--decision-retention``, ``--journal-retention`` and ``--reservation-timeout``."""
    f = click.option(
        "--reservation-timeout",
        envvar="RC_RESERVATION_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0, min_open=True),
        default=DEFAULT_RESERVATION_TIMEOUT_S,
        show_default=True,
        help="Seconds a cold lease may stay reserved after its admission (its creator "
        "never created the VM) before the leader releases it.",
    )(f)
    f = click.option(
        "--journal-retention",
        envvar="RC_JOURNAL_RETENTION",
        show_envvar=True,
        type=click.IntRange(min=1),
        default=DEFAULT_JOURNAL_RETENTION_S,
        show_default=True,
        help="Seconds of stream time the store keeps lease history (the journal that "
        "`reconciler audit` shows); older rows are pruned as batches are written.",
    )(f)
    return decision_retention_option(f)
