"""Retention inside the fold: forget decided request ids and released leases in time.

A decided request id is remembered (and its decision republished unchanged) for
``state.decision_retention_s`` seconds of stream time after its final decision; a
released lease is kept as long after its release. Then both are evicted from the state
and named in the step's effects, so the store deletes their rows in the transaction
that commits the step (docs/long-lived.md).

Rules:

- Time is the input message's timestamp, never a clock: eviction is part of the fold,
  so every replica and every replay of the stream evicts the same things at the same
  input and reaches the same state digest.
- Work per message is O(what expired): :class:`~reconciler.core.expiry.ExpiryIndex`
  hands out the due entries; each is checked against the state (a decision decided
  again, a lease released at another second, are skipped: they were filed again).
- Pending decisions are never evicted (a launch gate still waits on them), nor active
  leases. Evicting a lease drops its job binding and its instance's index entry when
  they still point at it.
"""

from __future__ import annotations

from reconciler.core.model import LeaseState
from reconciler.core.state import Effects, State

__all__ = ["DEFAULT_DECISION_RETENTION_S", "evict_expired"]

#: ``--decision-retention``'s default: a week of stream time
DEFAULT_DECISION_RETENTION_S = 7 * 86_400


def evict_expired(state: State, now: int, fx: Effects) -> int:
    """Evict what the retention lets go at stream second ``now``; how many went."""
    retention = state.decision_retention_s
    if retention is None:
        return 0
    decisions, leases = state.expiry.due(now - retention)
    evicted = 0
    for second, request_id in decisions:
        record = state.decisions.get(request_id)
        if record is None or record.phase != "final" or record.final_at != second:
            continue
        del state.decisions[request_id]
        fx.decisions.add(request_id)
        evicted += 1
    for second, lease_id in leases:
        if state.released_at.get(lease_id) != second:
            continue
        lease = state.leases.get(lease_id)
        del state.released_at[lease_id]
        if lease is None or lease.state is not LeaseState.RELEASED:
            continue
        del state.leases[lease_id]
        if state.by_instance.get(lease.instance) == lease_id:
            del state.by_instance[lease.instance]
        if lease.job is not None and state.jobs.get(lease.job) == lease_id:
            del state.jobs[lease.job]
            fx.jobs.add(lease.job)
        fx.leases.add(lease_id)
        evicted += 1
    return evicted
