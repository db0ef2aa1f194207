"""``reconciler executor``: the bus's create and delete commands, carried out on Incus.

- :mod:`.executor`: consume ``rc.out.exec.<host>.*`` per host and act through pylxd.
- :mod:`.commands`: decode and validate a command; classify Incus's failures.
- :mod:`.records`: the executor's own SQLite record of finished commands.
- :mod:`.metrics`: what it did, per host and verb, for Prometheus, and its probes.

Layer rules: imports :mod:`reconciler.work`, :mod:`reconciler.observe`, the adapters
(store, bus, incus) and the core; never another program's package (replica, bridge,
garm) nor the CLI.
"""
