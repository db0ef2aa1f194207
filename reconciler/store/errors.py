"""What can go wrong in the store, named after the condition.

Driver errors (``sqlite3.Error``) and undecodable rows never leave the store as such:
they are translated at the boundary into :class:`StoreError` with ``raise … from``, so
the caller handles one small family and still sees the cause.
"""

from __future__ import annotations


class StoreError(Exception):
    """The database could not be opened, read or written (the cause is chained)."""


class SchemaTooNew(StoreError):
    """The database was written by a newer reconciler than this one; it is left as is."""


class StoreLocked(StoreError):
    """Another live replica's writer holds the database (the message names its pid)."""


class StoreClosed(StoreError):
    """The store was used after :meth:`~reconciler.store.sqlite.Store.close`."""


__all__ = ["SchemaTooNew", "StoreClosed", "StoreError", "StoreLocked"]
