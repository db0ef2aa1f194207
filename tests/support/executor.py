"""Helpers for the executor's tests: commands on the bus, a running executor, what Incus did.

- :func:`create_cmd` / :func:`delete_cmd` build contract payloads
  (``reconciler/schemas/out/exec.*.json``); :func:`publish` puts one on the OUT stream the way the
  leader does (``Nats-Msg-Id`` = ``command_id`` unless told otherwise).
- :func:`fast_config` is an executor configuration with test timings (ack wait 1.5 s,
  heartbeats every 0.375 s, retries from 50 ms).
- :func:`running_executor` runs one :class:`~reconciler.executor.executor.Executor`
  for a block: stopped gracefully at the end, or *killed* (cancelled: nothing more is
  acked or handed back) with ``handle.kill()``.
- :class:`ActionLog` records every lifecycle action a simulated host emits, to count
  creations and check their order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
from nats.aio.client import Client
from nats.js import api

from reconciler.bus.connection import ConnectOptions
from reconciler.bus.streams import StreamNames
from reconciler.executor.executor import Executor, ExecutorConfig, consumer_name
from reconciler.executor.records import ExecutorStore, FinishedCommand
from reconciler.incus.client import IncusEndpoint
from reconciler.incus.simulator import Fleet

PREFIX = "rc"
NAMES = StreamNames.for_prefix(PREFIX)
GPU_PCI = ("0000:41:00.0", "0000:61:00.0", "0000:81:00.0", "0000:a1:00.0")


def create_cmd(
    host: str,
    instance: str,
    lease: str,
    *,
    project: str = "ci",
    pool: str = "small",
    image: str = "ubuntu/24.04",
    profiles: tuple[str, ...] = ("default",),
    cpu: int = 2,
    memory_mib: int = 4096,
    disk_gib: int = 20,
    gpus: tuple[tuple[int, str], ...] = (),
    command_id: str | None = None,
    instance_type: str | None = None,
) -> dict[str, Any]:
    extra = {} if instance_type is None else {"instance_type": instance_type}
    return {
        **extra,
        "v": 1,
        "command_id": command_id or f"create:{lease}",
        "host": host,
        "instance": instance,
        "project": project,
        "lease_id": lease,
        "pool": pool,
        "image": image,
        "profiles": list(profiles),
        "demand": {"cpu": cpu, "memory_mib": memory_mib, "disk_gib": disk_gib},
        "gpus": [{"index": i, "pci_address": pci} for i, pci in gpus],
    }


def delete_cmd(
    host: str,
    instance: str,
    lease: str,
    *,
    project: str = "ci",
    reason: str = "drained",
    command_id: str | None = None,
) -> dict[str, Any]:
    return {
        "v": 1,
        "command_id": command_id or f"delete:{lease}:{reason}",
        "host": host,
        "instance": instance,
        "project": project,
        "lease_id": lease,
        "reason": reason,
    }


async def publish(
    nc: Client,
    payload: dict[str, Any] | bytes,
    *,
    subject: str | None = None,
    msg_id: str | bool | None = True,
) -> int:
    """Publish a command on the OUT stream; its stream sequence.

    ``msg_id``: ``True`` = the payload's ``command_id``, ``False``/``None`` = no header
    (so the stream's deduplication does not apply), a string = that id.
    """
    if isinstance(payload, bytes):
        data, body = payload, {}
    else:
        data, body = orjson.dumps(payload), payload
    if subject is None:
        verb = "create" if "image" in body else "delete"
        subject = f"{PREFIX}.out.exec.{body['host']}.{verb}"
    header = body.get("command_id") if msg_id is True else (msg_id or None)
    headers = {"Nats-Msg-Id": str(header)} if header else None
    ack = await nc.jetstream().publish(subject, data, headers=headers, timeout=5)
    return int(ack.seq)


def endpoints_of(fleet: Fleet) -> tuple[IncusEndpoint, ...]:
    return tuple(IncusEndpoint(host=h, url=u) for h, u in sorted(fleet.endpoints.items()))


def fast_config(
    nats_url: str, db: Path, endpoints: tuple[IncusEndpoint, ...], **overrides: Any
) -> ExecutorConfig:
    settings: dict[str, Any] = {
        "endpoints": endpoints,
        "nats": ConnectOptions(
            urls=(nats_url,), reconnect_wait_s=0.1, connect_timeout_s=1.0, name="executor-test"
        ),
        "prefix": PREFIX,
        "db": db,
        "workers": 4,
        "ack_wait_s": 1.5,
        "fetch_timeout_s": 0.2,
        "reconnect_wait_s": 0.2,
        "retry_base_s": 0.05,
        "retry_cap_s": 0.4,
        "max_attempts": 4,
        "request_timeout_s": 2.0,
        "operation_timeout_s": 5.0,
    }
    settings.update(overrides)
    return ExecutorConfig(**settings)


@dataclass
class RunningExecutor:
    executor: Executor
    stop: anyio.Event
    scope: anyio.CancelScope
    finished: anyio.Event = field(default_factory=anyio.Event)

    def kill(self) -> None:
        """Cancel the executor as if its process died: nothing more is acked."""
        self.scope.cancel()

    async def shutdown(self, *, within_s: float = 15.0) -> None:
        """Stop gracefully and wait until it returned."""
        self.stop.set()
        with anyio.fail_after(within_s):
            await self.finished.wait()

    async def record(self, command_id: str, *, within_s: float = 10.0) -> FinishedCommand:
        """The finished record of ``command_id``, waiting for it."""
        with anyio.fail_after(within_s):
            while True:
                found = await self.executor.store.finished(command_id)
                if found is not None:
                    return found
                await anyio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_executor(
    config: ExecutorConfig, *, store: ExecutorStore | None = None, ready: bool = True
) -> AsyncIterator[RunningExecutor]:
    """An executor for the block (stopped gracefully at its end unless killed)."""
    executor = Executor(config, store=store)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        handle = RunningExecutor(executor=executor, stop=stop, scope=tg.cancel_scope)

        async def run() -> None:
            try:
                await executor.run(stop=stop)
            finally:
                handle.finished.set()

        tg.start_soon(run)
        if ready:
            with anyio.fail_after(10):
                await executor.ready.wait()
        try:
            yield handle
        finally:
            stop.set()


async def until(
    condition: Callable[[], Any], *, within_s: float = 10.0, every_s: float = 0.02
) -> None:
    """Poll ``condition`` (a function, or one returning an awaitable) until it holds."""
    with anyio.fail_after(within_s):
        while True:
            result = condition()
            if hasattr(result, "__await__"):
                result = await result
            if result:
                return
            await anyio.sleep(every_s)


async def consumer_info(nc: Client, host: str) -> api.ConsumerInfo:
    info: api.ConsumerInfo = await nc.jetstream().consumer_info(
        NAMES.out_stream, consumer_name(host)
    )
    return info


async def settled(nc: Client, host: str, *, within_s: float = 10.0) -> api.ConsumerInfo:
    """The consumer of ``host`` once nothing is pending or un-acked."""
    with anyio.fail_after(within_s):
        while True:
            info = await consumer_info(nc, host)
            if not info.num_ack_pending and not info.num_pending:
                return info
            await anyio.sleep(0.05)


class ActionLog:
    """Every lifecycle action the fleet's hosts emit: ``(host, project, name, action)``."""

    def __init__(self, fleet: Fleet) -> None:
        self.actions: list[tuple[str, str, str, str]] = []
        for name, host in fleet.hosts.items():
            original = host.events.publish
            host.events.publish = functools.partial(self._seen, name, original)  # type: ignore[method-assign]

    def _seen(self, host: str, original: Callable[[dict[str, Any]], None], event: Any) -> None:
        if event.get("type") == "lifecycle":
            meta = event["metadata"]
            self.actions.append((host, meta["project"], meta["name"], meta["action"]))
        original(event)

    def of(self, instance: str) -> list[str]:
        return [a for (_, _, name, a) in self.actions if name == instance]

    def count(self, action: str, instance: str | None = None) -> int:
        return sum(
            1 for (_, _, name, a) in self.actions if a == action and instance in (None, name)
        )
