"""``reconciler demo``: the whole system, end to end, on one machine.

- :mod:`.simulated`: the story on a simulated Incus fleet (three hosts, one with GPUs),
  with a local nats-server, one replica, the bridge and the executor, and the driver
  both demos share (it plays the operators and GARM, prints what comes back, replays).
- :mod:`.real_incus`: the same story on containers of a private, real Incus daemon
  (``--incus-real``).
- :mod:`.local_incus`: that private daemon (its own directory, no network, a busybox
  image whose init tells Incus it is ready, built with ``incus-ready.c``), which the
  tests start too.
- :mod:`.fair_share`: the admission queue's fair-sharing scenario (two tenants of
  weights 1 and 3 flooding four hosts; ``scripts/fair-share``).

Layer rules: above every program (it runs them together) and below the command line;
of the package, only the command line imports it.
"""
