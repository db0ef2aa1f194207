"""Where two folded states differ, table by table, for tests that compare stores with each
other or with a replay: a failed digest comparison then says which rows differ and how,
not just that two hashes do.

It covers what :func:`reconciler.store.digest.state_digest` covers (the position and the
tables the fold owns), in the same order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reconciler.core.state import State

__all__ = ["TABLES", "differences"]

#: the tables of :class:`State` that the digest covers, in its order
TABLES = (
    "hosts", "pools", "classes", "profiles", "policies", "leases", "decisions", "jobs",
    "released_at",
)  # fmt: skip


def differences(
    first: State, second: State, *, names: tuple[str, str] = ("a", "b"), rows: int = 3
) -> list[str]:
    """Lines saying where ``second`` differs from ``first``: the position, then for each
    table how many keys differ and the first ``rows`` of them on both sides (``None``
    where a side lacks the key). Empty when the states are equal."""
    lines: list[str] = []
    if first.applied_seq != second.applied_seq:
        lines.append(
            f"applied_seq: {names[0]} {first.applied_seq}, {names[1]} {second.applied_seq}"
        )
    for table in TABLES:
        a: Mapping[Any, Any] = getattr(first, table)
        b: Mapping[Any, Any] = getattr(second, table)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if not differ:
            continue
        lines.append(f"{table}: {len(differ)} differ, first {differ[:rows]}")
        for key in differ[:rows]:
            lines.append(f"  {key}: {names[0]} {a.get(key)!r}")
            lines.append(f"  {' ' * len(str(key))}  {names[1]} {b.get(key)!r}")
    return lines
