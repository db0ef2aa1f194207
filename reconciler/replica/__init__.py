"""``reconciler run``: one replica, its pipeline, its queries and, while it leads, the
leader's work.

- :mod:`.replica`: :class:`~.replica.Replica` and :class:`~.replica.RunConfig`:
  start-up order and lifetimes.
- :mod:`.pipeline`: consume ``RC_IN`` in order, fold, commit, ack (every replica, and
  the replay); :mod:`.collector`: the garbage collector kept off the folded state.
- :mod:`.leader`: leader election on the ``leader`` key (compare-and-set, TTL).
- The leader's work: :mod:`.outbox_publisher` (the outbox onto the bus),
  :mod:`.status_reporter` (host and pool status), :mod:`.topup` (warm pools kept at
  their minimum), :mod:`.verify` (suspect leases checked live),
  :mod:`.reservation_reaper` (cold reservations never created, released),
  :mod:`.queue_timer` (waits whose deadline passed, noticed on an idle bus), and
  :mod:`.snapshot_bucket` (the state published as snapshots, and a new replica started
  from one).
- :mod:`.query_responder`: ``<prefix>.query.*`` answered from the synced state.
- :mod:`.metrics`: Prometheus and health endpoints; :mod:`.fleet_metrics`: the fleet
  as metrics (capacity, pools, decisions, warm claims, waits); :mod:`.queue_stats`: the
  admission queue's counters.

Layer rules: imports :mod:`reconciler.work`, :mod:`reconciler.observe`, the adapters
(store, bus, incus) and the core below them; never another program's package (bridge,
executor, garm, replay) nor the CLI.
"""
