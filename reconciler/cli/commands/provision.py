"""``reconciler provision``: an admin's one-shot set-up of what the components use.

Why: in a least-privilege deployment no component may create or change streams. An
admin user runs this once (and again after changing a setting; it is idempotent):

- the IN and OUT streams, the leader bucket and the snapshots' object store, with
  ``--stream-replicas`` replicas
  (an existing stream's replica count and limits are updated to what is asked);
- one durable consumer per ``--executor-host`` (and per host of ``--incus-fleet``, the
  fleet file the executor reads) on the OUT stream, exactly as the executor would create
  it with its defaults (:func:`~reconciler.bus.consumers.ensure_executor_consumer`:
  ``executor-<host>``, filter ``<prefix>.out.exec.<host>.>``, delivering the commands of
  the last hour, so that creates decided before the host was provisioned still reach its
  executor), so that executors need no consumer-create permission, which could
  otherwise set a push ``deliver_subject`` to any subject. One that exists is left as it
  is.

Run right after the NATS nodes start, a cluster still forming cannot place replicated
streams yet; ``provision`` tries again every second for up to ``--wait`` seconds.

Replicas' input consumers (``<PREFIX>_IN-<replica>``) are not made here: a replica
recreates its own at every start, from the position its store has committed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anyio
import click
import structlog
from nats import errors as nats_errors
from nats.js import errors as js_errors

from reconciler.bus.connection import connect
from reconciler.bus.consumers import Ensured, ensure_executor_consumer
from reconciler.bus.streams import (
    DEFAULT_LEADER_TTL_S,
    StreamNames,
    StreamSetupError,
    cluster_forming,
    ensure_streams,
)
from reconciler.bus.violations import PermissionViolation
from reconciler.cli.options import (
    Common,
    bus_options,
    common_from,
    config_default,
    load_endpoints,
    log_options,
    stream_replicas_option,
)
from reconciler.executor.executor import ExecutorConfig, consumer_name
from reconciler.replica.snapshot_bucket import SnapshotBucket

__all__ = ["provision"]

#: seconds ``provision`` waits for a JetStream cluster that is still forming
CLUSTER_FORMING_WAIT_S = 60.0


@click.command()
@bus_options
@stream_replicas_option("Replicas of the streams and the leader bucket (3 on a 3-node cluster).")
@click.option(
    "--leader-ttl",
    envvar="RC_LEADER_TTL",
    show_envvar=True,
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_LEADER_TTL_S,
    show_default=True,
    help="Seconds the leader key lives without renewal (the replicas' --leader-ttl).",
)
@click.option(
    "--executor-host",
    "executor_hosts",
    multiple=True,
    metavar="HOST",
    help="Create the executor consumer of this Incus host; repeatable.",
)
@click.option(
    "--incus-fleet",
    envvar="RC_INCUS_FLEET",
    show_envvar=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A fleet file: create the executor consumer of every host in it.",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=CLUSTER_FORMING_WAIT_S,
    show_default=True,
    help="Seconds to wait for a JetStream cluster that is still forming (its nodes just "
    "started, the streams' replicas not placeable yet), trying again every second.",
)
@log_options
def provision(**kwargs: Any) -> None:
    """Create (or update) the streams, the leader bucket and the executors' consumers, as
    an admin user, so that every component can run with least privilege."""
    common = common_from(kwargs, name="reconciler-provision")
    hosts: tuple[str, ...] = kwargs["executor_hosts"]
    fleet: Path | None = kwargs["incus_fleet"]
    if fleet is not None:
        listed = (e.host for e in load_endpoints(fleet_file=fleet))
        hosts = tuple(dict.fromkeys((*hosts, *listed)))
    try:
        done = anyio.run(
            lambda: _provision(
                common,
                replicas=kwargs["stream_replicas"],
                leader_ttl_s=kwargs["leader_ttl"],
                hosts=hosts,
                wait_s=kwargs["wait_s"],
            )
        )
    except (StreamSetupError, PermissionViolation, TimeoutError, ClusterNotReady) as exc:
        raise click.ClickException(str(exc)) from None
    for line in done:
        click.echo(line)


class ClusterNotReady(Exception):
    """The JetStream cluster did not place the streams within the wait."""


async def _provision(
    common: Common,
    *,
    replicas: int,
    leader_ttl_s: float,
    hosts: tuple[str, ...],
    wait_s: float = CLUSTER_FORMING_WAIT_S,
) -> list[str]:
    """Provision; while the cluster is still forming (nodes just started: streams of
    ``replicas`` cannot be placed yet), try again every second for up to ``wait_s``.
    Every step is idempotent, so a try that placed some of it is simply repeated."""
    log = structlog.get_logger(__name__)
    deadline = anyio.current_time() + wait_s
    while True:
        try:
            return await _provision_once(
                common, replicas=replicas, leader_ttl_s=leader_ttl_s, hosts=hosts
            )
        except (js_errors.APIError, nats_errors.NoRespondersError, nats_errors.TimeoutError) as exc:
            why = cluster_forming(exc)
            if why is None:
                raise
            if anyio.current_time() >= deadline:
                raise ClusterNotReady(
                    f"the JetStream cluster could not place {replicas} replica(s) within "
                    f"{wait_s:g} s ({why}): check that {replicas} NATS node(s) with JetStream "
                    "are up and clustered, or give --stream-replicas the number there are"
                ) from None
            log.info("provision.waiting", why=why, replicas=replicas)
            await anyio.sleep(1.0)


async def _provision_once(
    common: Common, *, replicas: int, leader_ttl_s: float, hosts: tuple[str, ...]
) -> list[str]:
    names = StreamNames.for_prefix(common.prefix)
    opts = dataclasses.replace(common.nats, initial_timeout_s=common.nats.connect_timeout_s * 5)
    nc = await connect(opts)
    try:
        js = nc.jetstream()
        await ensure_streams(
            js, names, leader_ttl_s=leader_ttl_s, replicas=replicas, manage_replicas=True
        )
        snapshots = SnapshotBucket(js, common.prefix, replicas=replicas)
        await snapshots.ensure()
        done = [
            f"streams {names.in_stream}, {names.out_stream}, bucket {names.leader_bucket} and "
            f"object store {snapshots.name}: {replicas} replica(s)"
        ]
        for host in hosts:
            ensured = await ensure_executor_consumer(
                nc,
                js,
                stream=names.out_stream,
                prefix=common.prefix,
                host=host,
                ack_wait_s=float(config_default(ExecutorConfig, "ack_wait_s")),
                max_in_hand=int(config_default(ExecutorConfig, "max_in_hand")),
                catch_up_s=float(config_default(ExecutorConfig, "catch_up_s")),
                replicas=replicas,
                update=False,
            )
            what = "created" if ensured is Ensured.CREATED else "exists, left as it is"
            done.append(f"consumer {names.out_stream}/{consumer_name(host)}: {what}")
        return done
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()
