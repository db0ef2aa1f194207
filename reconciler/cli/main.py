"""The ``reconciler`` command line (docs/cli.md)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
import structlog

from reconciler.bus.embedded import NatsServerNotFound
from reconciler.cli.audit import audit_lines
from reconciler.cli.gc_policy import apply_gc_threshold
from reconciler.cli.logs import LOG_LEVELS, configure_logging
from reconciler.cli.oneshot import connect_timeout_option, once, oneshot_log_options
from reconciler.cli.options import (
    bus_options,
    common_from,
    config_default,
    db_option,
    incus_from,
    incus_options,
    log_options,
    run_options,
    stream_replicas_option,
)
from reconciler.cli.overview import overview_lines
from reconciler.cli.retention_options import decision_retention_option, retention_options
from reconciler.cli.signals import run_until_signalled
from reconciler.replay.replay import ReplayError, replay
from reconciler.replica.replica import Replica, RunConfig, StartupError, default_replica_name
from reconciler.store.errors import StoreError


class _Commands(click.Group):
    """The command group, with the Incus-side commands loaded only when they are run:
    ``reconciler run`` never loads pylxd, the simulator or aiohttp's server."""

    LAZY: dict[str, tuple[str, str]] = {
        "apply": ("reconciler.cli.apply_cmd", "apply_cmd"),
        "bridge": ("reconciler.cli.bridge_cmd", "bridge"),
        "cmd": ("reconciler.cli.send_cmd", "send_cmd"),
        "credentials": ("reconciler.cli.credentials_cmd", "credentials"),
        "executor": ("reconciler.cli.executor_cmd", "executor"),
        "garm-provider": ("reconciler.cli.garm_cmd", "garm_provider"),
        "provision": ("reconciler.cli.provision", "provision"),
        "query": ("reconciler.cli.query_cmd", "query_cmd"),
        "sim-incus": ("reconciler.cli.sim_incus", "sim_incus"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY:
            module, attr = self.LAZY[cmd_name]
            command = getattr(importlib.import_module(module), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="reconciler")
def cli() -> None:
    """Admission control for self-hosted CI runners on Incus.

    The interface (subjects, payloads, decisions, queries) is described in
    docs/interface.md of the project, and every command in docs/cli.md.
    """


# ------------------------------------------------------------------------------ run


@cli.command()
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


# --------------------------------------------------------------------------- replay


@cli.command("replay")
@bus_options
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Fold into this new SQLite file and keep it (default: a database in memory).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option(
    "--show", type=click.IntRange(min=0), default=20, show_default=True, help="Divergences shown."
)
@click.option(
    "--from-snapshot",
    is_flag=True,
    help="Start from a snapshot even when the stream still starts at seq 1 (always done "
    "when its oldest inputs aged out).",
)
@connect_timeout_option
@decision_retention_option
@oneshot_log_options
def replay_command(
    db: Path | None,
    as_json: bool,
    show: int,
    from_snapshot: bool,
    connect_timeout: float,
    **kwargs: Any,
) -> None:
    """Fold the input stream into a fresh database and compare every decision with the
    output stream. Prints a digest of the state; exits 1 on any divergence."""
    common = common_from(kwargs, name="reconciler-replay")
    retention = kwargs["decision_retention"]
    try:
        report = anyio.run(
            lambda: replay(
                once(common.nats, connect_timeout),
                prefix=common.prefix,
                db=db,
                decision_retention_s=retention,
                from_snapshot=from_snapshot,
            )
        )
    except TimeoutError as exc:
        raise click.ClickException(f"{exc} (--connect-timeout {connect_timeout:g})") from exc
    except (ReplayError, StoreError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(
            orjson.dumps(
                {
                    "ok": report.ok,
                    "first_seq": report.first_seq,
                    "last_seq": report.last_seq,
                    "inputs": report.inputs,
                    "dead_letters": report.dead_letters,
                    "outputs": report.outputs,
                    "compared": report.compared,
                    "divergences": len(report.divergences),
                    "digest": report.digest,
                    "snapshot_seq": report.snapshot_seq,
                    "snapshot_digest": report.snapshot_digest,
                    "older": report.older,
                    "details": [
                        {
                            "kind": d.kind,
                            "msg_id": d.msg_id,
                            "subject": d.subject,
                            "expected": (d.expected or b"").decode(errors="replace"),
                            "found": (d.found or b"").decode(errors="replace"),
                        }
                        for d in report.divergences[:show]
                    ],
                }
            )
        )
    else:
        if report.snapshot_seq:
            click.echo(
                f"started from the snapshot at seq {report.snapshot_seq} "
                f"(digest {report.snapshot_digest}): decisions before it are not compared"
            )
        click.echo(
            f"replayed inputs {report.first_seq}..{report.last_seq}: {report.inputs} folded "
            f"({report.dead_letters} dead-lettered), {report.outputs} outputs, "
            f"{report.compared} compared with the output stream"
        )
        for name, count in sorted(report.older.items()):
            click.echo(f"{count} outputs written by an older release, without {name} (added since)")
        click.echo(f"state digest: {report.digest}")
        for d in report.divergences[:show]:
            click.secho(f"  {d.kind:<10} {d.msg_id}  ({d.subject})", fg="red")
            if d.expected is not None:
                click.echo(f"    replay: {d.expected.decode(errors='replace')}")
            if d.found is not None:
                click.echo(f"    stream: {d.found.decode(errors='replace')}")
        if report.divergences:
            click.secho(f"{len(report.divergences)} divergences", fg="red", bold=True)
        else:
            click.secho("no divergences", fg="green")
    sys.exit(0 if report.ok else 1)


# ---------------------------------------------------------------------------- audit


@cli.command()
@click.argument("identifier")
@bus_options
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON lines.")
@click.option(
    "--no-inputs",
    is_flag=True,
    help="Do not fetch the input messages from the stream (works without NATS).",
)
@connect_timeout_option
@oneshot_log_options
def audit(
    identifier: str, as_json: bool, no_inputs: bool, connect_timeout: float, **kwargs: Any
) -> None:
    """A lease's timeline: its inputs, transitions and decisions, with stream sequences.

    IDENTIFIER is a job identity, an instance name, a lease id or a request id.
    """
    common = common_from(kwargs, name="reconciler-audit")
    try:
        lines = anyio.run(
            lambda: audit_lines(
                identifier,
                db=kwargs["db"],
                nats=None if no_inputs else once(common.nats, connect_timeout),
                prefix=common.prefix,
                as_json=as_json,
            )
        )
    except LookupError as exc:
        raise click.ClickException(str(exc)) from exc
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in lines:
        click.echo(line)


# --------------------------------------------------------------------------- status


@cli.command()
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print host and pool status as JSON lines.")
@oneshot_log_options
def status(db: Path, as_json: bool, log_format: str, log_level: str) -> None:
    """Hosts and pools at a glance, from the store of a (running or stopped) replica."""
    if not db.exists():
        raise click.ClickException(f"no store at {db} (use --db or RC_DB)")
    try:
        lines = anyio.run(lambda: overview_lines(db, as_json=as_json))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in lines:
        click.echo(line)


# ----------------------------------------------------------------------------- demo


@cli.command()
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("reconciler-demo.db"),
    envvar="RC_DB",
    show_default=True,
    help="SQLite file of the demo's replica (recreated).",
)
@click.option(
    "--nats-url",
    envvar="RC_NATS_URL",
    default=None,
    help="Use this NATS server (JetStream on) instead of starting a local nats-server.",
)
@click.option("--quiet", is_flag=True, help="Print only the summary.")
@click.option(
    "--incus-real",
    is_flag=True,
    help="Run the story on a private, real local Incus (containers; needs root, "
    "incus-base, busybox-static and gcc) instead of the simulator.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="error",
    show_default=True,
    help="Least severe level of the replica's logs.",
)
def demo(db: Path, nats_url: str | None, quiet: bool, incus_real: bool, log_level: str) -> None:
    """Drive a scripted fleet through a local reconciler over NATS, and summarise.

    Starts a nats-server (unless --nats-url), runs a replica into --db, publishes hosts,
    pools, warm and cold jobs, GPU jobs, a preemption and bad inputs, prints each
    decision as it comes back, then replays the stream to prove every decision again.
    """
    configure_logging(fmt="text", level=log_level)
    from reconciler.demo.real_incus import run_real_demo
    from reconciler.demo.simulated import run_demo  # the simulator, pylxd: only for the demo

    story = run_real_demo if incus_real else run_demo
    try:
        summary = anyio.run(lambda: story(db, nats_url=nats_url, echo=not quiet))
    except NatsServerNotFound as exc:
        raise click.ClickException(str(exc)) from exc
    requests: dict[str, list[dict[str, Any]]] = {}
    for d in summary.decisions:  # one request: its phases (pending, then final), in order
        requests.setdefault(str(d["request_id"]), []).append(d)
    outcomes: dict[str, int] = {}
    for phases in requests.values():
        last = phases[-1]
        path = " → ".join(str(d["outcome"]) for d in phases)
        key = f"{last['verb']} {path}" + (f" ({last['reason']})" if "reason" in last else "")
        outcomes[key] = outcomes.get(key, 0) + 1
    click.echo(f"\nSummary of {len(requests)} requests (each with its decisions)")
    for key, n in sorted(outcomes.items()):
        click.echo(f"  {n:>3} x {key}")
    click.echo(f"  executor commands: {dict(sorted(summary.commands.items()))}")
    click.echo(f"  dead letters: {len(summary.dead_letters)}")
    click.echo(f"  store: {db}, state digest {summary.digest[:16]}…")
    verdict = "no divergences" if summary.replay_divergences == 0 else "DIVERGENCES"
    click.secho(
        f"  replay of the input stream: {verdict}, same digest",
        fg="green" if summary.replay_divergences == 0 else "red",
    )
    if summary.replay_divergences:
        sys.exit(1)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
