"""``reconciler run``: one replica, its caches, its queries and, while it leads, the leader's work.

- :mod:`.runtime`: :class:`~.runtime.Replica`, start-up order and lifetimes.
- :mod:`.caches`: consume ``RC_IN`` in order, fold, commit (every replica).
- :mod:`.leader`: leader election on the ``leader`` key (compare-and-set, TTL).
- :mod:`.outbox`, :mod:`.status`, :mod:`.topup`, :mod:`.verify`: the leader's work.
- :mod:`.queries`: ``rc.query.*`` answered from the synced caches.
- :mod:`.replay`: fold a stream into a fresh store and compare every decision (an older
  release's outputs judged by :mod:`reconciler.core.compat`).
- :mod:`.metrics`: Prometheus and health endpoints.

Layer rules: imports :mod:`reconciler.work`, :mod:`reconciler.observe`, the adapters
(store, bus, incus) and the core below them; never another program's package (bridge,
executor, garm) nor the CLI.
"""
