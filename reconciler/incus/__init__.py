"""Incus: the pylxd adapter the bridge and executor use, and a simulator to test it on.

Rules of this layer:

- It imports :mod:`reconciler.core` only (never bus, store, work, a program or cli): what it
  returns are the core's types (:class:`~reconciler.core.model.Resources`,
  :class:`~reconciler.core.model.Gpu`) or small frozen views of its own.
- :mod:`.client` is the only module that talks pylxd; :mod:`.events` holds pylxd's
  WebSocket client for ``/1.0/events``. Everything blocking runs in worker threads with
  bounded timeouts, and every failure leaves as one of :mod:`.errors`.
- :mod:`.views` and :mod:`.units` are pure: Incus JSON and notations in, the contract's
  units out. :mod:`.endpoints` says where the hosts are (the fleet file);
  :mod:`.unix_http` carries pylxd's HTTP over a host's unix socket.
- :mod:`.simulator` serves what a real Incus answers (FACTS.md, rest-api.yaml) for tests,
  the demo and benchmarks; production code never imports it.
"""
