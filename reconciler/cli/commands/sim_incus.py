"""``reconciler sim-incus``: serve a simulated Incus fleet until SIGINT or SIGTERM.

Rules:

- Every host listens on its own endpoint (``--listen unix:DIR`` → ``DIR/<host>.socket``,
  or ``tcp:HOST:PORT`` → consecutive ports from PORT; 0 picks free ports) and the fleet
  file (``--fleet-file``) lists them once all are bound: wait for the file, then connect.
- The fleet is ``--hosts N`` default shapes, or ``--fleet`` JSON (``{"hosts": [shape…]}``).
- SIGINT/SIGTERM stop it gracefully: streams closed, operations cancelled, sockets and
  the fleet file removed; exit status 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import click
import orjson
import structlog

from reconciler.incus.simulator import Fleet, FleetOptions, Listen, default_fleet, fleet_from_json

logger = structlog.get_logger(__name__)


@click.command("sim-incus")
@click.option(
    "--listen",
    default="tcp:127.0.0.1:0",
    show_default=True,
    help="unix:DIR (one <host>.socket each) or tcp:HOST:PORT (consecutive ports; 0 = free).",
)
@click.option(
    "--hosts",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="How many default-shaped hosts (ignored with --fleet).",
)
@click.option(
    "--fleet",
    "fleet_description",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='Fleet description JSON: {"hosts": [shape, ...]}.',
)
@click.option(
    "--project",
    "projects",
    multiple=True,
    help="Extra project on every default host (repeatable), e.g. garm-project.",
)
@click.option(
    "--fleet-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write host name -> endpoint URL and shape here once listening.",
)
@click.option(
    "--boot-delay",
    type=float,
    default=2.0,
    show_default=True,
    help="Seconds from instance-started to instance-ready (7.x: and -agent-started).",
)
@click.option(
    "--action-delay",
    type=float,
    default=0.0,
    show_default=True,
    help="Seconds each create, start, forced stop and delete takes.",
)
@click.option(
    "--no-ready",
    is_flag=True,
    help="Guests never report Ready: status stays Running 103 after the agent starts.",
)
@click.option(
    "--ping-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between WebSocket pings on /1.0/events.",
)
@click.option(
    "--operation-retention",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds a finished operation stays visible.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the fault-rate draws."
)
@click.option(
    "--incus-version",
    type=click.Choice(["6.0", "7"]),
    default="6.0",
    show_default=True,
    help="Incus release to play: 6.0 (the LTS) or 7 (7.3); see docs/incus-simulator.md.",
)
def sim_incus(
    listen: str,
    hosts: int,
    fleet_description: Path | None,
    projects: tuple[str, ...],
    fleet_file: Path | None,
    boot_delay: float,
    action_delay: float,
    no_ready: bool,
    ping_interval: float,
    operation_retention: float,
    seed: int,
    incus_version: str,
) -> None:
    """Serve simulated Incus hosts (REST API + events) for tests and demos."""
    try:
        where = Listen.parse(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if fleet_description is not None:
        shapes = fleet_from_json(orjson.loads(fleet_description.read_bytes()))
    else:
        shapes = default_fleet(hosts, projects=projects)
    options = FleetOptions(
        boot_delay_s=boot_delay,
        action_delay_s=action_delay,
        report_ready=not no_ready,
        ping_interval_s=ping_interval,
        operation_retention_s=operation_retention,
        seed=seed,
        incus_version=incus_version,
    )
    fleet = Fleet(shapes, listen=where, options=options, fleet_file=fleet_file)
    anyio.run(_serve, fleet)


async def _serve(fleet: Fleet) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with fleet:
            for name, url in fleet.endpoints.items():
                click.echo(f"{name} {url}")
            logger.info(
                "sim_incus.serving",
                hosts=len(fleet.hosts),
                listen=str(fleet.listen),
                fleet_file=str(fleet.fleet_file) if fleet.fleet_file else None,
            )
            async for signum in signals:
                logger.info("sim_incus.stopping", signal=signal.Signals(signum).name)
                break
