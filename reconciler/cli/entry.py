"""The ``reconciler`` console script (and ``python -m reconciler.cli``): what has to
happen before the command line's own module is imported.

nats-py imports aiohttp for its WebSocket transport whether or not a server is reached
over WebSocket: 9 MiB of an idle replica's 75 MiB (measured by ``scripts/bench``).
``reconciler run`` needs aiohttp only for a ``ws://``/``wss://`` server or for
``--metrics-addr`` (Prometheus), so without either it is marked absent before nats-py is
imported, as the GARM provider and the replay's reader child already do. The decision
reads the command line and the environment (``RC_NATS_URL``, ``RC_METRICS_ADDR``) the
way the options do, and errs towards loading it; every other command keeps it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["main", "run_without_aiohttp"]


def run_without_aiohttp(args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``reconciler <args>`` is a ``run`` that cannot need aiohttp."""
    if not args or args[0] != "run":
        return False
    if env.get("RC_METRICS_ADDR"):
        return False
    options = args[1:]
    if any(a == "--metrics-addr" or a.startswith("--metrics-addr=") for a in options):
        return False
    words = [*options, env.get("RC_NATS_URL", "")]
    return not any("ws://" in w.lower() or "wss://" in w.lower() for w in words)


def main() -> None:
    if (
        run_without_aiohttp(sys.argv[1:], os.environ)
        and "aiohttp" not in sys.modules
        and "nats" not in sys.modules
    ):
        sys.modules["aiohttp"] = None  # type: ignore[assignment]
    from reconciler.cli.main import main as cli_main

    cli_main()
