"""The SQLite adapter: folded state, lease journal, outbox and position, in one transaction.

- :mod:`reconciler.store.sqlite`: :class:`Store`, the aiosqlite implementation, on
  :mod:`reconciler.store.database` (one connection used alone, driver errors translated).
- :mod:`reconciler.store.transactions`: the write transactions, plain ``sqlite3``.
- :mod:`reconciler.store.writer`: the writer process that runs them off the loop's GIL
  (:mod:`reconciler.store.writer_child` is the process itself;
  :mod:`reconciler.store.pipes` widens the pipes to it and to the replay's reader).
- :mod:`reconciler.store.codec`: exact JSON round trips of the core's dataclasses;
  :mod:`reconciler.store.outbox_rows`: the outbox's row format, one row per batch.
- :mod:`reconciler.store.digest`: the state's digest, which a replica and its replay
  compare; :mod:`reconciler.store.snapshot_format`: the state as canonical bytes, for snapshots.
- :mod:`reconciler.store.migrations`: the schema, as forward-only numbered migrations.
- :mod:`reconciler.store.errors`: :class:`StoreError` and its conditions.

Layer rules: imports only :mod:`reconciler.core` (never the bus nor a program);
every driver error leaves as a :class:`StoreError`.

The names below are loaded on first use, so that importing the package costs nothing:
the writer process imports :mod:`reconciler.store.transactions` and stays small (no
aiosqlite, no asyncio, no core model in its memory).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reconciler.store.errors import SchemaTooNew, StoreClosed, StoreError
    from reconciler.store.sqlite import Batch, OutboxRow, OutboxSnapshot, Store, encode_batch

__all__ = [
    "Batch",
    "OutboxRow",
    "OutboxSnapshot",
    "SchemaTooNew",
    "Store",
    "StoreClosed",
    "StoreError",
    "encode_batch",
]

_HOME = {
    "SchemaTooNew": "reconciler.store.errors",
    "StoreClosed": "reconciler.store.errors",
    "StoreError": "reconciler.store.errors",
    "Batch": "reconciler.store.sqlite",
    "OutboxRow": "reconciler.store.sqlite",
    "OutboxSnapshot": "reconciler.store.sqlite",
    "Store": "reconciler.store.sqlite",
    "encode_batch": "reconciler.store.sqlite",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
