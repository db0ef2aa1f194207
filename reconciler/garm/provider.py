"""The provider's operations, each one GARM command.

Rules:

- **Create** resumes the current attempt of the runner name (:mod:`.attempts`): warm
  first when the pool keeps warm VMs (``claim-warm``; on ``claimed`` GARM's tags and
  bootstrap go into the claimed instance through the Incus API, then
  ``mark-warm-injected``), otherwise cold (``admit-preemptible`` or ``admit``; on
  ``admitted`` the instance is created on the lease's host with cloud-init user data,
  started, and ``mark-created``). A rejection is exit 1 with its reason and detail.
- **A cold admission waits its turn**: it carries ``wait_s`` (the config's
  ``bootstrap_timeout - boot_time``), so a runner that does not fit now waits in its
  pool's queue (one ``garm.queued`` line: position and reason) until it is admitted,
  or its wait ends (``queue-timeout``, exit 1), or GARM deletes it (``cancelled``).
- **The pool** is the reconciler pool the runner's GARM pool maps to
  (:meth:`.config.ProviderConfig.pool_of`); the tenant is the one naming that pool.
- **The install script is rendered first** (:mod:`.install`), before anything is
  admitted: a template that cannot be rendered fails the call and changes nothing.
- **Delete** of a runner still waiting in the queue cancels its admission (a
  ``release`` naming its instance: final decision ``cancelled``); nothing is created.
- **Delete** accepts a provider id or a runner name: ``mark-deleting``, forced stop and
  delete (already gone is fine; an operation still running on the instance, such as
  the create of a call GARM killed, is waited for first), ``release``; nothing known is
  success too.
- **List** reads every configured host; one host that cannot be read fails the whole
  call (GARM removes runners missing from a list: never answer a partial one).
  ``RemoveAllInstances`` removes every instance of the controller, whatever pool GARM
  names (GARM v0.1.1 always sends one; the command is controller-wide).
- **A create or start Incus refused** is reported on the bus (the host's ``failure``
  input) before the call fails: the lease is released at once, with Incus's error as
  its fault, so GARM's retry finds the room free. **Get** of a runner whose latest
  attempt failed so (its lease released with a fault, no instance left) answers
  ``status: error`` with the fault as ``provider_fault``.
- **Answers** carry what GARM records from a create (and shows its users): the status,
  ``os_name`` and ``os_version`` (the image's ``image.os`` and ``image.release``) and
  the instance's global addresses. A create waits up to ``address_timeout`` for a first
  address, as the official Incus provider waits for an IPv4 one, since GARM takes
  addresses from the create's answer only.
- Instances carry GARM's tags (``user.runner-controller-id``, ``user.runner-pool-id``,
  ``user.os-type``, ``user.os-arch``) and ``user.runner-name``, so List and Get find a
  warm VM (whose instance name differs) by the runner it serves.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from reconciler.core.model import Resources
from reconciler.garm.admission import Admission
from reconciler.garm.attempts import MAX_ATTEMPTS, Attempt, find_attempt, job_of, runner_of_job
from reconciler.garm.bootstrap import cloud_config, injection, install_script
from reconciler.garm.config import ProviderConfig
from reconciler.garm.protocol import (
    Bootstrap,
    ExitCode,
    ProviderError,
    garm_status,
    provider_instance,
)
from reconciler.incus.client import IncusHost
from reconciler.incus.errors import IncusError
from reconciler.incus.views import InstanceSpec, InstanceView

__all__ = ["RUNNER_NAME_TAG", "Provider"]

logger = structlog.get_logger(__name__)

CONTROLLER_TAG = "user.runner-controller-id"
POOL_TAG = "user.runner-pool-id"
OS_TYPE_TAG = "user.os-type"
OS_ARCH_TAG = "user.os-arch"
RUNNER_NAME_TAG = "user.runner-name"
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True, kw_only=True)
class Found:
    """A runner's instance: where it is, and its lease when one is active."""

    runner: str
    instance: str
    host: str
    project: str
    lease: Mapping[str, Any] | None = None
    view: InstanceView | None = field(default=None, repr=False)


class Provider:
    """GARM's commands for one controller, over one bus connection and the Incus hosts."""

    def __init__(self, *, config: ProviderConfig, bus: Admission, controller_id: str) -> None:
        self.config = config
        self.bus = bus
        self.controller_id = controller_id
        self._hosts: dict[str, IncusHost] = {}

    # ----------------------------------------------------------------- plumbing

    def host(self, name: str) -> IncusHost:
        if name not in self._hosts:
            self._hosts[name] = IncusHost(
                self.config.endpoint(name),
                request_timeout_s=min(10.0, self.config.incus_timeout_s),
                operation_timeout_s=self.config.incus_timeout_s,
            )
        return self._hosts[name]

    async def aclose(self) -> None:
        for host in self._hosts.values():
            await host.aclose()

    @asynccontextmanager
    async def _incus(self, host: str, what: str) -> AsyncIterator[IncusHost]:
        try:
            yield self.host(host)
        except IncusError as exc:
            raise ProviderError(f"{what} on {host}: {exc}") from None

    async def _decide(self, verb: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        decision = await self.bus.command(verb, body, request_id=request_id)
        logger.info(
            "garm.decision",
            verb=verb,
            request_id=request_id,
            outcome=decision.get("outcome"),
            reason=decision.get("reason"),
            detail=decision.get("detail"),
        )
        return decision

    def _tags(self, bootstrap: Bootstrap) -> dict[str, str]:
        return {
            CONTROLLER_TAG: self.controller_id,
            POOL_TAG: bootstrap.pool_id,
            OS_TYPE_TAG: bootstrap.os_type,
            OS_ARCH_TAG: bootstrap.arch,
            RUNNER_NAME_TAG: bootstrap.name,
        }

    async def _answer(
        self, bootstrap: Bootstrap, *, host: str, instance: str, project: str
    ) -> dict[str, Any]:
        """The create's answer, from the instance as Incus shows it once it has a global
        address or ``address_timeout`` passed (a status Incus reports as running)."""
        view = await self._settled_view(host, instance, project)
        return provider_instance(
            name=bootstrap.name,
            provider_id=instance,
            status="running" if view is None else garm_status(view.status),
            os_type=bootstrap.os_type,
            os_arch=bootstrap.arch,
            os_name="" if view is None else view.os_name.lower(),
            os_version="" if view is None else view.os_version,
            addresses=() if view is None else view.addresses,
        )

    async def _settled_view(self, host: str, instance: str, project: str) -> InstanceView | None:
        """The instance once it has an address or ``address_timeout`` passed; ``None``
        when it cannot be read: the create succeeded, and failing its answer now would
        make GARM delete a good runner."""
        deadline = anyio.current_time() + self.config.address_timeout_s
        try:
            while True:
                view = await self.host(host).get_instance(instance, project=project, full=True)
                if view is None or view.addresses or anyio.current_time() >= deadline:
                    return view
                await anyio.sleep(min(1.0, max(0.0, deadline - anyio.current_time())))
        except IncusError as exc:
            logger.warning("garm.answer_unread", instance=instance, host=host, error=str(exc))
            return None

    # ----------------------------------------------------------------- create

    async def create(self, bootstrap: Bootstrap) -> dict[str, Any]:
        script = install_script(bootstrap)  # first: a template that fails admits nothing
        pool_name, source = self.config.pool_source(
            bootstrap.flavor, garm_pool=bootstrap.pool_id, named=bootstrap.specs.reconciler_pool
        )
        pool = await self._pool(pool_name)
        attempt = await find_attempt(self.bus, bootstrap.name)
        log = logger.bind(runner=bootstrap.name, attempt=attempt.number, pool=pool_name)
        log.info("garm.create", pool_from=source)
        warm = pool.get("warm") or {}
        if attempt.admit is None and (warm.get("max_ready") or warm.get("min_ready")):
            claim = attempt.claim or await self._decide(
                "claim-warm", {"pool": pool_name, "job": attempt.job}, attempt.rid("claim")
            )
            if claim.get("outcome") == "claimed":
                return await self._inject(bootstrap, attempt, claim["lease"], script)
            log.info("garm.no_warm", reason=claim.get("reason"))
        return await self._cold(bootstrap, attempt, pool, script)

    async def _pool(self, name: str) -> Mapping[str, Any]:
        found = await self.bus.query("pool", {"pool": name})
        if found is None or found.get("pool") is None:
            raise ProviderError(f"unknown-pool: the reconciler has no pool {name!r}")
        pool: Mapping[str, Any] = found["pool"]
        return pool

    async def _inject(
        self, bootstrap: Bootstrap, attempt: Attempt, lease: Mapping[str, Any], script: bytes
    ) -> dict[str, Any]:
        instance, host = str(lease["instance"]), str(lease["host"])
        project = await self._project_of(lease)
        done = await self.bus.last_decision(attempt.rid("injected"))
        if done is not None and done.get("outcome") == "ok":  # a call run again after success
            return await self._answer(bootstrap, host=host, instance=instance, project=project)
        plan = injection(bootstrap, script=script)
        async with self._incus(host, f"injecting the bootstrap into {instance}") as incus:
            await incus.update_config(instance, self._tags(bootstrap), project=project)
            made = await incus.execute(instance, list(plan.prepare), project=project)
            if made != 0:
                raise ProviderError(f"preparing {instance} for the bootstrap exited {made}")
            for path, content, mode in plan.files:
                await incus.push_file(instance, path, content, mode=mode, project=project)
            code = await incus.execute(instance, list(plan.command), project=project)
        if code != 0:
            raise ProviderError(f"bootstrap of {instance} exited {code}")
        done = await self._decide(
            "mark-warm-injected",
            {"job": attempt.job, "instance": instance},
            attempt.rid("injected"),
        )
        if done.get("outcome") != "ok":
            raise ProviderError(_refusal("mark-warm-injected", done))
        logger.info("garm.warm_claimed", runner=bootstrap.name, instance=instance, host=host)
        return await self._answer(bootstrap, host=host, instance=instance, project=project)

    async def _project_of(self, lease: Mapping[str, Any]) -> str:
        found = await self._lease_view(str(lease["lease_id"]), str(lease["pool"]))
        return str(found.get("project", "default")) if found else "default"

    async def _lease_view(self, lease_id: str, pool: str) -> Mapping[str, Any] | None:
        listed = await self.bus.query("pool", {"pool": pool}) or {}
        for entry in listed.get("leases", ()):
            if entry.get("lease_id") == lease_id:
                found: Mapping[str, Any] = entry
                return found
        return None

    async def _cold(
        self, bootstrap: Bootstrap, attempt: Attempt, pool: Mapping[str, Any], script: bytes
    ) -> dict[str, Any]:
        admit = attempt.admit
        if admit is None or admit.get("phase") != "final":
            body = {
                "pool": pool["pool"],
                "instance": bootstrap.name,
                "kind": "cold",
                "job": attempt.job,
                "wait_s": self.config.queue_wait_s,
            }
            admit = await self._decide(self.config.admission, body, attempt.rid("admit"))
        if admit.get("outcome") != "admitted":
            raise ProviderError(_refusal(self.config.admission, admit))
        lease = await self._lease_view(str(admit["lease"]["lease_id"]), str(pool["pool"]))
        if lease is None:
            raise ProviderError(f"lease {admit['lease']['lease_id']} is no longer active")
        host = str(lease["host"])
        spec = InstanceSpec.for_lease(
            name=str(lease["instance"]),
            image=str(pool["image"]),
            lease_id=str(lease["lease_id"]),
            pool=str(pool["pool"]),
            kind="cold",
            job=attempt.job,
            project=str(lease.get("project") or pool.get("project") or "default"),
            profiles=tuple(pool.get("profiles") or ()) or ("default",),
            demand=Resources(**lease["demand"]),
            gpu_pci=tuple(lease.get("gpu_pci") or ()),
            instance_type=str(pool.get("instance_type") or "virtual-machine"),
            user_data=cloud_config(bootstrap, script=script),
            tags=self._tags(bootstrap),
        )
        action = "create"
        try:
            async with self._incus(host, f"creating {spec.name}") as incus:
                await incus.create_instance(spec)
                action = "start"
                await incus.start_instance(spec.name, project=spec.project)
        except ProviderError as exc:  # the lease is released at once, with why
            await self.bus.report_failure(
                host=host,
                instance=spec.name,
                project=spec.project,
                lease_id=str(lease["lease_id"]),
                action=action,
                error=str(exc),
            )
            raise
        done = await self._decide("mark-created", {"instance": spec.name}, attempt.rid("created"))
        if done.get("outcome") != "ok":
            raise ProviderError(_refusal("mark-created", done))
        logger.info("garm.created", runner=bootstrap.name, host=host, lease=lease["lease_id"])
        return await self._answer(bootstrap, host=host, instance=spec.name, project=spec.project)

    # ----------------------------------------------------------------- lookups

    async def _leases(self) -> list[Mapping[str, Any]]:
        listed = await self.bus.query("pool", {})
        if listed is None:
            raise ProviderError("query pool answered nothing")
        leases: list[Mapping[str, Any]] = listed.get("leases", [])
        return leases

    async def _scan(self, *, full: bool = False) -> list[tuple[str, InstanceView]]:
        """Every instance of this controller on every configured host (``full``: with
        their addresses); any host that cannot be read fails the call (never a partial
        answer): one :class:`ProviderError` naming every host that could not be read."""
        found: list[tuple[str, InstanceView]] = []
        failures: dict[str, str] = {}

        async def read(name: str) -> None:
            try:
                async with self._incus(name, "listing instances") as incus:
                    views = await incus.list_instances(full=full)
            except ProviderError as exc:  # the others are still read, then all reported
                failures[name] = exc.message
                return
            found.extend(
                (name, v) for v in views if v.config.get(CONTROLLER_TAG) == self.controller_id
            )

        async with anyio.create_task_group() as tg:
            for name in sorted(self.config.hosts):
                tg.start_soon(read, name)
        if failures:
            raise ProviderError("; ".join(failures[name] for name in sorted(failures)))
        return sorted(found, key=lambda hv: (hv[0], hv[1].project, hv[1].name))

    async def find(self, identifier: str) -> list[Found]:
        """What ``identifier`` (a provider id or a runner name) names: its active leases,
        or else instances of this controller found on the hosts (one that lost its lease)."""
        out: list[Found] = []
        for lease in await self._leases():
            job = lease.get("job")
            runner = runner_of_job(str(job)) if job else str(lease["instance"])
            if identifier in (lease["instance"], runner):
                out.append(
                    Found(
                        runner=runner,
                        instance=str(lease["instance"]),
                        host=str(lease["host"]),
                        project=str(lease.get("project") or "default"),
                        lease=lease,
                    )
                )
        if out:
            return out
        for host, view in await self._scan():
            runner = view.config.get(RUNNER_NAME_TAG, view.name)
            if identifier in (view.name, runner):
                out.append(
                    Found(runner=runner, instance=view.name, host=host, project=view.project)
                )
        return out

    # ----------------------------------------------------------------- delete

    async def delete(self, identifier: str) -> None:
        cancelled = await self._cancel_waiting(identifier)
        found = await self.find(identifier)
        if not found and not cancelled:
            logger.info("garm.delete_unknown", identifier=identifier)
        for item in found:
            await self._delete_one(item)

    async def _cancel_waiting(self, identifier: str) -> bool:
        """Cancel the admission of ``identifier`` (its instance name, a cold runner's
        name) that still waits in the queue: whether one did."""
        waiting = await self.bus.waiting(identifier)
        for entry in waiting:
            key = _NOT_TOKEN.sub("-", str(entry["request_id"]))
            done = await self._decide("release", {"instance": identifier}, f"garm-cancel-{key}")
            logger.info(
                "garm.cancelled",
                runner=identifier,
                request_id=entry["request_id"],
                position=entry.get("position"),
                detail=done.get("detail"),
            )
        return bool(waiting)

    async def _delete_one(self, item: Found) -> None:
        key = _NOT_TOKEN.sub("-", str(item.lease["lease_id"])) if item.lease else None
        if key is not None:
            await self._decide("mark-deleting", {"instance": item.instance}, f"garm-deleting-{key}")
        async with self._incus(item.host, f"deleting {item.instance}") as incus:
            waited = await incus.destroy_instance(item.instance, project=item.project)
        if key is not None:
            await self._decide("release", {"instance": item.instance}, f"garm-release-{key}")
        logger.info(
            "garm.deleted",
            runner=item.runner,
            instance=item.instance,
            host=item.host,
            waited_for=list(waited),  # operations still running on it, such as a create
        )

    # ----------------------------------------------------------------- reads

    async def list(self, pool_id: str | None) -> list[dict[str, Any]]:
        out = []
        for _, view in await self._scan(full=True):
            if pool_id and view.config.get(POOL_TAG) != pool_id:
                continue
            out.append(_instance_of(view))
        return out

    async def get(self, identifier: str) -> dict[str, Any]:
        for item in await self.find(identifier):
            async with self._incus(item.host, f"reading {item.instance}") as incus:
                view = await incus.get_instance(item.instance, project=item.project, full=True)
            if view is not None:
                return _instance_of(view)
        failed = await self._failed(identifier)
        if failed is not None:
            return failed
        raise ProviderError(f"instance {identifier!r} not found", code=ExitCode.NOT_FOUND)

    async def _failed(self, identifier: str) -> dict[str, Any] | None:
        """The runner's latest lease, when it carries a fault (its create or start
        failed): an ``error`` instance with the fault. ``identifier`` is a runner name
        (its attempts' job identities) or a provider id (an instance name)."""
        latest: Mapping[str, Any] | None = None
        for number in range(1, MAX_ATTEMPTS + 1):
            found = await self.bus.query("lease", {"identifier": job_of(identifier, number)})
            if found is None:
                break
            latest = found
        if latest is None or not latest.get("fault"):
            return None
        job = latest.get("job")
        return provider_instance(
            name=runner_of_job(str(job)) if job else identifier,
            provider_id=str(latest["instance"]),
            status="error",
            fault=str(latest["fault"]),
        )

    async def set_running(self, identifier: str, *, running: bool) -> None:
        found = await self.find(identifier)
        if not found:
            raise ProviderError(f"instance {identifier!r} not found", code=ExitCode.NOT_FOUND)
        for item in found:
            async with self._incus(item.host, f"changing {item.instance}") as incus:
                if running:
                    await incus.start_instance(item.instance, project=item.project)
                else:
                    await incus.stop_instance(item.instance, project=item.project, force=True)

    async def remove_all(self) -> None:
        """Every instance of this controller, of every pool (GARM v0.1.1 sends a
        ``GARM_POOL_ID`` with this command too; it does not narrow it)."""
        for _, view in await self._scan():
            await self.delete(view.name)


#: Incus's architecture names → GARM's
_GARM_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "i386"}


def _instance_of(view: InstanceView) -> dict[str, Any]:
    return provider_instance(
        name=view.config.get(RUNNER_NAME_TAG, view.name),
        provider_id=view.name,
        status=garm_status(view.status),
        os_type=view.config.get(OS_TYPE_TAG, "linux"),
        os_arch=view.config.get(OS_ARCH_TAG) or _GARM_ARCH.get(view.architecture, "amd64"),
        os_name=view.os_name.lower(),
        os_version=view.os_version,
        addresses=view.addresses,
    )


def _refusal(verb: str, decision: Mapping[str, Any]) -> str:
    reason = decision.get("reason") or decision.get("outcome") or "refused"
    detail = decision.get("detail")
    return f"{reason}: {verb} {decision.get('outcome')}" + (f": {detail}" if detail else "")
