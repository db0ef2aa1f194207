"""The leader's warm-pool reconciler: keep ``min_ready`` warm VMs booting or ready per pool.

Rules (docs/architecture.md: the fold stays the only judge):

- The reconciler never changes state and never creates a VM. For a pool short of warm VMs
  (:func:`reconciler.core.status.warm_deficit`: below ``min_ready``, never beyond
  ``max_ready`` unclaimed or ``max_instances`` in all) it publishes ``admit`` commands of
  kind ``warm`` on the IN stream, exactly as any producer would; the fold admits them (or
  not) against capacity and sends the executor its ``create`` commands.
- Ids are deterministic: the request id ``topup-<pool>-<seq>-<i>`` and the instance
  name derive from the pool and the applied sequence the deficit was seen at, and each
  command carries its request id as ``Nats-Msg-Id``. Two leaders looking at the same
  state publish the same commands, which the stream deduplicates.
- A command published and not yet decided counts as on its way, so a pool is not asked
  twice for the same VM while the first request travels. A new leader starts without that
  memory: at worst it asks again, and the fold's ``max_ready`` caps the result.
- A warm lease still reserved or created ``boot_timeout_s`` after its admission (its VM
  could not be created or started: no event will ever say so) is released by a
  ``release`` command ``expire-<lease>``; the pool then asks for another. The admission
  time is :meth:`~reconciler.core.state.State.admitted_at`, as for the reaper of
  abandoned reservations (an admission evicted by the retention is older than that).
- A top-up that was rejected (no capacity, no suitable host) is not retried at once: the
  pool backs off, ``backoff_base_s`` after the first rejection, doubling with each
  rejection in a row up to ``backoff_cap_s``, except that room appearing on a host (less
  booked there, or the host itself changed: capacity, reserve, foreign demand, labels,
  GPUs, schedulable; not an inventory that says what the last one said) or a change to
  the pool's leases looks again within ``recheck_s``; changes meanwhile coalesce into
  that one look. Only a top-up that is admitted ends the backoff (or a pool that needs
  nothing any more): publishing the next one does not, since each rejected top-up is
  an input on the stream and a decision, and a pool that cannot be filled must not ask
  twice a second for as long as the fleet is full.
- A warm VM whose create or start failed (the executor's ``failure`` input: its lease is
  released at once, a bad image or profile) backs the pool off the same way, counted
  with its rejections: a pool whose VMs Incus refuses must not ask again at once, for
  ever.
- Otherwise a pool is looked at ``coalesce_s`` (50 ms) after a commit touched it: the
  commits meanwhile coalesce into that one look, instead of one look per commit (a
  busy pool commits hundreds of times a second, and a VM boots in seconds).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from nats.js import JetStreamContext

from reconciler.bus.sending import publish
from reconciler.core.messages import Decision, Origin, Subjects, command_msg_id
from reconciler.core.model import HostName, PoolName, RequestId
from reconciler.core.state import State
from reconciler.core.status import warm_deficit
from reconciler.replica.pipeline import Commit, Pipeline
from reconciler.work.queue import WorkQueue, run_with_resync

__all__ = ["WarmPoolReconciler", "topup_request_id", "warm_instance_name"]

logger = structlog.get_logger(__name__)

_NOT_NAME = re.compile(r"[^A-Za-z0-9-]+")


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def topup_request_id(pool: str, seq: int, index: int) -> RequestId:
    """``topup-<pool>-<seq>-<index>``, kept within a subject token's 128 characters."""
    request_id = f"topup-{pool}-{seq}-{index}"
    if len(request_id) > 128:
        digest = hashlib.sha256(pool.encode()).hexdigest()[:16]
        request_id = f"topup-{digest}-{seq}-{index}"
    return RequestId(request_id)


def warm_instance_name(pool: str, seq: int, index: int) -> str:
    """An Incus-valid instance name (1-63 of ``[A-Za-z0-9-]``, no leading or trailing
    ``-``, not all digits) for the ``index``-th top-up of ``pool`` seen at ``seq``."""
    suffix = f"w{_base36(seq)}-{index}"
    stem = _NOT_NAME.sub("-", pool).strip("-")[: 62 - len(suffix)].strip("-")
    return f"{stem}-{suffix}" if stem else suffix


class WarmPoolReconciler:
    """Publishes warm ``admit`` commands for pools below ``min_ready``, while leading."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        js: JetStreamContext,
        prefix: str,
        workers: int = 1,
        interval_s: float = 10.0,
        recheck_s: float = 2.0,
        coalesce_s: float = 0.05,
        boot_timeout_s: float = 600.0,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.pipeline = pipeline
        self.recheck_s = recheck_s
        self.coalesce_s = coalesce_s
        self.boot_timeout_s = boot_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self._clock = clock
        self._wall = wall
        self.js = js
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.workers = workers
        self.interval_s = interval_s
        self.queue: WorkQueue[str] = WorkQueue(
            name="warm-pools", clock=clock, backoff_base=0.5, backoff_cap=60.0
        )
        #: request id -> pool, published and not yet decided
        self.in_flight: dict[RequestId, PoolName] = {}
        #: pools whose last top-up was rejected: rejections in a row, and when (``clock``)
        #: the next top-up may go
        self.refused: dict[PoolName, tuple[int, float]] = {}
        #: pools whose last warm VM could not be created: an admitted top-up does not end
        #: their backoff (the create may fail again), a VM of theirs becoming ready does
        self._failing: set[PoolName] = set()
        #: each host's room as last seen (:func:`_room`), to tell room appearing from an
        #: inventory that changes nothing
        self._rooms: dict[HostName, _Room] = {}
        self.published = 0

    def notify(self, commit: Commit) -> None:
        """Commit listener: look again at every pool the batch touched or whose top-up it
        decided, and at every pool backing off a rejection when a host changed (capacity
        may have appeared)."""
        for pool in commit.fx.failed_pools:
            self._back_off(pool, cause="create-failed", request_id=None)
        for pool in commit.fx.pools:
            if pool in self._failing:  # its VMs fail: not before its backoff says so
                due = self.refused.get(pool, (0, 0.0))[1]
                self.queue.add_after(pool, max(due - self._clock(), 0.0))
            elif pool in self.refused:  # refused lately: look again soon, not per commit
                self._recheck(pool)
            else:
                self.queue.add_after(pool, self.coalesce_s)
        for request_id in commit.fx.decisions:
            decided = self.in_flight.get(request_id)
            if decided is not None:  # one of ours was decided: settle it
                self.queue.add_after(decided, self.coalesce_s)
        if commit.fx.hosts and self._room_appeared(commit.fx.hosts) and self.refused:
            for pool in list(self.refused):  # coalesced: a busy fleet changes all the time
                if pool not in self._failing:  # room does not mend an image
                    self._recheck(pool)

    def _room_appeared(self, hosts: set[HostName]) -> bool:
        """Whether any of ``hosts`` may have more room than when last seen (a host seen
        for the first time may); remembers what each has now."""
        state, rooms = self.pipeline.state, self._rooms
        appeared = False
        for name in hosts:
            room = _room(state, name)
            before = rooms.get(name)
            rooms[name] = room
            if before is None or _more_room(before, room):
                appeared = True
        return appeared

    def _recheck(self, pool: PoolName) -> None:
        """Room may have appeared for a refused pool: try again within ``recheck_s``."""
        count, due = self.refused[pool]
        self.refused[pool] = (count, min(due, self._clock() + self.recheck_s))
        self.queue.add_after(pool, self.recheck_s)

    async def run(self) -> None:
        await run_with_resync(
            self.queue,
            self.reconcile,
            keys=lambda: sorted(self.pipeline.state.pools),
            every_s=self.interval_s,
            workers=self.workers,
        )

    async def reconcile(self, pool_name: str) -> None:
        """One look at one pool: publish the admits its deficit calls for."""
        state = self.pipeline.state
        pool = PoolName(pool_name)
        self._settle(pool)
        await self._expire_stuck(pool)
        deficit = warm_deficit(state, pool)
        config = state.pools.get(pool)
        if pool in self._failing and (
            state.pool_ready.get(pool) or config is None or config.warm.min_ready == 0
        ):  # its VMs boot again (the image is good), or it wants none any more
            self._failing.discard(pool)
            self.refused.pop(pool, None)
        if deficit <= 0:  # nothing to ask for (filled otherwise, lowered, deleted)
            if pool not in self._failing:  # one booting may fail like the others
                self.refused.pop(pool, None)
            return
        if pool in self.refused:
            wait = self.refused[pool][1] - self._clock()
            if wait > 0:  # not before the backoff (or a change) says so
                self.queue.add_after(pool, wait)
                return
        wanted = deficit - sum(1 for p in self.in_flight.values() if p == pool)
        if wanted <= 0:
            return
        seq = state.applied_seq
        for index in range(wanted):
            request_id = topup_request_id(pool, seq, index)
            payload = {
                "v": 1,
                "request_id": request_id,
                "pool": pool,
                "instance": warm_instance_name(pool, seq, index),
                "kind": "warm",
            }
            await publish(
                self.js,
                self.subjects.command("admit"),
                orjson.dumps(payload),
                msg_id=command_msg_id(Origin.LEADER, request_id),
            )
            self.in_flight[request_id] = pool
            self.published += 1
        logger.info("warm_pool.top_up", pool=pool, requested=wanted, at_seq=seq)

    async def _expire_stuck(self, pool: PoolName) -> None:
        """Release the pool's warm leases that never became ready within the boot timeout.

        A create the executor could not carry out (a bad image, a refused start) sends no
        event back: without this, its lease would book capacity and count as booting
        forever, and the pool would never refill. A VM that does turn up later carries a
        released lease's tag, so the next inventory has the executor delete it.
        """
        state = self.pipeline.state
        now = self._wall()
        for lease in state.booting_in_pool(pool):
            if lease.request_id is None:
                continue
            admitted_at = state.admitted_at(lease)  # None: older than the decision retention
            if admitted_at is not None and now - admitted_at < self.boot_timeout_s:
                continue
            request_id = RequestId(f"expire-{lease.lease_id}")
            if request_id in self.in_flight or request_id in state.decisions:
                continue
            payload = {"v": 1, "request_id": request_id, "instance": lease.instance}
            await publish(
                self.js,
                self.subjects.command("release"),
                orjson.dumps(payload),
                msg_id=command_msg_id(Origin.LEADER, request_id),
            )
            self.in_flight[request_id] = pool
            logger.warning(
                "warm_pool.boot_timed_out",
                pool=pool,
                lease_id=lease.lease_id,
                instance=lease.instance,
                host=lease.host,
                state=lease.state.value,
                waited_s=round(now - admitted_at) if admitted_at is not None else None,
            )

    def _settle(self, pool: PoolName) -> None:
        """Forget this pool's decided top-ups: an admitted one ends the pool's backoff, a
        rejected one starts it or doubles it (an expiry's release is neither)."""
        decisions = self.pipeline.state.decisions
        admitted = False
        rejected: Decision | None = None
        for request_id in [r for r, p in self.in_flight.items() if p == pool]:
            record = decisions.get(request_id)
            if record is None:
                continue
            del self.in_flight[request_id]
            if record.verb != "admit":
                continue
            decision = record.decision
            if decision.outcome == "rejected":
                rejected = decision
            else:
                admitted = True
        if rejected is None:
            if admitted and pool not in self._failing:
                self.refused.pop(pool, None)
            return
        # one more in a row per round, however many of its admits were rejected; a
        # round that got some of its VMs starts the count again
        if admitted:
            self.refused.pop(pool, None)
        self._back_off(pool, cause=rejected.reason, request_id=rejected.request_id)

    def _back_off(self, pool: PoolName, *, cause: str | None, request_id: str | None) -> None:
        """One more top-up of ``pool`` that did not give a VM: wait longer before the next
        (``backoff_base_s`` doubling up to ``backoff_cap_s``)."""
        count = self.refused.get(pool, (0, 0.0))[0] + 1
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (count - 1))
        self.refused[pool] = (count, self._clock() + delay)
        if cause == "create-failed":
            self._failing.add(pool)
        logger.warning(
            "warm_pool.top_up_rejected" if cause != "create-failed" else "warm_pool.create_failed",
            pool=pool,
            request_id=request_id,
            reason=cause,
            in_a_row=count,
            retry_in_s=delay,
        )


#: a host's room: what placement reads of the host itself, then what is booked there
#: (cpu, memory, disk) and how many of its GPUs are held
_Room = tuple[tuple[Any, ...], tuple[int, ...], int]


def _room(state: State, name: HostName) -> _Room:
    host = state.hosts.get(name)
    entity: tuple[Any, ...] = (
        ()
        if host is None
        else (
            host.uid,
            host.schedulable,
            host.labels,
            host.capacity,
            host.reserve,
            host.gpus,
            host.gpu_profile,
            host.foreign_demand,
            host.foreign_gpus,
        )
    )
    booked = state.booked.get(name)
    held = state.gpus_held.get(name)
    return entity, tuple(booked) if booked else (0, 0, 0), len(held) if held else 0


def _more_room(before: _Room, now: _Room) -> bool:
    """The host changed, or less is booked on it in some respect."""
    return (
        before[0] != now[0]
        or any(n < b for n, b in zip(now[1], before[1], strict=True))
        or now[2] < before[2]
    )
