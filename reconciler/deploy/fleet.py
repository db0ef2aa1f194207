"""The named parts of one deployment: its subject prefix, NATS nodes, replicas and Incus
hosts, and the NATS users that follow from them.

Rules:

- Every name is one NATS subject token and a file name (``[A-Za-z0-9][A-Za-z0-9_-]{0,62}``):
  it becomes part of subjects (``rc.out.exec.<host>.>``), consumer names
  (``RC_IN-<replica>``) and credential files (``<replica>.nk``).
- The NATS users are ``admin``, one per replica, ``bridge``, ``executor`` and
  ``producer``; a replica or node may not take one of those names, and no name may be
  used twice among nodes, replicas and users.
- :meth:`Fleet.merged` adds names to a recorded fleet in order and never drops one; a
  host given again with another URL takes the new URL; the prefix cannot change.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from reconciler.bus.streams import StreamNames

__all__ = [
    "COMPONENT_USERS",
    "DEFAULT_INCUS_CERTS_DIR",
    "DEFAULT_NATS_NODES",
    "INCUS_USERS",
    "Fleet",
    "FleetError",
]

#: the users that are not replicas (a replica is a user of its own, named after it)
COMPONENT_USERS = ("admin", "bridge", "executor", "producer")
#: the non-replica users that reach Incus themselves (the replicas do too: live checks)
INCUS_USERS = ("bridge", "executor", "producer")
DEFAULT_NATS_NODES = ("nats-1", "nats-2", "nats-3")
#: where the components find each Incus host's server certificate (``<host>.crt``)
DEFAULT_INCUS_CERTS_DIR = "/etc/reconciler/incus"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


class FleetError(ValueError):
    """A name that cannot be used, or a fleet that contradicts the recorded one."""


def _check_name(name: str, *, role: str) -> str:
    if not _NAME.fullmatch(name):
        raise FleetError(
            f"{role} name {name!r} must be 1-63 of [A-Za-z0-9_-], starting with a letter or "
            "digit (it becomes part of NATS subjects, consumer names and file names)"
        )
    return name


def _append(known: tuple[str, ...], more: Iterable[str]) -> tuple[str, ...]:
    out = list(known)
    for name in more:
        if name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Fleet:
    """The names of one deployment (``deployment.json`` in the credentials directory)."""

    prefix: str = "rc"
    nats_nodes: tuple[str, ...] = ()
    replicas: tuple[str, ...] = ()
    #: Incus host name -> its HTTPS endpoint
    incus_hosts: Mapping[str, str] = field(default_factory=dict)
    #: extra names and addresses on the NATS nodes' certificates
    sans: tuple[str, ...] = ()
    incus_certs_dir: str = DEFAULT_INCUS_CERTS_DIR

    @property
    def names(self) -> StreamNames:
        return StreamNames.for_prefix(self.prefix)

    @property
    def users(self) -> tuple[str, ...]:
        """Every NATS user: admin, each replica, bridge, executor, producer."""
        return ("admin", *self.replicas, "bridge", "executor", "producer")

    @property
    def incus_users(self) -> tuple[str, ...]:
        """The users with an Incus client certificate of their own."""
        return (*self.replicas, *INCUS_USERS)

    def merged(
        self,
        *,
        prefix: str | None = None,
        nats_nodes: Iterable[str] = (),
        replicas: Iterable[str] = (),
        incus_hosts: Mapping[str, str] | None = None,
        sans: Iterable[str] = (),
        incus_certs_dir: str | None = None,
    ) -> Fleet:
        """This fleet with more names (nothing is dropped), checked."""
        if prefix is not None and prefix != self.prefix and self.is_recorded:
            raise FleetError(
                f"this deployment's prefix is {self.prefix!r}: a credentials directory "
                f"serves one prefix (use another directory for {prefix!r})"
            )
        hosts = dict(self.incus_hosts)
        for host, url in (incus_hosts or {}).items():
            hosts[_check_name(host, role="Incus host")] = url or hosts.get(host) or _url(host)
        merged = Fleet(
            prefix=prefix or self.prefix,
            nats_nodes=_append(self.nats_nodes, nats_nodes) or DEFAULT_NATS_NODES,
            replicas=_append(self.replicas, replicas),
            incus_hosts=hosts,
            sans=_append(self.sans, sans),
            incus_certs_dir=incus_certs_dir or self.incus_certs_dir,
        )
        merged.check()
        return merged

    @property
    def is_recorded(self) -> bool:
        return bool(self.nats_nodes or self.replicas or self.incus_hosts)

    def check(self) -> None:
        """Raise :class:`FleetError` unless every name is usable and used once."""
        StreamNames.for_prefix(self.prefix)  # a bad prefix raises ValueError
        for name in self.nats_nodes:
            _check_name(name, role="NATS node")
        for name in self.replicas:
            _check_name(name, role="replica")
        taken: dict[str, str] = {user: "component" for user in COMPONENT_USERS}
        for role, names in (("NATS node", self.nats_nodes), ("replica", self.replicas)):
            for name in names:
                if name in taken:
                    raise FleetError(f"{role} name {name!r} is already a {taken[name]} name")
                taken[name] = role
        for host, url in self.incus_hosts.items():
            if not url.startswith("https://"):
                raise FleetError(f"Incus host {host}: {url!r} is not an https:// endpoint")
        if not self.replicas:
            raise FleetError("name at least one replica (--replica NAME)")
        if not self.incus_hosts:
            raise FleetError("name at least one Incus host (--incus-host NAME[=URL])")

    # ------------------------------------------------------------------ the record

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "prefix": self.prefix,
                "nats_nodes": list(self.nats_nodes),
                "replicas": list(self.replicas),
                "incus_hosts": dict(self.incus_hosts),
                "sans": list(self.sans),
                "incus_certs_dir": self.incus_certs_dir,
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_json(cls, data: bytes, *, source: Path) -> Fleet:
        try:
            raw: dict[str, Any] = orjson.loads(data)
            return cls(
                prefix=str(raw["prefix"]),
                nats_nodes=tuple(map(str, raw["nats_nodes"])),
                replicas=tuple(map(str, raw["replicas"])),
                incus_hosts={str(k): str(v) for k, v in raw["incus_hosts"].items()},
                sans=tuple(map(str, raw.get("sans", ()))),
                incus_certs_dir=str(raw.get("incus_certs_dir", DEFAULT_INCUS_CERTS_DIR)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise FleetError(f"{source} is not a deployment record: {exc!r}") from None

    @classmethod
    def recorded_in(cls, directory: Path) -> Fleet:
        """The fleet recorded in ``directory`` (an empty one if there is none yet)."""
        path = directory / "deployment.json"
        if not path.exists():
            return cls()
        return cls.from_json(path.read_bytes(), source=path)


def _url(host: str) -> str:
    return f"https://{host}:8443"
