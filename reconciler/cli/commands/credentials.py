"""``reconciler credentials``: the credentials, NATS accounts and Incus fleet file of a
deployment, for its named replicas and Incus hosts (:mod:`reconciler.deploy`).

Run it once with every name, and again to add a replica, a host or a node: what exists
is kept, what is missing is made, and ``accounts.conf`` and ``fleet.json`` are written
again from the recorded fleet. Nothing needs the network; nothing secret is printed.

Exit status: 0 when the directory is complete; 1 for a name or a directory it cannot
use (a message says which); 2 for a usage error.
"""

from __future__ import annotations

from pathlib import Path

import click

from reconciler.deploy.credentials import write_credentials
from reconciler.deploy.fleet import DEFAULT_INCUS_CERTS_DIR, Fleet, FleetError

__all__ = ["credentials"]


def _hosts(pairs: tuple[str, ...]) -> dict[str, str]:
    hosts: dict[str, str] = {}
    for pair in pairs:
        host, _, url = pair.partition("=")
        if not host:
            raise click.BadParameter(f"{pair!r} is not NAME or NAME=URL", param_hint="--incus-host")
        hosts[host] = url
    return hosts


@click.command()
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The deployment's credentials directory (made 0700; kept and completed if it exists).",
)
@click.option(
    "--prefix",
    help="Subject prefix of the deployment (default rc; a directory serves one prefix).",
)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    metavar="NAME",
    help="A replica (reconciler run --replica NAME): its own NATS user; repeatable.",
)
@click.option(
    "--incus-host",
    "incus_hosts",
    multiple=True,
    metavar="NAME[=URL]",
    help="An Incus host and its endpoint (default https://NAME:8443); repeatable.",
)
@click.option(
    "--nats-node",
    "nats_nodes",
    multiple=True,
    metavar="NAME",
    help="A NATS node (default nats-1, nats-2, nats-3 on the first run); repeatable.",
)
@click.option(
    "--san",
    "sans",
    multiple=True,
    metavar="NAME",
    help="An extra DNS name or IP address on every NATS node's certificate; repeatable.",
)
@click.option(
    "--incus-certs-dir",
    help="Where the components find each Incus host's server certificate, <host>.crt "
    f"(written into fleet.json; default {DEFAULT_INCUS_CERTS_DIR}).",
)
@click.option(
    "--rotate",
    multiple=True,
    metavar="NAME",
    help="Give a user a new NKey and certificate (its previous NKey stays accepted until "
    "--retire), or a node a new certificate; repeatable.",
)
@click.option(
    "--retire",
    multiple=True,
    metavar="NAME",
    help="Stop accepting a rotated user's previous NKey; repeatable.",
)
def credentials(
    out: Path,
    prefix: str | None,
    replicas: tuple[str, ...],
    incus_hosts: tuple[str, ...],
    nats_nodes: tuple[str, ...],
    sans: tuple[str, ...],
    incus_certs_dir: str | None,
    rotate: tuple[str, ...],
    retire: tuple[str, ...],
) -> None:
    """Make or complete a deployment's credentials directory.

    For the named NATS nodes, replicas and Incus hosts: a CA; each node's certificate;
    for every NATS user (admin, each replica, bridge, executor, producer) an NKey seed
    and a client certificate; an Incus client certificate for each component that
    reaches Incus; accounts.conf (each user's least privilege); fleet.json (the Incus
    hosts); deployment.json (the names, so that a later run adds to them).
    """
    try:
        fleet = Fleet.recorded_in(out).merged(
            prefix=prefix,
            nats_nodes=nats_nodes,
            replicas=replicas,
            incus_hosts=_hosts(incus_hosts),
            sans=sans,
            incus_certs_dir=incus_certs_dir,
        )
        made = write_credentials(out, fleet, rotate=rotate, retire=retire)
    except (FleetError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"credentials of prefix {fleet.prefix!r} in {out}: NATS nodes "
        f"{', '.join(fleet.nats_nodes)}; replicas {', '.join(fleet.replicas)}; Incus hosts "
        + ", ".join(f"{h} ({u})" for h, u in sorted(fleet.incus_hosts.items()))
    )
    click.echo(f"created: {', '.join(made.created) if made.created else 'nothing (complete)'}")
    for name in made.rotated:
        click.echo(f"rotated {name}: its previous NKey stays accepted until --retire {name}")
    for name in made.retired:
        click.echo(f"retired the previous NKey of {name}")
    click.echo("every Incus host must trust these client certificates:")
    for user, cert in made.incus_certs.items():
        click.echo(f"  incus config trust add-certificate {cert} --name reconciler-{user}")
