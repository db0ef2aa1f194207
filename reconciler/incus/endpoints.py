"""Where the Incus hosts are: their endpoints, and the fleet file that lists them.

Kept apart from :mod:`reconciler.incus.client` (and pylxd, requests, cryptography) so
that a process naming hosts without talking to them does not load the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

__all__ = ["IncusEndpoint", "endpoints_from_fleet_file"]


@dataclass(frozen=True, kw_only=True)
class IncusEndpoint:
    """How to reach one Incus host: its name in the fleet and its pylxd URL.

    ``url`` is ``http+unix://<quoted socket path>``, ``https://HOST:8443`` or (the
    simulator) ``http://HOST:PORT``; ``cert`` is the client certificate and key paths,
    ``verify`` a bool or a CA/server certificate path, as pylxd takes them.
    """

    host: str
    url: str
    cert: tuple[str, str] | None = None
    verify: bool | str = True


def endpoints_from_fleet_file(path: Path) -> tuple[IncusEndpoint, ...]:
    """The endpoints listed in a simulator fleet file, by host name."""
    hosts = orjson.loads(path.read_bytes())["hosts"]
    return tuple(IncusEndpoint(host=name, url=hosts[name]["url"]) for name in sorted(hosts))
