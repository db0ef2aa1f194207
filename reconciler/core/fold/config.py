"""Config inputs folded: pools, resource classes, GPU profiles and GPU policies.

Rules: an input the fold refuses (a pool whose warm bounds contradict its maxima or
whose claim names repeat, a warm pool without an image, a class whose GPU request is
empty, an invalid GPU runtime, a negative GPU index) is rejected by name on
``out.config.rejected.<kind>.<name>``, and the last good version stays in force; an
accepted one replaces it whole. A GPU profile whose revision is not newer than the last
is ignored.
"""

from __future__ import annotations

from reconciler.core import inputs as ev
from reconciler.core.fold.step import Step
from reconciler.core.model import (
    ClassName,
    GpuPolicy,
    GpuProfile,
    Pool,
    ResourceClass,
)
from reconciler.core.runtime import (
    RuntimeConfigError,
    validate_overrides,
    validate_profile,
)

__all__ = ["on_class", "on_gpu_policy", "on_gpu_profile", "on_pool"]


def on_pool(step: Step, cfg: ev.PoolConfig) -> None:
    warm = cfg.warm
    error = None
    if warm.min_ready > warm.max_ready:
        error = f"pool {cfg.pool!r}: warm.min_ready {warm.min_ready} > max_ready {warm.max_ready}"
    elif warm.max_ready > cfg.max_instances:
        error = (
            f"pool {cfg.pool!r}: warm.max_ready {warm.max_ready} > "
            f"max_instances {cfg.max_instances}"
        )
    elif len({c.name for c in cfg.claims}) != len(cfg.claims):
        error = f"pool {cfg.pool!r}: claim names repeat"
    elif warm.max_ready > 0 and not cfg.image:
        error = f"pool {cfg.pool!r}: a warm pool needs an image"
    if error is not None:
        step.reject_config("pool", cfg.pool, error)
        return
    step.state.pools[cfg.pool] = Pool(
        name=cfg.pool,
        flavor=cfg.flavor,
        claims=cfg.claims,
        warm=cfg.warm,
        max_instances=cfg.max_instances,
        priority=cfg.priority,
        host_selector=dict(cfg.host_selector),
        placement=cfg.placement,
        image=cfg.image,
        profiles=cfg.profiles,
        project=cfg.project,
        seq=step.seq,
        instance_type=cfg.instance_type,
    )
    step.fx.pools.add(cfg.pool)
    step.fx.pool_rows.add(cfg.pool)


def on_class(step: Step, cfg: ev.ClassConfig) -> None:
    gpu = cfg.gpu
    error = None
    if gpu is not None and gpu.count < 1:
        error = f"class {cfg.name!r}: parameters.gpu.count must be at least 1, not {gpu.count}"
    elif gpu is not None and (gpu.vendor == "" or gpu.model == ""):
        error = f"class {cfg.name!r}: parameters.gpu vendor and model may not be empty"
    if error is not None:
        step.reject_config("class", cfg.name, error)
        return
    step.state.classes[ClassName(cfg.name)] = ResourceClass(
        name=cfg.name, gpu=gpu, host_selector=dict(cfg.host_selector), seq=step.seq
    )
    step.fx.classes.add(cfg.name)


def on_gpu_profile(step: Step, cfg: ev.GpuProfileConfig) -> None:
    old = step.state.profiles.get(cfg.name)
    if old is not None and cfg.revision <= old.revision:
        step.note(f"gpu-profile {cfg.name} r{cfg.revision} is stale; ignored")
        return
    try:
        validate_profile(cfg.name, cfg.defaults)
    except RuntimeConfigError as exc:
        step.reject_config("gpu-profile", cfg.name, str(exc))
        return
    step.state.profiles[cfg.name] = GpuProfile(cfg.name, cfg.revision, cfg.defaults, step.seq)
    step.fx.profiles.add(cfg.name)


def on_gpu_policy(step: Step, cfg: ev.GpuPolicyConfig) -> None:
    try:
        overrides = validate_overrides(cfg.name, cfg.overrides)
        if cfg.selector.indexes is not None and any(i < 0 for i in cfg.selector.indexes):
            raise RuntimeConfigError(f"gpu-policy {cfg.name!r}: negative GPU index")
    except RuntimeConfigError as exc:
        step.reject_config("gpu-policy", cfg.name, str(exc))
        return
    step.state.policies[cfg.name] = GpuPolicy(
        cfg.name, cfg.priority, cfg.selector, overrides, step.seq
    )
    step.fx.policies.add(cfg.name)
