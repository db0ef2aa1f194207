"""``reconciler demo``: the story run end to end on one machine (:mod:`reconciler.demo`),
summarised; exits 1 if its replay diverged.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import click

from reconciler.bus.embedded import NatsServerNotFound
from reconciler.cli.logs import LOG_LEVELS, configure_logging

__all__ = ["demo"]


@click.command("demo")
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
