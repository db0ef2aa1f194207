"""``reconciler replay``: fold a stream again and compare every output with the bus.

- :mod:`.replay`: the replay itself: from the stream's start or a snapshot, folded by
  the replica's own pipeline code (:mod:`reconciler.replica.pipeline`), every output
  with a ``Nats-Msg-Id`` compared byte for byte, divergences reported.
- :mod:`.readers`: the readers of both streams (ephemeral consumers without acks), and
  the protocol of the child process that reads them on a core of its own;
  :mod:`.reader_child` is that child's entry point (``python -m``).

Layer rules: a program above the replica, whose fold it reuses so that a replay decides
exactly what ``reconciler run`` decided; it imports the replica, the adapters (store,
bus) and the core, and publishes nothing, acks nothing, writes no store but its own.
"""
