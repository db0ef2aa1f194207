"""A deployment's credentials directory, made or completed in place.

What :func:`write_credentials` leaves in the directory (docs/operations.md, "Credentials"):

- ``ca.pem``, ``ca-key.pem``: the deployment's CA (keep ``ca-key.pem`` off the servers);
- ``<node>.pem``, ``<node>-key.pem`` for every NATS node (server and client usage);
- for every NATS user (``admin``, each replica, ``bridge``, ``executor``, ``producer``):
  ``<user>.nk`` (its NKey seed), ``<user>.pem`` and ``<user>-key.pem`` (its NATS client
  certificate);
- for every user that reaches Incus (each replica, ``bridge``, ``executor``,
  ``producer``): ``<user>-incus.pem`` and ``<user>-incus-key.pem``, the client
  certificate each Incus host must trust;
- ``accounts.conf``: the NATS accounts (:mod:`reconciler.deploy.accounts`);
- ``fleet.json``: the Incus fleet file the bridge, the executor and the replicas read;
- ``deployment.json``: the fleet these were made for.

Rules: existing keys, seeds and certificates are kept; private files are created
``0600`` (never written wider first); ``--rotate`` moves a user's seed aside as
``<user>.nk.previous`` (still accepted in ``accounts.conf``) and makes a new seed and
certificate; ``--retire`` removes the previous seed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import nkeys
import orjson

from reconciler.deploy.accounts import render_accounts
from reconciler.deploy.fleet import Fleet, FleetError
from reconciler.deploy.pki import Authority, Issued

__all__ = ["Made", "public_key", "write_credentials"]

PREVIOUS = ".previous"


@dataclass
class Made:
    """What a run did: files created, users rotated or retired, what Incus must trust."""

    fleet: Fleet
    created: list[str] = field(default_factory=list)
    rotated: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    #: the Incus client certificates, by user, that every Incus host must trust
    incus_certs: dict[str, Path] = field(default_factory=dict)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start; refuse to replace a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _replace(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a generated (not secret) file whole, atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    _write_new(tmp, data, mode)
    tmp.replace(path)


def public_key(seed_file: Path) -> str:
    """The public NKey of a seed file (the seed never leaves this function)."""
    seed = bytearray(seed_file.read_bytes().strip())
    try:
        key: bytes = nkeys.from_seed(seed).public_key
    except Exception as exc:  # nkeys raises its own error classes, and binascii's
        raise FleetError(f"{seed_file} is not an NKey user seed ({type(exc).__name__})") from None
    return key.decode()


class _Directory:
    def __init__(self, root: Path, made: Made) -> None:
        self.root = root
        self.made = made

    def authority(self) -> Authority:
        cert, key = self.root / "ca.pem", self.root / "ca-key.pem"
        if cert.exists() and key.exists():
            return Authority.load(cert.read_bytes(), key.read_bytes())
        if cert.exists() or key.exists():
            raise FleetError(
                f"{self.root} holds one of ca.pem and ca-key.pem without the other: restore "
                "the missing one, or move both away to start a new CA (every certificate "
                "must then be made again)"
            )
        ca = Authority.create()
        _write_new(key, ca.key_pem, 0o600)
        _write_new(cert, ca.cert_pem, 0o644)
        self.made.created += [cert.name, key.name]
        return ca

    def certificate(self, stem: str, issue: Callable[[], Issued]) -> None:
        """``<stem>.pem`` and ``<stem>-key.pem``, issued by ``issue()`` when missing."""
        cert, key = self.root / f"{stem}.pem", self.root / f"{stem}-key.pem"
        if cert.exists() and key.exists():
            return
        cert.unlink(missing_ok=True)
        key.unlink(missing_ok=True)
        issued = issue()
        _write_new(key, issued.key_pem, 0o600)
        _write_new(cert, issued.cert_pem, 0o644)
        self.made.created += [cert.name, key.name]

    def seed(self, user: str) -> Path:
        path = self.root / f"{user}.nk"
        if not path.exists():
            seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
            _write_new(path, seed + b"\n", 0o600)
            self.made.created.append(path.name)
        return path

    def rotate(self, fleet: Fleet, name: str) -> None:
        if name not in fleet.users and name not in fleet.nats_nodes:
            raise FleetError(f"cannot rotate {name!r}: not a user or node of this deployment")
        if name in fleet.users:
            seed = self.root / f"{name}.nk"
            previous = self.root / f"{name}.nk{PREVIOUS}"
            if previous.exists():
                raise FleetError(
                    f"{name} is still being rotated ({previous.name} exists): retire the "
                    f"previous key first (--retire {name})"
                )
            if seed.exists():
                seed.rename(previous)
        (self.root / f"{name}.pem").unlink(missing_ok=True)
        (self.root / f"{name}-key.pem").unlink(missing_ok=True)
        self.made.rotated.append(name)

    def retire(self, name: str) -> None:
        previous = self.root / f"{name}.nk{PREVIOUS}"
        if not previous.exists():
            raise FleetError(f"{name} has no previous key to retire ({previous.name})")
        previous.unlink()
        self.made.retired.append(name)

    def keys(self, user: str) -> list[str]:
        found = [public_key(self.root / f"{user}.nk")]
        previous = self.root / f"{user}.nk{PREVIOUS}"
        if previous.exists():
            found.append(public_key(previous))
        return found


def incus_fleet_file(fleet: Fleet) -> bytes:
    """``fleet.json``: every Incus host, its endpoint and its pinned server certificate."""
    hosts = {
        host: {"url": url, "verify": f"{fleet.incus_certs_dir.rstrip('/')}/{host}.crt"}
        for host, url in sorted(fleet.incus_hosts.items())
    }
    return orjson.dumps({"hosts": hosts}, option=orjson.OPT_INDENT_2) + b"\n"


def write_credentials(
    root: Path,
    fleet: Fleet,
    *,
    rotate: Iterable[str] = (),
    retire: Iterable[str] = (),
) -> Made:
    """Make what is missing in ``root`` for ``fleet`` (already merged with the record)."""
    fleet.check()
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    made = Made(fleet=fleet)
    d = _Directory(root, made)
    for name in retire:
        d.retire(name)
    for name in rotate:
        d.rotate(fleet, name)
    ca = d.authority()
    for node in fleet.nats_nodes:
        sans = [node, "localhost", "127.0.0.1", *fleet.sans]
        d.certificate(node, functools.partial(ca.issue, node, sans=sans, server=True))
    for user in fleet.users:
        d.seed(user)
        d.certificate(user, functools.partial(ca.issue, user))
    for user in fleet.incus_users:
        d.certificate(f"{user}-incus", functools.partial(ca.issue, f"reconciler {user}"))
        made.incus_certs[user] = root / f"{user}-incus.pem"
    accounts = render_accounts(fleet, {user: d.keys(user) for user in fleet.users})
    _replace(root / "accounts.conf", accounts.encode())
    _replace(root / "fleet.json", incus_fleet_file(fleet))
    _replace(root / "deployment.json", fleet.to_json() + b"\n")
    return made
