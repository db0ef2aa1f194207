"""A digest of the folded state: one hex string that two replicas, or a run and its replay,
compare to prove they hold the same state.

Rules:

- It covers what the fold owns and the store persists: the position, every host, pool,
  class, GPU profile and policy, every lease (released ones too), every request's latest
  decision (its exact bytes and the second it became final) and every job binding, and
  the second each released lease was released (retention counts from these). Derived
  indexes are left out: they are rebuilt from these.
- Entities are hashed in the order of their keys, each as its exact store encoding
  (:func:`reconciler.store.codec.encode`), so the digest never depends on dict order,
  batch boundaries or how the state was reached (folded, loaded, replayed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from reconciler.core.state import State
from reconciler.store.codec import encode

__all__ = ["state_digest"]


def state_digest(state: State) -> str:
    """The SHA-256 (hex) of ``state``'s persisted content; see the module's rules."""
    h = hashlib.sha256()
    h.update(b"applied_seq=%d\n" % state.applied_seq)
    tables: tuple[tuple[str, Mapping[Any, Any]], ...] = (
        ("hosts", state.hosts),
        ("pools", state.pools),
        ("classes", state.classes),
        ("profiles", state.profiles),
        ("policies", state.policies),
        ("leases", state.leases),
    )
    for name, table in tables:
        h.update(b"[%s]\n" % name.encode())
        for key in sorted(table):
            h.update(key.encode())
            h.update(b"=")
            h.update(encode(table[key]))
            h.update(b"\n")
    h.update(b"[decisions]\n")
    for request_id in sorted(state.decisions):
        record = state.decisions[request_id]
        h.update(
            f"{request_id}={record.verb}/{record.phase}/{record.lease_id}/{record.final_at}=".encode()
        )
        h.update(record.payload)
        h.update(b"\n")
    h.update(b"[jobs]\n")
    for job in sorted(state.jobs):
        h.update(f"{job}={state.jobs[job]}\n".encode())
    h.update(b"[released_at]\n")
    for lease_id in sorted(state.released_at):
        h.update(f"{lease_id}={state.released_at[lease_id]}\n".encode())
    return h.hexdigest()
