"""Config inputs folded: pools, resource classes, GPU profiles and GPU policies, one at a
time (``in.config.<kind>.<name>``) or as one change (the ``apply-config`` command).

Rules:

- An input the fold refuses (a pool whose warm bounds contradict its maxima or whose
  claim names repeat, a warm pool without an image, a class whose GPU request is empty,
  an invalid GPU runtime, a negative GPU index: :mod:`reconciler.core.configs`), or one
  with a field its schema does not name, is rejected by name on
  ``out.config.rejected.<kind>.<name>``, and the last good version stays in force; an
  accepted one replaces it whole. A single GPU profile input whose revision is not newer
  than the last is ignored.
- An ``apply-config`` change is applied whole or not at all. Every item is checked as a
  single input would be, and the change as a whole: an item named twice (or put and
  deleted), a deletion of what does not exist, a class still named by a pool's claims or
  a GPU profile still named by a host or rendered into an active lease (as the change
  would leave them), a GPU profile changed without a newer revision, a tenant naming a
  pool another tenant names (as the change would leave them; a single tenant input is
  checked against the state alike). One refused item
  and nothing changes: the decision is ``rejected`` (``invalid-config``) and lists every
  refused item with its reason. Otherwise every item is put or deleted and the decision
  is ``applied``, listing what became of each (``created``, ``updated``, ``deleted``,
  ``unchanged``; an unchanged item is left as it is).
- A deleted pool admits nothing new (``unknown-pool``); its warm VMs that serve no job
  (booting or ready, unclaimed) are drained at once (``draining``, a delete command with
  reason ``drained``); its other leases run to their end.
- :func:`plan_change` is the check alone, without changing anything: the ``config-check``
  query answers with it, so ``apply --dry-run`` and ``diff`` give the fold's own verdict.
"""

from __future__ import annotations

from typing import Any, Final

from reconciler.core import inputs as ev
from reconciler.core.configs import CONFIG_KINDS, ConfigKind, ConfigView
from reconciler.core.fold.step import Step
from reconciler.core.messages import ItemChange, ItemResult
from reconciler.core.model import GpuProfile
from reconciler.core.state import State, is_idle_warm

__all__ = [
    "MAX_DECISION_ITEMS",
    "on_apply_config",
    "on_class",
    "on_gpu_policy",
    "on_gpu_profile",
    "on_pool",
    "on_refused_config",
    "on_tenant",
    "plan_change",
]

#: an ``apply-config`` decision lists at most this many items (its size stays bounded)
MAX_DECISION_ITEMS: Final = 256


# ---------------------------------------------------------------- single inputs


def on_pool(step: Step, cfg: ev.PoolConfig) -> None:
    _single(step, CONFIG_KINDS["pool"], cfg.pool, cfg)


def on_class(step: Step, cfg: ev.ClassConfig) -> None:
    _single(step, CONFIG_KINDS["class"], cfg.name, cfg)


def on_gpu_profile(step: Step, cfg: ev.GpuProfileConfig) -> None:
    old = step.state.profiles.get(cfg.name)
    if old is not None and cfg.revision <= old.revision:
        step.note(f"gpu-profile {cfg.name} r{cfg.revision} is stale; ignored")
        return
    _single(step, CONFIG_KINDS["gpu-profile"], cfg.name, cfg)


def on_gpu_policy(step: Step, cfg: ev.GpuPolicyConfig) -> None:
    _single(step, CONFIG_KINDS["gpu-policy"], cfg.name, cfg)


def on_tenant(step: Step, cfg: ev.TenantConfig) -> None:
    _single(step, CONFIG_KINDS["tenant"], cfg.tenant, cfg)


def on_refused_config(step: Step, refused: ev.RefusedConfig) -> None:
    step.reject_config(refused.kind, refused.name, refused.error)


def _single(step: Step, spec: ConfigKind, name: str, cfg: Any) -> None:
    error = spec.check(cfg)
    if error is None and spec.conflicts is not None:
        view = ConfigView(step.state, put={spec.kind: {name: spec.build(cfg, step.seq)}})
        error = spec.conflicts(view, name)
    if error is not None:
        step.reject_config(spec.kind, name, error)
        return
    _put(step, spec, name, cfg)


def _put(step: Step, spec: ConfigKind, name: str, cfg: Any) -> None:
    spec.table(step.state)[name] = spec.build(cfg, step.seq)
    spec.touch(step.fx, name)


# ---------------------------------------------------------------- a whole change


def plan_change(state: State, change: ev.ApplyConfig) -> list[ItemResult]:
    """What applying ``change`` would do to each of its items (puts, then deletions):
    its change, or why it is refused. Changes nothing; see the module's rules."""
    results: list[ItemResult] = []
    seen: set[tuple[str, str]] = set()
    put: dict[str, dict[str, object]] = {}
    deleted: dict[str, set[str]] = {}
    for item in change.items:
        spec = CONFIG_KINDS[item.kind]
        error, verdict = item.error, None
        if error is None and (item.kind, item.name) in seen:
            error = f"{item.kind} {item.name!r} is named twice in the change"
        if error is None:
            error = spec.check(item.config)
        if error is None:
            verdict, error, entity = _compare(state, spec, item)
            put.setdefault(item.kind, {})[item.name] = entity
        seen.add((item.kind, item.name))
        results.append(ItemResult(kind=item.kind, name=item.name, change=verdict, error=error))
    for ref in change.deletions:
        spec = CONFIG_KINDS[ref.kind]
        error = None
        if (ref.kind, ref.name) in seen:
            error = f"{ref.kind} {ref.name!r} is named twice in the change"
        elif ref.name not in spec.table(state):
            error = f"there is no {ref.kind} named {ref.name!r}"
        seen.add((ref.kind, ref.name))
        deleted.setdefault(ref.kind, set()).add(ref.name)
        results.append(
            ItemResult(
                kind=ref.kind, name=ref.name, change=None if error else "deleted", error=error
            )
        )
    view = ConfigView(state, put=put, deleted=deleted)
    for index, result in enumerate(results):
        conflicts = CONFIG_KINDS[result.kind].conflicts
        if result.error is None and result.change in ("created", "updated") and conflicts:
            conflict = conflicts(view, result.name)
            if conflict is not None:
                results[index] = ItemResult(kind=result.kind, name=result.name, error=conflict)
        if result.change == "deleted":
            users = CONFIG_KINDS[result.kind].users(view, result.name)
            if users:
                results[index] = ItemResult(
                    kind=result.kind,
                    name=result.name,
                    error=f"{result.kind} {result.name!r} is in use by {', '.join(users)}",
                )
    return results


def _compare(
    state: State, spec: ConfigKind, item: ev.ConfigItem
) -> tuple[ItemChange | None, str | None, object]:
    """An item to put, against the state: its change (or error) and the entity."""
    entity = spec.build(item.config, 0)
    current = spec.table(state).get(item.name)
    if current is None:
        return "created", None, entity
    if spec.payload(current) == spec.payload(entity):
        return "unchanged", None, entity
    if isinstance(entity, GpuProfile) and entity.revision <= current.revision:
        return (
            None,
            f"gpu-profile {item.name!r}: revision {entity.revision} is not newer than "
            f"{current.revision}; a changed profile needs a newer revision",
            entity,
        )
    return "updated", None, entity


def on_apply_config(step: Step, cmd: ev.ApplyConfig) -> None:
    results = plan_change(step.state, cmd)
    refused = [r for r in results if r.error is not None]
    if refused:
        first = refused[0]
        step.decide(
            cmd.request_id,
            cmd.verb,
            "rejected",
            reason="invalid-config",
            detail=f"{len(refused)} of {len(results)} item(s) refused, nothing applied; "
            f"first: {first.error}",
            items=_listed(refused),
        )
        return
    for item, result in zip(cmd.items, results, strict=False):
        if result.change != "unchanged":
            _put(step, CONFIG_KINDS[item.kind], item.name, item.config)
    drained = 0
    for ref in cmd.deletions:
        drained += _delete(step, CONFIG_KINDS[ref.kind], ref.name)
    step.decide(
        cmd.request_id,
        cmd.verb,
        "applied",
        detail=_summary(results, drained),
        items=_listed(results),
    )


def _listed(results: list[ItemResult]) -> list[ItemResult]:
    return results[:MAX_DECISION_ITEMS]


def _summary(results: list[ItemResult], drained: int) -> str:
    counts: dict[str, int] = {}
    for result in results:
        assert result.change is not None
        counts[result.change] = counts.get(result.change, 0) + 1
    said = ", ".join(f"{n} {change}" for change, n in counts.items()) or "nothing to change"
    text = f"{len(results)} item(s): {said}"
    if drained:
        text += f"; {drained} warm VM(s) of deleted pools drained"
    if len(results) > MAX_DECISION_ITEMS:
        text += f" (the first {MAX_DECISION_ITEMS} listed)"
    return text


def _delete(step: Step, spec: ConfigKind, name: str) -> int:
    """Delete an item (it exists: the plan checked); for a pool, drain its idle warm
    VMs. How many were drained."""
    del spec.table(step.state)[name]
    spec.touch(step.fx, name)
    if spec.kind != "pool":
        return 0
    idle = sorted(
        (le for le in step.state.leases.values() if le.pool == name and is_idle_warm(le)),
        key=lambda le: le.lease_id,
    )
    for lease in idle:
        step.drain(lease, "pool-deleted")
    return len(idle)
