"""The provider's side of the bus: commands with their final decisions, and queries,
through the producer's client (:mod:`reconciler.client`).

Rules:

- A command is published to ``<prefix>.in.cmd.<verb>`` with ``Nats-Msg-Id`` =
  ``garm:<request_id>``, after subscribing to its decision subject and after reading the
  decision already stored in the OUT stream: a retried call finds what an earlier,
  killed one was answered, and a re-sent command is deduplicated.
- A ``pending`` decision (a preemption waiting for its victims, or ``queued``: the
  request waits in its pool's queue) is waited through and logged, one line (a queued
  one with its position and reason); the whole wait is bounded by ``decision_timeout``
  plus the command's ``wait_s``. A missing final decision is an error, never a guess.
- Queries retry for a short while when no replica answers or caches are not synced yet.
- Payloads hold identities, never a secret of the bootstrap.
"""

from __future__ import annotations

from typing import Any

import structlog
from nats.aio.client import Client

from reconciler.client import NoDecision, NoReplica, QueryFailed, ReconcilerClient
from reconciler.core.messages import DEFAULT_PREFIX, Decision, Origin
from reconciler.garm.protocol import ProviderError

__all__ = ["Admission"]

logger = structlog.get_logger(__name__)


class Admission:
    """Commands and queries of one provider call, over one NATS connection; decisions
    as the JSON objects they travel as."""

    def __init__(
        self,
        nc: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        decision_timeout_s: float = 600.0,
        query_timeout_s: float = 10.0,
    ) -> None:
        self.client = ReconcilerClient(
            nc, prefix=prefix, origin=Origin.GARM, publish_timeout_s=query_timeout_s
        )
        self.decision_timeout_s = decision_timeout_s
        self.query_timeout_s = query_timeout_s

    async def last_decision(self, request_id: str) -> dict[str, Any] | None:
        """The latest decision stored for ``request_id``, or ``None``."""
        decision = await self.client.last_decision(request_id)
        return None if decision is None else decision.as_dict()

    async def command(
        self, verb: str, body: dict[str, Any], *, request_id: str, final: bool = True
    ) -> dict[str, Any]:
        """Send a command (idempotently) and return its final decision (with ``final``
        false: its first decision, pending or final)."""
        within_s = self.decision_timeout_s + int(body.get("wait_s") or 0)
        try:
            decision = await self.client.command(
                verb,
                {"v": 1, "request_id": request_id, **body},
                within_s=within_s,
                first=not final,
                on_decision=_log_pending,
            )
        except NoDecision:
            raise ProviderError(
                f"no final decision for {verb} {request_id} within "
                f"{within_s:g} s; is `reconciler run` running?"
            ) from None
        return decision.as_dict()

    async def report_failure(self, **fields: str) -> None:
        """Report a create or start that failed (``host``, ``instance``, ``project``,
        ``lease_id``, ``action``, ``error``): its lease is released with the error as its
        fault. Best effort: the call fails anyway, and the reservation timeout releases
        the lease when the report cannot be sent."""
        try:
            await self.client.report_failure(**fields)
        except Exception as exc:
            logger.warning("garm.failure_unreported", error=repr(exc), **fields)

    async def waiting(self, instance: str) -> list[dict[str, Any]]:
        """The requests waiting in the queue for ``instance``. A replica of a release
        without queues (it does not know the query) has none waiting."""
        try:
            found = await self.client.query("queue", {}, within_s=self.query_timeout_s)
        except QueryFailed as exc:
            if exc.code == "invalid" and (exc.message or "").startswith("unknown query"):
                return []
            raise ProviderError(str(exc)) from None
        except NoReplica as exc:
            raise ProviderError(str(exc)) from None
        return [r for r in (found or {}).get("requests", ()) if r.get("instance") == instance]

    async def query(self, name: str, body: dict[str, Any]) -> Any:
        """A query's ``result``; a ``not-found`` error returns ``None``."""
        try:
            return await self.client.query(name, body, within_s=self.query_timeout_s)
        except (QueryFailed, NoReplica) as exc:
            raise ProviderError(str(exc)) from None


def _log_pending(decision: Decision) -> None:
    if decision.final:
        return
    if decision.outcome == "queued":
        logger.info(
            "garm.queued",
            request_id=decision.request_id,
            position=decision.position,
            reason=decision.reason,
        )
    else:
        logger.info(
            "garm.decision_pending",
            request_id=decision.request_id,
            victims=[v.instance for v in decision.victims or ()],
        )
