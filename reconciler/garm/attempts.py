"""Attempts of one runner name: deterministic identities, and which attempt is current.

GARM retries a failed create with the same runner name (after deleting what the failed
one left), and may kill a call midway. Each try is an *attempt* ``n`` (1, 2, …) whose
request ids and job identity derive from the name and ``n`` only, so that:

- a call killed midway and run again finds the same attempt and resumes it: the same
  request ids get the same decisions, nothing is admitted twice; an admission that
  still waits in the queue (its latest decision ``queued``) is waited for again, in
  the place it has;
- a retry after a released (or rejected) attempt starts attempt ``n + 1`` with fresh ids.

The job identity of attempt 1 is the runner name; later attempts use ``<name>~<n>``,
because the reconciler binds a job to its lease for good (a released lease keeps its
job), so a retried runner needs a new job identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from reconciler.garm.protocol import ProviderError

__all__ = ["Attempt", "find_attempt", "job_of", "request_id", "runner_of_job"]

#: more than GARM's 5 retries, with room for deletes and restarts in between
MAX_ATTEMPTS = 64
#: steps of an attempt; the order in which they happen
STEPS = ("claim", "admit", "created", "injected")


def request_id(name: str, attempt: int, step: str) -> str:
    """``garm-<step>-<attempt>-<name>``: a subject token (names are Incus names)."""
    return f"garm-{step}-{attempt}-{name}"


def job_of(name: str, attempt: int) -> str:
    return name if attempt == 1 else f"{name}~{attempt}"


def runner_of_job(job: str) -> str:
    """The runner name a job identity was made from."""
    return job.split("~", 1)[0]


class Decisions(Protocol):
    async def last_decision(self, request_id: str) -> dict[str, Any] | None: ...

    async def query(self, name: str, body: dict[str, Any]) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """The attempt to run: its number and what is already decided in it."""

    name: str
    number: int
    claim: dict[str, Any] | None = None
    admit: dict[str, Any] | None = None

    @property
    def job(self) -> str:
        return job_of(self.name, self.number)

    def rid(self, step: str) -> str:
        return request_id(self.name, self.number, step)


async def _alive(bus: Decisions, decision: dict[str, Any]) -> bool:
    """Whether the lease a decision names is still active and not being deleted."""
    lease_id = (decision.get("lease") or {}).get("lease_id")
    if lease_id is None:
        return False
    found = await bus.query("lease", {"identifier": lease_id})
    return found is not None and found.get("state") not in ("released", "deleting")


async def find_attempt(bus: Decisions, name: str) -> Attempt:
    """The attempt a create of ``name`` continues, or the first fresh one."""
    for number in range(1, MAX_ATTEMPTS + 1):
        claim = await bus.last_decision(request_id(name, number, "claim"))
        admit = await bus.last_decision(request_id(name, number, "admit"))
        here = Attempt(name=name, number=number, claim=claim, admit=admit)
        if claim is None and admit is None:
            return here  # fresh, or its first command is still on its way: resend it
        if claim is not None and claim.get("outcome") == "claimed":
            if await _alive(bus, claim):
                return here
            continue
        if admit is None:
            return here  # no warm VM was found: admission comes next
        if admit.get("outcome") == "queued":
            return here  # it still waits in the queue: wait on, in its place
        if admit.get("outcome") in ("admitted", "pending") and await _alive(bus, admit):
            return here
    raise ProviderError(f"runner {name!r} has used all {MAX_ATTEMPTS} attempts")
