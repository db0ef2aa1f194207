"""``reconciler run``: one replica of the reconciler, until a signal (docs/cli.md).

The options become a :class:`~reconciler.replica.replica.RunConfig`; the garbage
collector's threshold is set (:func:`~reconciler.replica.collector.apply_gc_threshold`)
and the replica runs until SIGTERM or SIGINT (the batch in hand committed first).
"""

from __future__ import annotations

from typing import Any

import anyio
import click
import structlog

from reconciler.cli.options import (
    bus_options,
    common_from,
    config_default,
    db_option,
    incus_from,
    incus_options,
    log_options,
    retention_options,
    run_options,
    stream_replicas_option,
)
from reconciler.cli.signals import run_until_signalled
from reconciler.replica.collector import apply_gc_threshold
from reconciler.replica.replica import Replica, RunConfig, StartupError, default_replica_name
from reconciler.store.errors import StoreError

__all__ = ["run"]


@click.command("run")
@bus_options
@db_option
@run_options
@retention_options
@incus_options
@click.option(
    "--replica",
    envvar="RC_REPLICA",
    show_envvar=True,
    default=default_replica_name,
    show_default="the host name",
    help="This replica's name: its durable consumer is <PREFIX>_IN-<replica>.",
)
@click.option(
    "--batch",
    envvar="RC_BATCH",
    show_envvar=True,
    type=click.IntRange(min=1, max=10_000),
    default=config_default(RunConfig, "batch"),
    show_default=True,
    help="Input messages fetched and committed per batch at most.",
)
@stream_replicas_option(
    "Replicas of the streams and the leader bucket when this replica creates them "
    "(3 on a 3-node NATS cluster); existing ones are left as they are."
)
@click.option(
    "--store-writer",
    envvar="RC_STORE_WRITER",
    show_envvar=True,
    type=click.Choice(["process", "thread"]),
    default=config_default(RunConfig, "store_writer"),
    show_default=True,
    help="Where commits run: a child process, off the event loop's GIL (the fast "
    "choice), or a thread of this process.",
)
@log_options
def run(**kwargs: Any) -> None:
    """Run the reconciler: the pipeline on every replica, leader work on one.

    Folds the input stream into the SQLite store, answers queries, and, while it holds
    the leader key, publishes decisions and executor commands and host/pool status, tops
    warm pools up, and verifies suspect leases with a live GET on their Incus host
    (--incus-fleet / --incus; without them suspect leases stay suspect).
    SIGTERM or SIGINT stops it after the batch in hand is committed; a second one stops
    it at once (nothing is lost either way: the next start resumes from the store).
    """
    common = common_from(kwargs, name="reconciler")
    incus = incus_from(kwargs)
    try:
        config = RunConfig(
            incus=incus.endpoints,
            nats=common.nats,
            prefix=common.prefix,
            db=kwargs["db"],
            replica=kwargs["replica"],
            workers=kwargs["workers"],
            batch=kwargs["batch"],
            store_writer=kwargs["store_writer"],
            stream_replicas=kwargs["stream_replicas"],
            status_debounce_s=kwargs["status_debounce"],
            status_progress_interval_s=kwargs["status_progress_interval"],
            live_get_timeout_s=kwargs["live_get_timeout"],
            warm_boot_timeout_s=kwargs["warm_boot_timeout"],
            decision_retention_s=kwargs["decision_retention"],
            journal_retention_s=kwargs["journal_retention"],
            reservation_timeout_s=kwargs["reservation_timeout"],
            leader_ttl_s=kwargs["leader_ttl"],
            metrics_addr=kwargs["metrics_addr"],
            metrics_per_host=kwargs["metrics_per_host"],
            freeze_loaded_state=kwargs["gc_threshold"] > 0,
            snapshot_interval_s=kwargs["snapshot_interval"],
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    thresholds = apply_gc_threshold(kwargs["gc_threshold"])
    structlog.get_logger("reconciler").debug("gc.thresholds", thresholds=list(thresholds))
    try:
        anyio.run(
            lambda: run_until_signalled(
                lambda stop: Replica(config).run(stop=stop),
                stopping="stopping after the batch in hand",
            )
        )
    except (StartupError, StoreError) as exc:
        raise click.ClickException(str(exc)) from exc
