"""One message being folded: its sequence, its time, its effects, and the moves every
part of the fold makes with them.

:class:`Step` is a small object so that the fold's parts (:mod:`.hosts`,
:mod:`.config`, :mod:`.commands`, :mod:`.gates`) share the input's sequence and stream
time and the batch's :class:`~reconciler.core.state.Effects`. Its methods are the
primitives they change the state through: a decision (and its republication), a lease
created or moved (journal transition, touched keys, retention filing), an executor
command, a refused config input, a note for the logs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reconciler.core.expiry import SECONDS_SEEN, epoch_second
from reconciler.core.messages import (
    MAX_ERROR_CHARS,
    MAX_OUTPUT_BYTES,
    UNPREFIXED,
    ConfigRejected,
    DeleteReason,
    ItemResult,
    Output,
    clip,
    create_command_id,
    create_payload,
    decision_output,
    delete_command_id,
    delete_payload,
    exec_output,
    lease_payload,
    victim_payload,
)
from reconciler.core.model import (
    DELETING,
    DRAINING,
    READY,
    RELEASED,
    Host,
    HostName,
    InstanceType,
    Lease,
    LeaseId,
    LeaseState,
    Pool,
    RequestId,
    evolve_lease,
)
from reconciler.core.state import DecisionRecord, Effects, State, Transition

__all__ = ["OutputTooLarge", "Step"]


class OutputTooLarge(Exception):
    """An input would make a decision or command larger than
    :data:`~reconciler.core.messages.MAX_OUTPUT_BYTES`, which a NATS server may refuse
    to carry. The step may have changed the state already: the caller drops it (the
    live line reloads its committed state) and dead-letters the input ``too-large``."""


class Step:
    """One message being folded; see the module's docstring."""

    __slots__ = ("at", "fx", "now", "seq", "state", "ts")

    def __init__(self, state: State, seq: int, timestamp: str, fx: Effects) -> None:
        self.state = state
        self.seq = seq
        self.ts = timestamp
        #: the stream time in whole seconds (retention), None for a timestamp without one;
        #: epoch_second()'s cache read first, as most inputs share their second with others
        now = SECONDS_SEEN.get(timestamp[:19])
        self.now = now if now is not None else epoch_second(timestamp)
        #: the journal's time of this step: its stream second, 0 when it has none
        self.at = self.now if self.now is not None else 0
        self.fx = fx

    def note(self, text: str) -> None:
        self.fx.notes.append((self.seq, text))

    def republish(self, request_id: RequestId) -> None:
        """Answer a request id decided already: its latest decision, the same bytes."""
        record = self.state.decisions[request_id]
        self.fx.outputs.append(
            Output(UNPREFIXED.decision(request_id), record.msg_id, record.payload)
        )
        self.note(f"request {request_id} already decided; decision re-sent")

    def decide(
        self,
        request_id: RequestId,
        verb: str,
        outcome: str,
        *,
        phase: str = "final",
        reason: str | None = None,
        detail: str | None = None,
        lease: Lease | None = None,
        victims: Iterable[Lease] | None = None,
        items: Iterable[ItemResult] | None = None,
        position: int | None = None,
    ) -> None:
        if detail is not None and len(detail) > MAX_ERROR_CHARS:
            detail = clip(detail)  # a decision's size stays bounded
        out = decision_output(
            request_id,
            verb,
            outcome,
            phase,
            self.seq,
            self.ts,
            reason,
            detail,
            lease_payload(lease) if lease is not None else None,
            [victim_payload(v) for v in victims] if victims is not None else None,
            [i.as_dict() for i in items] if items is not None else None,
            position,
        )
        if len(out.payload) > MAX_OUTPUT_BYTES:
            raise OutputTooLarge(
                f"its {verb} decision would be {len(out.payload)} bytes, over {MAX_OUTPUT_BYTES}"
            )
        final_at = self.now if phase == "final" else None
        state = self.state
        # positional: the fields' order is request_id, verb, phase, payload, lease_id, final_at
        record = DecisionRecord(
            request_id,
            verb,
            phase,
            out.payload,
            lease.lease_id if lease is not None else None,
            final_at,
        )
        state.decisions[request_id] = record
        if final_at is not None:
            # expiry.add_decision(), its common case inlined: the second's bucket exists
            bucket = state.expiry.decisions.get(final_at)
            if bucket is not None:
                bucket.append(request_id)
            else:
                state.expiry.add_decision(final_at, request_id)
        fx = self.fx
        fx.decisions.add(request_id)
        fx.outputs.append(out)
        fx.verdicts.append((verb, outcome, reason))

    def move(self, lease: Lease, to: LeaseState, event: str, **changes: Any) -> Lease:
        """Change a lease's state (or only its fields, when ``to`` is its state)."""
        new = evolve_lease(lease, state=to, **changes)
        self.state.put_lease(new)
        fx = self.fx
        fx.leases.add(new.lease_id)
        fx.hosts.add(new.host)
        fx.pools.add(new.pool)
        if to is not lease.state:
            fx.transitions.append(
                Transition(self.seq, new.lease_id, event, str(lease.state), str(to), self.at)
            )
            if to is RELEASED:
                self._released(new.lease_id)
        return new

    def _released(self, lease_id: LeaseId) -> None:
        """File a lease just released for eviction after the retention."""
        if self.now is not None:
            self.state.released_at[lease_id] = self.now
            self.state.expiry.add_lease(self.now, lease_id)

    def create(self, lease: Lease, event: str) -> None:
        self.state.put_lease(lease)
        self.fx.leases.add(lease.lease_id)
        self.fx.hosts.add(lease.host)
        self.fx.pools.add(lease.pool)
        self.fx.transitions.append(
            Transition(self.seq, lease.lease_id, event, None, str(lease.state), self.at)
        )
        if lease.state is RELEASED:
            self._released(lease.lease_id)

    def drain(self, lease: Lease, event: str) -> Lease:
        """Drain an idle warm VM: ``draining`` when it is ready (no claim binds it any
        more), ``deleting`` while it still boots, and a delete command with reason
        ``drained``."""
        drained = self.move(lease, DRAINING if lease.state is READY else DELETING, event)
        self.exec_delete(drained, "drained")
        return drained

    def exec_delete(
        self,
        lease: Lease,
        reason: DeleteReason,
        *,
        host: HostName | None = None,
        project: str | None = None,
    ) -> None:
        """Ask the executor to delete the lease's VM (an orphan: where it was seen)."""
        where = host or lease.host
        command_id = delete_command_id(lease.lease_id, reason)
        payload = delete_payload(
            command_id,
            where,
            lease.instance,
            project or lease.project,
            lease.lease_id,
            reason,
        )
        self.fx.outputs.append(exec_output("delete", where, command_id, payload))

    def exec_create(self, lease: Lease, pool: Pool, host: Host) -> None:
        """Ask the executor to create and start a warm lease's VM."""
        by_index = {g.index: g for g in host.gpus}
        command_id = create_command_id(lease.lease_id)
        payload = create_payload(
            command_id,
            lease.host,
            lease.instance,
            lease.project,
            lease.lease_id,
            lease.pool,
            pool.image,
            pool.profiles,
            lease.demand,
            [(i, by_index[i].pci_address) for i in lease.gpus],
            # always the pool's type, its default spelled out: the executor need not know it
            (pool.instance_type or InstanceType.VIRTUAL_MACHINE).value,
        )
        out = exec_output("create", lease.host, command_id, payload)
        if len(out.payload) > MAX_OUTPUT_BYTES:
            raise OutputTooLarge(
                f"its create command would be {len(out.payload)} bytes, over {MAX_OUTPUT_BYTES}"
            )
        self.fx.outputs.append(out)

    def reject_config(self, kind: str, name: str, error: str) -> None:
        rejected = ConfigRejected(kind=kind, name=name, error=error, input_seq=self.seq)
        self.fx.outputs.append(rejected.output())
        self.note(f"config {kind} {name} rejected: {error}")
