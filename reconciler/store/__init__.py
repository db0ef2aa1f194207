"""The SQLite adapter: folded state, lease journal, outbox and position, in one transaction.

- :mod:`reconciler.store.sqlite`: :class:`Store`, the aiosqlite implementation.
- :mod:`reconciler.store.codec`: exact JSON round trips of the core's dataclasses.
- :mod:`reconciler.store.migrations`: the schema, as forward-only numbered migrations.
- :mod:`reconciler.store.errors`: :class:`StoreError` and its conditions.

Layer rules: imports only :mod:`reconciler.core` (never the bus or the controller);
every driver error leaves as a :class:`StoreError`.
"""

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
