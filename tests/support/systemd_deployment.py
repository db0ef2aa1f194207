"""The documented bare-host deployment (docs/operations.md, "systemd on bare hosts"), run
for real: Debian 12 system containers with systemd as PID 1 on a private Incus daemon of
their own (:mod:`tests.support.debian_image`), one machine per role.

- ``nats-1``..``nats-3``: the NATS nodes (``reconciler-nats.service``, nats-server 2.10);
  ``replica-1``, ``replica-2``: ``reconciler@<replica>`` (``replica-1`` also runs
  ``reconciler-provision``); ``edge``: ``reconciler-bridge`` and ``reconciler-executor``;
  ``garm``: GARM's host, where the provider is called as GARM calls it.
- The Incus host the bridge and the executor manage is the session's private daemon
  (:mod:`tests.support.realincus`), on the machine running the tests: it serves HTTPS on a
  loopback port and trusts the components' client certificates, as the docs say.
- The containers have no network device. Every connection goes through host loopback
  ports and Incus ``proxy`` devices: a port a container serves is forwarded from the
  host's loopback (``bind=host``), a port it uses is forwarded to the host's
  (``bind=instance``), each on the same number, so that ``tls://localhost:<port>``
  means the same node on the host and in every container.
- The docs' blocks marked ``<!-- deploy: NAME -->`` are run as written (:func:`doc_steps`),
  from the unpacked source release, with the variables the docs name (``SECRETS``,
  ``RELEASE``, ``INCUS_CERTS``, ``NODE``, ``REPLICA``); the edits the docs ask of the
  operator (which node, which URLs) are made by :class:`Site`.
- Every wait is bounded and says what it waited for, with the unit's journal.
"""

from __future__ import annotations

import concurrent.futures
import io
import re
import shlex
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from reconciler.demo.local_incus import LocalIncus
from tests.support.cluster import _free_ports
from tests.support.repo import ROOT

T = TypeVar("T")

DOC = ROOT / "docs" / "operations.md"
NODES = ("nats-1", "nats-2", "nats-3")
REPLICAS = ("replica-1", "replica-2")
EDGE = "edge"
GARM = "garm"
MACHINES = (*NODES, *REPLICAS, EDGE, GARM)
#: where the project is installed (the docs' "Install")
INSTALLED = (*REPLICAS, EDGE, GARM)
INCUS_HOST = "incus-1"
#: the Incus endpoint inside the containers (forwarded to the host's private daemon)
INCUS_PORT = 8443
METRICS_PORT = 9108
MONITOR_PORT = 8222
IMAGE_ALIAS = "rc-debian"

_MARK = re.compile(r"^<!-- deploy: ([a-z-]+) -->\n```sh\n(.*?)^```", re.M | re.S)


def doc_steps(path: Path = DOC) -> dict[str, str]:
    """The blocks of ``path`` marked ``<!-- deploy: NAME -->``, by name."""
    return {m.group(1): m.group(2) for m in _MARK.finditer(path.read_text())}


def _user_files(user: str, *, incus: bool) -> list[str]:
    files = [f"{user}.nk", f"{user}.pem", f"{user}-key.pem"]
    return [*files, f"{user}-incus.pem", f"{user}-incus-key.pem"] if incus else files


def credential_files(machine: str) -> list[str]:
    """The files of ``reconciler credentials`` each machine gets (the docs' tables)."""
    if machine in NODES:
        return ["ca.pem", "accounts.conf", f"{machine}.pem", f"{machine}-key.pem"]
    if machine in REPLICAS:
        files = ["ca.pem", "fleet.json", *_user_files(machine, incus=True)]
        # the provisioning unit runs on the first replica's host
        return files + _user_files("admin", incus=False) if machine == REPLICAS[0] else files
    if machine == EDGE:
        return ["ca.pem", "fleet.json", *_user_files("bridge", incus=True),
                *_user_files("executor", incus=True)]  # fmt: skip
    return ["ca.pem", *_user_files("producer", incus=True)]


@dataclass(frozen=True)
class Ports:
    """Host loopback ports, each forwarded to the same number where it is served."""

    client: dict[str, int]
    route: dict[str, int]
    monitor: dict[str, int]
    metrics: dict[str, int]
    incus: int

    @classmethod
    def allocate(cls) -> Ports:
        free = iter(_free_ports(3 * len(NODES) + len(REPLICAS) + 1))
        return cls(
            client={n: next(free) for n in NODES},
            route={n: next(free) for n in NODES},
            monitor={n: next(free) for n in NODES},
            metrics={r: next(free) for r in REPLICAS},
            incus=next(free),
        )

    @property
    def nats_urls(self) -> str:
        return ",".join(f"tls://localhost:{self.client[n]}" for n in NODES)


def _proxy(listen: int, connect: int, bind: str) -> list[str]:
    return [
        "proxy",
        f"listen=tcp:127.0.0.1:{listen}",
        f"connect=tcp:127.0.0.1:{connect}",
        f"bind={bind}",
    ]


@dataclass
class Site:
    """The containers of one deployment on their own private daemon."""

    daemon: LocalIncus
    ports: Ports
    work: Path
    #: step name -> seconds, in order
    timings: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ plumbing

    def _run(
        self, args: list[str], *, input: bytes | None, timeout: float
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["incus", *args],
            env=self.daemon.env(),
            input=input,
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def incus(self, *args: str, input: bytes | None = None, timeout: float = 120) -> str:
        done = self._run(list(args), input=input, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"incus {' '.join(args[:4])}…: {done.stderr.decode().strip()}")
        return done.stdout.decode()

    def sh(
        self,
        machine: str,
        script: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/root",
        input: bytes | None = None,
        timeout: float = 300,
    ) -> str:
        """``script`` in ``machine``'s shell (``sh -eu``), as root, from ``cwd``."""
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        full = f"{exports}cd {shlex.quote(cwd)}\n{script}"
        done = self._run(["exec", machine, "--", "sh", "-euc", full], input=input, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"on {machine}, exit {done.returncode}:\n{script}\n--- stdout\n"
                f"{done.stdout.decode()[-2000:]}\n--- stderr\n{done.stderr.decode()[-3000:]}"
            )
        return done.stdout.decode()

    def push(self, machine: str, files: Mapping[str, bytes | Path], *, mode: int = 0o600) -> None:
        """Put ``files`` (path in the container -> content or local file) in one go."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, content in files.items():
                data = content.read_bytes() if isinstance(content, Path) else content
                info = tarfile.TarInfo(name.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        self.sh(machine, "tar -x -C / --no-same-owner", input=buffer.getvalue())

    def journal(self, machine: str, unit: str, lines: int = 40) -> str:
        try:
            return self.sh(machine, f"journalctl -u {shlex.quote(unit)} -n {lines} --no-pager")
        except RuntimeError as exc:
            return f"(no journal: {exc})"

    @staticmethod
    def parallel(call: Callable[[str], T], machines: Iterable[str]) -> dict[str, T]:
        names = list(machines)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(names)) as pool:
            futures = {name: pool.submit(call, name) for name in names}
            return {name: future.result() for name, future in futures.items()}

    def timed(self, step: str, call: Callable[[], T]) -> T:
        started = time.monotonic()
        try:
            return call()
        finally:
            self.timings[step] = time.monotonic() - started

    # ------------------------------------------------------------------ machines

    def destroy(self) -> None:
        """Delete every machine at once (each with time to spare on a busy disk)."""
        names = [str(i["name"]) for i in self.daemon.instances()]
        if names:
            self.parallel(lambda n: self.incus("delete", "--force", n, timeout=300), names)

    def launch(self, machine: str) -> None:
        self.incus("launch", IMAGE_ALIAS, machine, timeout=300)
        p = self.ports
        devices: list[tuple[str, list[str]]] = []
        if machine in NODES:
            for port in (p.client[machine], p.route[machine]):
                devices.append((f"serve-{port}", _proxy(port, port, "host")))
            devices.append(("monitor", _proxy(p.monitor[machine], MONITOR_PORT, "host")))
            for other in NODES:
                if other != machine:
                    devices.append(
                        (f"route-{other}", _proxy(p.route[other], p.route[other], "instance"))
                    )
        else:
            for node in NODES:
                devices.append((f"{node}", _proxy(p.client[node], p.client[node], "instance")))
            devices.append(("incus", _proxy(INCUS_PORT, p.incus, "instance")))
        if machine in REPLICAS:
            devices.append(("metrics", _proxy(p.metrics[machine], METRICS_PORT, "host")))
        for name, spec in devices:
            self.incus("config", "device", "add", machine, name, *spec)
        # A boot takes seconds on a quiet machine; on a loaded one (the suite beside other
        # work) it has taken over 120 s. systemd's own timeout ends the wait, whatever a
        # unit does; if it does not, say which jobs were still running.
        try:
            state = self.sh(
                machine, "timeout 280 systemctl is-system-running --wait || true", timeout=300
            )
        except subprocess.TimeoutExpired as exc:
            jobs = self.sh(machine, "systemctl list-jobs --no-pager || true", timeout=30)
            raise RuntimeError(f"{machine}: systemd still booting after 300 s:\n{jobs}") from exc
        if state.strip() not in ("running", "degraded"):
            jobs = self.sh(machine, "systemctl list-jobs --no-pager || true", timeout=30)
            raise RuntimeError(f"{machine}: systemd is {state.strip()!r} after boot:\n{jobs}")

    def wait_http(
        self, url: str, *, what: str, within_s: float, diagnose: Callable[[], str]
    ) -> None:
        deadline = time.monotonic() + within_s
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError as exc:
                last = repr(exc)
            time.sleep(0.3)
        raise AssertionError(f"{what} not ready within {within_s} s ({last}):\n{diagnose()}")


# ------------------------------------------------------------------ the deployment


@dataclass(frozen=True)
class Inputs:
    """What the deployment is made from, on the machine running the tests."""

    secrets: Path  # the output of `reconciler credentials`
    wheel: Path
    sdist: Path
    wheelhouse: Path
    nats_server: Path  # a nats-server 2.10 binary
    incus_server_cert: Path  # the managed Incus host's /var/lib/incus/server.crt

    @property
    def source_dir(self) -> str:
        """Where the unpacked source release is, in a container."""
        return "/root/" + self.sdist.name.removesuffix(".tar.gz")


GARM_CONFIG = "/etc/garm/reconciler-provider.toml"


def garm_config(ports: Ports) -> str:
    """The provider's configuration on GARM's host (docs/garm.md)."""
    d = "/etc/garm/reconciler"
    return "\n".join([
        f'nats_url = "{ports.nats_urls}"',
        f'nats_nkey = "{d}/producer.nk"',
        f'tls_ca = "{d}/ca.pem"',
        f'tls_cert = "{d}/producer.pem"',
        f'tls_key = "{d}/producer-key.pem"',
        'inbox_prefix = "_INBOX.producer"',
        f'incus_cert = "{d}/producer-incus.pem"',
        f'incus_key = "{d}/producer-incus-key.pem"',
        f'incus_verify = "{d}/{INCUS_HOST}.crt"',
        "decision_timeout = 120",
        # the test's instances have no network device: no address will come
        "address_timeout = 1",
        "[incus.hosts]",
        f'"{INCUS_HOST}" = "https://127.0.0.1:{INCUS_PORT}"',
        "[pools]",
        '"small" = "ci-small"',
        "",
    ])  # fmt: skip


def node_env(ports: Ports, node: str) -> str:
    """``/etc/nats/node.env`` as the docs ask it to be edited for ``node``."""
    routes = [f"NATS_ROUTE_{i}=tls://localhost:{ports.route[n]}" for i, n in enumerate(NODES, 1)]
    return "\n".join([
        f"NATS_NAME={node}",
        f"NATS_CERT_FILE=/etc/nats/secrets/{node}.pem",
        f"NATS_KEY_FILE=/etc/nats/secrets/{node}-key.pem",
        f"NATS_CLIENT_PORT={ports.client[node]}",
        f"NATS_ROUTE_PORT={ports.route[node]}",
        f"NATS_HTTP_PORT={MONITOR_PORT}",
        *routes,
        "",
    ])  # fmt: skip


def stage(site: Site, inputs: Inputs, machine: str) -> None:
    """Copy to ``machine`` what an operator brings to it: its credentials, the unpacked
    source release, and the release's wheels, the Incus server certificate or the
    nats-server binary where they are needed."""
    secrets = {f"/root/secrets/{n}": inputs.secrets / n for n in credential_files(machine)}
    site.push(machine, secrets, mode=0o600)
    shared: dict[str, bytes | Path] = {f"/root/{inputs.sdist.name}": inputs.sdist}
    if machine in INSTALLED:
        shared[f"/root/release/{inputs.wheel.name}"] = inputs.wheel
        for wheel in inputs.wheelhouse.glob("*.whl"):
            shared[f"/root/release/{wheel.name}"] = wheel
        shared[f"/root/incus-certs/{INCUS_HOST}.crt"] = inputs.incus_server_cert
    site.push(machine, shared, mode=0o644)
    if machine in NODES:
        site.push(machine, {"/usr/local/bin/nats-server": inputs.nats_server}, mode=0o755)
    site.sh(machine, f"tar -xzf {shlex.quote(inputs.sdist.name)}")


def deploy(site: Site, inputs: Inputs) -> None:
    """Every step of the docs, timed (``site.timings``)."""
    steps = doc_steps()
    ports = site.ports
    src = inputs.source_dir
    common = {"SECRETS": "/root/secrets", "RELEASE": "/root/release",
              "INCUS_CERTS": "/root/incus-certs"}  # fmt: skip

    def run(machine: str, step: str, **env: str) -> str:
        return site.sh(machine, steps[step], env={**common, **env}, cwd=src)

    site.timed("launch 7 containers", lambda: site.parallel(site.launch, MACHINES))
    site.timed("copy files in", lambda: site.parallel(lambda m: stage(site, inputs, m), MACHINES))
    site.timed("install the release", lambda: site.parallel(lambda m: run(m, "install"), INSTALLED))

    def nats_node(node: str) -> None:
        run(node, "nats-node", NODE=node)
        site.push(node, {"/etc/nats/node.env": node_env(ports, node).encode()}, mode=0o644)
        run(node, "nats-start")

    def nats_log(node: str) -> str:
        """A node's log without the healthcheck's own lines (one every 0.3 s)."""
        log = site.journal(node, "reconciler-nats", lines=400)
        said = "\n".join(line for line in log.splitlines() if "Healthcheck failed" not in line)
        return said[-6000:]

    def cluster_views() -> str:
        """Every node's routes and JetStream view (its meta group's peers among them)."""
        views = []
        for other in NODES:
            for page in ("routez", "jsz"):
                url = f"http://127.0.0.1:{ports.monitor[other]}/{page}"
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        views.append(f"{other} /{page}: {resp.read().decode()[:4000]}")
                except OSError as exc:
                    views.append(f"{other} /{page}: {exc!r}")
        return "\n".join(views)

    def nats_diagnosis(node: str) -> str:
        """What a node that is not ready says, and every node's view of the cluster."""
        return nats_log(node) + "\n" + cluster_views()

    def nats_ready() -> None:
        site.parallel(nats_node, NODES)
        for node in NODES:
            site.wait_http(
                f"http://127.0.0.1:{ports.monitor[node]}/healthz",
                what=f"NATS node {node}",
                within_s=90,  # a cluster's first meta-leader election, on a busy machine
                diagnose=lambda node=node: nats_diagnosis(node),  # type: ignore[misc]
            )

    site.timed("NATS cluster", nats_ready)

    def reconciler_host(machine: str) -> None:
        run(machine, "reconciler-host")
        site.sh(
            machine,
            "sed -i 's|^RC_NATS_URL=.*|RC_NATS_URL=" + ports.nats_urls + "|' "
            "/etc/reconciler/reconciler.env",
        )

    site.timed("reconciler hosts", lambda: site.parallel(reconciler_host, (*REPLICAS, EDGE)))

    def provision() -> None:
        try:
            run(REPLICAS[0], "provision")
        except RuntimeError as exc:
            # what the cluster looked like to each node when placement failed
            logs = "\n".join(f"--- {node}\n{nats_log(node)}" for node in NODES)
            raise AssertionError(
                f"{exc}\n{site.journal(REPLICAS[0], 'reconciler-provision')}\n"
                f"{cluster_views()}\n{logs}"
            ) from None

    site.timed("provision", provision)

    def replicas() -> None:
        site.parallel(lambda r: run(r, "replica", REPLICA=r), REPLICAS)
        for replica in REPLICAS:
            site.wait_http(
                f"http://127.0.0.1:{ports.metrics[replica]}/readyz",
                what=f"replica {replica}",
                within_s=90,
                diagnose=lambda r=replica: site.journal(r, f"reconciler@{r}"),  # type: ignore[misc]
            )

    site.timed("replicas ready", replicas)
    site.timed("bridge and executor", lambda: run(EDGE, "bridge-executor"))

    def garm_host() -> None:
        run(GARM, "garm")
        site.push(GARM, {GARM_CONFIG: garm_config(ports).encode()}, mode=0o600)

    site.timed("GARM's host", garm_host)
