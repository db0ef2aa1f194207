"""The pipes between a replica's processes and the children they start (the store's
writer, the replay's reader): made wider than Linux's default 64 KiB, so that a frame of
a megabyte or so crosses in one write instead of one piece per turn of an event loop."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Protocol

__all__ = ["widen_pipe"]


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


def widen_pipe(pipe: _HasFileno, size: int) -> int:
    """Make ``pipe`` hold up to ``size`` bytes, or as many as the system allows
    (``fs.pipe-max-size``), never fewer than it holds; its size then (0 where pipes
    cannot be resized: not Linux, or not a pipe)."""
    setsize, getsize = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if setsize is None or getsize is None:
        return 0
    try:
        current = int(fcntl.fcntl(pipe.fileno(), getsize))
    except OSError:
        return 0  # not a pipe
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        limit = 1 << 20
    if min(size, limit) > current:
        # more than this process may have: it keeps the size it has
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe.fileno(), setsize, min(size, limit))
    return int(fcntl.fcntl(pipe.fileno(), getsize))
