"""``reconciler bridge``: Incus hosts to the bus (lifecycle events, inventory, snapshots).

- :mod:`.bridge`: one :class:`~.bridge.HostBridge` per Incus host, under one
  :class:`~.bridge.Bridge`.
- :mod:`.metrics`: its Prometheus metrics and probes (``--metrics-addr``).

Layer rules: imports the adapters (bus, incus), :mod:`reconciler.observe` and the core
only; never another program's package (replica, executor, garm) nor the CLI.
"""
