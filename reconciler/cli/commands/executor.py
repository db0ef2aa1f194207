"""``reconciler executor``: carry out the reconciler's create and delete commands on Incus.

Rules:

- The managed hosts are those of ``--incus-fleet FILE`` and of every ``--incus
  HOST=URL`` (which wins over the file for the same host), narrowed by ``--host`` when
  given. TLS options (``--incus-cert``/``--incus-key``, ``--incus-verify``) apply to the
  ``https://`` endpoints that do not carry their own in the fleet file.
- Every option is also an environment variable: the bus and log options as every
  command's (``RC_NATS_URL``, ``RC_PREFIX``, ``RC_LOG_FORMAT``…), the Incus options as
  ``RC_INCUS_…`` (shared with the bridge), the executor's own as ``RC_EXECUTOR_…``
  (``--db`` is ``RC_EXECUTOR_DB``, so it never picks up a replica's ``RC_DB``).
- SIGTERM or SIGINT: stop fetching, finish and ack the commands running, hand the
  others back to JetStream, exit 0. A second signal stops at once (what was not acked
  is redelivered to the next executor, and its database answers what was finished).
- Runs as ``reconciler executor`` once registered, or ``python -m
  reconciler.cli.commands.executor``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click

from reconciler.cli.options import (
    bus_options,
    common_from,
    config_default,
    incus_from,
    incus_options,
    load_endpoints,
    log_options,
    parse_verify,
)
from reconciler.cli.signals import run_until_signalled
from reconciler.executor.executor import Executor, ExecutorConfig
from reconciler.store.errors import StoreError

__all__ = ["executor", "load_endpoints", "parse_verify", "run_executor"]

F = TypeVar("F", bound=Callable[..., Any])


def _own(name: str, *dest: str, **kwargs: Any) -> Callable[[F], F]:
    """An executor option: environment variable ``RC_EXECUTOR_<NAME>``."""
    env = "RC_EXECUTOR_" + name.upper().replace("-", "_")
    return click.option(f"--{name}", *dest, envvar=env, show_envvar=True, **kwargs)


@click.command("executor")
@incus_options
@_own("host", "only_hosts", multiple=True, help="Manage only this host of the fleet; repeatable.")
@_own(
    "storage-pool",
    default=config_default(ExecutorConfig, "storage_pool"),
    show_default=True,
    help="Storage pool of the root disk of created VMs.",
)
@bus_options
@_own(
    "db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=config_default(ExecutorConfig, "db"),
    show_default=True,
    help="SQLite file of finished command ids.",
)
@_own(
    "workers",
    type=click.IntRange(min=1),
    default=config_default(ExecutorConfig, "workers"),
    show_default=True,
    help="Instances of each host worked on at once.",
)
@_own(
    "ack-wait",
    type=click.FloatRange(min=1),
    default=config_default(ExecutorConfig, "ack_wait_s"),
    show_default=True,
    help="Seconds JetStream waits for an ack (held commands send in_progress 4 times as often).",
)
@_own(
    "max-in-hand",
    type=click.IntRange(min=1),
    default=config_default(ExecutorConfig, "max_in_hand"),
    show_default=True,
    help="Commands held per host at most (the consumer's max_ack_pending).",
)
@_own(
    "retry-base",
    type=click.FloatRange(min=0, min_open=True),
    default=config_default(ExecutorConfig, "retry_base_s"),
    show_default=True,
    help="Seconds before the first retry of a failed command; doubles per failure.",
)
@_own(
    "retry-cap",
    type=click.FloatRange(min=0, min_open=True),
    default=config_default(ExecutorConfig, "retry_cap_s"),
    show_default=True,
    help="Longest wait between retries.",
)
@_own(
    "max-attempts",
    type=click.IntRange(min=1),
    default=config_default(ExecutorConfig, "max_attempts"),
    show_default=True,
    help="Attempts of a command whose failure may pass (unreachable hosts are retried forever).",
)
@_own(
    "retention",
    type=click.FloatRange(min=0, min_open=True),
    default=config_default(ExecutorConfig, "retention_s"),
    show_default=True,
    help="Seconds finished command ids are remembered.",
)
@_own(
    "catch-up",
    type=click.FloatRange(min=0),
    default=config_default(ExecutorConfig, "catch_up_s"),
    show_default=True,
    help="A host's consumer created now delivers the commands of the last SECONDS (0: new only).",
)
@_own(
    "metrics-addr",
    default=None,
    help="HOST:PORT for Prometheus /metrics, /healthz and /readyz (off when unset).",
)
@log_options
def executor(**kwargs: Any) -> None:
    """Carry out the reconciler's create and delete commands on Incus hosts.

    One durable consumer per host on <PREFIX>_OUT (<prefix>.out.exec.<host>.>); each
    instance's commands in order, instances in parallel; every command id acted on once.
    SIGTERM or SIGINT finishes the commands running and exits; a second one exits at once.
    """
    common = common_from(kwargs, name="reconciler-executor")
    incus = incus_from(kwargs, only=kwargs["only_hosts"])
    endpoints = incus.endpoints
    if not endpoints:
        raise click.UsageError("no Incus host to manage: give --incus-fleet or --incus")
    try:
        config = ExecutorConfig(
            endpoints=endpoints,
            nats=common.nats,
            prefix=common.prefix,
            db=kwargs["db"],
            workers=kwargs["workers"],
            ack_wait_s=kwargs["ack_wait"],
            max_in_hand=kwargs["max_in_hand"],
            retry_base_s=kwargs["retry_base"],
            retry_cap_s=max(kwargs["retry_cap"], kwargs["retry_base"]),
            max_attempts=kwargs["max_attempts"],
            retention_s=kwargs["retention"],
            catch_up_s=kwargs["catch_up"],
            storage_pool=kwargs["storage_pool"],
            request_timeout_s=incus.request_timeout_s,
            operation_timeout_s=incus.operation_timeout_s,
            metrics_addr=kwargs["metrics_addr"] or None,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        anyio.run(run_executor, config)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc


async def run_executor(config: ExecutorConfig) -> None:
    """Run an :class:`Executor` until SIGTERM/SIGINT (a second one stops it at once)."""
    runner = Executor(config)
    await run_until_signalled(
        lambda stop: runner.run(stop=stop), stopping="finishing the commands running"
    )


if __name__ == "__main__":
    executor(prog_name="reconciler executor")
