"""``reconciler bridge``: Incus hosts → the bus (lifecycle events, snapshots, inventories)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import click
import orjson

from reconciler.bridge.bridge import (
    DEFAULT_RESYNC_S,
    Bridge,
    HostBridge,
    HostSettings,
    settings_from_json,
)
from reconciler.bus.connection import ConnectOptions, connect
from reconciler.bus.streams import StreamNames, ensure_streams
from reconciler.cli.options import (
    IncusOptions,
    bus_options,
    common_from,
    incus_from,
    incus_options,
    log_options,
    wait_for_file,
)
from reconciler.cli.signals import run_until_signalled
from reconciler.incus.client import IncusHost
from reconciler.observe.endpoints import parse_addr

if TYPE_CHECKING:
    from reconciler.observe.endpoints import MetricsServer

__all__ = ["bridge"]


@click.command()
@bus_options
@incus_options
@click.option(
    "--hosts-config",
    envvar="RC_HOSTS_CONFIG",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="What Incus does not say of a host (waited for when it does not exist yet): "
    '{"defaults": {"reserve": {"cpu", "memory_mib", "disk_gib"}, "labels": {}, '
    '"schedulable": true, "gpu_profile": null, "storage_pool": '
    '"default"}, "hosts": {"<host>": {…}}}. A host takes new work only when it says '
    "schedulable and no operator cordoned it (reconciler cordon, drain; uncordon).",
)
@click.option(
    "--resync-interval",
    envvar="RC_RESYNC_INTERVAL",
    show_envvar=True,
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_RESYNC_S,
    show_default=True,
    help="Seconds between full inventories (and snapshot checks) of every host.",
)
@click.option(
    "--metrics-addr",
    envvar="RC_BRIDGE_METRICS_ADDR",
    show_envvar=True,
    help="HOST:PORT for Prometheus /metrics, /healthz and /readyz (off when unset).",
)
@log_options
def bridge(
    hosts_config: Path | None, resync_interval: float, metrics_addr: str | None, **kwargs: Any
) -> None:
    """Watch Incus hosts through pylxd and publish what the reconciler needs.

    For every host: its lifecycle events (instance-*), verbatim; a snapshot of capacity,
    reserve, labels and GPUs when it changes; and a complete inventory after every
    (re)connection, soon after instances are created or deleted, and periodically.
    """
    common = common_from(kwargs, name="reconciler-bridge")
    incus = incus_from(kwargs)
    if not incus.endpoints:
        raise click.UsageError("no Incus hosts: give --incus-fleet FILE or --incus HOST=URL")
    settings = {"*": HostSettings()}
    if hosts_config is not None:
        wait_for_file(hosts_config, option="--hosts-config")
        try:
            settings = settings_from_json(orjson.loads(hosts_config.read_bytes()))
        except (OSError, ValueError, TypeError) as exc:
            raise click.BadParameter(f"{hosts_config}: {exc}") from exc
    if metrics_addr:
        try:
            parse_addr(metrics_addr)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics-addr") from exc
    anyio.run(
        lambda: _run(
            common.nats,
            common.prefix,
            incus,
            settings,
            resync_s=resync_interval,
            metrics_addr=metrics_addr,
        )
    )


async def _run(
    nats: ConnectOptions,
    prefix: str,
    incus: IncusOptions,
    settings: dict[str, HostSettings],
    *,
    resync_s: float,
    metrics_addr: str | None = None,
) -> None:
    nc = await connect(nats)
    metrics: MetricsServer | None = None
    hosts = [
        IncusHost(
            ep,
            request_timeout_s=incus.request_timeout_s,
            operation_timeout_s=incus.operation_timeout_s,
        )
        for ep in incus.endpoints
    ]
    try:
        js = nc.jetstream()
        await ensure_streams(js, StreamNames.for_prefix(prefix))
        bridges = [
            HostBridge(
                incus=host,
                js=js,
                prefix=prefix,
                settings=settings.get(host.name, settings["*"]),
                resync_s=resync_s,
            )
            for host in hosts
        ]
        if metrics_addr:
            from reconciler.bridge.metrics import bridge_metrics_server

            metrics = bridge_metrics_server(addr=metrics_addr, hosts=bridges, nc=nc)
            await metrics.start()

        async def watch(stop: anyio.Event) -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(Bridge(bridges).run)
                await stop.wait()  # nothing is in hand between publishes: stop at once
                tg.cancel_scope.cancel()

        await run_until_signalled(watch, stopping="stopping")
    finally:
        with anyio.CancelScope(shield=True):
            if metrics is not None:
                await metrics.stop()
            for host in hosts:
                await host.aclose()
            await nc.close()
