"""Keyed work queues shared by the programs (the replica's leader, the executor).

- :mod:`.queue`: :class:`~.queue.WorkQueue` and :func:`~.queue.run_workers`.

Layer rules: imports nothing of the project; it is below every program and above none.
"""
