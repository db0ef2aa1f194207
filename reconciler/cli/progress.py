"""Progress of long one-shot work (``replay``, ``audit``) on a terminal.

Rules:

- Shown only when the stream it writes to (standard error) is a terminal: a pipe, a
  file or a CI log gets nothing, so output meant for programs stays as it was.
- One line, rewritten in place (carriage return, then erase to the end of the line), at
  most every :data:`EVERY_S`: what is done of the total, the rate since the start and
  the time left at that rate; :meth:`Progress.done` leaves a last line with the rate
  and the time it took.
- The clock is passed in (tests); nothing here touches what the work computes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["EVERY_S", "Progress"]

#: the shortest time between two redraws
EVERY_S = 0.25


def _duration(seconds: float) -> str:
    seconds = max(int(seconds + 0.5), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """A progress line for ``label`` over ``total`` ``unit`` (see the module's rules)."""

    def __init__(
        self,
        label: str,
        *,
        unit: str,
        total: int = 0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = EVERY_S,
    ) -> None:
        self.label = label
        self.unit = unit
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self._clock = clock
        self._every_s = every_s
        self._started = clock()
        self._shown_at: float | None = None
        self.count = 0

    def update(self, count: int, total: int | None = None) -> None:
        """``count`` of ``total`` (the one given before, when ``None``) are done."""
        self.count = count
        if total is not None:
            self.total = total
        if not self.enabled:
            return
        now = self._clock()
        if self._shown_at is not None and now - self._shown_at < self._every_s:
            return
        self._shown_at = now
        self._write(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        rate = self.count / elapsed
        text = f"{self.label}: {self.count:,}"
        if self.total:
            share = min(self.count / self.total, 1.0)
            text += f"/{self.total:,} {self.unit} ({share:.0%})"
        else:
            text += f" {self.unit}"
        text += f", {rate:,.0f}/s"
        if self.total and rate > 0:
            text += f", {_duration((self.total - self.count) / rate)} left"
        return text

    def done(self) -> None:
        """The last line: how many, at what rate, in how long (a terminal only)."""
        if not self.enabled:
            return
        elapsed = max(self._clock() - self._started, 1e-9)
        self._write(
            f"{self.label}: {self.count:,} {self.unit} in {_duration(elapsed)}, "
            f"{self.count / elapsed:,.0f}/s",
            end="\n",
        )

    def _write(self, text: str, *, end: str = "") -> None:
        self.stream.write(f"\r{text}\x1b[K{end}")
        self.stream.flush()
