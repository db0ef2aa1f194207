"""The admission queue's counters (``rc_queue_*`` metrics, built by
:mod:`.metrics`), kept from every commit: every replica folds, so every replica counts.

Rules: plain counters, no metrics library (a replica without ``--metrics-addr`` does not
load one); fed by the commit listener :meth:`QueueStats.notify` from each batch's
effects (how each wait ended, message time).
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["ENDINGS", "WAIT_BUCKETS", "QueueStats"]

#: the upper bounds (seconds) of the time-queued histogram's buckets
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
#: how admission requests ended, the label values of ``rc_queue_requests_total``
ENDINGS = ("at-once", "after-waiting", "timed-out", "cancelled", "refused")


class QueueStats:
    """The admission queue's counters, kept from every commit (every replica folds):
    how requests ended, and how long those that waited waited (a histogram)."""

    def __init__(self) -> None:
        self.ended: dict[str, int] = dict.fromkeys(ENDINGS, 0)
        #: per bucket of WAIT_BUCKETS (and +Inf last): waits that ended within it
        self.buckets = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0

    def notify(self, commit: Any) -> None:
        fx = commit.fx
        self.ended["at-once"] += fx.admitted_at_once
        for how, _pool, waited_ms in fx.waits_ended:
            self.ended["after-waiting" if how == "admitted" else how] += 1
            seconds = waited_ms / 1000
            self.buckets[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
            self.wait_sum += seconds
