"""The fold: every input, in stream order, applied to the state, returning its effects.

This is where every safety rule lives (docs/architecture.md, rule 1). It is deterministic:
time is the input message's timestamp, ids derive from the input sequence and the
request ids, and every choice ends in a total order on names. A message at or below
``state.applied_seq`` is skipped, so a redelivered batch changes nothing.

:func:`fold` dispatches each input by its type to the part of the fold that knows it:

- :mod:`.hosts`: snapshots, inventories, lifecycle events, observations, failures, and
  the operators' host commands (cordon, uncordon, drain);
- :mod:`.config`: pools, resource classes, GPU profiles and policies, one at a time or
  as one ``apply-config`` change;
- :mod:`.commands`: admit, claim-warm, drains, the mark-* commands, release, render-runtime;
- :mod:`.admission`: what an admission checks and books, at once or after waiting;
- :mod:`.queue`: requests that wait for room (the admission queue): queued, tried
  again after every input that may free room, timed out on message time, cancelled;
- :mod:`.gates`: the launch gate of a preemptible admission, which host inputs and
  releases open;
- :mod:`.step`: the message being folded and the moves the parts make through it.

Before that, the decision retention evicts what has expired at the input's stream time
(:mod:`reconciler.core.retention`), and a command whose request id was decided already
is answered with its decision again, unchanged. Outputs are the messages of
:mod:`reconciler.core.messages`, sorted-key JSON, so that folding the same stream twice
gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

from reconciler.core import inputs as ev
from reconciler.core.fold import commands, config, hosts, queue
from reconciler.core.fold.step import OutputTooLarge, Step
from reconciler.core.retention import evict_expired
from reconciler.core.state import Effects, State

__all__ = ["OutputTooLarge", "fold", "fold_input"]

# Speed notes, for every module of the fold (the hot path of the live line and of
# replay):
# - enum members as module constants (imported from model as ``READY`` and so on): on
#   Python 3.11 ``LeaseState.READY`` goes through the enum metaclass's ``__getattr__``
#   hook (about 100 ns, where a global is about 10 ns), and the fold tests lease states
#   and kinds several times per input;
# - enum values as ``str(member)``: the lease enums are ``StrEnum``s, whose ``str()`` is
#   their value (Python's documented ``StrEnum.__str__``), a C call where ``.value`` is
#   a Python-level descriptor (about 6 times slower);
# - a lease's ``active`` and ``gated`` spelled out (``lease.state is not RELEASED``,
#   ``lease.gate_seq is not None``), and an admission's verb (``Admit.verb``) too: each
#   is a property, a Python-level call, and the fold asks them of most inputs;
# - decisions and executor commands written by the positional builders of
#   :mod:`reconciler.core.messages`, without a typed message on the way.


def fold(state: State, message: ev.Message, fx: Effects | None = None) -> Effects:
    """Apply one message. Skipped (no effects) when at or below the applied position."""
    return fold_input(
        state, message.seq, message.timestamp, message.input, Effects() if fx is None else fx
    )


def fold_input(state: State, seq: int, timestamp: str, item: ev.Input, fx: Effects) -> Effects:
    """:func:`fold` of a message given by its parts (sequence, stream time, input), for
    a caller that has them apart: the pipeline folds each input it decodes this way,
    without a :class:`~reconciler.core.inputs.Message` built for it."""
    if seq <= state.applied_seq:
        return fx
    handler = _HANDLERS.get(type(item))
    step = Step(state, seq, timestamp, fx)
    now = step.now
    retention = state.decision_retention_s
    if now is not None and retention is not None:
        # evict_expired() when something is due (the expiry index's own test, inlined):
        # most steps have nothing to evict
        due = state.expiry.seconds
        if due and due[0] <= now - retention:
            evict_expired(state, now, fx)
    if handler is None:  # pragma: no cover - every input type is registered
        raise TypeError(f"no handler for {type(item).__name__}")
    if state.waiting:  # waits end on message time, before the input is looked at
        queue.expire_due(step)
    # a set lookup on the exact type rather than isinstance() against the Command union
    if type(item) in _COMMANDS and item.request_id in state.decisions:  # type: ignore[union-attr]
        step.republish(item.request_id)  # type: ignore[union-attr]
    else:
        handler(step, item)
        if state.waiting and type(item) not in queue.NO_ROOM_FREED:
            queue.pump(step)
    state.applied_seq = seq
    return fx


#: the command input types: a command whose request id was decided is answered again
_COMMANDS: frozenset[type] = frozenset(get_args(ev.Command))

_HANDLERS: dict[type, Callable[[Step, Any], None]] = {
    ev.HostSnapshot: hosts.on_snapshot,
    ev.HostInventory: hosts.on_inventory,
    ev.Lifecycle: hosts.on_lifecycle,
    ev.Observation: hosts.on_observation,
    ev.Failure: hosts.on_failure,
    ev.PoolConfig: config.on_pool,
    ev.ClassConfig: config.on_class,
    ev.GpuProfileConfig: config.on_gpu_profile,
    ev.GpuPolicyConfig: config.on_gpu_policy,
    ev.TenantConfig: config.on_tenant,
    ev.RefusedConfig: config.on_refused_config,
    ev.Admit: commands.on_admit,
    ev.ClaimWarm: commands.on_claim_warm,
    ev.AuthorizeWarmDrain: commands.on_drain,
    ev.MarkCreated: commands.on_mark_created,
    ev.MarkWarmInjected: commands.on_mark_injected,
    ev.MarkDeleting: commands.on_mark_deleting,
    ev.Release: commands.on_release,
    ev.RenderRuntime: commands.on_render_runtime,
    ev.ApplyConfig: config.on_apply_config,
    ev.Cordon: hosts.on_cordon,
    ev.Uncordon: hosts.on_uncordon,
    ev.Drain: hosts.on_drain_host,
    ev.QueueTimeout: queue.on_queue_timeout,
}
