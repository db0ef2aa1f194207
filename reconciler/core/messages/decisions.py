"""Decisions (docs/interface.md, "Commands and their decisions"): built and read.

``out.decision.<request_id>``, ``Nats-Msg-Id`` ``decision:<request_id>:<phase>``::

    {v, request_id, verb, phase, outcome, reason?, detail?, lease?, victims?, items?,
     input_seq, decided_at}

Rules:

- The bytes are sorted-key JSON, written once by the fold and republished unchanged for
  as long as the request id is remembered; a replay must reproduce them byte for byte.
- :func:`decision_output` is how the fold writes one: a payload built with its keys in
  sorted order at every level (so orjson writes it as it is, without its sort: a third
  of the cost of the dump), from the lease itself (:func:`lease_payload`). It runs for
  most inputs, so it builds no :class:`Decision` on the way.
- :class:`Decision` is the typed message, for everyone who reads one (the caches' logs,
  the warm-pool reconciler, GARM's provider, the command line): :meth:`Decision.parse`
  reads the bytes, :meth:`Decision.encode` writes exactly the bytes the fold wrote for
  it (a test keeps the two ways the same). Unknown fields are ignored, as the contract
  says a reader must.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import orjson

from reconciler.core.messages.envelope import Output
from reconciler.core.messages.fields import (
    MessageError,
    field_int,
    field_ints,
    field_object,
    field_objects,
    field_str,
    field_strs,
    json_object,
    optional_str,
)
from reconciler.core.messages.ids import decision_id
from reconciler.core.messages.subjects import UNPREFIXED
from reconciler.core.model import Lease, Resources

__all__ = [
    "ITEM_CHANGES",
    "PHASES",
    "DecidedLease",
    "Decision",
    "ItemChange",
    "ItemResult",
    "Phase",
    "Victim",
    "decision_output",
    "lease_payload",
    "victim_payload",
]

Phase = Literal["pending", "final"]
PHASES: Final[tuple[Phase, ...]] = get_args(Phase)


def lease_payload(lease: Lease) -> dict[str, object]:
    """A decision's ``lease``: ``lease.as_dict()`` with its keys, and its demand's, in
    sorted order, ready for orjson to write without sorting (a test keeps the two the
    same). Its kind and state are the enum members themselves: orjson writes a str
    subclass (a ``StrEnum`` member) as its string, and they compare equal to it."""
    out: dict[str, object] = {"adopted": True} if lease.adopted else {}
    if lease.gate_seq is not None:
        out["awaiting_victims"] = list(lease.awaiting_victims)
    d = lease.demand
    out["demand"] = {"cpu": d.cpu, "disk_gib": d.disk_gib, "memory_mib": d.memory_mib}
    if lease.fault is not None:
        out["fault"] = lease.fault
    out["gpus"] = list(lease.gpus)
    out["host"] = lease.host
    out["host_uid"] = lease.host_uid
    out["instance"] = lease.instance
    if lease.job is not None:
        out["job"] = lease.job
    out["kind"] = lease.kind
    out["lease_id"] = lease.lease_id
    out["pool"] = lease.pool
    out["state"] = lease.state
    if lease.suspect_revision is not None:
        out["suspect"] = True
    return out


def victim_payload(lease: Lease) -> dict[str, object]:
    """One of a pending decision's ``victims``: ``{host, instance, lease_id}``."""
    return {"host": lease.host, "instance": lease.instance, "lease_id": lease.lease_id}


def decision_output(
    request_id: str,
    verb: str,
    outcome: str,
    phase: str,
    input_seq: int,
    decided_at: str,
    reason: str | None,
    detail: str | None,
    lease: dict[str, object] | None,
    victims: list[dict[str, object]] | None,
    items: list[dict[str, object]] | None = None,
    position: int | None = None,
) -> Output:
    """One decision as the fold publishes it: ``lease`` and ``victims`` as built by
    :func:`lease_payload` and :func:`victim_payload`, ``items`` (a config change's) by
    :meth:`ItemResult.as_dict` (keys sorted). Positional, for the fold's sake (it calls
    this for most inputs)."""
    payload: dict[str, Any] = {"decided_at": decided_at}
    if detail is not None:
        payload["detail"] = detail
    payload["input_seq"] = input_seq
    if items is not None:
        payload["items"] = items
    if lease is not None:
        payload["lease"] = lease
    payload["outcome"] = outcome
    payload["phase"] = phase
    if position is not None:
        payload["position"] = position
    if reason is not None:
        payload["reason"] = reason
    payload["request_id"] = request_id
    payload["v"] = 1
    payload["verb"] = verb
    if victims is not None:
        payload["victims"] = victims
    # envelope.encode() without its sort (see above); a copy of its own size, as there
    data = bytes(memoryview(orjson.dumps(payload)))
    # the subject and the id spelled out: UNPREFIXED.decision() and decision_id()
    return Output(f"out.decision.{request_id}", f"decision:{request_id}:{phase}", data, outcome)


# ----------------------------------------------------------------------- typed


@dataclass(frozen=True, slots=True, kw_only=True)
class DecidedLease:
    """The lease a decision names, as it was when decided."""

    lease_id: str
    instance: str
    host: str
    host_uid: str
    pool: str
    kind: str
    state: str
    demand: Resources
    gpus: tuple[int, ...] = ()
    job: str | None = None
    adopted: bool = False
    #: missing from an inventory and not verified since
    suspect: bool = False
    #: while it waits at a launch gate: the victims still to go (``None`` otherwise)
    awaiting_victims: tuple[str, ...] | None = None
    #: what could not be done to its VM (an addition: a create refused, a delete failed)
    fault: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The JSON object, keys sorted: what :func:`lease_payload` builds."""
        out: dict[str, object] = {"adopted": True} if self.adopted else {}
        if self.awaiting_victims is not None:
            out["awaiting_victims"] = list(self.awaiting_victims)
        d = self.demand
        out["demand"] = {"cpu": d.cpu, "disk_gib": d.disk_gib, "memory_mib": d.memory_mib}
        if self.fault is not None:
            out["fault"] = self.fault
        out["gpus"] = list(self.gpus)
        out["host"] = self.host
        out["host_uid"] = self.host_uid
        out["instance"] = self.instance
        if self.job is not None:
            out["job"] = self.job
        out["kind"] = self.kind
        out["lease_id"] = self.lease_id
        out["pool"] = self.pool
        out["state"] = self.state
        if self.suspect:
            out["suspect"] = True
        return out

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> DecidedLease:
        demand = field_object(body, "demand")
        awaiting = body.get("awaiting_victims")
        return cls(
            lease_id=field_str(body, "lease_id"),
            instance=field_str(body, "instance"),
            host=field_str(body, "host"),
            host_uid=field_str(body, "host_uid"),
            pool=field_str(body, "pool"),
            kind=field_str(body, "kind"),
            state=field_str(body, "state"),
            demand=Resources(
                field_int(demand, "cpu"),
                field_int(demand, "memory_mib"),
                field_int(demand, "disk_gib"),
            ),
            gpus=tuple(field_ints(body, "gpus")),
            job=optional_str(body, "job"),
            adopted=body.get("adopted") is True,
            suspect=body.get("suspect") is True,
            awaiting_victims=None
            if awaiting is None
            else tuple(field_strs(body, "awaiting_victims")),
            fault=optional_str(body, "fault"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Victim:
    """A warm lease a pending preemption waits for."""

    lease_id: str
    instance: str
    host: str

    def as_dict(self) -> dict[str, object]:
        return {"host": self.host, "instance": self.instance, "lease_id": self.lease_id}

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Victim:
        return cls(
            lease_id=field_str(body, "lease_id"),
            instance=field_str(body, "instance"),
            host=field_str(body, "host"),
        )


#: what became of one item of an ``apply-config`` change
ItemChange = Literal["created", "updated", "deleted", "unchanged"]
ITEM_CHANGES: Final[tuple[ItemChange, ...]] = get_args(ItemChange)


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemResult:
    """One item of an ``apply-config`` decision: the config it names (``kind`` as in its
    subject, ``pool``, ``class``…), and what became of it, or why it was refused."""

    kind: str
    name: str
    change: ItemChange | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.change is not None:
            out["change"] = self.change
        if self.error is not None:
            out["error"] = self.error
        out["kind"] = self.kind
        out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ItemResult:
        change = optional_str(body, "change")
        if change is not None and change not in ITEM_CHANGES:
            raise MessageError(f"unknown item change {change!r}")
        return cls(
            kind=field_str(body, "kind"),
            name=field_str(body, "name"),
            change=change,  # one of ITEM_CHANGES, checked above
            error=optional_str(body, "error"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One decision, typed; see the module's rules."""

    request_id: str
    verb: str
    phase: Phase
    outcome: str
    input_seq: int
    decided_at: str
    reason: str | None = None
    detail: str | None = None
    lease: DecidedLease | None = None
    #: a pending preemption's victims (``None``: the decision names none)
    victims: tuple[Victim, ...] | None = None
    #: an ``apply-config`` change's items (an addition; ``None`` for other verbs)
    items: tuple[ItemResult, ...] | None = None
    #: a queued request's place in its pool's queue, 1-based (an addition; ``None``
    #: unless ``outcome`` is ``queued``)
    position: int | None = None

    @property
    def final(self) -> bool:
        return self.phase == "final"

    @property
    def subject(self) -> str:
        """Its subject, without the prefix."""
        return UNPREFIXED.decision(self.request_id)

    @property
    def msg_id(self) -> str:
        return decision_id(self.request_id, self.phase)

    def output(self) -> Output:
        """The output that publishes it: the bytes the fold writes for it."""
        return decision_output(
            self.request_id,
            self.verb,
            self.outcome,
            self.phase,
            self.input_seq,
            self.decided_at,
            self.reason,
            self.detail,
            None if self.lease is None else self.lease.as_dict(),
            None if self.victims is None else [v.as_dict() for v in self.victims],
            None if self.items is None else [i.as_dict() for i in self.items],
            self.position,
        )

    def encode(self) -> bytes:
        return self.output().payload

    def as_dict(self) -> dict[str, Any]:
        """The JSON object it travels as (what :meth:`parse` of its bytes read)."""
        parsed: dict[str, Any] = orjson.loads(self.encode())
        return parsed

    @classmethod
    def parse(cls, data: bytes) -> Decision:
        """A decision's payload, read; :class:`MessageError` when it is not one."""
        return cls.from_dict(json_object(data, "a decision"))

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Decision:
        phase = field_str(body, "phase")
        if phase not in PHASES:
            raise MessageError(f"unknown decision phase {phase!r}")
        lease = body.get("lease")
        victims = body.get("victims")
        items = body.get("items")
        return cls(
            request_id=field_str(body, "request_id"),
            verb=field_str(body, "verb"),
            phase=phase,  # one of PHASES, checked above
            outcome=field_str(body, "outcome"),
            input_seq=field_int(body, "input_seq"),
            decided_at=field_str(body, "decided_at"),
            reason=optional_str(body, "reason"),
            detail=optional_str(body, "detail"),
            lease=None if lease is None else DecidedLease.from_dict(field_object(body, "lease")),
            victims=None
            if victims is None
            else tuple(Victim.from_dict(v) for v in field_objects(body, "victims")),
            items=None
            if items is None
            else tuple(ItemResult.from_dict(i) for i in field_objects(body, "items")),
            position=None if body.get("position") is None else field_int(body, "position"),
        )
