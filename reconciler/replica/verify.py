"""The leader's live verification of suspect leases (docs/interface.md: ``…observation``).

A lease missing from an inventory is only *suspect* (the fold never releases on an
inventory alone). This reconciler asks the lease's Incus host directly, with a bounded
live GET, and publishes what it saw as an observation input; the fold then releases the
lease only on a confirmed absence at a revision at least that of the inventory.

Rules:

- Keys are lease ids. A committed batch that touched a suspect lease queues it; every
  ``interval_s`` every suspect lease is queued again (a lost answer is asked again).
- ``checked_revision`` is the host's inventory revision *before* the GET: what the GET
  saw is at least that fresh.
- Only a definite answer is published: present (with its status) or absent (Incus said
  "not found"). A timeout (``live_get_timeout_s``) or an unreachable host publishes
  nothing and retries with a per-lease backoff, so a partition can never release a lease.
- A host without an Incus endpoint is logged once and skipped: its suspects stay suspect.
- The observation's ``Nats-Msg-Id`` is ``observation:<lease>:<revision>:<present>``: two
  leaders verifying the same suspicion publish it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
import orjson
import structlog
from nats.js import JetStreamContext

from reconciler.bus.sending import publish
from reconciler.core.messages import Subjects, observation_msg_id
from reconciler.core.model import LeaseId
from reconciler.replica.pipeline import Commit, Pipeline
from reconciler.work.queue import TemporaryError, WorkQueue, run_with_resync

if TYPE_CHECKING:  # the client (pylxd) is loaded only by a replica that has Incus hosts
    from reconciler.incus.client import IncusHost

__all__ = ["IncusPresence", "InstanceProbe", "Presence", "SuspectVerifier"]

logger = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Presence:
    """What a live GET saw: the instance exists (with its status), or Incus says not found."""

    present: bool
    status: str | None = None


class InstanceProbe(Protocol):
    """One Incus host's live GET (implemented over pylxd in :mod:`reconciler.incus`)."""

    async def presence(self, *, name: str, project: str, timeout_s: float) -> Presence:
        """Raise on anything but a definite answer (timeout, unreachable, server error)."""
        ...


class IncusPresence:
    """The live GET of one Incus host, through pylxd: ``None`` from Incus is absence."""

    def __init__(self, incus: IncusHost) -> None:
        self.incus = incus

    async def presence(self, *, name: str, project: str, timeout_s: float) -> Presence:
        view = await self.incus.get_instance(name, project=project, timeout_s=timeout_s)
        return Presence(present=False) if view is None else Presence(True, view.status)


class SuspectVerifier:
    """Verifies suspect leases on their hosts, while leading."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        js: JetStreamContext,
        prefix: str,
        probes: Mapping[str, InstanceProbe],
        live_get_timeout_s: float = 5.0,
        workers: int = 2,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.js = js
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.probes = probes
        self.live_get_timeout_s = live_get_timeout_s
        self.workers = workers
        self.interval_s = interval_s
        self.queue: WorkQueue[LeaseId] = WorkQueue(
            name="verify", clock=clock, backoff_base=0.5, backoff_cap=30.0
        )
        self.published = 0
        self._unreachable: set[str] = set()
        #: the suspect leases, kept up to date by :meth:`notify` after one scan when the
        #: term starts, so that a resync round does not walk every lease (100,000 of
        #: them: ~20 ms of the event loop) to find a handful
        self._suspect: set[LeaseId] | None = None

    def notify(self, commit: Commit) -> None:
        """Commit listener: queue every suspect lease the batch touched."""
        leases = self.pipeline.state.leases
        known = self._suspect
        for lease_id in commit.fx.leases:
            lease = leases.get(lease_id)
            if lease is not None and lease.active and lease.suspect_revision is not None:
                self.queue.add(lease_id)
                if known is not None:
                    known.add(lease_id)
            elif known is not None:
                known.discard(lease_id)

    async def run(self) -> None:
        await run_with_resync(
            self.queue,
            self.verify,
            keys=self._suspects,
            every_s=self.interval_s,
            workers=self.workers,
        )

    def _suspects(self) -> list[LeaseId]:
        leases = self.pipeline.state.leases
        if self._suspect is None:  # once per term, then kept by notify
            self._suspect = {
                le.lease_id
                for le in leases.values()
                if le.active and le.suspect_revision is not None
            }
        still = []
        for lease_id in sorted(self._suspect):
            lease = leases.get(lease_id)
            if lease is not None and lease.active and lease.suspect_revision is not None:
                still.append(lease_id)
            else:
                self._suspect.discard(lease_id)
        return still

    async def verify(self, lease_id: LeaseId) -> None:
        """One live GET for one suspect lease, published as an observation."""
        state = self.pipeline.state
        lease = state.leases.get(lease_id)
        if lease is None or not lease.active or lease.suspect_revision is None:
            return
        host = state.hosts.get(lease.host)
        probe = self.probes.get(lease.host)
        if host is None or probe is None:
            if lease.host not in self._unreachable:
                self._unreachable.add(lease.host)
                logger.warning("verify.no_endpoint", host=lease.host, lease_id=lease_id)
            return
        checked = host.inventory_revision
        try:
            with anyio.fail_after(self.live_get_timeout_s):
                seen = await probe.presence(
                    name=lease.instance, project=lease.project, timeout_s=self.live_get_timeout_s
                )
        except TimeoutError as exc:
            raise TemporaryError(f"live GET of {lease.instance} on {lease.host} timed out") from exc
        except Exception as exc:
            raise TemporaryError(f"live GET of {lease.instance} on {lease.host}: {exc}") from exc
        payload: dict[str, object] = {
            "v": 1,
            "host": lease.host,
            "instance": lease.instance,
            "present": seen.present,
            "checked_revision": checked,
        }
        if seen.status is not None:
            payload["status"] = seen.status
        await publish(
            self.js,
            self.subjects.host_input(lease.host, "observation"),
            orjson.dumps(payload),
            msg_id=observation_msg_id(lease_id, checked, seen.present),
        )
        self.published += 1
        logger.info(
            "verify.observed",
            lease_id=lease_id,
            instance=lease.instance,
            host=lease.host,
            present=seen.present,
            status=seen.status,
            checked_revision=checked,
        )
