"""What every long-running program serves on ``--metrics-addr``: Prometheus ``/metrics``
and the probes ``/healthz`` and ``/readyz``.

- :mod:`.endpoints`: :class:`~.endpoints.MetricsServer` (one address, one registry per
  program), :class:`~.endpoints.Readiness`, and the metric-family helpers the programs'
  collectors (``replica/metrics.py``, ``bridge/metrics.py``, ``executor/metrics.py``)
  build their series with.

Layer rules: imports nothing of the project; it is below every program and above none.
"""
