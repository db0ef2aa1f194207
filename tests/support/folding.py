"""Folding and committing as the tests do it: a batch at once, committed in one call
(the production code folds input by input, and encodes a batch while the last is
written)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.state import Effects, State
from reconciler.store.sqlite import OutboxRow, Store, encode_batch


def fold_batch(state: State, messages: Iterable[Message]) -> Effects:
    """Fold ``messages`` into ``state``, as one batch: their effects together."""
    fx = Effects()
    for message in messages:
        fold(state, message, fx)
    return fx


async def unsent_outbox(store: Store, limit: int = 100_000) -> list[OutboxRow]:
    """The store's unpublished outputs, oldest first, of at most ``limit`` batches."""
    return (await store.outbox_snapshot(limit)).rows


async def commit(store: Store, state: State, fx: Effects, *, applied_seq: int) -> bool:
    """Encode and write one folded batch (``Store.write``): ``False``, and nothing
    written, when ``applied_seq`` is at or below the stored position."""
    return await store.write(encode_batch(state, fx, applied_seq=applied_seq))


async def transitions_at(store: Store, input_seq: int) -> list[dict[str, Any]]:
    """Every lease transition one input caused, in order, from the store's journal."""
    async with store.using("read journal") as conn:
        rows = await conn.execute_fetchall(
            "SELECT lease_id, event, from_state, to_state FROM journal "
            "WHERE input_seq = ? ORDER BY id",
            (input_seq,),
        )
    return [
        {"lease_id": lid, "event": event, "from_state": src, "to_state": dst}
        for lid, event, src, dst in rows
    ]
