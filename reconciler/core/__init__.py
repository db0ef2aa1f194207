"""The domain, pure: what the reconciler knows and decides, as plain functions over frozen
dataclasses.

- :mod:`.model`: resources, hosts, GPUs, pools, resource classes, GPU profiles and
  policies, leases; :mod:`.frozen`: building and copying those dataclasses fast.
- :mod:`.inputs`: the typed inputs the fold takes (``from_payload``: a validated dict to
  one of them, with the domain's own checks); :mod:`.configs`: each kind of config's
  checks, entity, payload and users, in one table.
- :mod:`.state`: the folded state and the effects of one step; :mod:`.fold`: applying an
  input to it, one module per kind of input, over the launch gate.
- The fold's choices: :mod:`.placement` (DRA semantics, pack or spread) over
  :mod:`.candidates` (the fitting hosts of each request shape, kept incrementally),
  :mod:`.preemption` (victims), :mod:`.runtime` (a GPU's effective runtime),
  :mod:`.waiting` (the admission queue: requests that wait for room, in order), and
  :mod:`.tenants` (quotas, cohorts that borrow and lend, fair shares).
- :mod:`.retention` and :mod:`.expiry`: what the fold forgets, in stream time.
- :mod:`.messages`: the wire contract (subjects, message ids, headers, and every message
  published, built and parsed); :mod:`.compat`: how an older release's outputs compare.
- Read-only answers: :mod:`.queries` (the queries) and :mod:`.status` (host and pool
  status payloads).

Layer rules: imports no asyncio, SQLite, NATS, pylxd, clock or randomness, and nothing of
the project outside itself: time is the input's stream time, ids derive from stream
sequences and request ids, and every choice ends in an order on names, so every replica
and every replay decides the same, byte for byte.
"""
