#!/usr/bin/env python3
"""The project's benchmark: ``reconciler run`` end to end, over its own nats-server.

Performance is measured here, never by timed unit tests (docs/performance.md,
"Targets"): as ratios against a bare nats-py loop measured in the same run, as latency
percentiles, and as memory. Everything runs against a ``nats-server -js`` that this script
starts on a random loopback port in a temporary directory and stops at the end; the
reconciler is the real one, ``python -m reconciler.cli run`` (what the console script
runs), as a subprocess (so the benchmark client never competes for its event loop, and
its RSS is its own).

Workload
    ``--hosts`` host snapshots (64 vCPU, 256 GiB, 2 TB each), a cold pool and a warm
    pool, then commands: cold admits (the bulk), warm admits followed by the lifecycle
    events of the VM booting on the host it was placed on, claim-warm,
    mark-warm-injected, mark-created and release, keeping the fleet about 70 % booked
    so that admissions succeed. While it is generated, every input goes through the
    project's decoder and the pure fold (a shadow of the reconciler's state), so lease
    placements are known, the payloads are schema-valid, and the expected outcomes are
    reported (``throughput.outcomes``). Every command gets exactly one decision.

Phases (``--skip`` any of them)
    throughput
        The IN stream is filled with ``--messages`` inputs before the reconciler starts.
        ``fold_events_per_s`` is the full pipeline of ``reconciler run`` (consume, decode,
        fold, SQLite commit, outbox publish confirmed, ack): input messages divided by the
        time from its consumer's first pull request (seen on a core subscription to
        ``$JS.API.CONSUMER.MSG.NEXT.<IN>.<durable>``, so start-up is not counted) to the
        arrival of the last command's decision on a core subscription (the server-side
        publish that stores it in the OUT stream). The OUT stream is then checked to
        hold one decision per command and no dead letter. ``baseline_fetch_ack_per_s``
        is a bare nats-py pull consumer (same consumer settings, same ``--batch``) doing
        ``fetch(batch)`` and ``msg.ack()`` over the same stream content, in this process,
        measured before the reconciler starts and again after it stopped; the better of
        the two is used, so ``ratio`` = fold / baseline is conservative.
        ``throughput.cpu_us_per_input`` is the CPU time each process spent per input
        (the reconciler's main process, its store writer, nats-server), and
        ``baseline_client_cpu_us_per_message`` the bare loop's own per message: the
        ratio is bounded by the second over the first, since the main process is the
        one that runs out of core first.
    latency
        A fresh reconciler on a fresh prefix gets the setup, then commands are published
        open-loop at ``--rate`` commands/s for ``--latency-seconds`` (after a warm-up of
        up to 1 s that is not counted), each with JetStream async publish, never waiting
        for replies; lifecycle events go out with the next command. Latency is the
        arrival of a command's decision on a core subscription to
        ``<prefix>.out.decision.>`` minus the moment its command was published.
        ``latency.send_lag_ms_max`` shows whether the sender kept the schedule.
    rss
        A fresh reconciler on a fresh prefix with a zero-flavor pool folds ``--leases``
        cold admissions (all admitted: each holds a lease). ``peak_rss_mib`` is the
        ``VmHWM`` (peak resident set) of the ``reconciler run`` subprocess, read from
        ``/proc`` after every admission is folded and its decision published;
        ``rss.rss_mib`` is its ``VmRSS`` then, ``rss.idle_rss_mib`` the one before the
        admissions. The number of held leases is counted in its SQLite store.

    I/O floor (part of throughput)
        ``io_floor_per_s``: the least any implementation of this job does on the bus, by a
        bare nats-py loop over the same stream and consumer settings: ``fetch(batch)``,
        publish one output per input to the OUT stream (a ``Nats-Msg-Id`` each, all of a
        batch sent before waiting, every one confirmed by the stream), then ``ack`` each
        input. Measured before and after the pipeline like the bare loop, the better
        kept; ``ratio_io_floor`` = fold / floor (the target: >= 1.0), next to ``ratio``
        (fold / bare fetch+ack, reported).
    soak (only with ``--soak``: minutes long, never in CI)
        A fresh reconciler with ``--decision-retention`` and ``--journal-retention`` of
        ``--soak-retention`` seconds folds ``--soak-commands`` commands (admit and
        release pairs on a zero-flavor pool: live leases stay near zero), published in
        chunks each folded before the next. After every chunk its RSS (with its writer)
        and its SQLite file sizes are sampled; ``soak.rss_bytes_per_command`` and
        ``soak.db_bytes_per_command`` are least-squares slopes over the samples taken
        once three retentions of stream time have passed (retention applies, so a
        bounded service shows about 0), ``soak.*_first_to_last`` the plain differences.

Output: ONE JSON line on stdout; progress and errors go to stderr. Exit status 1 when
something failed (a process died, a decision is missing, a dead letter, a reconciler that
did not stop cleanly); missed targets do not fail the run, they are reported under
``targets``. ``--py-spy FILE`` records the reconciler with py-spy during the throughput
phase (flame graph for ``.svg``, speedscope for ``.json``, collapsed stacks otherwise).

    scripts/bench [--quick] [--messages N] [--batch N] [--hosts N] [--rate R]
                  [--latency-seconds S] [--leases N] [--skip rss,latency,throughput]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import heapq
import math
import os
import platform
import random
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import FetchTimeoutError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reconciler.bus.decoder import BadInput, Decoder  # noqa: E402
from reconciler.bus.streams import StreamNames, ensure_streams  # noqa: E402
from reconciler.cli.logs import configure_logging  # noqa: E402
from reconciler.client import ReconcilerClient  # noqa: E402
from reconciler.core.fold import fold  # noqa: E402
from reconciler.core.inputs import Message  # noqa: E402
from reconciler.core.messages import (  # noqa: E402
    DECISION_HEAD,
    MSG_ID,
    Origin,
    command_msg_id,
)
from reconciler.core.model import JobId, LeaseState, PoolName  # noqa: E402
from reconciler.core.state import State  # noqa: E402
from tests.support import builders as b  # noqa: E402

PHASES = ("throughput", "latency", "rss", "fleet", "snapshot", "queue", "soak")
NATS_BINARIES = ("/usr/sbin/nats-server", "/usr/local/bin/nats-server")
FULL = {
    "messages": 100_000,
    "hosts": 50,
    "rate": 1000.0,
    "latency_seconds": 10.0,
    "leases": 100_000,
    "fleet_hosts": 10_000,
    "queued": 10_000,
}
QUICK = {
    "messages": 3_000,
    "hosts": 20,
    "rate": 1000.0,
    "latency_seconds": 2.0,
    "leases": 3_000,
    "fleet_hosts": 200,
    "queued": 1_000,
}
#: the targets (docs/performance.md, "Targets"); see ``targets``
TARGET_RATIO = 0.6
TARGET_RATIO_DESIGN = 0.85
TARGET_P99_MS = 20.0
TARGET_P99_RATE = 1000.0
TARGET_RSS_MIB = 200.0
TARGET_RSS_LEASES = 100_000
TARGET_IO_FLOOR_RATIO = 1.0
#: bytes of growth per decided command allowed once retention applies (RSS, database)
TARGET_SOAK_BYTES = 50.0
TARGET_SOAK_COMMANDS = 1_000_000
TARGET_FLEET_HOSTS = 10_000
TARGET_SNAPSHOT_RATIO = 0.9
#: the queue phase (issue 26): requests waiting, and releases a second that admit them
TARGET_QUEUED = 10_000
TARGET_QUEUE_RELEASE_RATE = 1000.0
#: replays of the snapshot phase, each between two bare reads; the figure is the median
SNAPSHOT_ROUNDS = 3
#: fleet utilisation (booked vCPU / allocatable vCPU) above which the workload releases
TARGET_UTILISATION = 0.7
TIMESTAMP = "2026-12-02T10:00:00.000000000Z"
REPLICA = "bench"
WARM_POOL = PoolName("warm")

Item = tuple[str, dict[str, Any]]

_t0 = time.perf_counter()


class BenchError(RuntimeError):
    """A phase could not be measured (the message says why)."""


def log(text: str) -> None:
    print(f"[bench {time.perf_counter() - _t0:7.1f}s] {text}", file=sys.stderr, flush=True)


# ============================================================================ options


@dataclass(frozen=True, kw_only=True)
class Options:
    messages: int
    batch: int
    hosts: int
    rate: float
    latency_seconds: float
    leases: int
    fleet_hosts: int
    skip: frozenset[str]
    queued: int = 10_000
    quick: bool
    seed: int
    log_level: str
    nats_server: str | None
    py_spy: Path | None
    soak: bool = False
    soak_commands: int = TARGET_SOAK_COMMANDS
    soak_retention: int = 10


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark `reconciler run` over a real nats-server; one JSON line out.",
    )
    parser.add_argument("--messages", type=int, help="inputs in the throughput stream (100000)")
    parser.add_argument("--batch", type=int, default=500, help="fetch/commit batch (500)")
    parser.add_argument("--hosts", type=int, help="host snapshots (50)")
    parser.add_argument("--rate", type=float, help="offered commands/s, latency phase (1000)")
    parser.add_argument("--latency-seconds", type=float, help="measured seconds of latency (10)")
    parser.add_argument(
        "--leases", type=int, help="leases held for the RSS and fleet phases (100000)"
    )
    parser.add_argument("--fleet-hosts", type=int, help="hosts of the fleet phase (10000)")
    parser.add_argument(
        "--queued", type=int, help="requests waiting in the queue phase (10000; releases at --rate)"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PHASE",
        help="skip a phase: throughput, latency, rss, fleet, snapshot, queue (repeat or "
        "comma-separate)",
    )
    parser.add_argument(
        "--soak",
        action="store_true",
        help="run the soak phase too (minutes: RSS and database growth per command)",
    )
    parser.add_argument(
        "--soak-commands", type=int, default=TARGET_SOAK_COMMANDS, help="soak commands (1000000)"
    )
    parser.add_argument(
        "--soak-retention",
        type=int,
        default=10,
        help="the soaked reconciler's decision and journal retention, seconds (10)",
    )
    parser.add_argument("--quick", action="store_true", help="small numbers, for CI smoke")
    parser.add_argument("--seed", type=int, default=7, help="workload seed (7)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the reconciler's --log-level (info, its default)",
    )
    parser.add_argument("--nats-server", help="nats-server binary (PATH, then /usr/sbin)")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="FILE",
        help="py-spy the reconciler: FILE for the throughput phase, FILE-latency for latency, "
        "FILE-latency-bf for the fleet phase",
    )
    args = parser.parse_args(argv)
    skip = frozenset(s.strip() for part in args.skip for s in part.split(",") if s.strip())
    unknown = skip - set(PHASES)
    if unknown:
        parser.error(f"--skip takes {', '.join(PHASES)}, not {', '.join(sorted(unknown))}")
    defaults = QUICK if args.quick else FULL

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    opts = Options(
        messages=int(pick("messages")),
        batch=args.batch,
        hosts=int(pick("hosts")),
        rate=float(pick("rate")),
        latency_seconds=float(pick("latency_seconds")),
        leases=int(pick("leases")),
        fleet_hosts=int(pick("fleet_hosts")),
        queued=int(pick("queued")),
        skip=skip,
        quick=args.quick,
        seed=args.seed,
        log_level=args.log_level,
        nats_server=args.nats_server,
        py_spy=args.py_spy,
        soak=args.soak,
        soak_commands=args.soak_commands,
        soak_retention=args.soak_retention,
    )
    if opts.soak_commands < 2 or opts.soak_retention < 1:
        parser.error("--soak-commands must be >= 2 and --soak-retention >= 1")
    if opts.batch < 1 or opts.batch > 10_000:
        parser.error("--batch must be 1..10000 (what `reconciler run --batch` accepts)")
    if opts.hosts < 1 or opts.messages < opts.hosts + 10 or opts.leases < 1 or opts.fleet_hosts < 1:
        parser.error(
            "--hosts and --fleet-hosts must be >= 1, --messages >= hosts + 10, --leases >= 1"
        )
    if opts.rate <= 0 or opts.latency_seconds <= 0:
        parser.error("--rate and --latency-seconds must be > 0")
    return opts


# =========================================================================== workload


@dataclass(frozen=True, slots=True)
class Input:
    """One input message as published: commands carry ``in:<request_id>`` as msg id."""

    subject: str
    data: bytes
    request_id: str | None

    @property
    def headers(self) -> dict[str, str] | None:
        if self.request_id is None:
            return None
        return {MSG_ID: command_msg_id(Origin.LEADER, self.request_id)}


@dataclass(slots=True)
class Workload:
    setup: list[Input]
    items: list[Input]
    #: "<verb> <outcome> (<reason>)" -> how many, as the pure fold decides (empty: not shadowed)
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def all(self) -> list[Input]:
        return [*self.setup, *self.items]

    @property
    def commands(self) -> list[str]:
        return [i.request_id for i in self.items if i.request_id is not None]


def host_names(hosts: int) -> list[str]:
    return [f"host-{i:05d}" for i in range(hosts)]


def fleet_setup(hosts: int) -> list[Item]:
    return [
        b.snapshot(
            name,
            cpu=64,
            memory_mib=262_144,
            disk_gib=2000,
            reserve=b.res(2, 4096, 50),
            labels={"zone": "ab"[i % 2]},
        )
        for i, name in enumerate(host_names(hosts))
    ]


class ShadowFleet:
    """Encodes inputs and folds each one into a shadow state, through the real decoder."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.decoder = Decoder()
        self.state = State()
        self.inputs: list[Input] = []
        self.outcomes: Counter[str] = Counter()

    def send(self, item: Item) -> str | None:
        """Append and fold ``item``; a command's decision outcome."""
        subject = b.subject_of(item, prefix=self.prefix)
        data = orjson.dumps(item[1])
        decoded = self.decoder.decode(subject, data, prefix=self.prefix)
        if isinstance(decoded, BadInput):
            raise BenchError(f"the workload built a bad input ({decoded.reason}): {decoded.error}")
        seq = len(self.inputs) + 1
        fold(
            self.state, Message(seq=seq, timestamp=TIMESTAMP, input=decoded.input, subject=subject)
        )
        request_id = item[1].get("request_id")
        self.inputs.append(Input(subject, data, request_id))
        if request_id is None:
            return None
        decision = orjson.loads(self.state.decisions[request_id].payload)
        outcome, reason = str(decision["outcome"]), decision.get("reason")
        self.outcomes[f"{item[0][4:]} {outcome}" + (f" ({reason})" if reason else "")] += 1
        return outcome

    def utilisation(self) -> float:
        booked = sum(row[0] for row in self.state.booked.values())
        allocatable = sum(h.allocatable.cpu for h in self.state.hosts.values())
        return booked / allocatable if allocatable else 1.0


def _take(rng: random.Random, items: list[str]) -> str:
    """Remove and return a random element in O(1)."""
    i = rng.randrange(len(items))
    items[i], items[-1] = items[-1], items[i]
    return items.pop()


def mixed_workload(
    *, prefix: str, hosts: int, seed: int, messages: int | None = None, commands: int | None = None
) -> Workload:
    """Setup, then commands until ``messages`` inputs in all or ``commands`` commands."""
    fleet = ShadowFleet(prefix)
    for item in fleet_setup(hosts):
        fleet.send(item)
    fleet.send(b.pool("ci", cpu=2, memory_mib=4096, disk_gib=20, max_instances=1_000_000))
    fleet.send(
        b.pool(
            "warm", cpu=4, memory_mib=8192, disk_gib=40, max_ready=100_000, max_instances=1_000_000
        )
    )
    setup_len = len(fleet.inputs)
    rng = random.Random(seed)
    cold: list[str] = []  # instances with an active cold lease
    reserved: deque[str] = deque()  # cold leases to mark created, oldest first (may be stale)
    booting: list[tuple[int, str, str]] = []  # heap of (due step, instance, host) to boot
    claimed: list[str] = []  # warm instances bound to a job, not yet injected
    injected: list[str] = []
    jobs: dict[str, str] = {}  # instance -> job
    n = 0
    sent_commands = 0
    utilisation = 0.0

    def still_reserved() -> str | None:
        while reserved:
            name = reserved.popleft()
            lease = fleet.state.lease_of_instance(name)
            if lease is not None and lease.state is LeaseState.RESERVED:
                return name
        return None

    def done() -> bool:
        if messages is not None:
            return len(fleet.inputs) >= messages
        return commands is not None and sent_commands >= commands

    while not done():
        n += 1
        while booting and booting[0][0] <= n:
            _, name, host = heapq.heappop(booting)
            fleet.send(b.lifecycle(host, "instance-created", name))
            fleet.send(b.lifecycle(host, "instance-ready", name))
        if n % 20 == 1:
            utilisation = fleet.utilisation()
        # above the target, half the commands release: the fleet hovers around it
        roll = rng.random()
        if utilisation >= TARGET_UTILISATION and rng.random() < 0.5:
            roll = 1.0
        rid = f"r{n}"
        ready = fleet.state.pool_ready.get(WARM_POOL)
        if roll < 0.35:
            name = f"c{n}"
            if fleet.send(b.admit(rid, "ci", name)) == "admitted":
                cold.append(name)
                reserved.append(name)
        elif roll < 0.45:
            name = f"w{n}"
            if fleet.send(b.admit(rid, "warm", name, kind="warm")) == "admitted":
                lease = fleet.state.lease_of_instance(name)
                assert lease is not None
                heapq.heappush(booting, (n + rng.randrange(5, 40), name, lease.host))
        elif roll < 0.55 and ready:
            job = f"job-{n}"
            fleet.send(b.cmd("claim-warm", rid, pool="warm", job=job))
            bound = fleet.state.jobs.get(JobId(job))
            if bound is not None:
                name = fleet.state.leases[bound].instance
                jobs[name] = job
                claimed.append(name)
        elif roll < 0.65 and claimed:
            name = _take(rng, claimed)
            fleet.send(b.cmd("mark-warm-injected", rid, job=jobs[name], instance=name))
            injected.append(name)
        elif roll < 0.80 and (created := still_reserved()) is not None:
            fleet.send(b.cmd("mark-created", rid, instance=created))
        elif cold or injected:
            pool = cold if (rng.random() < 0.7 or not injected) and cold else injected
            name = _take(rng, pool)
            fleet.send(b.cmd("release", rid, instance=name))
        else:
            name = f"c{n}"
            if fleet.send(b.admit(rid, "ci", name)) == "admitted":
                cold.append(name)
                reserved.append(name)
        sent_commands += 1
    return Workload(fleet.inputs[:setup_len], fleet.inputs[setup_len:], fleet.outcomes)


def admission_workload(*, prefix: str, hosts: int, leases: int) -> Workload:
    """Setup with a zero-flavor pool, then ``leases`` cold admits that all succeed."""
    setup = [
        *fleet_setup(hosts),
        b.pool("rss", cpu=0, memory_mib=0, disk_gib=0, max_instances=leases + 1),
    ]
    items = [b.admit(f"a{i}", "rss", f"vm-{i:07d}") for i in range(leases)]

    def encode(item: Item) -> Input:
        return Input(
            b.subject_of(item, prefix=prefix), orjson.dumps(item[1]), item[1].get("request_id")
        )

    return Workload([encode(i) for i in setup], [encode(i) for i in items])


# ========================================================================== processes


def find_nats_server(explicit: str | None) -> str:
    found = explicit or shutil.which("nats-server")
    if found is None:
        found = next((p for p in NATS_BINARIES if os.access(p, os.X_OK)), None)
    if found is None:
        raise BenchError("no nats-server binary: install one or pass --nats-server")
    return found


def _stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals, within_s: float) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(within_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return int(proc.returncode)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


class NatsServerProcess:
    """``nats-server -a 127.0.0.1 -p -1 -js -sd <dir>``; the port from ``--ports_file_dir``."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.log_path = workdir / "nats-server.log"
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=False
        )
        return out.stdout.strip().removeprefix("nats-server: ")

    def start(self, within_s: float = 10.0) -> None:
        ports = self.workdir / "ports"
        ports.mkdir(parents=True)
        args = [self.binary, "-a", "127.0.0.1", "-p", "-1", "-js",
                "-sd", str(self.workdir / "store"), "--ports_file_dir", str(ports)]  # fmt: skip
        with self.log_path.open("wb") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self._proc = proc
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchError(
                    f"nats-server exited with {proc.returncode}: {_tail(self.log_path)}"
                )
            for path in ports.glob(f"*_{proc.pid}.ports"):
                with contextlib.suppress(ValueError, OSError, KeyError, IndexError):
                    self.url = str(orjson.loads(path.read_bytes())["nats"][0])
                    return
            time.sleep(0.01)
        raise BenchError(f"nats-server did not report its port: {_tail(self.log_path)}")

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise BenchError("nats-server is not started")
        return self._proc.pid

    def stop(self) -> None:
        if self._proc is not None:
            _stop_process(self._proc, signal.SIGTERM, 10)


class ReconcilerProcess:
    """``python -m reconciler.cli run`` on one prefix, with its own SQLite file."""

    def __init__(
        self,
        *,
        url: str,
        prefix: str,
        workdir: Path,
        batch: int,
        log_level: str,
        extra_args: Sequence[str] = (),
    ) -> None:
        #: more ``reconciler run`` options (a phase's own)
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.url = url
        self.prefix = prefix
        self.names = StreamNames.for_prefix(prefix)
        self.workdir = workdir
        self.db = workdir / f"{prefix}.db"
        self.log_path = workdir / f"{prefix}-reconciler.log"
        self.batch = batch
        self.log_level = log_level
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def durable(self) -> str:
        """The name of its input consumer (``<IN>-<replica>``)."""
        return f"{self.names.in_stream}-{REPLICA}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise BenchError("the reconciler is not started")
        return self._proc.pid

    def start(self) -> None:
        args = [sys.executable, "-m", "reconciler.cli", "run",
                "--nats-url", self.url, "--db", str(self.db), "--prefix", self.prefix,
                "--replica", REPLICA, "--batch", str(self.batch),
                "--log-format", "json", "--log-level", self.log_level,
                *self.extra_args]  # fmt: skip
        with self.log_path.open("wb") as out:
            self._proc = subprocess.Popen(
                args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        log(f"reconciler run --prefix {self.prefix} started (pid {self._proc.pid})")

    def check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise BenchError(
                f"reconciler ({self.prefix}) exited with {self._proc.returncode}:\n"
                f"{_tail(self.log_path)}"
            )

    def pids(self) -> list[int]:
        """The reconciler and its children (the store's writer process), recursively."""
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                todo.extend(int(c) for c in children)
        return found

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time so far of the reconciler and its children, and the children's share."""
        total = children = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                used = cpu_seconds(pid)
                total += used
                if pid != self.pid:
                    children += used
        return total, children

    def memory_mib(self) -> dict[str, float]:
        """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) in MiB, from ``/proc``,
        summed over the reconciler and its children (the sum of the peaks bounds the
        peak of the sum), and the writer's share (``writer_VmRSS``, ``writer_VmHWM``)."""
        found: dict[str, float] = {"VmRSS": 0.0, "VmHWM": 0.0}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        mib = int(value.split()[0]) / 1024
                        found[key] = round(found[key] + mib, 1)
                        if pid != self.pid:
                            name = f"writer_{key}"
                            found[name] = round(found.get(name, 0.0) + mib, 1)
        return found

    def stop(self) -> int:
        """SIGTERM (it commits the batch in hand); its exit status."""
        if self._proc is None:
            return 0
        code = _stop_process(self._proc, signal.SIGTERM, 20)
        log(f"reconciler run --prefix {self.prefix} stopped ({code})")
        return code


def new_reconciler(ctx: Context, prefix: str, *extra_args: str) -> ReconcilerProcess:
    return ReconcilerProcess(
        url=ctx.url,
        prefix=prefix,
        workdir=ctx.workdir,
        batch=ctx.opts.batch,
        log_level=ctx.opts.log_level,
        extra_args=extra_args,
    )


@contextlib.asynccontextmanager
async def running(proc: ReconcilerProcess) -> AsyncIterator[ReconcilerProcess]:
    """The reconciler started for the block, stopped after it; a failure if it did not
    exit 0 (when the block itself succeeded)."""
    proc.start()
    succeeded = False
    try:
        yield proc
        succeeded = True
    finally:
        code = await asyncio.to_thread(proc.stop)
    if succeeded and code != 0:
        raise BenchError(f"reconciler ({proc.prefix}) exited with {code}:\n{_tail(proc.log_path)}")


class PySpy:
    """``py-spy record`` of one process until :meth:`stop` (SIGINT makes it write)."""

    def __init__(self, out: Path, pid: int, log_path: Path) -> None:
        binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.access(binary, os.X_OK):
            raise BenchError("--py-spy needs py-spy (pip install py-spy; not a project dependency)")
        fmt = {".svg": "flamegraph", ".json": "speedscope"}.get(out.suffix, "raw")
        # --idle: waiting shows too (a pipeline stall is time spent in select);
        # --nonblocking: the reconciler is never paused to be sampled
        args = [binary, "record", "--pid", str(pid), "--rate", "250", "--threads",
                "--idle", "--nonblocking", "--format", fmt, "--output", str(out)]  # fmt: skip
        with log_path.open("wb") as sink:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
        self.out = out

    def stop(self) -> None:
        _stop_process(self._proc, signal.SIGINT, 60)


# ================================================================================ bus


@dataclass(slots=True)
class Context:
    """What every phase uses: the options, the server, a scratch directory, a client."""

    opts: Options
    url: str
    workdir: Path
    nc: Client
    server_pid: int

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()


async def publish_all(js: JetStreamContext, inputs: Sequence[Input], *, within_s: float) -> None:
    """Publish ``inputs`` in order, pipelined; returns once the stream stored each one."""
    futures = [
        await js.publish_async(i.subject, i.data, headers=i.headers) for i in inputs
    ]  # nats-py bounds the acks in flight (4000)
    acks = await asyncio.wait_for(asyncio.gather(*futures), timeout=within_s)
    duplicates = sum(1 for ack in acks if ack.duplicate)
    if duplicates:
        raise BenchError(f"{duplicates} inputs were dropped as duplicates by the IN stream")


async def stream_last_seq(js: JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).state.last_seq or 0)


async def count_subject(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages of ``stream`` match ``subject`` (an ephemeral consumer's pending)."""
    info = await js.add_consumer(
        stream,
        api.ConsumerConfig(
            filter_subject=subject,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=10.0,
        ),
    )
    try:
        return int(info.num_pending or 0)
    finally:
        await js.delete_consumer(stream, info.name)


async def health(nc: Client, prefix: str) -> dict[str, Any] | None:
    """A replica's ``health`` (the producer's client), or ``None`` when none answers."""
    return await ReconcilerClient(nc, prefix=prefix, origin=Origin.LEADER).health()


async def wait_until(
    proc: ReconcilerProcess,
    what: str,
    check: Callable[[], Awaitable[bool]],
    *,
    within_s: float,
    every_s: float = 0.05,
) -> None:
    """Poll ``check`` until true; fail when the reconciler dies or time runs out."""
    deadline = time.monotonic() + within_s
    while True:
        proc.check_alive()
        if await check():
            return
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {within_s:.0f} s waiting for {what}")
        await asyncio.sleep(every_s)


async def wait_applied(
    ctx: Context, proc: ReconcilerProcess, seq: int, *, within_s: float
) -> dict[str, Any]:
    """Until the reconciler leads, is synced and has committed up to ``seq``."""
    seen: dict[str, Any] = {}

    async def check() -> bool:
        found = await health(ctx.nc, proc.prefix)
        if found is not None:
            seen.update(found)
        return bool(
            found
            and found["leader_ready"]
            and found["caches_synced"]
            and found["applied_seq"] >= seq
        )

    await wait_until(proc, f"applied_seq >= {seq} ({proc.prefix})", check, within_s=within_s)
    return seen


async def wait_event(
    proc: ReconcilerProcess, what: str, event: asyncio.Future[float], *, within_s: float
) -> float:
    async def check() -> bool:
        return event.done()

    await wait_until(proc, what, check, within_s=within_s, every_s=0.01)
    return event.result()


def arrival_future(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future[float], Any]:
    """A future set to the arrival time of the first message, and the callback to set it."""
    future: asyncio.Future[float] = loop.create_future()

    async def on_message(_msg: Msg) -> None:
        if not future.done():
            future.set_result(time.perf_counter())

    return future, on_message


@dataclass(frozen=True, slots=True)
class Baseline:
    """One run of the bare loop: its rate and its own CPU per message."""

    per_s: float
    client_cpu_us: float


async def _pull_from_start(ctx: Context, names: StreamNames, durable: str) -> Any:
    """A pull subscription on a new durable over the whole IN stream, as a plain nats-py
    client makes one (explicit acks, one per message, where the reconciler's own consumer
    acks cumulatively: ``reconciler.bus.consumers``): what the baselines measure against."""
    batch = ctx.opts.batch
    await ctx.js.add_consumer(
        names.in_stream,
        config=api.ConsumerConfig(
            durable_name=durable,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=60.0,
            max_deliver=-1,
            max_ack_pending=max(4 * batch, 1000),
            max_waiting=16,
            replay_policy=api.ReplayPolicy.INSTANT,
        ),
    )
    return await ctx.js.pull_subscribe_bind(
        durable=durable, stream=names.in_stream, pending_msgs_limit=max(8 * batch, 4096)
    )


async def baseline_fetch_ack(
    ctx: Context, names: StreamNames, *, total: int, durable: str
) -> Baseline:
    """A bare nats-py ``fetch(batch)`` + ``msg.ack()`` loop over the whole IN stream
    (:func:`_pull_from_start`)."""
    js, batch = ctx.js, ctx.opts.batch
    sub = await _pull_from_start(ctx, names, durable)
    try:
        got = 0
        started = time.perf_counter()
        cpu = time.process_time(), cpu_seconds(ctx.server_pid)
        while got < total:
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except (TimeoutError, NatsTimeoutError, FetchTimeoutError):
                if time.perf_counter() - started > 60 + total / 1000:
                    raise BenchError(f"baseline stalled after {got} of {total}") from None
                continue
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await ctx.nc.flush()
        elapsed = time.perf_counter() - started
        client_cpu = (time.process_time() - cpu[0]) / elapsed
        server_cpu = (cpu_seconds(ctx.server_pid) - cpu[1]) / elapsed
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(names.in_stream, durable)
    rate = total / elapsed
    client_us = client_cpu * elapsed / total * 1e6
    log(
        f"baseline {durable}: {total} messages in {elapsed:.2f} s = {rate:,.0f}/s "
        f"(cpu: client {client_cpu:.0%}, nats-server {server_cpu:.0%}; "
        f"client {client_us:.1f} µs a message)"
    )
    return Baseline(per_s=rate, client_cpu_us=client_us)


async def io_floor(ctx: Context, names: StreamNames, *, total: int, durable: str) -> Baseline:
    """The I/O floor: the bare loop plus one confirmed output per input, the least this
    job does on the bus (see the module's docstring). Outputs go to the OUT stream as
    ``<prefix>.out.floor.<durable>.<n>`` with a ``Nats-Msg-Id`` each, every output of a
    batch sent before any answer is awaited (one reply subscription, as the reconciler's
    publisher does), and the inputs are acked once all are confirmed."""
    js, nc, batch = ctx.js, ctx.nc, ctx.opts.batch
    sub = await _pull_from_start(ctx, names, durable)
    loop = asyncio.get_running_loop()
    inbox = nc.new_inbox()
    state: dict[str, Any] = {"answers": 0, "errors": 0, "want": 0, "done": None}

    async def on_answer(msg: Msg) -> None:
        state["answers"] += 1
        if b'"error"' in msg.data:
            state["errors"] += 1
        done = state["done"]
        if state["answers"] >= state["want"] and done is not None and not done.done():
            done.set_result(None)

    answers = await nc.subscribe(f"{inbox}.*", cb=on_answer)
    # a subject of the OUT stream that is no output of the contract: the floor's own
    subject = names.subjects.absolute(f"out.floor.{durable}")
    try:
        got = 0
        started = time.perf_counter()
        cpu = time.process_time(), cpu_seconds(ctx.server_pid)
        while got < total:
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except (TimeoutError, NatsTimeoutError, FetchTimeoutError):
                if time.perf_counter() - started > 60 + total / 1000:
                    raise BenchError(f"I/O floor stalled after {got} of {total}") from None
                continue
            state["want"] += len(msgs)
            state["done"] = loop.create_future()
            for i, msg in enumerate(msgs, start=got):
                await nc.publish(
                    f"{subject}.{i}",
                    msg.data,
                    reply=f"{inbox}.{i}",
                    headers={MSG_ID: f"floor:{durable}:{i}"},
                )
            if state["answers"] < state["want"]:
                await asyncio.wait_for(state["done"], timeout=30)
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await nc.flush()
        elapsed = time.perf_counter() - started
        client_cpu = (time.process_time() - cpu[0]) / elapsed
        server_cpu = (cpu_seconds(ctx.server_pid) - cpu[1]) / elapsed
    finally:
        await answers.unsubscribe()
        await sub.unsubscribe()
        await js.delete_consumer(names.in_stream, durable)
    if state["errors"]:
        raise BenchError(f"I/O floor: the OUT stream refused {state['errors']} outputs")
    rate = total / elapsed
    client_us = client_cpu * elapsed / total * 1e6
    log(
        f"I/O floor {durable}: {total} messages in {elapsed:.2f} s = {rate:,.0f}/s "
        f"(cpu: client {client_cpu:.0%}, nats-server {server_cpu:.0%}; "
        f"client {client_us:.1f} µs a message)"
    )
    return Baseline(per_s=rate, client_cpu_us=client_us)


# ============================================================================= phases


async def throughput_phase(ctx: Context) -> dict[str, Any]:
    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix("bt")
    started = time.perf_counter()
    load = mixed_workload(
        prefix=names.prefix, hosts=opts.hosts, seed=opts.seed, messages=opts.messages
    )
    inputs, commands = load.all, load.commands
    log(
        f"throughput: {len(inputs)} inputs ({len(commands)} commands) built and shadow-folded "
        f"in {time.perf_counter() - started:.1f} s; outcomes {dict(load.outcomes)}"
    )
    await ensure_streams(js, names)
    await publish_all(js, inputs, within_s=120 + len(inputs) / 1000)
    total = await stream_last_seq(js, names.in_stream)
    if total != len(inputs):
        raise BenchError(f"IN stream holds {total} messages, not {len(inputs)}")
    baselines = [await baseline_fetch_ack(ctx, names, total=total, durable="baseline-before")]
    floors = [await io_floor(ctx, names, total=total, durable="floor-before")]

    loop = asyncio.get_running_loop()
    first_fetch, on_fetch = arrival_future(loop)
    last_decision, on_decision = arrival_future(loop)
    proc = new_reconciler(ctx, names.prefix)
    subs = [
        await ctx.nc.subscribe(
            f"$JS.API.CONSUMER.MSG.NEXT.{names.in_stream}.{proc.durable}", cb=on_fetch
        ),
        await ctx.nc.subscribe(names.subjects.decision(commands[-1]), cb=on_decision),
    ]
    await ctx.nc.flush()
    profiler: PySpy | None = None
    async with running(proc):
        if opts.py_spy is not None:
            profiler = PySpy(opts.py_spy, proc.pid, ctx.workdir / "py-spy.log")
        try:
            limit = 120 + total / 200
            t_first = await wait_event(proc, "the first fetch", first_fetch, within_s=30)
            (used, writer_used), server_used = proc.cpu_seconds(), cpu_seconds(ctx.server_pid)
            t_last = await wait_event(proc, "the last decision", last_decision, within_s=limit)
            (total_cpu, writer_cpu), server_cpu = proc.cpu_seconds(), cpu_seconds(ctx.server_pid)
            cpu = (total_cpu - used, writer_cpu - writer_used, server_cpu - server_used)
        finally:
            if profiler is not None:
                await asyncio.to_thread(profiler.stop)
                log(f"py-spy profile written to {opts.py_spy}")
        for sub in subs:
            await sub.unsubscribe()
        seconds = t_last - t_first
        fold_rate = total / seconds
        # CPU per input, by process: the budget the ratio is made of (the bare loop's
        # client CPU per message is logged next to it)
        per_input_us = {
            "main": round((cpu[0] - cpu[1]) / total * 1e6, 1),
            "writer": round(cpu[1] / total * 1e6, 1),
            "nats_server": round(cpu[2] / total * 1e6, 1),
        }
        log(
            f"fold pipeline: {total} messages in {seconds:.2f} s = {fold_rate:,.0f}/s "
            f"(cpu: reconciler {cpu[0] / seconds:.0%} of which its writer {cpu[1] / seconds:.0%}, "
            f"nats-server {cpu[2] / seconds:.0%}; µs an input: {per_input_us})"
        )
        await wait_applied(ctx, proc, total, within_s=30)
        decisions = await count_subject(js, names.out_stream, names.subjects.decisions)
        dead = await count_subject(js, names.out_stream, names.subjects.dead_letters)
    if decisions != len(commands) or dead:
        raise BenchError(
            f"OUT stream holds {decisions} decisions for {len(commands)} commands "
            f"and {dead} dead letters"
        )
    baselines.append(await baseline_fetch_ack(ctx, names, total=total, durable="baseline-after"))
    floors.append(await io_floor(ctx, names, total=total, durable="floor-after"))
    best = max(baselines, key=lambda b: b.per_s)
    floor = max(floors, key=lambda b: b.per_s)
    return {
        "fold_events_per_s": round(fold_rate, 1),
        "baseline_fetch_ack_per_s": round(best.per_s, 1),
        "ratio": round(fold_rate / best.per_s, 4),
        "io_floor_per_s": round(floor.per_s, 1),
        "ratio_io_floor": round(fold_rate / floor.per_s, 4),
        "throughput": {
            "io_floor_runs_per_s": [round(f.per_s, 1) for f in floors],
            "io_floor_client_cpu_us_per_message": round(floor.client_cpu_us, 1),
            "messages": total,
            "commands": len(commands),
            "fold_seconds": round(seconds, 3),
            "baseline_runs_per_s": [round(b.per_s, 1) for b in baselines],
            "cpu_us_per_input": per_input_us,
            "baseline_client_cpu_us_per_message": round(best.client_cpu_us, 1),
            "reconciler_cpu_util": round(cpu[0] / seconds, 3),
            "writer_cpu_util": round(cpu[1] / seconds, 3),
            "nats_server_cpu_util": round(cpu[2] / seconds, 3),
            "decisions": decisions,
            "dead_letters": dead,
            "outcomes": dict(sorted(load.outcomes.items())),
            "profiled": opts.py_spy is not None,
        },
    }


async def latency_phase(ctx: Context) -> dict[str, Any]:
    return await measure_latency(ctx, "bl", hosts=ctx.opts.hosts, seed=ctx.opts.seed + 1)


async def measure_latency(
    ctx: Context, prefix: str, *, hosts: int, seed: int, held: list[Input] | None = None
) -> dict[str, Any]:
    """The latency phase's measurement on ``prefix`` (see the module's doc), after the
    ``held`` inputs (folded before the measurement starts) when given."""
    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix(prefix)
    warmup_s = min(1.0, opts.latency_seconds / 5)
    warmup = int(opts.rate * warmup_s)
    measured = max(1, int(opts.rate * opts.latency_seconds))
    started = time.perf_counter()
    load = mixed_workload(prefix=names.prefix, hosts=hosts, seed=seed, commands=warmup + measured)
    log(f"latency ({prefix}): workload built in {time.perf_counter() - started:.1f} s")
    await ensure_streams(js, names)
    preload = [*load.setup, *(held or ())]
    await publish_all(js, preload, within_s=60 + len(preload) / 1000)
    arrivals: dict[str, float] = {}
    sent: dict[str, float] = {}
    head = names.subjects.absolute(DECISION_HEAD)  # what each decision's subject starts with

    async def on_decision(msg: Msg) -> None:
        arrivals.setdefault(msg.subject[len(head) :], time.perf_counter())

    proc = new_reconciler(ctx, names.prefix)
    profiler: PySpy | None = None
    async with running(proc):
        await wait_applied(ctx, proc, len(preload), within_s=60 + len(preload) / 500)
        sub = await ctx.nc.subscribe(names.subjects.decisions, cb=on_decision)
        await ctx.nc.flush()
        if held:
            await asyncio.sleep(2.0)  # the leader's first status round begins
        if opts.py_spy is not None:
            suffix = "latency" if prefix == "bl" else f"latency-{prefix}"
            out = opts.py_spy.with_stem(f"{opts.py_spy.stem}-{suffix}")
            profiler = PySpy(out, proc.pid, ctx.workdir / "py-spy-latency.log")
        log(f"latency: {warmup} warm-up + {measured} commands at {opts.rate:g}/s, open loop")
        # this client's own garbage collector must not pause it while it measures: a full
        # collection over the workload it holds (100,000 held leases' inputs) took 100 to
        # 200 ms here, late sends and late arrival stamps that were counted as the
        # reconciler's latency. Frozen, the workload is never scanned; thawed afterwards.
        gc.collect()
        gc.freeze()
        try:
            futures: list[asyncio.Future[api.PubAck]] = []
            lag = 0.0
            k = 0
            start = measure_from = time.perf_counter() + 0.05
            cpu_start = proc.cpu_seconds()[0]
            for item in load.items:
                if item.request_id is not None:
                    due = start + k / opts.rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    lag = max(lag, time.perf_counter() - due)
                    k += 1
                    if k == warmup + 1:
                        measure_from = time.perf_counter()
                        cpu_start = proc.cpu_seconds()[0]
                    sent[item.request_id] = time.perf_counter()
                futures.append(
                    await js.publish_async(item.subject, item.data, headers=item.headers)
                )
            send_seconds = time.perf_counter() - measure_from
            cpu = (proc.cpu_seconds()[0] - cpu_start) / send_seconds
            if profiler is not None:
                await asyncio.to_thread(profiler.stop)
                log(f"py-spy profile written to {profiler.out}")
            await asyncio.wait_for(asyncio.gather(*futures), timeout=60)

            async def all_arrived() -> bool:
                return len(arrivals) >= len(sent)

            await wait_until(proc, "every decision", all_arrived, within_s=60, every_s=0.05)
        finally:
            gc.unfreeze()
        await sub.unsubscribe()
    ids = load.commands[warmup:]
    samples = sorted((arrivals[r] - sent[r]) * 1000 for r in ids)
    return {
        "latency_ms": {
            "p50": round(percentile(samples, 0.50), 2),
            "p90": round(percentile(samples, 0.90), 2),
            "p99": round(percentile(samples, 0.99), 2),
            "max": round(samples[-1], 2),
        },
        "offered_rate_per_s": opts.rate,
        "latency": {
            "commands": len(ids),
            "warmup_commands": warmup,
            "inputs_sent": len(load.items),
            "achieved_rate_per_s": round(len(ids) / send_seconds, 1),
            "send_lag_ms_max": round(lag * 1000, 2),
            "mean_ms": round(sum(samples) / len(samples), 2),
            "reconciler_cpu_util": round(cpu, 3),
            "outcomes": dict(sorted(load.outcomes.items())),
        },
    }


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(q * len(sorted_samples)))
    return sorted_samples[min(rank, len(sorted_samples)) - 1]


async def rss_phase(ctx: Context) -> dict[str, Any]:
    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix("br")
    load = admission_workload(prefix=names.prefix, hosts=opts.hosts, leases=opts.leases)
    await ensure_streams(js, names)
    await publish_all(js, load.setup, within_s=60)
    total = len(load.setup) + len(load.items)
    loop = asyncio.get_running_loop()
    last_decision, on_decision = arrival_future(loop)
    proc = new_reconciler(ctx, names.prefix)
    async with running(proc):
        await wait_applied(ctx, proc, len(load.setup), within_s=60)
        await asyncio.sleep(1.0)
        idle = proc.memory_mib()
        sub = await ctx.nc.subscribe(names.subjects.decision(load.commands[-1]), cb=on_decision)
        await ctx.nc.flush()
        log(f"rss: idle {idle}; publishing {len(load.items)} admissions")
        await publish_all(js, load.items, within_s=120 + len(load.items) / 500)
        await wait_event(
            proc, "the last admission", last_decision, within_s=120 + len(load.items) / 200
        )
        await sub.unsubscribe()
        await wait_applied(ctx, proc, total, within_s=60)
        await asyncio.sleep(2.0)  # the status round and the allocator settle
        held = proc.memory_mib()
        log(f"rss: holding {held}")
    leases = count_active_leases(proc.db)
    if leases < opts.leases:
        raise BenchError(f"the store holds {leases} active leases, not {opts.leases}")
    grown = held["VmRSS"] - idle["VmRSS"]
    return {
        "peak_rss_mib": held["VmHWM"],
        "rss": {
            "process": "the `reconciler run` subprocess and its store writer, summed; "
            "/proc/<pid>/status",
            "writer_peak_rss_mib": held.get("writer_VmHWM"),
            "leases": leases,
            "peak_rss_mib": held["VmHWM"],
            "rss_mib": held["VmRSS"],
            "idle_rss_mib": idle["VmRSS"],
            "bytes_per_lease": round(grown * 1024 * 1024 / leases),
        },
    }


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(x, y)`` points; None for fewer than two x values."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def soak_chunk(prefix: str, first_pair: int, pairs: int) -> list[Input]:
    """Admit-and-release pairs ``first_pair``… on the soak pool, encoded."""
    out: list[Input] = []
    for n in range(first_pair, first_pair + pairs):
        for item in (
            b.admit(f"s{n}", "soak", f"vm-{n}"),
            b.cmd("release", f"x{n}", instance=f"vm-{n}"),
        ):
            out.append(
                Input(
                    b.subject_of(item, prefix=prefix),
                    orjson.dumps(item[1]),
                    f"{item[1]['request_id']}",
                )
            )
    return out


def file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


async def soak_phase(ctx: Context) -> dict[str, Any]:
    """RSS and database bytes per decided command with a short retention (see the
    module's docstring)."""
    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix("bs")
    retention = opts.soak_retention
    setup = [
        Input(b.subject_of(item, prefix=names.prefix), orjson.dumps(item[1]), None)
        for item in (
            *fleet_setup(1),
            b.pool("soak", cpu=0, memory_mib=0, disk_gib=0, max_instances=1_000_000),
        )
    ]
    await ensure_streams(js, names)
    await publish_all(js, setup, within_s=60)
    proc = new_reconciler(
        ctx,
        names.prefix,
        "--decision-retention", str(retention),
        "--journal-retention", str(retention),
    )  # fmt: skip
    chunk_pairs = max(1, min(10_000, opts.soak_commands // 40))
    samples: list[dict[str, float]] = []
    async with running(proc):
        seq = len(setup)
        await wait_applied(ctx, proc, seq, within_s=60)
        started = time.monotonic()
        pairs = 0
        while pairs * 2 < opts.soak_commands:
            chunk = soak_chunk(names.prefix, pairs, chunk_pairs)
            await publish_all(js, chunk, within_s=120 + len(chunk) / 500)
            seq += len(chunk)
            pairs += chunk_pairs
            await wait_applied(ctx, proc, seq, within_s=120 + len(chunk) / 200)
            memory = proc.memory_mib()
            samples.append(
                {
                    "commands": pairs * 2,
                    "elapsed_s": round(time.monotonic() - started, 2),
                    "rss_mib": memory["VmRSS"],
                    "db_bytes": file_bytes(proc.db),
                    "wal_bytes": file_bytes(proc.db.with_name(proc.db.name + "-wal")),
                }
            )
            if len(samples) % 10 == 0:
                log(f"soak: {samples[-1]}")
        peak = proc.memory_mib()["VmHWM"]
    with contextlib.closing(sqlite3.connect(f"file:{proc.db}?mode=ro", uri=True)) as conn:
        rows = {
            table: int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            for table in ("decisions", "leases", "jobs", "journal", "outbox_batches")
        }
    steady = [s for s in samples if s["elapsed_s"] >= 3 * retention] or samples[-2:]
    mib = 1024 * 1024
    rss_slope = slope([(s["commands"], s["rss_mib"] * mib) for s in steady])
    db_slope = slope([(s["commands"], s["db_bytes"]) for s in steady])
    both_slope = slope([(s["commands"], s["db_bytes"] + s["wal_bytes"]) for s in steady])
    first, last = steady[0], steady[-1]
    span = max(1.0, last["commands"] - first["commands"])
    return {
        "soak": {
            "commands": pairs * 2,
            "retention_s": retention,
            "steady_samples": len(steady),
            "steady_from_commands": first["commands"],
            "rss_bytes_per_command": None if rss_slope is None else round(rss_slope, 2),
            "db_bytes_per_command": None if db_slope is None else round(db_slope, 2),
            "db_and_wal_bytes_per_command": None if both_slope is None else round(both_slope, 2),
            # the largest WAL file sampled (a writer that never pauses outruns passive
            # checkpoints; the store starts a WAL past 64 MiB over between two commits)
            "wal_bytes_max": max(s["wal_bytes"] for s in samples),
            "rss_bytes_per_command_first_to_last": round(
                (last["rss_mib"] - first["rss_mib"]) * mib / span, 2
            ),
            "db_bytes_per_command_first_to_last": round(
                (last["db_bytes"] - first["db_bytes"]) / span, 2
            ),
            "peak_rss_mib": peak,
            "final": samples[-1],
            "rows_at_end": rows,
            "samples": samples[:: max(1, len(samples) // 20)],
        }
    }


def count_active_leases(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT count(*) FROM leases WHERE state != 'released'").fetchone()
    return int(row[0])


# ============================================================ fleet and snapshot phases


def held_leases(prefix: str, hosts: int, leases: int) -> list[Input]:
    """A zero-flavor pool and ``leases`` cold admissions of it, each on a selected host
    (round robin over the fleet): live leases spread evenly, booking nothing, so that the
    mixed workload that follows places exactly as it would without them."""
    names = host_names(hosts)
    items = [b.pool("held", cpu=0, memory_mib=0, disk_gib=0, max_instances=leases + 1)]
    items += [
        b.admit(f"held-{i}", "held", f"held-{i:07d}", host=names[i % hosts]) for i in range(leases)
    ]
    return [
        Input(b.subject_of(i, prefix=prefix), orjson.dumps(i[1]), i[1].get("request_id"))
        for i in items
    ]


async def fleet_phase(ctx: Context) -> dict[str, Any]:
    """The latency phase with ``--fleet-hosts`` hosts and ``--leases`` live leases."""
    opts = ctx.opts
    held = held_leases("bf", opts.fleet_hosts, opts.leases)
    found = await measure_latency(ctx, "bf", hosts=opts.fleet_hosts, seed=opts.seed + 2, held=held)
    return {
        "fleet_latency_ms": found["latency_ms"],
        "fleet": {**found["latency"], "hosts": opts.fleet_hosts, "live_leases": opts.leases},
    }


async def snapshot_phase(ctx: Context) -> dict[str, Any]:
    """Replay from a snapshot against a bare read of the same stream.

    A reconciler (``--snapshot-interval 1``) folds the first half of a mixed workload of
    ``--messages`` inputs and publishes a snapshot of it; it then folds the second half.
    The IN stream is purged below the snapshot's position, as if the first half had aged
    out. ``replay_from_snapshot_per_s`` is the inputs of the tail divided by the time
    of ``replay_into`` (fetch and verify the snapshot, fold the tail, compare every
    output with the OUT stream), in this process, connected as ``reconciler replay`` is
    (its reader child reads both streams); ``bare_read_per_s`` the bare fetch+ack loop
    over the same tail; the ratio is the first over the second. There are
    :data:`SNAPSHOT_ROUNDS` replays, each between two bare reads and taken against their
    mean; the figures are those of the round with the median ratio, and
    ``snapshot.rounds`` lists every round's.
    """
    from reconciler.replica.snapshot_bucket import SnapshotBucket

    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix("bs")
    load = mixed_workload(
        prefix=names.prefix, hosts=opts.hosts, seed=opts.seed + 3, messages=opts.messages
    )
    first = load.all[: len(load.all) // 2]
    rest = load.all[len(load.all) // 2 :]
    await ensure_streams(js, names)
    await publish_all(js, first, within_s=120 + len(first) / 1000)
    bucket = SnapshotBucket(js, names.prefix)
    proc = new_reconciler(ctx, names.prefix)
    proc.extra_args = ("--snapshot-interval", "1")
    async with running(proc):
        applied = (await wait_applied(ctx, proc, len(first), within_s=120 + len(first) / 500))[
            "applied_seq"
        ]

        async def snapshot_taken() -> bool:
            positions = await bucket.positions()
            return bool(positions) and positions[-1] >= applied

        await wait_until(proc, "a snapshot", snapshot_taken, within_s=60, every_s=0.2)
        snapshot_seq = (await bucket.positions())[-1]
        await publish_all(js, rest, within_s=120 + len(rest) / 1000)
        last = await stream_last_seq(js, names.in_stream)

        async def all_published() -> bool:
            found = await health(ctx.nc, names.prefix)
            return bool(found and found["applied_seq"] >= last and found["published_seq"] >= last)

        await wait_until(proc, "every output published", all_published, within_s=300)
    last = await stream_last_seq(js, names.in_stream)
    await js.purge_stream(names.in_stream, seq=snapshot_seq + 1)
    tail = last - snapshot_seq
    # bare, replay, bare, replay, ...: each replay against the mean of the bare reads on
    # either side of it, so that the machine's speed drifting between the two does not
    # decide the ratio; the figure is the median round
    bares = [await baseline_fetch_ack(ctx, names, total=tail, durable="bench-bare-tail-0")]
    rounds: list[dict[str, Any]] = []
    for n in range(1, SNAPSHOT_ROUNDS + 1):
        replayed = await _replay_from_snapshot(ctx, names, snapshot_seq)
        bares.append(
            await baseline_fetch_ack(ctx, names, total=tail, durable=f"bench-bare-tail-{n}")
        )
        bare_per_s = (bares[-2].per_s + bares[-1].per_s) / 2
        bare_cpu_us = (bares[-2].client_cpu_us + bares[-1].client_cpu_us) / 2
        rate = replayed["inputs"] / replayed["seconds"]
        rounds.append(
            {**replayed, "rate": rate, "bare_per_s": bare_per_s, "bare_cpu_us": bare_cpu_us}
        )
        log(
            f"snapshot: round {n}: replay of {replayed['inputs']} inputs after the snapshot "
            f"at {snapshot_seq} in {replayed['seconds']:.2f} s = {rate:,.0f}/s; bare read "
            f"{bare_per_s:,.0f}/s (mean of before and after): {rate / bare_per_s:.3f}"
        )
    ratios = [r["rate"] / r["bare_per_s"] for r in rounds]
    mid = sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]
    median = rounds[mid]
    return {
        "replay_from_snapshot_per_s": round(median["rate"]),
        "bare_read_per_s": round(median["bare_per_s"]),
        "snapshot_ratio": round(ratios[mid], 3),
        "snapshot": {
            "snapshot_seq": snapshot_seq,
            "tail_inputs": median["inputs"],
            "compared": median["compared"],
            # every round's ratio, in the order run; the figures here are the median's
            "rounds": [round(r, 3) for r in ratios],
            "replay_seconds": round(median["seconds"], 2),
            "replay_part_seconds": {k: round(v, 2) for k, v in median["parts"].items()},
            "replay_fold_per_s": round(median["inputs"] / median["parts"]["fold"]),
            # CPU per tail input: the replay's own process, its reader child, the bare loop
            "replay_cpu_us": round(median["cpu"] / median["inputs"] * 1e6, 1),
            "replay_reader_cpu_us": round(median["reader_cpu"] / median["inputs"] * 1e6, 1),
            "bare_read_cpu_us": round(median["bare_cpu_us"], 1),
        },
    }


async def _replay_from_snapshot(
    ctx: Context, names: StreamNames, snapshot_seq: int
) -> dict[str, Any]:
    """One replay of the tail, connected as ``reconciler replay`` is (both streams read by
    its child process): its time, parts and CPU (its own and its child's)."""
    from reconciler.bus.connection import ConnectOptions
    from reconciler.replay.replay import replay_into

    started = time.perf_counter()
    cpu = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    report = await replay_into(
        ctx.nc,
        prefix=names.prefix,
        batch=ctx.opts.batch,
        connect_opts=ConnectOptions.from_url(ctx.url, name="bench-replay"),
    )
    elapsed = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not report.ok or report.snapshot_seq != snapshot_seq:
        raise BenchError(
            f"replay from the snapshot at {snapshot_seq}: started at {report.snapshot_seq}, "
            f"{len(report.divergences)} divergences"
        )
    return {
        "inputs": report.inputs,
        "compared": report.compared,
        "seconds": elapsed,
        "parts": dict(report.seconds),
        "cpu": time.process_time() - cpu[0],
        "reader_cpu": children.ru_utime + children.ru_stime - cpu[1].ru_utime - cpu[1].ru_stime,
    }


# ========================================================================== queue phase


def queue_workload(prefix: str, queued: int) -> tuple[Workload, list[Input]]:
    """Setup: hosts with room for ``queued`` 1-vCPU VMs exactly, filled by as many
    admissions; then ``queued`` admissions that wait (``wait_s`` an hour). The releases
    of the fillers, one by one, each admit the next waiting request (one lane, FIFO)."""
    per_host = 1000
    hosts = max(1, -(-queued // per_host))
    setup: list[Item] = [
        b.snapshot(
            f"qhost-{h:03d}",
            cpu=per_host + 2,
            memory_mib=1 << 30,
            disk_gib=1 << 20,
            reserve=b.res(2, 0, 0),
        )
        for h in range(hosts)
    ]
    room = hosts * per_host
    setup.append(b.pool("q", cpu=1, memory_mib=0, disk_gib=0, max_instances=room + queued + 1))
    fill = [b.admit(f"f{i}", "q", f"fill-{i:06d}") for i in range(room)]
    waiting = [b.admit(f"q{i}", "q", f"wait-{i:06d}", wait_s=3600) for i in range(queued)]
    releases = [b.cmd("release", f"x{i}", instance=f"fill-{i:06d}") for i in range(queued)]

    def encode(item: Item) -> Input:
        return Input(
            b.subject_of(item, prefix=prefix), orjson.dumps(item[1]), item[1].get("request_id")
        )

    return (
        Workload([encode(i) for i in [*setup, *fill]], [encode(i) for i in waiting]),
        [encode(i) for i in releases],
    )


async def queue_phase(ctx: Context) -> dict[str, Any]:
    """``--queued`` requests waiting, then releases at ``--rate`` a second: the latency of
    each admission decision (release sent to the waiting request's final decision
    received), and the reconciler's peak RSS."""
    opts, js = ctx.opts, ctx.js
    names = StreamNames.for_prefix("bq")
    load, releases = queue_workload(names.prefix, opts.queued)
    await ensure_streams(js, names)
    preload = load.all
    await publish_all(js, preload, within_s=120 + len(preload) / 500)
    arrivals: dict[str, float] = {}
    sent: dict[str, float] = {}
    head = names.subjects.absolute(DECISION_HEAD)

    async def on_decision(msg: Msg) -> None:
        if b'"phase":"final"' in msg.data:
            arrivals.setdefault(msg.subject[len(head) :], time.perf_counter())

    proc = new_reconciler(ctx, names.prefix)
    async with running(proc):
        await wait_applied(ctx, proc, len(preload), within_s=120 + len(preload) / 200)
        await asyncio.sleep(1.0)
        waiting_rss = proc.memory_mib()
        sub = await ctx.nc.subscribe(names.subjects.decisions, cb=on_decision)
        await ctx.nc.flush()
        log(f"queue: {opts.queued} waiting; releases at {opts.rate:g}/s, open loop")
        gc.collect()
        gc.freeze()
        try:
            futures: list[asyncio.Future[api.PubAck]] = []
            start = time.perf_counter() + 0.05
            lag = 0.0
            for k, item in enumerate(releases):
                due = start + k / opts.rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                lag = max(lag, time.perf_counter() - due)
                sent[f"q{k}"] = time.perf_counter()
                futures.append(
                    await js.publish_async(item.subject, item.data, headers=item.headers)
                )
            send_seconds = time.perf_counter() - start
            await asyncio.wait_for(asyncio.gather(*futures), timeout=60)

            async def all_arrived() -> bool:
                return all(r in arrivals for r in sent)

            await wait_until(proc, "every admission", all_arrived, within_s=120, every_s=0.05)
        finally:
            gc.unfreeze()
        await sub.unsubscribe()
        held = proc.memory_mib()
    samples = sorted((arrivals[r] - sent[r]) * 1000 for r in sent)
    # where the slow ones were: the p99 of each second of the run, by second
    by_second: dict[int, list[float]] = {}
    for r, at in sent.items():
        by_second.setdefault(int(at - start), []).append((arrivals[r] - at) * 1000)
    p99_by_second = [round(percentile(sorted(v), 0.99), 1) for _, v in sorted(by_second.items())]
    return {
        "queue_latency_ms": {
            "p50": round(percentile(samples, 0.50), 2),
            "p90": round(percentile(samples, 0.90), 2),
            "p99": round(percentile(samples, 0.99), 2),
            "max": round(samples[-1], 2),
        },
        "queue": {
            "queued": opts.queued,
            "releases": len(releases),
            "offered_rate_per_s": opts.rate,
            "achieved_rate_per_s": round(len(releases) / send_seconds, 1),
            "send_lag_ms_max": round(lag * 1000, 2),
            "peak_rss_mib": held["VmHWM"],
            "rss_mib_while_waiting": waiting_rss["VmRSS"],
            "p99_ms_by_second": p99_by_second,
            "measures": "release published to the waiting request's final (admitted) "
            "decision received",
        },
    }


# =============================================================================== main

Phase = Callable[[Context], Awaitable[dict[str, Any]]]
PHASE_FUNCTIONS: dict[str, Phase] = {
    "throughput": throughput_phase,
    "latency": latency_phase,
    "rss": rss_phase,
    "soak": soak_phase,
    "fleet": fleet_phase,
    "snapshot": snapshot_phase,
    "queue": queue_phase,
}
#: what a skipped or failed phase reports (JSON null)
EMPTY: dict[str, dict[str, Any]] = {
    "throughput": {"fold_events_per_s": None, "baseline_fetch_ack_per_s": None, "ratio": None},
    "latency": {"latency_ms": None},
    "rss": {"peak_rss_mib": None},
    "soak": {"soak": None},
    "fleet": {"fleet_latency_ms": None},
    "snapshot": {"snapshot_ratio": None},
    "queue": {"queue_latency_ms": None},
}


async def run_phases(
    opts: Options, server: NatsServerProcess, workdir: Path, errors: list[str]
) -> dict[str, Any]:
    nc = await nats.connect(server.url, name="bench", connect_timeout=2, max_reconnect_attempts=5)
    ctx = Context(opts=opts, url=server.url, workdir=workdir, nc=nc, server_pid=server.pid)
    found: dict[str, Any] = {}
    try:
        for name in PHASES:
            found.update(EMPTY[name])
            if name in opts.skip or (name == "soak" and not opts.soak):
                continue  # the soak runs only when asked for (--soak)
            log(f"phase {name}")
            started = time.perf_counter()
            try:
                found.update(await PHASE_FUNCTIONS[name](ctx))
            except Exception as exc:
                log(f"phase {name} FAILED: {exc!r}")
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
            log(f"phase {name} took {time.perf_counter() - started:.1f} s")
    finally:
        await nc.close()
    return found


def targets(found: dict[str, Any], opts: Options) -> dict[str, dict[str, Any]]:
    """Pass/fail of each target; ``pass`` is null when its phase did not run, and
    ``conditions_met`` false when the run's parameters are not the target's."""

    def check(value: Any, ok: Callable[[float], bool], **extra: Any) -> dict[str, Any]:
        return {"value": value, "pass": None if value is None else ok(value), **extra}

    ratio, p99, rss = found.get("ratio"), found.get("latency_ms"), found.get("peak_rss_mib")
    floor_ratio, soak = found.get("ratio_io_floor"), found.get("soak") or {}
    p99 = None if p99 is None else p99["p99"]
    fleet_p99 = found.get("fleet_latency_ms")
    fleet_p99 = None if fleet_p99 is None else fleet_p99["p99"]
    return {
        "ratio": check(
            ratio, lambda v: v >= TARGET_RATIO, target=f">= {TARGET_RATIO}", source="issue"
        ),
        "ratio_design": check(
            ratio,
            lambda v: v >= TARGET_RATIO_DESIGN,
            target=f">= {TARGET_RATIO_DESIGN}",
            source="design",
        ),
        "latency_p99_ms": check(
            p99,
            lambda v: v <= TARGET_P99_MS,
            target=f"<= {TARGET_P99_MS:g} ms at {TARGET_P99_RATE:g}/s",
            conditions_met=opts.rate >= TARGET_P99_RATE,
        ),
        "ratio_io_floor": check(
            floor_ratio,
            lambda v: v >= TARGET_IO_FLOOR_RATIO,
            target=f">= {TARGET_IO_FLOOR_RATIO}",
            source="issue",
        ),
        "soak_rss_bytes_per_command": check(
            soak.get("rss_bytes_per_command"),
            lambda v: v <= TARGET_SOAK_BYTES,
            target=f"<= {TARGET_SOAK_BYTES:g} B over {TARGET_SOAK_COMMANDS} commands",
            conditions_met=opts.soak_commands >= TARGET_SOAK_COMMANDS,
        ),
        "soak_db_bytes_per_command": check(
            soak.get("db_bytes_per_command"),
            lambda v: v <= TARGET_SOAK_BYTES,
            target=f"<= {TARGET_SOAK_BYTES:g} B over {TARGET_SOAK_COMMANDS} commands",
            conditions_met=opts.soak_commands >= TARGET_SOAK_COMMANDS,
        ),
        "peak_rss_mib": check(
            rss,
            lambda v: v <= TARGET_RSS_MIB,
            target=f"<= {TARGET_RSS_MIB:g} MiB with {TARGET_RSS_LEASES} leases",
            conditions_met=opts.leases >= TARGET_RSS_LEASES,
        ),
        "fleet_latency_p99_ms": check(
            fleet_p99,
            lambda v: v <= TARGET_P99_MS,
            target=f"<= {TARGET_P99_MS:g} ms at {TARGET_P99_RATE:g}/s with "
            f"{TARGET_FLEET_HOSTS} hosts and {TARGET_RSS_LEASES} live leases",
            conditions_met=opts.rate >= TARGET_P99_RATE
            and opts.fleet_hosts >= TARGET_FLEET_HOSTS
            and opts.leases >= TARGET_RSS_LEASES,
            source="issue 15",
        ),
        "queue_latency_p99_ms": check(
            None if found.get("queue_latency_ms") is None else found["queue_latency_ms"]["p99"],
            lambda v: v <= TARGET_P99_MS,
            target=f"<= {TARGET_P99_MS:g} ms with {TARGET_QUEUED} waiting, releases at "
            f"{TARGET_QUEUE_RELEASE_RATE:g}/s",
            conditions_met=opts.queued >= TARGET_QUEUED and opts.rate >= TARGET_QUEUE_RELEASE_RATE,
            source="issue 26",
        ),
        "snapshot_ratio": check(
            found.get("snapshot_ratio"),
            lambda v: v >= TARGET_SNAPSHOT_RATIO,
            target=f">= {TARGET_SNAPSHOT_RATIO} of a bare read of the stream",
            source="issue 15",
        ),
    }


def versions(nats_server: str | None) -> dict[str, Any]:
    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "reconciler": dist("reconciler"),
        "git_commit": commit or None,
        "nats_py": dist("nats-py"),
        "nats_server": nats_server,
        "aiosqlite": dist("aiosqlite"),
        "sqlite": sqlite3.sqlite_version,
        "orjson": dist("orjson"),
        "anyio": dist("anyio"),
    }


def machine() -> dict[str, Any]:
    model = None
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        model = match.group(1).strip() if match else None
    mem = None
    with contextlib.suppress(OSError, AttributeError, ValueError):
        match = re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M)
        mem = round(int(match.group(1)) / 1024) if match else None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "mem_total_mib": mem,
        "platform": platform.platform(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: processes, temp dir


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    configure_logging(fmt="text", level="warning")  # the project's loggers: stderr, not stdout
    signal.signal(signal.SIGTERM, _terminate)
    errors: list[str] = []
    found: dict[str, Any] = {}
    load_before = round(os.getloadavg()[0], 2)
    server_version: str | None = None
    with tempfile.TemporaryDirectory(prefix="rc-bench-") as tmp:
        workdir = Path(tmp)
        server: NatsServerProcess | None = None
        try:
            server = NatsServerProcess(find_nats_server(opts.nats_server), workdir / "nats")
            server_version = server.version()
            server.start()
            log(f"nats-server {server_version} at {server.url}; scratch {workdir}")
            found = asyncio.run(run_phases(opts, server, workdir, errors))
        except Exception as exc:
            errors.append(f"setup: {type(exc).__name__}: {exc}")
            log(f"FAILED: {exc!r}")
        finally:
            if server is not None:
                server.stop()
    result: dict[str, Any] = {
        "bench": "reconciler-run",
        "ok": not errors,
        "errors": errors,
        **{key: value for phase in PHASES for key, value in EMPTY[phase].items()},
        "offered_rate_per_s": opts.rate,
        **found,
        "messages": opts.messages,
        "batch": opts.batch,
        "hosts": opts.hosts,
        "rate": opts.rate,
        "latency_seconds": opts.latency_seconds,
        "leases": opts.leases,
        "soak_commands": opts.soak_commands if opts.soak else None,
        "fleet_hosts": opts.fleet_hosts,
        "queued": opts.queued,
        "quick": opts.quick,
        "skipped": sorted(opts.skip),
        "seed": opts.seed,
        "reconciler_log_level": opts.log_level,
        "targets": targets(found, opts),
        "versions": versions(server_version),
        "machine": {**machine(), "loadavg_1m_at_start": load_before},
        "elapsed_s": round(time.perf_counter() - _t0, 1),
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
