"""reconciler: admission control for self-hosted CI runners on Incus.

One package per program and per layer, imported downward only (the import-linter
contracts in ``pyproject.toml`` keep it so; docs/development.md has the map):

- :mod:`.core`: the pure domain: the model, the inputs, the fold and its choices, the
  wire contract (:mod:`reconciler.core.messages`); no I/O, no clock.
- The adapters: :mod:`.store` (SQLite), :mod:`.bus` (NATS JetStream), :mod:`.incus`
  (pylxd, and a simulated Incus fleet).
- Shared by the programs: :mod:`.client` (the producer client: a command and its
  decision, queries, configuration), :mod:`.work` (keyed work queues), :mod:`.observe`
  (``/metrics``, ``/healthz``, ``/readyz``).
- The programs: :mod:`.replica` (``reconciler run``), :mod:`.bridge`, :mod:`.executor`,
  :mod:`.garm` (GARM's provider), :mod:`.web` (a read-only page of the fleet), and above
  the replica :mod:`.replay`.
- Above them: :mod:`.demo` (everything together on one machine) and :mod:`.deploy` (a
  secured deployment's credentials and accounts); at the top :mod:`.cli`.

``reconciler.__version__`` is the installed distribution's version, read from its
metadata on first use: ``pyproject.toml``'s ``version`` is the one place it is written.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # looked up lazily: importlib.metadata costs a few milliseconds that the GARM
    # provider, started once per call, should not pay unless it is asked its version
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("reconciler")
        except PackageNotFoundError:  # a bare checkout on sys.path, never installed
            return "0+unknown"
    raise AttributeError(f"module 'reconciler' has no attribute {name!r}")
