"""One aiosqlite connection, used alone: what every SQLite database of the project shares.

Rules:

- Every use of the connection goes through :meth:`Database.using`, which holds a lock
  (so a transaction never interleaves with another coroutine's statements) and turns
  driver errors into :class:`~reconciler.store.errors.StoreError` naming the database
  and what was being done (``raise … from``).
- :meth:`Database.close` is idempotent; using a closed database raises
  :class:`~reconciler.store.errors.StoreClosed`.
- A database file is created ``0600`` (:func:`create_private`, before SQLite opens it;
  SQLite gives its ``-wal`` and ``-shm`` files the same mode): leases, jobs and instance
  names are nobody else's business on a shared host.
- :meth:`Database.call` runs a whole synchronous function (a transaction) on the
  connection's own thread in one hop, instead of one hop per statement: under a busy
  event loop every hop waits its turn, and a 14-statement commit waited 14 times. It
  queues the function on aiosqlite's worker thread (``Connection._execute`` with the
  thread's ``sqlite3`` connection), the same path every aiosqlite method takes;
  :func:`check_worker_api` fails at open, loudly, if a future aiosqlite changes it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import aiosqlite

from reconciler.store.errors import StoreClosed, StoreError

__all__ = ["Database", "check_worker_api", "create_private"]

T = TypeVar("T")


def create_private(path: Path) -> None:
    """Create the database file ``path`` readable and writable by its owner only, unless
    it exists (an existing file keeps the mode its operator gave it) or is ``:memory:``."""
    if str(path) == ":memory:" or path.exists():
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return  # created meanwhile (theirs), or not creatable: SQLite's open says why
    os.close(fd)


def check_worker_api(conn: aiosqlite.Connection) -> None:
    """Raise :class:`StoreError` unless ``conn`` offers the worker-thread call we use."""
    if not callable(getattr(conn, "_execute", None)) or not hasattr(type(conn), "_conn"):
        raise StoreError(
            f"aiosqlite {getattr(aiosqlite, '__version__', '?')} has no worker-thread call "
            "(Connection._execute/_conn): pin aiosqlite to a version that has them"
        )


class Database:
    """An open connection to the SQLite file ``path``; ``label`` names it in errors."""

    label = "database"

    def __init__(self, conn: aiosqlite.Connection, path: Path) -> None:
        self._conn: aiosqlite.Connection | None = conn
        self._lock = asyncio.Lock()
        self.path = path

    async def close(self) -> None:
        """Close the connection (idempotent); later uses raise :class:`StoreClosed`."""
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    await conn.close()
                except sqlite3.Error as exc:
                    raise StoreError(f"cannot close {self.label} {self.path}: {exc}") from exc

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @asynccontextmanager
    async def using(self, what: str) -> AsyncIterator[aiosqlite.Connection]:
        """The connection, alone, with driver errors translated."""
        async with self._lock:
            conn = self._conn
            if conn is None:
                raise StoreClosed(f"{self.label} {self.path} is closed ({what})")
            try:
                yield conn
            except sqlite3.Error as exc:
                raise StoreError(f"{self.label} {self.path}: {what} failed: {exc}") from exc

    async def call(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        """``fn(connection)`` on the database thread, in one hop; errors translated."""
        async with self.using(what) as conn:
            run: Callable[..., Awaitable[T]] = conn._execute
            return await run(fn, conn._conn)
