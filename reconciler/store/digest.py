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
- A lease's encoding may be given (``known``: lease id -> (lease, its encoding), as an
  earlier digest recorded it with ``record``); it is used only when the state holds that
  very object (``is``), and any other lease (replaced since, or not given) is encoded. A
  lease is immutable all the way down (a frozen dataclass of strings, numbers, enums,
  tuples of these and a frozen ``Resources``), so one object always has one encoding,
  and the digest is the same with or without ``known``. This is how a replay from a
  snapshot digests its final state without encoding again the leases the fold left as
  the snapshot decoded them (:attr:`reconciler.store.snapshot_format.DecodedSnapshot.
  lease_encodings`, recorded by its verification digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from reconciler.core.model import Lease, LeaseId
from reconciler.core.state import State
from reconciler.store.codec import encode

__all__ = ["LeaseEncodings", "state_digest"]

#: lease id -> (a lease, its exact store encoding)
LeaseEncodings = Mapping[LeaseId, tuple[Lease, bytes]]


def state_digest(
    state: State,
    *,
    known: LeaseEncodings | None = None,
    record: dict[LeaseId, tuple[Lease, bytes]] | None = None,
) -> str:
    """The SHA-256 (hex) of ``state``'s persisted content; see the module's rules.
    ``known``: encodings of leases to use where the state still holds the same object.
    ``record``: filled with every lease of ``state`` and its encoding (each in a bytes
    object of its own size: orjson hands back a buffer of at least 4 KiB)."""
    h = hashlib.sha256()
    update = h.update
    update(b"applied_seq=%d\n" % state.applied_seq)
    tables: tuple[tuple[str, Mapping[Any, Any]], ...] = (
        ("hosts", state.hosts),
        ("pools", state.pools),
        ("classes", state.classes),
        ("profiles", state.profiles),
        ("policies", state.policies),
    )
    for name, table in tables:
        update(b"[%s]\n" % name.encode())
        for key in sorted(table):
            update(key.encode())
            update(b"=")
            update(encode(table[key]))
            update(b"\n")
    update(b"[leases]\n")
    leases = state.leases
    for lease_id in sorted(leases):
        lease = leases[lease_id]
        if known is not None and (hit := known.get(lease_id)) is not None and hit[0] is lease:
            data = hit[1]
        elif record is not None:
            data = bytes(memoryview(encode(lease)))
        else:
            data = encode(lease)
        if record is not None:
            record[lease_id] = (lease, data)
        update(lease_id.encode())
        update(b"=")
        update(data)
        update(b"\n")
    update(b"[decisions]\n")
    for request_id in sorted(state.decisions):
        decision = state.decisions[request_id]
        update(
            f"{request_id}={decision.verb}/{decision.phase}/{decision.lease_id}/"
            f"{decision.final_at}=".encode()
        )
        update(decision.payload)
        update(b"\n")
    update(b"[jobs]\n")
    for job in sorted(state.jobs):
        update(f"{job}={state.jobs[job]}\n".encode())
    update(b"[released_at]\n")
    for lease_id in sorted(state.released_at):
        update(f"{lease_id}={state.released_at[lease_id]}\n".encode())
    # the queue and the tenants only when there are any: a state that never had them
    # keeps its digest
    optional: tuple[tuple[bytes, Mapping[Any, Any]], ...] = (
        (b"[waiting]\n", state.waiting),
        (b"[tenants]\n", state.tenants),
    )
    for header, rows in optional:
        if rows:
            update(header)
            for key in sorted(rows):
                update(key.encode())
                update(b"=")
                update(encode(rows[key]))
                update(b"\n")
    return h.hexdigest()
