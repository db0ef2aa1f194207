"""Golden digests of the fold: fixed, seeded streams whose every output byte and final
state are pinned by SHA-256 constants recorded from the fold as it was.

The fold's outputs are replayed byte for byte against history (DESIGN.md, "Principles"),
so a change to the core that is meant to be only faster must leave these digests
exactly as they are. A digest covers, in order: every output (subject, msg id, payload
bytes, outcome), every journal transition, each batch's touched keys and notes; and the
final state through :func:`reconciler.store.digest.state_digest`.

Streams:

- ``bench``: ``scripts/bench_core.py``'s mixed workload (snapshots, pools, cold, warm and
  preemptible admits, claims, lifecycle, releases) at 50 hosts and at 2,000 hosts;
- ``mixed``: ``tests/support/workload.py``'s commands of every verb with duplicates, drains,
  mark-deleting and lifecycle events broadcast to every host;
- ``rich``: a seeded stream drawn against the state as it folds (so it names the
  instances and leases that exist): GPU hosts and classes, claims (some invalid), GPU
  profiles and policies (some rejected), selected hosts, spread and host selectors,
  preemption and launch gates with the executor's deletes, inventories that adopt,
  count foreign VMs and leave leases suspect, observations, runtime re-renders,
  injected warm VMs, stale snapshots, pool reconfigurations, duplicate request ids, and
  a decision retention short enough that eviction runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reconciler.core.fold import fold
from reconciler.core.inputs import DomainError, Message, from_payload
from reconciler.core.model import TAG_JOB, TAG_KIND, TAG_LEASE_ID, TAG_POOL, LeaseState
from reconciler.core.state import Effects, State
from reconciler.store.digest import state_digest
from tests.core.test_fold_properties import derived, rebuilt
from tests.support import builders as b
from tests.support import workload as wl
from tests.support.repo import ROOT

Item = tuple[str, dict[str, Any]]


def _bench_workload() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_core", ROOT / "scripts" / "bench_core.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_bench_core", module)
    spec.loader.exec_module(module)
    return module.workload


_T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def _timestamp(seq: int, step_s: int) -> str:
    """A stream time that moves forward ``step_s`` seconds per input (with a fraction,
    as JetStream writes them)."""
    t = _T0 + timedelta(seconds=seq * step_s)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + ".123456789Z"


class Recorder:
    """Folds messages in batches, hashing everything each batch produced."""

    def __init__(self, *, batch: int = 50, retention: int | None = None, step_s: int = 1) -> None:
        self.state = State(decision_retention_s=retention)
        self.hash = hashlib.sha256()
        self.batch = batch
        self.step_s = step_s
        self.fx = Effects()
        self.pending = 0
        self.seq = 0
        self.outputs = 0

    def send(self, item: Item) -> Effects:
        """Fold one item as the next input; the batch's effects so far."""
        self.seq += 1
        kind, payload = item
        try:
            built = from_payload(kind, payload)
        except DomainError as exc:
            # dead-lettered by the decoder: it never reaches the fold, takes no seq
            self.seq -= 1
            self.hash.update(b"D|%s\n" % str(exc).encode())
            return Effects()
        msg = Message(seq=self.seq, timestamp=_timestamp(self.seq, self.step_s), input=built)
        before = len(self.fx.outputs)
        fold(self.state, msg, self.fx)
        self.pending += 1
        if self.pending >= self.batch:
            self.flush()
            return Effects()
        return self._since(before)

    def _since(self, before: int) -> Effects:
        fx = Effects()
        fx.outputs = self.fx.outputs[before:]
        return fx

    def flush(self) -> None:
        fx, h = self.fx, self.hash
        for out in fx.outputs:
            h.update(
                b"O|%s|%s|%s|"
                % (out.subject.encode(), str(out.msg_id).encode(), str(out.outcome).encode())
            )
            h.update(out.payload)
            h.update(b"\n")
        for t in fx.transitions:
            h.update(
                repr((t.input_seq, t.lease_id, t.event, t.from_state, t.to_state, t.at)).encode()
            )
        for name in (
            "hosts", "pools", "host_rows", "pool_rows", "classes", "profiles",
            "policies", "leases", "decisions", "jobs",
        ):  # fmt: skip
            h.update(b"%s=%s\n" % (name.encode(), repr(sorted(getattr(fx, name))).encode()))
        for seq, note in fx.notes:
            h.update(b"N|%d|%s\n" % (seq, note.encode()))
        self.outputs += len(fx.outputs)
        self.fx = Effects()
        self.pending = 0

    def finish(self) -> tuple[str, str]:
        self.flush()
        assert derived(self.state) == derived(rebuilt(self.state))
        return self.hash.hexdigest(), state_digest(self.state)


# ------------------------------------------------------------------------ streams


def bench_stream(inputs: int, hosts: int, seed: int) -> tuple[str, str]:
    rec = Recorder(batch=500)
    for item in _bench_workload()(inputs, hosts, seed):
        rec.send(item)
    return rec.finish()


def mixed_stream(commands: int, hosts: int, seed: int) -> tuple[str, str]:
    rec = Recorder(batch=64, retention=600)
    work = wl.mixed(commands, seed=seed, hosts=hosts)
    for item in work.setup + work.items:
        rec.send(item)
    return rec.finish()


class Rich:
    """A seeded stream drawn against the folded state (see the module docstring)."""

    HOSTS = 12

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.rec = Recorder(batch=37, retention=1800, step_s=3)
        self.n = 0
        self.revision: dict[str, int] = {}
        self.inv_revision: dict[str, int] = {}
        self.request_ids: list[str] = []
        self.jobs: list[str] = []

    @property
    def state(self) -> State:
        return self.rec.state

    def send(self, item: Item) -> Effects:
        if item[0].startswith("cmd."):
            self.request_ids.append(item[1]["request_id"])
        return self.rec.send(item)

    def rid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    # ---- hosts

    def host_snapshot(self, i: int, *, stale: bool = False) -> Item:
        name = f"h{i:02d}"
        if not stale:
            self.revision[name] = self.revision.get(name, 0) + 1
        rev = self.revision.get(name, 1) - (1 if stale else 0)
        gpus = None
        if i % 3 == 0:
            gpus = [b.gpu(k, numa=k // 2, model="A100" if k < 3 else "H100") for k in range(4)]
            if self.rng.random() < 0.1:
                gpus = gpus[:3]  # a GPU gone
        return b.snapshot(
            name,
            revision=rev,
            cpu=16 if i % 2 else 24,
            memory_mib=65536,
            disk_gib=400,
            reserve=b.res(1, 1024, 10),
            gpus=gpus,
            labels={"zone": "a" if i % 4 else "b", "rack": str(i % 3)},
            schedulable=self.rng.random() > 0.05,
            gpu_profile="std" if i % 6 == 0 else None,
        )

    def setup(self) -> None:
        self.send(b.gpu_profile("std", persistence=True, power_limit_w=250))
        self.send(b.gpu_profile("std", revision=1))  # stale
        self.send(b.gpu_profile("bad", revision=1, power_limit_w=-3))
        self.send(b.gpu_profile("worse", revision=1, mig_mode="sometimes"))  # a domain error
        self.send(b.gpu_policy("p1", priority=1, overrides={"ecc": True}, models=["A100"]))
        self.send(
            b.gpu_policy(
                "p2", priority=2, overrides={"compute_mode": "exclusive-process"}, indexes=[0, 1]
            )
        )
        self.send(b.gpu_policy("p-bad", overrides={"power_limit_w": -5}))
        for i in range(self.HOSTS):
            self.send(self.host_snapshot(i))
        self.send(b.gpu_class("a100", model="A100"))
        self.send(b.gpu_class("any2", count=2))
        self.send(b.gpu_class("zoneb", count=1, host_selector={"zone": "b"}))
        self.send(b.gpu_class("broken", count=0))
        self.send(b.pool("cold", cpu=2, memory_mib=4096, disk_gib=20, max_instances=400))
        self.send(
            b.pool(
                "warm",
                cpu=4,
                memory_mib=8192,
                disk_gib=40,
                min_ready=2,
                max_ready=16,
                max_instances=60,
            )
        )
        self.send(
            b.pool(
                "warm-prot",
                cpu=3,
                memory_mib=6144,
                disk_gib=30,
                min_ready=2,
                max_ready=6,
                protect_min_ready=True,
                priority=5,
                max_instances=40,
            )
        )
        self.send(
            b.pool(
                "gpu",
                cpu=4,
                memory_mib=16384,
                disk_gib=50,
                claims=[{"name": "g", "class": "a100"}],
                max_instances=30,
            )
        )
        self.send(
            b.pool(
                "spread",
                cpu=1,
                memory_mib=2048,
                disk_gib=10,
                placement="spread",
                host_selector={"zone": "a"},
                max_instances=50,
                instance_type="container",
            )
        )
        self.send(b.pool("bad-pool", min_ready=3, max_ready=1))

    # ---- picks

    def leases(self, *states: LeaseState) -> list[Any]:
        out = [le for le in self.state.leases.values() if le.state in states]
        return sorted(out, key=lambda le: le.lease_id)

    def pick(self, seq: list[Any]) -> Any:
        return seq[self.rng.randrange(len(seq))] if seq else None

    # ---- one step

    def step(self) -> None:
        r = self.rng.random()
        S = LeaseState
        if r < 0.20:
            pool = self.rng.choice(["cold", "cold", "warm", "warm-prot", "gpu", "spread", "nope"])
            kind = "warm" if pool.startswith("warm") else "cold"
            fields: dict[str, Any] = {}
            if self.rng.random() < 0.1:
                fields["host"] = f"h{self.rng.randrange(self.HOSTS + 1):02d}"
            if self.rng.random() < 0.1:
                fields["claims"] = [
                    self.rng.choice(
                        [
                            {"name": "g", "class": "any2"},
                            {"name": "x", "class": "zoneb"},
                            {"name": "y", "class": "missing"},
                            {"name": "g", "class": "a100", "parameters": {"gpu": {"count": 2}}},
                            {
                                "name": "g",
                                "class": "a100",
                                "parameters": {"gpu": {"model": "H100"}},
                            },
                        ]
                    )
                ]
            if kind == "cold" and self.rng.random() < 0.15:
                job = f"job-{self.rng.randrange(1, self.n + 2)}"
                fields["job"] = job
            name = (
                f"vm{self.n + 1}"
                if self.rng.random() > 0.05
                else f"vm{self.rng.randrange(1, self.n + 2)}"
            )
            self.send(b.admit(self.rid("a"), pool, name, kind=kind, **fields))
        elif r < 0.30:
            pool = self.rng.choice(["cold", "cold", "gpu", "spread"])
            fields = {}
            if self.rng.random() < 0.15:
                fields["host"] = f"h{self.rng.randrange(self.HOSTS):02d}"
            self.send(b.admit(self.rid("p"), pool, f"vm{self.n + 1}", preemptible=True, **fields))
        elif r < 0.42:
            booting = self.leases(S.RESERVED, S.CREATED)
            warm = [le for le in booting if le.kind.value == "warm"]
            lease = self.pick(warm if warm and self.rng.random() < 0.7 else booting)
            if lease is not None:
                action = self.rng.choice(["instance-created", "instance-ready", "instance-ready"])
                self.send(b.lifecycle(lease.host, action, lease.instance, project=lease.project))
        elif r < 0.48:
            self.jobs.append(f"wjob-{self.n}")
            job = self.pick(self.jobs) if self.rng.random() < 0.2 else self.jobs[-1]
            self.send(
                b.cmd(
                    "claim-warm",
                    self.rid("k"),
                    pool=self.rng.choice(["warm", "warm-prot", "nope"]),
                    job=job,
                )
            )
        elif r < 0.52:
            lease = self.pick(self.leases(S.CLAIMED, S.INJECTED, S.READY))
            if lease is not None:
                job = lease.job if lease.job is not None and self.rng.random() < 0.8 else "other"
                self.send(
                    b.cmd("mark-warm-injected", self.rid("j"), instance=lease.instance, job=job)
                )
        elif r < 0.58:
            lease = self.pick(self.leases(S.RESERVED, S.CREATED, S.READY))
            inst = lease.instance if lease is not None else "ghost"
            self.send(b.cmd("mark-created", self.rid("m"), instance=inst))
        elif r < 0.66:
            lease = self.pick(
                self.leases(S.RESERVED, S.CREATED, S.READY, S.CLAIMED, S.INJECTED, S.DELETING)
            )
            inst = lease.instance if lease is not None else "ghost"
            verb = self.rng.choice(["release", "release", "mark-deleting"])
            self.send(b.cmd(verb, self.rid("r"), instance=inst))
        elif r < 0.69:
            lease = self.pick(self.leases(S.READY, S.CREATED, S.CLAIMED))
            inst = lease.instance if lease is not None else "ghost"
            self.send(b.cmd("authorize-warm-drain", self.rid("x"), instance=inst))
        elif r < 0.75:
            # the executor deletes what it was told to (victims, drains) or anything
            victims = self.leases(S.VICTIM)
            lease = self.pick(victims or self.leases(S.DRAINING, S.DELETING))
            if lease is not None:
                self.send(
                    b.lifecycle(
                        lease.host, "instance-deleted", lease.instance, project=lease.project
                    )
                )
                if self.rng.random() < 0.5:  # the bridge's next snapshot of that host
                    self.send(self.host_snapshot(int(lease.host[1:])))
        elif r < 0.83:
            i = self.rng.randrange(self.HOSTS)
            self.send(self.host_snapshot(i, stale=self.rng.random() < 0.1))
        elif r < 0.88:
            self.inventory()
        elif r < 0.91:
            lease = self.pick([le for le in self.leases(*S) if le.suspect_revision is not None])
            if lease is not None:
                rev = self.inv_revision.get(lease.host, 1)
                self.send(
                    b.observation(
                        lease.host,
                        lease.instance,
                        present=self.rng.random() < 0.4,
                        checked_revision=rev,
                    )
                )
            else:
                self.send(b.observation("h01", "ghost", present=False))
        elif r < 0.93:
            lease = self.pick(self.leases(S.CLAIMED, S.CREATED, S.RESERVED))
            inst = lease.instance if lease is not None else "ghost"
            self.send(b.cmd("render-runtime", self.rid("rr"), instance=inst))
        elif r < 0.95:
            # a duplicate request id, re-sent with any content
            rid = self.pick(self.request_ids)
            if rid is not None:
                self.rec.send(b.admit(rid, "cold", f"dup{self.n}"))
        elif r < 0.96:
            self.send(
                b.pool(
                    "cold",
                    cpu=self.rng.choice([1, 2, 3]),
                    memory_mib=4096,
                    disk_gib=20,
                    max_instances=self.rng.choice([40, 400]),
                )
            )
        elif r < 0.97:
            self.send(b.gpu_profile("std", revision=self.n, ecc=self.rng.random() < 0.5))
        elif r < 0.985:
            self.send(b.lifecycle("h01", "instance-stopped", "ghost"))
        else:
            self.send(self.rng.choice(self.malformed()))

    def malformed(self) -> list[Item]:
        """Inputs the decoder dead-letters (``DomainError``), one of each check."""
        return [
            b.snapshot("h00", revision=99, gpus=[b.gpu(0), b.gpu(0)]),
            b.snapshot(
                "h00",
                revision=99,
                gpus=[b.gpu(0), {**b.gpu(1), "pci_address": b.gpu(0)["pci_address"]}],
            ),
            b.inventory("h01", [b.instance("twice"), b.instance("twice")], revision=99),
            b.admit(self.rid("e"), "cold", "e", claims=[{"name": "g", "class": "a100"}] * 2),
            b.admit(self.rid("e"), "warm", "e", kind="warm", preemptible=True),
            ("cmd.nonsense", {"v": 1, "request_id": "n"}),
        ]

    def inventory(self) -> None:
        i = self.rng.randrange(self.HOSTS)
        host = f"h{i:02d}"
        self.inv_revision[host] = self.inv_revision.get(host, 0) + 1
        instances = []
        for lease in sorted(self.state.leases.values(), key=lambda le: le.lease_id):
            if lease.host == host and lease.active and self.rng.random() < 0.85:
                instances.append(b.instance(lease.instance, project=lease.project))
        roll = self.rng.random()
        if roll < 0.3:
            instances.append(b.instance(f"foreign{self.n}", cpu=1, memory_mib=1024, disk_gib=5))
        elif roll < 0.5:
            config = {TAG_LEASE_ID: f"LX{self.n}", TAG_POOL: "warm", TAG_KIND: "warm"}
            if self.rng.random() < 0.3:
                config[TAG_JOB] = f"ajob-{self.n}"
            instances.append(b.instance(f"adopt{self.n}", config=config, status_code=103))
        elif roll < 0.6:
            released = self.pick([le for le in self.leases(LeaseState.RELEASED) if le.host == host])
            if released is not None:
                config = {
                    TAG_LEASE_ID: released.lease_id,
                    TAG_POOL: released.pool,
                    TAG_KIND: released.kind.value,
                }
                instances.append(
                    b.instance(released.instance, config=config, project=released.project)
                )
        if self.rng.random() < 0.05:
            self.inv_revision[host] -= 1  # stale
        rev = max(self.inv_revision[host], 0)
        self.send(b.inventory(host, instances, revision=rev))


def rich_stream(steps: int, seed: int) -> tuple[str, str]:
    rich = Rich(seed)
    rich.setup()
    for _ in range(steps):
        rich.step()
    return rich.rec.finish()


# ------------------------------------------------------------------------ golden

#: (outputs digest, state digest) per stream, recorded from the fold before any speed-up
GOLDEN: dict[str, tuple[str, str]] = {
    "bench-50": (
        "3dc3db99c26fa6b94a84813b861371288e0e392def0ddb162d6eeef291868edd",
        "c6d05198cf9ea28f77658695f754df3552b09739b36f23570cca830952802f1e",
    ),
    "bench-2000": (
        "558a2d09a2c53d31671105f2659f9e491c2856f46ba9a25498f6718926918e39",
        "dd3997234ea75e64593f87b74bd78a17c4a7571863eb2bcc5c82e2f3ba5a05af",
    ),
    "mixed-8": (
        "34ab140037b429bfc9b7cf25d1653b820c95d2bb8535ccdeb845727b0ed3add1",
        "966fa08e4c313f4fbf1721be74af7602664989980e31e8aae7f071f81004cca1",
    ),
    "rich-a": (
        "6fd8fcfe0f83ff0e5cc5e3054d5eeaabe001afeb4c8148ac699eab5d33804656",
        "66a70061d74d98b543fa050ae1dffde86be113d7e4600f04a9546b62f868a7f3",
    ),
    "rich-b": (
        "8b99f344e699e87b1cfaab3833fd9f4ac029c897ba86dcb479e83d8c9844f5df",
        "d35aa6d579f03217d5e958196b55fcd32959d60e3c1d2a453557b44bfd3cec73",
    ),
}


@pytest.mark.parametrize(
    ("name", "run"),
    [
        ("bench-50", lambda: bench_stream(10000, 50, 7)),
        ("bench-2000", lambda: bench_stream(12000, 2000, 11)),
        ("mixed-8", lambda: mixed_stream(3000, 8, 3)),
        ("rich-a", lambda: rich_stream(6000, 1)),
        ("rich-b", lambda: rich_stream(6000, 2)),
    ],
)
def test_the_fold_gives_the_recorded_bytes(name: str, run: Any) -> None:
    outputs, state = run()
    assert (outputs, state) == GOLDEN[name], f"{name}: {(outputs, state)!r}"
