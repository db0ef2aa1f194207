"""Folding helpers the tests share (the production code folds input by input)."""

from __future__ import annotations

from collections.abc import Iterable

from reconciler.core.fold import fold
from reconciler.core.inputs import Message
from reconciler.core.state import Effects, State
from reconciler.store.sqlite import OutboxRow, Store


def fold_batch(state: State, messages: Iterable[Message]) -> Effects:
    """Fold ``messages`` into ``state``, as one batch: their effects together."""
    fx = Effects()
    for message in messages:
        fold(state, message, fx)
    return fx


async def unsent_outbox(store: Store, limit: int = 100_000) -> list[OutboxRow]:
    """The store's unpublished outputs, oldest first, of at most ``limit`` batches."""
    return (await store.outbox_snapshot(limit)).rows
